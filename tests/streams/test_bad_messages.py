"""BatchConsumer on the real broker: every message a stage cannot use goes to
``<topic>.errors`` with a reason naming topic, partition, offset and what was expected;
the good messages around it come through and nothing raises."""

from __future__ import annotations

import random
import time

import pyarrow as pa

from relax.streams.read import read_table
from relax.schemas import topics
from relax.schemas.v1 import REWARDS, ROLLOUTS
from relax.streams.client import ensure_topics, producer_kwargs
from relax.streams.codec import encode
from relax.streams.consumer import BatchConsumer
from relax.streams.producer import BatchProducer

from testdata import alternating_rewards, rollout_rows


def _produce(bus, topic: str, messages: list[tuple[bytes | None, list[tuple[str, bytes]]]]):
    """Send ``(value, headers)`` pairs in order to partition 0 with a raw kafka-python
    producer (no relax encoding or headers added)."""
    from kafka import KafkaProducer

    kp = KafkaProducer(**producer_kwargs(bus))
    for i, (value, headers) in enumerate(messages):
        kp.send(topic, value=value, key=f"k{i}".encode(), headers=headers, partition=0)
    kp.flush()
    kp.close()


def _poll_until(consumer: BatchConsumer, want_rows: int, max_polls: int = 40) -> list:
    got = []
    for _ in range(max_polls):
        ds = consumer.poll(0.5)
        consumer.done(ds)
        got.extend(ds)
        if sum(d.table.num_rows for d in got) >= want_rows:
            break
    consumer.commit()
    return got


def _errors_by_offset(bus, topic: str) -> dict[int, dict]:
    return {e["source_offset"]: e for e in read_table(bus, topics.errors_topic(topic)).to_pylist()}


def _hdr(schema: str | bytes) -> list[tuple[str, bytes]]:
    return [("relax-schema", schema if isinstance(schema, bytes) else schema.encode())]


def test_every_unusable_message_goes_to_the_errors_topic_and_good_ones_come_through(bus, unique):
    topic = topics.run_topic(unique, topics.ROLLOUTS)
    ensure_topics(bus, {topic: 1, topics.errors_topic(topic): 1})
    rollouts = rollout_rows(6, group_size=2, tokens=8)
    good_a = encode(pa.RecordBatch.from_pylist(rollouts[:2], schema=ROLLOUTS))
    good_b = encode(pa.RecordBatch.from_pylist(rollouts[2:4], schema=ROLLOUTS))
    good_c = encode(pa.RecordBatch.from_pylist(rollouts[4:], schema=ROLLOUTS))  # no header
    rewards = encode(pa.RecordBatch.from_pylist(alternating_rewards(rollouts[:2]), schema=REWARDS))
    no_prompt_id = encode(pa.RecordBatch.from_pylist(rollouts[:2], schema=ROLLOUTS)
                          .drop_columns(["prompt_id"]))
    corrupt = bytearray(good_a)
    rng = random.Random(3)
    corrupt[len(corrupt) // 2: len(corrupt) // 2 + 64] = bytes(rng.randrange(256) for _ in range(64))
    messages = [
        (good_a, _hdr("rollouts")),          # 0 good
        (None, _hdr("rollouts")),            # 1 null value (tombstone)
        (b"", _hdr("rollouts")),             # 2 empty value
        (b"\x00not arrow", _hdr("rollouts")),  # 3 undecodable bytes
        (good_a, _hdr("no_such_schema")),    # 4 unknown schema header
        (good_a, _hdr(b"\xff\xfe")),         # 5 header that is not UTF-8
        (rewards, _hdr("rewards")),          # 6 a valid batch of another relax schema
        (rewards, []),                       # 7 the same without a header
        (good_a, _hdr("rewards")),           # 8 the topic's bytes under another schema header
        (no_prompt_id, _hdr("rollouts")),    # 9 Arrow schema does not match
        (None, []),                          # 10 tombstone without headers
        (good_b, _hdr("rollouts")),          # 11 good
        (good_c, []),                        # 12 good: no header, the topic tells the schema
    ]
    _produce(bus, topic, messages)
    c = BatchConsumer(bus, topics.group(unique, "bad"), [topic], stage="reward.test")
    got = _poll_until(c, 6)
    got += _poll_until(c, 1, max_polls=2)  # nothing more arrives
    assert [d.offset for d in got] == [0, 11, 12]
    assert [rid for d in got for rid in d.table.column("rollout_id").to_pylist()] == \
        [r["rollout_id"] for r in rollouts]
    assert c.routed_errors == 10
    assert c.positions() == {(topic, 0): 13}
    c.close()

    errs = _errors_by_offset(bus, topic)
    assert sorted(errs) == list(range(1, 11))
    for offset, e in errs.items():
        assert e["source_topic"] == topic and e["source_partition"] == 0
        assert e["stage"] == "reward.test/decode"
        assert f"{topic}[0]@{offset}" in e["error"], e["error"]
        assert "expected" in e["error"], e["error"]
        assert e["key"] == f"k{offset}".encode()
        assert e["value"] == messages[offset][0] or (offset in (1, 10) and e["value"] is None)
    assert "null value" in errs[1]["error"] and "null value" in errs[10]["error"]
    assert "empty value" in errs[2]["error"]
    assert "not an Arrow IPC stream" in errs[3]["error"]
    assert "unknown schema 'no_such_schema'" in errs[4]["error"]
    assert "'rollouts'" in errs[4]["error"]
    assert "not UTF-8" in errs[5]["error"]
    for offset in (6, 8):
        assert "schema header 'rewards' is not the schema of topic" in errs[offset]["error"]
        assert "expected 'rollouts'" in errs[offset]["error"]
    assert "a 'rewards' batch" in errs[7]["error"] and "expected 'rollouts'" in errs[7]["error"]
    assert "prompt_id" in errs[9]["error"]


def test_corrupt_arrow_buffers_are_routed_not_crashing(bus, unique):
    """Flipped bytes inside a valid stream: each message is delivered whole and valid, or
    routed; none crashes the consumer (or the process: buffers are fully validated)."""
    topic = topics.run_topic(unique, topics.ROLLOUTS)
    ensure_topics(bus, {topic: 1, topics.errors_topic(topic): 1})
    good = encode(pa.RecordBatch.from_pylist(rollout_rows(4, group_size=4, tokens=8),
                                             schema=ROLLOUTS))
    rng = random.Random(7)
    messages = []
    for _ in range(300):
        b = bytearray(good)
        for _ in range(rng.randrange(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        messages.append((bytes(b), _hdr("rollouts")))
    messages.append((good, _hdr("rollouts")))
    _produce(bus, topic, messages)
    c = BatchConsumer(bus, topics.group(unique, "corrupt"), [topic], stage="fuzz")
    seen = 0
    for _ in range(60):
        ds = c.poll(0.5)
        c.done(ds)
        seen += len(ds)
        for d in ds:
            d.table.validate(full=True)
        if c.positions().get((topic, 0)) == len(messages):
            break
    assert c.positions() == {(topic, 0): len(messages)}
    assert seen + c.routed_errors == len(messages) and c.routed_errors > 0
    c.close()


def test_a_consumer_of_several_topics_takes_each_topics_own_schema(bus, unique):
    """The aggregator's inputs: rollouts and rewards topics in one consumer; each message
    is checked against its own topic's schema."""
    src_r, src_w = topics.run_topic(unique, topics.ROLLOUTS), topics.run_topic(unique, topics.REWARDS)
    ensure_topics(bus, {src_r: 1, src_w: 1, topics.errors_topic(src_r): 1,
                        topics.errors_topic(src_w): 1})
    rollouts = rollout_rows(2, group_size=2, tokens=8)
    r_bytes = encode(pa.RecordBatch.from_pylist(rollouts, schema=ROLLOUTS))
    w_bytes = encode(pa.RecordBatch.from_pylist(alternating_rewards(rollouts), schema=REWARDS))
    _produce(bus, src_r, [(r_bytes, _hdr("rollouts")), (w_bytes, _hdr("rewards"))])
    _produce(bus, src_w, [(w_bytes, _hdr("rewards")), (r_bytes, _hdr("rollouts")), (w_bytes, [])])
    c = BatchConsumer(bus, topics.group(unique, "aggregate"), [src_r, src_w], stage="aggregate")
    got = _poll_until(c, 6)
    got += _poll_until(c, 1, max_polls=2)
    assert sorted((d.topic, d.offset) for d in got) == sorted([(src_r, 0), (src_w, 0), (src_w, 2)])
    assert c.routed_errors == 2
    c.close()
    assert list(_errors_by_offset(bus, src_r)) == [1]
    assert list(_errors_by_offset(bus, src_w)) == [1]


def test_the_aggregate_changelog_carries_several_schemas_named_by_header(bus, unique):
    changelog = topics.changelog_topic(unique)
    ensure_topics(bus, {changelog: 1, topics.errors_topic(changelog): 1})
    rollouts = rollout_rows(2, group_size=2, tokens=8)
    r_bytes = encode(pa.RecordBatch.from_pylist(rollouts, schema=ROLLOUTS))
    w_bytes = encode(pa.RecordBatch.from_pylist(alternating_rewards(rollouts), schema=REWARDS))
    _produce(bus, changelog, [
        (r_bytes, _hdr("rollouts")),   # 0 good
        (w_bytes, _hdr("rewards")),    # 1 good
        (w_bytes, []),                 # 2 no header: the changelog holds several schemas
        (r_bytes, _hdr("prompts")),    # 3 not a schema the changelog holds
        (w_bytes, _hdr("rollouts")),   # 4 header and bytes disagree
    ])
    c = BatchConsumer(bus, topics.group(unique, "cl"), [changelog], stage="cl")
    got = _poll_until(c, 4)
    got += _poll_until(c, 1, max_polls=2)
    assert [d.offset for d in got] == [0, 1]
    assert [d.table.schema.metadata[b"relax.schema"] for d in got] == [b"rollouts", b"rewards"]
    c.close()
    errs = _errors_by_offset(bus, changelog)
    assert sorted(errs) == [2, 3, 4]
    assert "no relax-schema header" in errs[2]["error"]
    assert "schema header 'prompts' is not a schema of topic" in errs[3]["error"]
    assert "a 'rewards' batch" in errs[4]["error"]


def test_metrics_readers_skip_what_is_not_a_metrics_batch(bus, unique):
    """The launcher's follower reads ``<run>.metrics`` and the rollout's credit reads
    ``<run>.progress``, both group-less: a tombstone or garbage there is skipped, never a
    crash of the run."""
    from kafka import KafkaProducer

    from relax.infra.control.launch import MetricsFollower
    from relax.schemas import metric_names as M
    from relax.streams.metrics import MetricsWriter
    from relax.streams.progress import PROGRESS_KEY, TrainerProgress, progress_row

    metrics, progress_topic = (topics.run_topic(unique, topics.METRICS),
                               topics.run_topic(unique, topics.PROGRESS))
    ensure_topics(bus, {metrics: 1, progress_topic: 1})
    raw = KafkaProducer(bootstrap_servers=bus.bootstrap_servers)
    for topic in (metrics, progress_topic):
        raw.send(topic, value=None, key=b"trainer")
        raw.send(topic, value=b"not arrow", key=b"trainer")
    raw.flush()
    raw.close()
    p = BatchProducer(bus)
    w = MetricsWriter(p, unique, "trainer")
    w.add(M.GROUPS_CONSUMED, 6, 3)
    w.flush()
    p.send(progress_topic, progress_row(6, 10, 3), key=PROGRESS_KEY)
    p.flush()
    follower, progress = MetricsFollower(bus, unique), TrainerProgress(bus, unique)
    deadline = time.monotonic() + 20
    rows: list = []
    while (not rows or progress.consumed is None) and time.monotonic() < deadline:
        rows += follower.poll(0.5)
        progress.poll(0.5)
    follower.close()
    progress.close()
    p.close()
    assert [(r["name"], r["value"]) for r in rows] == [(M.GROUPS_CONSUMED, 6.0)]
    assert (progress.consumed, progress.needed, progress.version) == (6, 10, 3)

def test_metrics_follower_reads_to_the_end_written_before_the_call(bus, unique):
    """``read_to_end`` returns only once every record written before it is read (the
    end of a run read its metrics with one 1 s poll, and after a Kafka node was lost
    that missed the last steps: a finished 5-step run counted fewer)."""
    from relax.infra.control.run_watch import MetricsFollower
    from relax.schemas import metric_names as M
    from relax.streams.metrics import MetricsWriter
    from relax.streams.producer import BatchProducer

    p = BatchProducer(bus)
    w = MetricsWriter(p, unique, "trainer")
    for step in range(1, 41):
        w.add(M.STEP_S, 0.5, step)
        w.flush()
        p.flush()  # one record per step
    follower = MetricsFollower(bus, unique)
    try:
        assert follower.read_to_end(30.0)
        assert [r["policy_version"] for r in follower.rows] == list(range(1, 41))
        w.add(M.STEP_S, 0.5, 41)
        w.flush()
        p.flush()
        assert follower.read_to_end(30.0) and follower.rows[-1]["policy_version"] == 41
        assert follower.read_to_end(30.0) and len(follower.rows) == 41  # nothing twice
    finally:
        follower.close()
        p.close()
