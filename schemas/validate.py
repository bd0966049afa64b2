"""Validation of record batches against the v1 schemas.

:func:`validate` checks a :class:`pyarrow.RecordBatch` (or Table) against a
named schema and raises :class:`SchemaError` naming the first bad field and row
and what was expected. Checks are vectorised with ``pyarrow.compute``: about
linear in the number of rows, not tokens.
"""

from __future__ import annotations

from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc

from relax.schemas.v1 import DROP_REASONS, FINISH_REASONS, get_schema


class SchemaError(ValueError):
    """A record batch does not match its schema.

    Attributes:
        schema: schema name (e.g. ``rollouts``).
        field: the offending field name (None if the whole batch is at fault).
        row: the first offending row index within the batch (None if not row-specific).
        expected: what was expected, in words.
    """

    def __init__(self, schema: str, field: str | None, row: int | None, expected: str,
                 got: str | None = None):
        self.schema, self.field, self.row, self.expected, self.got = schema, field, row, expected, got
        where = f"{schema}"
        if row is not None:
            where += f" row {row}"
        if field is not None:
            where += f" field {field!r}"
        msg = f"{where}: expected {expected}"
        if got is not None:
            msg += f", got {got}"
        super().__init__(msg)


def check_schema(actual: pa.Schema, name: str) -> None:
    """Raise :class:`SchemaError` unless ``actual`` has exactly the fields and types of
    schema ``name`` (metadata and field order of extras are not compared).

    Raises:
        SchemaError: naming the first missing, extra or mistyped field.
    """
    expected = get_schema(name)
    names = set(actual.names)
    for f in expected:
        if f.name not in names:
            raise SchemaError(name, f.name, None, f"a field of type {f.type}", "no such field")
        got = actual.field(f.name).type
        if not got.equals(f.type):
            raise SchemaError(name, f.name, None, f"type {f.type}", str(got))
    extra = [n for n in actual.names if expected.get_field_index(n) < 0]
    if extra:
        raise SchemaError(name, extra[0], None, f"only the fields {expected.names}", "an extra field")


def _first_true(mask: pa.Array | pa.ChunkedArray) -> int | None:
    """Index of the first true value of a boolean array (nulls count as false)."""
    if not pc.any(mask).as_py():  # nulls are skipped
        return None
    return int(pc.index(pc.fill_null(mask, False), True).as_py())


def _require(name: str, field: str, bad: pa.Array, expected: str,
             got: Callable[[int], str] | None = None) -> None:
    row = _first_true(bad)
    if row is not None:
        raise SchemaError(name, field, row, expected, got(row) if got else None)


def _check_not_null(name: str, batch: pa.RecordBatch | pa.Table) -> None:
    schema = get_schema(name)
    for f in schema:
        if f.nullable:
            continue
        col = batch.column(f.name)
        if col.null_count:
            _require(name, f.name, pc.is_null(col), "a value (field is not nullable)", lambda r: "null")


def _check_same_len(name: str, batch, field: str, ref: str = "response_ids",
                    allow_null: bool = False) -> None:
    n = pc.list_value_length(batch.column(field))
    m = pc.list_value_length(batch.column(ref))
    bad = pc.not_equal(n, m)
    if allow_null:
        bad = pc.and_(bad, pc.is_valid(batch.column(field)))
    _require(name, field, bad, f"the same length as {ref}",
             lambda r: f"{n[r].as_py()} vs {m[r].as_py()}")


def _check_in(name: str, batch, field: str, allowed: tuple[str, ...], allow_null=False) -> None:
    col = batch.column(field)
    bad = pc.invert(pc.is_in(col, value_set=pa.array(allowed)))
    if allow_null:
        bad = pc.and_(bad, pc.is_valid(col))
    _require(name, field, bad, f"one of {list(allowed)}", lambda r: repr(col[r].as_py()))


def _check_tokens(name: str, batch) -> None:
    for field in ("prompt_ids", "response_ids"):
        flat = pc.list_flatten(batch.column(field))
        if len(flat) and pc.min(flat).as_py() < 0:
            parents = pc.list_parent_indices(batch.column(field))
            row = int(parents[_first_true(pc.less(flat, 0))].as_py())
            raise SchemaError(name, field, row, "token ids >= 0")
    mask = batch.column("loss_mask")
    flat = pc.list_flatten(mask)
    if len(flat):
        bad = pc.invert(pc.is_in(flat, value_set=pa.array([0, 1], pa.int8())))
        i = _first_true(bad)
        if i is not None:
            row = int(pc.list_parent_indices(mask)[i].as_py())
            raise SchemaError(name, "loss_mask", row, "values 0 or 1", str(flat[i].as_py()))
    _check_same_len(name, batch, "loss_mask")
    _check_same_len(name, batch, "logprobs")
    _check_same_len(name, batch, "token_policy_versions", allow_null=True)
    start, end = batch.column("policy_version_start"), batch.column("policy_version_end")
    _require(name, "policy_version_start", pc.less(start, 0), "policy_version >= 0",
             lambda r: str(start[r].as_py()))
    _require(name, "policy_version_end", pc.less(end, start), "policy_version_end >= policy_version_start",
             lambda r: f"{end[r].as_py()} < {start[r].as_py()}")
    idx, size = batch.column("sample_index"), batch.column("group_size")
    _require(name, "sample_index", pc.or_(pc.less(idx, 0), pc.greater_equal(idx, size)),
             "0 <= sample_index < group_size", lambda r: f"{idx[r].as_py()} of {size[r].as_py()}")
    _check_in(name, batch, "finish_reason", FINISH_REASONS)


def _check_rollouts(name, batch) -> None:
    _check_tokens(name, batch)


def _check_train_samples(name, batch) -> None:
    _check_tokens(name, batch)
    _check_same_len(name, batch, "advantages")
    _check_same_len(name, batch, "ref_logprobs", allow_null=True)
    _check_same_len(name, batch, "teacher_logprobs", allow_null=True)
    _check_in(name, batch, "drop_reason", DROP_REASONS, allow_null=True)


def _check_rewards(name, batch) -> None:
    v = batch.column("value")
    bad = pc.and_(pc.is_valid(v), pc.invert(pc.is_finite(v)))
    _require(name, "value", bad, "a finite float or null", lambda r: str(v[r].as_py()))


def _check_finite_logprobs(column: str) -> Callable:
    def check(name, batch) -> None:
        flat = pc.list_flatten(batch.column(column))
        if len(flat) and not pc.all(pc.is_finite(flat)).as_py():
            i = _first_true(pc.invert(pc.is_finite(flat)))
            row = int(pc.list_parent_indices(batch.column(column))[i].as_py())
            raise SchemaError(name, column, row, "finite log-probs", str(flat[i].as_py()))
    return check


def _check_weights(name, batch) -> None:
    for r, (m, total) in enumerate(zip(batch.column("manifest").to_pylist(),
                                       batch.column("total_bytes").to_pylist())):
        s = sum(e["nbytes"] for e in m)
        if s != total:
            raise SchemaError(name, "total_bytes", r, f"the sum of manifest nbytes ({s})", str(total))


_ROW_CHECKS: dict[str, Callable] = {
    "rollouts": _check_rollouts,
    "train_samples": _check_train_samples,
    "rewards": _check_rewards,
    "ref_logprobs": _check_finite_logprobs("ref_logprobs"),
    "teacher_logprobs": _check_finite_logprobs("teacher_logprobs"),
    "weights": _check_weights,
}


def validate(batch: pa.RecordBatch | pa.Table, name: str) -> None:
    """Check ``batch`` against v1 schema ``name``: fields and types, non-nullable
    fields, and per-schema row rules (list lengths equal to ``response_ids``,
    ``loss_mask`` in {0, 1}, ``policy_version_end >= policy_version_start``,
    ``finish_reason`` / ``drop_reason`` in their sets, finite reward values, ...).

    Args:
        batch: ``[N rows]`` record batch or table.
        name: schema name, one of :data:`relax.schemas.v1.SCHEMAS`.

    Raises:
        SchemaError: naming the schema, the first bad row and field, and what was expected.
        KeyError: for an unknown schema name (lists the valid ones).
    """
    check_schema(batch.schema, name)
    _check_not_null(name, batch)
    check = _ROW_CHECKS.get(name)
    if check is not None and batch.num_rows:
        check(name, batch)
