"""The stage loop (process_once, run_loop) on the in-memory bus: the delivery contract
and the hooks, without a broker (the same contract on real brokers: test_bus.py,
test_delivery.py and the e2e tests)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from relax.schemas.v1 import REWARDS, ROLLOUTS
from relax.streams.memory import MemoryBus, MemoryConsumer, MemoryProducer
from relax.streams.stage import Output, RecordError, StageStats, process_once, run_loop

from testdata import alternating_rewards, rollout_rows

SRC, OUT = "r1.rollouts", "r1.rewards"


def _bus(groups: int = 3, partitions: int = 2) -> tuple[MemoryBus, list[dict]]:
    bus = MemoryBus(partitions=partitions)
    rows = rollout_rows(groups * 2, group_size=2, tokens=3)
    p = MemoryProducer(bus)
    p.send(SRC, pa.RecordBatch.from_pylist(rows, schema=ROLLOUTS))
    p.flush()
    return bus, rows


def _score(d):
    rows = alternating_rewards(d.table.to_pylist())
    return [(OUT, pa.RecordBatch.from_pylist(rows, schema=REWARDS))]


def _committed(bus: MemoryBus, group: str = "g") -> int:
    return sum(o for (g, t, _), o in bus.committed.items() if g == group and t == SRC)


def test_outputs_are_flushed_then_inputs_committed():
    bus, rows = _bus()
    c, p = MemoryConsumer(bus, "g", [SRC]), MemoryProducer(bus)
    stats = StageStats()
    assert process_once(c, p, _score, stage="t", stats=stats) == 3  # one message per group
    assert bus.table(OUT).num_rows == len(rows) and stats.rows_out == len(rows)
    assert _committed(bus) == 3 and stats.commits == 1
    assert process_once(c, p, _score, stage="t", stats=stats) == 0  # nothing new
    # a new member of the group starts at the committed offsets: nothing is read twice
    assert process_once(MemoryConsumer(bus, "g", [SRC]), p, _score, stage="t") == 0


def test_a_record_error_goes_to_the_error_topic_and_the_rest_goes_on():
    bus, rows = _bus()
    bad = rows[0]["group_id"]

    def fn(d):
        if d.key == bad.encode():
            raise RecordError("response_text: expected a string", row=1)
        return _score(d)

    c, p = MemoryConsumer(bus, "g", [SRC]), MemoryProducer(bus)
    assert process_once(c, p, fn, stage="reward.t") == 3
    errs = bus.table(SRC + ".errors").to_pylist()
    assert len(errs) == 1 and errs[0]["stage"] == "reward.t" and errs[0]["row"] == 1
    assert errs[0]["error"] == "response_text: expected a string"
    assert errs[0]["source_topic"] == SRC and errs[0]["key"] == bad.encode()
    assert bus.table(OUT).num_rows == len(rows) - 2 and _committed(bus) == 3


@pytest.mark.parametrize("where", ["fn", "flush"])
def test_nothing_is_committed_when_the_function_or_the_flush_fails(where):
    bus, _ = _bus()
    c, p = MemoryConsumer(bus, "g", [SRC]), MemoryProducer(bus)
    calls = []

    def fn(d):
        calls.append(d.offset)
        if where == "fn" and len(calls) == 2:
            raise RuntimeError("engine died")
        return _score(d)

    if where == "flush":
        p.fail_flush = ConnectionError("broker gone")
    with pytest.raises((RuntimeError, ConnectionError)):
        process_once(c, p, fn, stage="t")
    assert _committed(bus) == 0 and bus.table(OUT) is None
    # a restarted stage reads everything again (at-least-once)
    assert process_once(MemoryConsumer(bus, "g", [SRC]), MemoryProducer(bus), _score,
                        stage="t") == 3


def test_batch_function_sees_the_whole_poll_and_after_runs_on_empty_polls():
    bus, rows = _bus()
    seen, afters = [], []

    def batch_fn(ds):
        seen.append(len(ds))
        table = pa.concat_tables([d.table for d in ds])
        return [Output(OUT, pa.RecordBatch.from_pylist(alternating_rewards(table.to_pylist()),
                                                       schema=REWARDS), partition=1)]

    c, p = MemoryConsumer(bus, "g", [SRC]), MemoryProducer(bus)
    assert process_once(c, p, batch_fn=batch_fn, after=lambda: afters.append(1), stage="t") == 3
    assert process_once(c, p, batch_fn=batch_fn, after=lambda: afters.append(1), stage="t") == 0
    assert seen == [3] and afters == [1, 1]
    assert [len(part) for part in bus.topics[OUT]] == [0, 3]  # Output.partition honoured
    with pytest.raises(ValueError, match="exactly one"):
        process_once(c, p, _score, batch_fn=batch_fn, stage="t")


def test_run_loop_hooks_gate_periodic_idle_exit_and_done():
    log, gate = [], iter([False, False, True, True, True, True])
    turns = iter([2, 0, 0, 0])

    def turn():
        log.append("turn")
        return next(turns, 0)

    run_loop(turn, lambda: False, ready=lambda: next(gate, True),
             wait=lambda: log.append("wait"), before=lambda: log.append("before"),
             periodic=lambda: log.append("periodic"), every_s=0.0,
             done=lambda: log.count("turn") == 3)
    assert log == ["before", "wait", "periodic"] * 2 + ["before", "turn", "periodic"] * 3

    n = []
    run_loop(lambda: n.append(1) or 0, lambda: len(n) > 10_000, exit_when_idle_s=1e-3)
    assert 0 < len(n) < 10_000  # left by the idle exit, not by should_stop
    n.clear()
    run_loop(lambda: n.append(1) or 0, lambda: len(n) >= 50, exit_when_idle_s=1e-9,
             idle_counts=lambda: False)
    assert len(n) == 50  # no partitions owned: idleness does not count


class _Metrics:
    """Records what a BusyWindow writes (the MetricsWriter interface it uses)."""

    def __init__(self):
        self.rows, self.flushes = [], 0

    def add(self, name, value, policy_version=None):
        self.rows.append((name, value))

    def add_many(self, values, policy_version=None):
        for k, v in values.items():
            self.add(k, v, policy_version)

    def busy(self):
        return [r for r in self.rows if r[0] == "busy_frac"]

    def flush(self):
        self.flushes += 1


def test_busy_window_writes_the_busy_fraction_of_each_window():
    """run_loop counts turns that did work as busy, empty turns and the readiness wait as
    idle; every window_s it writes busy_frac (clock: a fake, advanced by the turns)."""
    from relax.streams.stage import BusyWindow

    now = [0.0]
    metrics = _Metrics()
    busy = BusyWindow(metrics, window_s=10.0, clock=lambda: now[0])
    # 4 s working, 1 s idle turns, 3 s closed gate ...: windows of >= 10 s
    script = iter([("turn", 4.0, 1), ("turn", 1.0, 0), ("turn", 4.0, 1), ("turn", 1.0, 0),
                   ("wait", 3.0, 0), ("wait", 3.0, 0), ("wait", 3.0, 0), ("turn", 2.0, 3),
                   ("turn", 10.0, 2)])
    step = {"kind": None}

    def ready():
        step.update(zip(("kind", "s", "n"), next(script, ("end", 0.0, 0))))
        return step["kind"] != "wait"

    def wait():
        now[0] += step["s"]

    def turn():
        now[0] += step["s"]
        return step["n"]

    run_loop(turn, lambda: step["kind"] == "end", ready=ready, wait=wait)  # no busy: no rows
    assert metrics.rows == []
    script = iter([("turn", 4.0, 1), ("turn", 1.0, 0), ("turn", 4.0, 1), ("turn", 1.0, 0),
                   ("wait", 3.0, 0), ("wait", 3.0, 0), ("wait", 3.0, 0), ("turn", 2.0, 3),
                   ("turn", 10.0, 2)])
    step["kind"] = None
    now[0] = busy.start = 0.0
    run_loop(turn, lambda: step["kind"] == "end", ready=ready, wait=wait, busy=busy)
    assert metrics.busy() == [("busy_frac", 0.8), ("busy_frac", 2.0 / 11.0), ("busy_frac", 1.0)]
    assert metrics.flushes == 3 and busy.busy_s == 0.0
    # each row with the process's peak resident set (MB), as getrusage gives it
    import resource

    peaks = [v for n, v in metrics.rows if n == "peak_rss_mb"]
    assert len(peaks) == 3 and 10 < peaks[-1] <= resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def test_a_loop_shorter_than_a_window_still_writes_its_busy_fraction():
    """The open window is written when the loop ends: a stage that lives less than one
    window (a tiny run) still has a row on the dashboard's timeline."""
    from relax.streams.stage import BusyWindow

    now = [0.0]
    metrics = _Metrics()
    busy = BusyWindow(metrics, window_s=5.0, clock=lambda: now[0])
    turns = iter([(1.5, 1), (0.5, 0), (1.0, 2)])

    def turn():
        s, n = next(turns)
        now[0] += s
        return n

    run_loop(turn, lambda: now[0] >= 3.0, busy=busy)
    assert metrics.busy() == [("busy_frac", 2.5 / 3.0)] and metrics.flushes == 1
    assert busy.close() is None  # nothing since: no second row


def test_busy_window_caps_at_one():
    from relax.streams.stage import BusyWindow

    now = [0.0]
    metrics = _Metrics()
    busy = BusyWindow(metrics, window_s=1.0, clock=lambda: now[0])
    now[0] = 2.0
    assert busy.record(5.0, True) == 1.0  # a turn longer than the window it ends
    now[0] = 2.5
    assert busy.record(0.5, True) is None
    assert metrics.busy() == [("busy_frac", 1.0)]
