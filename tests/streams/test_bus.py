"""Integration tests of producer, consumer and stage loop on Apache Kafka."""

from __future__ import annotations

import pyarrow as pa

from relax.schemas import topics
from relax.schemas.v1 import ROLLOUTS
from relax.streams.client import ensure_topics
from relax.streams.consumer import BatchConsumer
from relax.streams.producer import BatchProducer
from relax.streams.stage import RecordError, process_once

from testdata import rollout_rows


def _drain(consumer, want_rows, max_polls=60):
    got = []
    for _ in range(max_polls):
        ds = consumer.poll(1.0)
        got.extend(ds)
        if sum(d.table.num_rows for d in got) >= want_rows:
            break
    return got


def test_roundtrip_keyed_in_order(bus, unique):
    run = unique
    t = topics.run_topic(run, "rollouts")
    ensure_topics(bus, {t: 3})
    rows = rollout_rows(40, group_size=4, tokens=64)
    p = BatchProducer(bus)
    p.send(t, pa.RecordBatch.from_pylist(rows, schema=ROLLOUTS))
    assert p.flush() >= 10
    c = BatchConsumer(bus, topics.group(run, "check"), [t], stage="check")
    got = _drain(c, 40)
    by_group: dict[str, list[str]] = {}
    for d in got:
        gids = set(d.table.column("group_id").to_pylist())
        assert gids == {d.key.decode()}, "one key per message"
        by_group.setdefault(d.key.decode(), []).extend(d.table.column("rollout_id").to_pylist())
    want: dict[str, list[str]] = {}
    for r in rows:
        want.setdefault(r["group_id"], []).append(r["rollout_id"])
    assert by_group == want
    c.close()
    p.close()


def test_garbage_goes_to_errors_topic_and_stage_goes_on(bus, unique):
    run = unique
    src, dst = topics.run_topic(run, "rollouts"), topics.run_topic(run, "rewards")
    ensure_topics(bus, {src: 2, dst: 2, topics.errors_topic(src): 1})
    p = BatchProducer(bus)
    good = pa.RecordBatch.from_pylist(rollout_rows(8, group_size=4, tokens=8), schema=ROLLOUTS)
    p.send_value(src, b"\x00not arrow at all", key=b"g-bad")
    p.send(src, good)
    p.flush()
    c = BatchConsumer(bus, topics.group(run, "stage"), [src], stage="stage")
    seen = []

    def fn(d):
        seen.extend(d.table.column("rollout_id").to_pylist())
        if "g0000" in d.table.column("group_id").to_pylist()[0]:
            raise RecordError("group g0000 rejected by the test", row=0)
        return []

    for _ in range(30):
        process_once(c, p, fn, stage="stage")
        if len(seen) >= 8:
            break
    assert len(seen) == 8
    from relax.streams.read import read_table

    errs = read_table(bus, topics.errors_topic(src)).to_pylist()
    stages = sorted(e["stage"] for e in errs)
    assert stages == ["stage", "stage/decode"]
    dec = next(e for e in errs if e["stage"] == "stage/decode")
    assert dec["value"] == b"\x00not arrow at all" and dec["source_topic"] == src
    assert dec["source_offset"] is not None and "Arrow" in dec["error"]
    c.close()
    p.close()
