"""Arrow <-> Kafka message values.

One Kafka message value = one Arrow IPC *stream* (schema + record batches,
uncompressed: Kafka compresses whole producer batches with zstd). Field
metadata (docs) is stripped on the wire and restored from the canonical v1
schema on decode, which keeps small messages small.

:func:`encode_messages` splits a batch into IPC streams of at most
``max_message_bytes`` each; a single row over the limit has its media bytes
moved to the :class:`~relax.streams.blobs.BlobStore` (the row keeps the URI);
if it is still too large, :class:`RecordTooLarge` names the row and sizes.
"""

from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from relax.schemas.validate import SchemaError, check_schema
from relax.schemas.v1 import get_schema
from relax.streams.blobs import BlobStore

_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression=None)


class RecordTooLarge(ValueError):
    """One row does not fit in a message even after moving its media to the blob store.

    Attributes:
        row: row index in the batch given to :func:`encode_messages`.
        nbytes: the encoded size of that row alone (bytes).
        limit: ``max_message_bytes``.
        detail: the rest of the message (why no blob store took the media, where).
        what: the name of the limit in the message.
    """

    def __init__(self, row: int, nbytes: int, limit: int, detail: str = "",
                 what: str = "max_message_bytes"):
        self.row, self.nbytes, self.limit, self.detail = row, nbytes, limit, detail
        super().__init__(f"row {row} encodes to {nbytes} bytes, over {what}={limit}{detail}")


class DecodeError(ValueError):
    """A message value is not a readable Arrow IPC stream."""


def _strip_type(t: pa.DataType) -> pa.DataType:
    if pa.types.is_struct(t):
        return pa.struct([_strip_field(t.field(i)) for i in range(t.num_fields)])
    if pa.types.is_list(t):
        return pa.list_(_strip_field(t.value_field))
    if pa.types.is_map(t):
        return pa.map_(_strip_field(t.key_field), _strip_field(t.item_field))
    return t


def _strip_field(f: pa.Field) -> pa.Field:
    return pa.field(f.name, _strip_type(f.type), f.nullable)


@functools.lru_cache(maxsize=64)
def wire_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` without field metadata (kept: schema-level ``relax.*`` metadata).
    Cached by schema content: batches sliced from one another share one entry."""
    return pa.schema([_strip_field(f) for f in schema], metadata=schema.metadata)


def encode(batch: pa.RecordBatch | pa.Table) -> bytes:
    """Serialise a batch or table as one Arrow IPC stream (field docs stripped).

    A zero-row input gives a stream with the schema and no data (public case C33)."""
    sink = pa.BufferOutputStream()
    _write(sink, batch)
    return sink.getvalue().to_pybytes()


def encoded_size(batch: pa.RecordBatch | pa.Table) -> int:
    """Bytes :func:`encode` would produce, measured without copying data."""
    sink = pa.MockOutputStream()
    _write(sink, batch)
    return sink.size()


def _write(sink, batch: pa.RecordBatch | pa.Table) -> None:
    # the IPC writer compares schemas without metadata, so batches are written as
    # they are under the stripped wire schema: no per-batch schema rebuild.
    with pa.ipc.new_stream(sink, wire_schema(batch.schema), options=_IPC_OPTIONS) as w:
        if isinstance(batch, pa.Table):
            for b in batch.to_batches():
                w.write_batch(b)
        elif batch.num_rows:
            w.write_batch(batch)


def decode(value: bytes, name: str | None = None) -> pa.Table:
    """Read one message value back into a table.

    Args:
        value: an Arrow IPC stream.
        name: the expected v1 schema name; when given, fields and types are checked
            and the canonical schema (with its field docs) is attached. A stream
            with no batches gives an empty table with the schema (public case C33);
            zero-row batches mid-stream are kept and do not end the stream.

    Raises:
        DecodeError: if the value is null or empty, or its bytes are not a valid Arrow IPC
            stream (every buffer is validated, so a corrupt one cannot crash a later
            compute call).
        relax.schemas.SchemaError: if the decoded fields/types differ from schema ``name``.
    """
    if not value:
        raise DecodeError("null value (a tombstone)" if value is None else "empty value")
    try:
        table = pa.ipc.open_stream(pa.py_buffer(value)).read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        raise DecodeError(f"not an Arrow IPC stream ({len(value)} bytes): {e}") from e
    if name is None:
        return table
    canonical = get_schema(name)
    if not table.schema.equals(wire_schema(canonical)):
        try:
            check_schema(table.schema, name)
        except KeyError as e:  # a field name the stream holds twice
            raise SchemaError(name, None, None, "unique field names", f"duplicates ({e})") from e
        table = table.select(canonical.names)
    return pa.Table.from_batches(
        [pa.RecordBatch.from_arrays(b.columns, schema=canonical) for b in table.to_batches()],
        schema=canonical)


def _offload_media(row: pa.RecordBatch, blobs: BlobStore) -> pa.RecordBatch:
    """Replace inline media bytes of a one-row batch by blob-store URIs."""
    idx = row.schema.get_field_index("media")
    items = row.column(idx).to_pylist()[0] or []
    for item in items:
        if item.get("data") is not None:
            item["uri"] = blobs.put(item["data"])
            item["data"] = None
    new = pa.array([items], type=row.schema.field(idx).type)
    return row.set_column(idx, row.schema.field(idx), new)


def split_rows(batch: pa.RecordBatch, max_message_bytes: int) -> list[tuple[int, int]]:
    """Row ranges ``[(start, stop), ...]`` whose encodings fit ``max_message_bytes``.

    Starts from an even split estimated from the total size, then halves any piece
    still too large; a single row that does not fit is returned as its own range
    (the caller decides: blob store or :class:`RecordTooLarge`).
    """
    n = batch.num_rows
    if n == 0:
        return [(0, 0)]
    total = encoded_size(batch)
    if total <= max_message_bytes:
        return [(0, n)]
    pieces = -(-total // int(max_message_bytes * 0.9))
    step = max(1, -(-n // pieces))
    todo = [(s, min(s + step, n)) for s in range(0, n, step)]
    out: list[tuple[int, int]] = []
    while todo:
        s, e = todo.pop(0)
        if e - s == 1 or encoded_size(batch.slice(s, e - s)) <= max_message_bytes:
            out.append((s, e))
        else:
            m = (s + e) // 2
            todo[:0] = [(s, m), (m, e)]
    return out


def encode_messages(batch: pa.RecordBatch | pa.Table, max_message_bytes: int,
                    blobs: BlobStore | None = None) -> list[bytes]:
    """Split ``batch`` into message values of at most ``max_message_bytes`` each.

    Rows keep their order, and every row is in exactly one value. A table is first
    merged into as few record batches as Arrow allows (one, unless a 32-bit
    binary/string column is over 2 GiB: then ``combine_chunks`` keeps several chunks);
    each record batch is encoded on its own, so one value never mixes two of them. A
    row that alone exceeds the limit has the bytes of its ``media`` items moved to
    ``blobs`` (the item keeps a URI).

    Args:
        batch: ``[N rows]``; a zero-row input gives one value (the schema, no rows).
        max_message_bytes: the largest value to return (bytes).
        blobs: where oversize media go (None: nowhere).

    Raises:
        RecordTooLarge: a row still exceeds the limit (or has no media and no blob
            store is configured); ``row`` counts from the first row of ``batch``.
    """
    if not isinstance(batch, pa.Table):
        return _encode_batch(batch, max_message_bytes, blobs, 0)
    if batch.num_rows == 0:
        return _encode_batch(pa.RecordBatch.from_pylist([], schema=batch.schema),
                             max_message_bytes, blobs, 0)
    out, first = [], 0
    for b in batch.combine_chunks().to_batches():
        if b.num_rows == 0:
            continue
        out += _encode_batch(b, max_message_bytes, blobs, first)
        first += b.num_rows
    return out


def _encode_batch(batch: pa.RecordBatch, max_message_bytes: int, blobs: BlobStore | None,
                  first_row: int) -> list[bytes]:
    """:func:`encode_messages` of one record batch whose first row is row ``first_row``
    of the caller's input (for the row number in :class:`RecordTooLarge`)."""
    # common case: one message. Buffer sizes bound the data from above (a slice reports
    # its parent's buffers), so only when they are large is the exact size measured.
    if (batch.get_total_buffer_size() < max_message_bytes * 0.9
            or encoded_size(batch) <= max_message_bytes):
        value = encode(batch)
        if len(value) <= max_message_bytes:
            return [value]
    out = []
    for s, e in split_rows(batch, max_message_bytes):
        piece = batch.slice(s, e - s)
        value = encode(piece)
        if len(value) > max_message_bytes:
            if blobs is not None and "media" in piece.schema.names:
                piece = _offload_media(piece, blobs)
                value = encode(piece)
            if len(value) > max_message_bytes:
                hint = "" if blobs is not None else " (no blob store configured for media)"
                raise RecordTooLarge(first_row + s, len(value), max_message_bytes, hint)
        out.append(value)
    return out


def group_by_key(batch: pa.RecordBatch | pa.Table, key_column: str) -> list[tuple[str, pa.Table]]:
    """Split rows by the value of ``key_column`` (string), keeping row order within a key
    and keys in order of first appearance.

    Rows are gathered one record batch at a time (a take over a whole table would
    concatenate its chunks, which fails past 2 GiB in a 32-bit binary/string column), so
    a key's table may hold several chunks; together the tables hold every row once.

    Returns:
        ``[(key, table)]``; one entry per distinct key.
    """
    table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
    keys = table.column(key_column)
    if table.num_rows == 0:
        return []
    enc = pc.dictionary_encode(keys).combine_chunks()
    if len(enc.dictionary) == 1:
        return [(enc.dictionary[0].as_py(), table)]
    # dictionary order is the order of first appearance, so a stable sort by code
    # groups rows by key, keys in order of first appearance, rows in order.
    codes = enc.indices.to_numpy(zero_copy_only=False)
    if np.all(codes[1:] >= codes[:-1]):  # rows already contiguous by key: slice, no copy
        return [(enc.dictionary[code].as_py(), table.slice(s, e - s))
                for code, s, e in _runs(codes)]
    pieces: dict[int, list[pa.RecordBatch]] = {}
    first = 0
    for b in table.to_batches():
        if b.num_rows == 0:  # a table may hold empty chunks
            continue
        order = np.argsort(codes[first:first + b.num_rows], kind="stable")
        taken = b.take(pa.array(order))
        for code, s, e in _runs(codes[first:first + b.num_rows][order]):
            pieces.setdefault(code, []).append(taken.slice(s, e - s))
        first += b.num_rows
    return [(enc.dictionary[code].as_py(), pa.Table.from_batches(pieces[code], table.schema))
            for code in sorted(pieces)]


def _runs(codes: np.ndarray) -> list[tuple[int, int, int]]:
    """``[(code, start, stop)]`` of each run of equal values in ``codes`` (``[N]`` int)."""
    bounds = np.flatnonzero(np.diff(codes)) + 1
    starts, ends = np.concatenate([[0], bounds]), np.concatenate([bounds, [len(codes)]])
    return [(int(codes[s]), int(s), int(e)) for s, e in zip(starts, ends)]
