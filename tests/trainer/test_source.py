"""SampleSource on the real broker: staleness admission, ledger, drops, duplicates."""

from __future__ import annotations

import time

import pyarrow as pa

from relax.schemas import topics
from relax.streams.client import ensure_topics
from relax.streams.producer import BatchProducer
from relax.trainer.ledger import Ledger
from relax.trainer.source import SampleSource

from testdata import train_sample_table


def _table(start_group, n_groups, version, drop=None, group_size=2):
    t = train_sample_table(n_groups, group_size=group_size, seed=start_group,
                           policy_version=version)
    rows = t.to_pylist()
    for r in rows:
        g = int(r["group_id"][1:]) + start_group
        r["group_id"] = f"g{g:04d}"
        r["rollout_id"] = f"g{g:04d}/{r['sample_index']}"
        r["drop_reason"] = drop
    return pa.Table.from_pylist(rows, schema=t.schema)


def test_admission_ledger_and_duplicates(bus, unique):
    run = unique
    topic = topics.run_topic(run, "train_samples")
    ensure_topics(bus, {topic: 2})
    p = BatchProducer(bus)
    p.send(topic, _table(0, 1, version=0))                               # g0000: stale at v2
    p.send(topic, _table(1, 1, version=1, drop="filtered_zero_variance"))  # g0001: filtered
    p.send(topic, _table(2, 1, version=1, drop="error_reward"))           # g0002: error
    p.send(topic, _table(3, 3, version=1))                                # g0003..g0005: ok
    p.send(topic, _table(3, 1, version=1))                                # g0003 again: dup
    p.send(topic, _table(6, 1, version=2))                                # g0006: ok
    p.flush()
    ledger = Ledger()
    drops = []
    src = SampleSource(bus, run, ledger, batch_groups=2, max_staleness=1, on_drop=drops.append)
    b = src.next_batch(2, lambda: False)
    assert len(b.groups) == 2
    src.trained(b, 2)
    b2 = src.next_batch(2, lambda: False)
    src.trained(b2, 2)
    gids = sorted(g.column("group_id")[0].as_py() for g in b.groups + b2.groups)
    assert gids == ["g0003", "g0004", "g0005", "g0006"]  # arrival order across partitions varies
    assert sorted(b.staleness + b2.staleness) == [0, 0] + [1] * 6
    # nothing more to train; the redelivered g0003 is skipped whenever it is read (up to
    # 10 s on a loaded machine: a fresh-clone CI run once had not read it after 3 s)
    deadline = time.monotonic() + 10
    assert src.next_batch(2, lambda: src.duplicates >= 2 or time.monotonic() > deadline) is None
    assert src.duplicates == 2  # g0003 redelivered
    src.close()
    c = ledger.counts()
    assert c["stale"] == 2 and c["filtered"] == 2 and c["error"] == 2
    assert c["trained"] == 8
    assert "g0000/0" in ledger.ids("stale") and "g0001/1" in ledger.ids("filtered")
    assert sum(drops) == 3  # three whole groups dropped, reported for replacement
    p.close()


def test_ledger_refuses_double_decision(tmp_path):
    import pytest

    led = Ledger()
    led.record("a", "trained", 0)
    with pytest.raises(ValueError, match="already recorded"):
        led.record("a", "stale", 1)
    with pytest.raises(ValueError, match="valid"):
        led.record("b", "lost", 1)
    led.record("b", "stale", 1, 3)
    led.save(tmp_path / "l.parquet")
    back = Ledger.load(tmp_path / "l.parquet")
    assert back.counts() == {"trained": 1, "stale": 1, "filtered": 0, "error": 0}
    assert back.ids("stale") == {"b"}


def test_stale_group_credit_comes_back_while_the_batch_waits(bus, unique):
    """Second wedge of issue 12: the batch holds one usable group, drops a stale one, and
    can complete only with a replacement; the rollout makes that replacement only once the
    drop is reported. The drop must be reported while waiting, not when the batch is done."""
    import threading

    run = unique
    topic = topics.run_topic(run, "train_samples")
    ensure_topics(bus, {topic: 1})
    p = BatchProducer(bus)
    p.send(topic, _table(0, 1, version=3))  # g0000: admitted at v4
    p.send(topic, _table(1, 1, version=0))  # g0001: stale at v4 (max_staleness 1)
    p.flush()
    replaced = threading.Event()

    def rollout_credit(groups: int) -> None:  # what the rollout stage does with the credit
        p.send(topic, _table(2, groups, version=4))
        p.flush()
        replaced.set()

    src = SampleSource(bus, run, Ledger(), batch_groups=2, max_staleness=1,
                       on_drop=rollout_credit, start_version=4)
    deadline = time.monotonic() + 30
    b = src.next_batch(4, lambda: time.monotonic() > deadline)
    src.close()
    p.close()
    assert replaced.is_set() and b is not None, "the batch waited for credit it never returned"
    assert sorted(g.column("group_id")[0].as_py() for g in b.groups) == ["g0000", "g0002"]
    assert b.dropped["stale"] == 2


def test_a_sync_run_s_reader_holds_while_the_step_trains(bus, unique):
    """max_staleness 0: nothing written while the step trains can be admitted, so the
    reading thread does not fetch from the batch to ``trained`` (its fetch loop took CPU
    from the step, issue 19), then reads what came meanwhile."""
    run = unique
    topic = topics.run_topic(run, "train_samples")
    ensure_topics(bus, {topic: 1})
    p = BatchProducer(bus)
    p.send(topic, _table(0, 1, version=0))
    p.flush()
    src = SampleSource(bus, run, Ledger(), batch_groups=1, max_staleness=0)
    try:
        b = src.next_batch(0, lambda: False)
        time.sleep(1.0)  # a poll under way when the batch was taken ends (0.2 s)
        p.send(topic, _table(1, 1, version=1))  # written while the step trains
        p.flush()
        time.sleep(2.0)  # the thread reads a record within ~0.2 s when it reads
        with src.locked():
            assert not src._queue
        src.trained(b, 0)
        deadline = time.monotonic() + 30
        b2 = src.next_batch(1, lambda: time.monotonic() > deadline)
        assert b2 is not None and b2.groups[0].column("group_id")[0].as_py() == "g0001"
    finally:
        src.close()
        p.close()


def test_rollouts_of_a_branch_lost_in_a_trainer_restart_are_stale(bus, unique):
    """A trainer restarted from an older checkpoint, at v2, reads rollouts that its dead
    predecessor's v5 made: counted stale (admit would refuse a version newer than the
    trainer's), and the good group trains."""
    run = unique
    topic = topics.run_topic(run, "train_samples")
    ensure_topics(bus, {topic: 1})
    p = BatchProducer(bus)
    p.send(topic, _table(0, 1, version=5))
    p.send(topic, _table(1, 1, version=2))
    p.flush()
    ledger = Ledger()
    src = SampleSource(bus, run, ledger, batch_groups=1, max_staleness=1)
    try:
        b = src.next_batch(2, lambda: False)
        assert [g.column("group_id")[0].as_py() for g in b.groups] == ["g0001"]
        src.trained(b, 2)
    finally:
        src.close()
        p.close()
    assert sorted(ledger.ids("stale")) == ["g0000/0", "g0000/1"]
