"""Codec: Arrow IPC streams as message values, splitting, blobs; cases C31 and C33."""

from __future__ import annotations

import pyarrow as pa
import pytest

from relax.schemas.v1 import PROMPTS, ROLLOUTS
from relax.streams.blobs import BlobStore
from relax.streams.codec import (DecodeError, RecordTooLarge, decode, encode, encode_messages,
                                 group_by_key, split_rows)

from testdata import rollout_rows


def test_roundtrip_restores_canonical_schema_with_docs():
    b = pa.RecordBatch.from_pylist(rollout_rows(5), schema=ROLLOUTS)
    value = encode(b)
    t = decode(value, "rollouts")
    assert t.schema.equals(ROLLOUTS, check_metadata=True)
    assert t.equals(pa.Table.from_batches([b]))
    # the wire form carries no field docs
    assert b"rollout log-probs" not in value


def test_decode_garbage_raises_decode_error():
    with pytest.raises(DecodeError, match="not an Arrow IPC stream"):
        decode(b"\x00\x01garbage")


def test_decode_wrong_schema_names_field():
    from relax.schemas import SchemaError

    t = pa.table({"prompt_id": ["a"]})
    with pytest.raises(SchemaError, match="prompts"):
        decode(encode(t), "prompts")


@pytest.mark.parametrize("offset,length", [(1, 3), (0, 6), (2, 0), (5, 1)])
def test_c31_list_sliced_via_offsets_roundtrips(offset, length):
    values = pa.array([10, 20, 30, 40, 50, 60], pa.int64())
    offsets = pa.array([offset, offset + length], pa.int32())
    arr = pa.ListArray.from_arrays(offsets, values)
    batch = pa.RecordBatch.from_arrays([arr], names=["tokens"])
    back = decode(encode(batch))
    back.validate(full=True)
    assert back.column("tokens").to_pylist() == [[10, 20, 30, 40, 50, 60][offset:offset + length]]


def test_c31_sliced_rows_roundtrip():
    arr = pa.array([[1, 2], [3], [4, 5, 6]], pa.list_(pa.int64()))
    batch = pa.RecordBatch.from_arrays([arr], names=["tokens"]).slice(1, 2)
    back = decode(encode(batch))
    back.validate(full=True)
    assert back.column("tokens").to_pylist() == [[3], [4, 5, 6]]
    assert back.column("tokens").to_pylist() != [[1, 2], [3]]


def test_c33_stream_with_schema_and_no_batches():
    schema = pa.schema([("sample_id", pa.int64()), ("tokens", pa.list_(pa.int32()))])
    empty = pa.RecordBatch.from_pylist([], schema=schema)
    t = decode(encode(empty))
    assert t.num_rows == 0 and t.schema.names == ["sample_id", "tokens"]


def test_c33_zero_row_batch_mid_stream_is_not_the_end():
    schema = pa.schema([("sample_id", pa.int64()), ("tokens", pa.list_(pa.int32()))])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as w:
        for n in (4, 0, 1):
            w.write_batch(pa.RecordBatch.from_pylist(
                [{"sample_id": i, "tokens": [i]} for i in range(n)], schema=schema))
    raw = sink.getvalue().to_pybytes()
    reader = pa.ipc.open_stream(raw)
    assert [b.num_rows for b in reader] == [4, 0, 1]
    t = decode(raw)
    assert t.num_rows == 5 and t.column("sample_id").to_pylist()[-1] == 0


@pytest.mark.parametrize("limit", [64 * 1024, 200 * 1024, 1 << 20])
def test_split_keeps_order_and_limit(limit):
    b = pa.RecordBatch.from_pylist(rollout_rows(64, tokens=512), schema=ROLLOUTS)
    msgs = encode_messages(b, limit)
    assert all(len(m) <= limit for m in msgs)
    back = pa.concat_tables([decode(m, "rollouts") for m in msgs])
    assert back.column("rollout_id").to_pylist() == b.column("rollout_id").to_pylist()
    ranges = split_rows(b, limit)
    assert ranges[0][0] == 0 and ranges[-1][1] == 64
    assert all(a[1] == b_[0] for a, b_ in zip(ranges, ranges[1:]))


def _prompt(data: bytes | None):
    return {"prompt_id": "p1", "dataset": "d", "prompt": "describe the image", "messages": None,
            "label": None, "metadata": "{}", "created_at": 0,
            "media": [{"kind": "image", "uri": None, "data": data, "mime": "image/png", "turn": 0}]}


def test_oversize_media_goes_to_blob_store(tmp_path):
    big = bytes(range(256)) * 4096  # 1 MiB
    b = pa.RecordBatch.from_pylist([_prompt(big), _prompt(b"small")], schema=PROMPTS)
    store = BlobStore(tmp_path / "blobs")
    msgs = encode_messages(b, 256 * 1024, store)
    rows = pa.concat_tables([decode(m, "prompts") for m in msgs]).to_pylist()
    item = rows[0]["media"][0]
    assert item["data"] is None and item["uri"].startswith("file://")
    assert BlobStore.get(item["uri"]) == big
    assert rows[1]["media"][0]["data"] == b"small"


def test_oversize_row_without_media_fails_loudly():
    b = pa.RecordBatch.from_pylist(rollout_rows(3, tokens=40_000), schema=ROLLOUTS)
    with pytest.raises(RecordTooLarge, match="row 0 encodes to .* over max_message_bytes=65536"):
        encode_messages(b, 64 * 1024)


def test_group_by_key_keeps_row_order_within_key():
    rows = rollout_rows(12, group_size=3)
    order = [0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11]  # interleave groups
    b = pa.RecordBatch.from_pylist([rows[i] for i in order], schema=ROLLOUTS)
    groups = group_by_key(b, "group_id")
    assert [k for k, _ in groups] == ["g0000", "g0001", "g0002", "g0003"]
    for k, t in groups:
        assert set(t.column("group_id").to_pylist()) == {k}
        idx = t.column("sample_index").to_pylist()
        assert idx == sorted(idx)


def _several_chunks(order: list[int], n_chunks: int = 3) -> pa.Table:
    """Rollout rows (groups of 3) in ``order``, as a table whose columns keep
    ``n_chunks`` chunks, and an empty chunk between each two."""
    rows = rollout_rows(len(order), group_size=3)
    per = -(-len(order) // n_chunks)
    empty = pa.Table.from_pylist([], schema=ROLLOUTS)
    return pa.concat_tables(
        [t for c in range(n_chunks) for t in (
            pa.Table.from_pylist([rows[i] for i in order[c * per:(c + 1) * per]], schema=ROLLOUTS),
            empty)][:-1])


@pytest.mark.parametrize("limit", [1 << 20, 16 * 1024])
def test_every_row_of_a_chunked_table_is_encoded(limit):
    t = _several_chunks(list(range(24)))
    assert t.column("rollout_id").num_chunks == 5
    msgs = encode_messages(t, limit)
    assert all(len(m) <= limit for m in msgs)
    back = pa.concat_tables([decode(m, "rollouts") for m in msgs])
    assert back.column("rollout_id").to_pylist() == t.column("rollout_id").to_pylist()


@pytest.mark.parametrize("interleaved", [False, True])
def test_keyed_path_keeps_every_row_of_a_chunked_table(interleaved):
    order = [i for j in range(3) for i in range(j, 24, 3)] if interleaved else list(range(24))
    t = _several_chunks(order)
    got = {}
    for key, part in group_by_key(t, "group_id"):
        for m in encode_messages(part, 16 * 1024):
            rows = decode(m, "rollouts").to_pylist()
            assert {r["group_id"] for r in rows} == {key}
            got.setdefault(key, []).extend(r["rollout_id"] for r in rows)
    want = {}
    for r in t.to_pylist():  # keys in order of first appearance, rows in order per key
        want.setdefault(r["group_id"], []).append(r["rollout_id"])
    assert list(got.items()) == list(want.items())


def _over_2gib_table(rows: int = 2200, row_bytes: int = 1_000_000) -> pa.Table:
    """``rows`` rows of ``row_bytes`` binary each (2.2 GB: past 32-bit offsets), in two
    chunks that share one data buffer; group_id alternates ``a``/``b``."""
    import numpy as np

    half = rows // 2
    data = pa.py_buffer(np.random.default_rng(0).integers(0, 255, half * row_bytes,
                                                          dtype=np.uint8).tobytes())
    offsets = pa.py_buffer(np.arange(0, (half + 1) * row_bytes, row_bytes,
                                     dtype=np.int32).tobytes())
    chunk = pa.Array.from_buffers(pa.binary(), half, [None, offsets, data])
    return pa.table({"row": pa.array(np.arange(rows)),
                     "group_id": pa.array(["a", "b"] * half),
                     "payload": pa.chunked_array([chunk, chunk])})


@pytest.mark.slow
def test_column_over_2gib_keeps_every_row():
    """A 2.2 GB binary column: combine_chunks cannot make it one chunk; every row must
    still be encoded, on the plain and on the keyed path (peak memory about 6 GB)."""
    t = _over_2gib_table()
    limit = 64 << 20

    def rows_back(table) -> list[int]:
        got = []
        for m in encode_messages(table, limit):
            assert len(m) <= limit
            got += decode(m).column("row").to_pylist()
        return got

    assert rows_back(t) == list(range(2200))
    keyed = {k: rows_back(part) for k, part in group_by_key(t, "group_id")}
    assert keyed == {"a": list(range(0, 2200, 2)), "b": list(range(1, 2200, 2))}
