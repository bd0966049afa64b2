"""relax monitor: lag of a real consumer group, snapshot contents, rates, --once --json."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pytest
from rich.console import Console
from testdata import alternating_rewards, produce_run, rollout_rows, train_sample_rows

from relax.infra.observe.monitor import (
    MetricsFold,
    Monitor,
    Reading,
    SamplesFold,
    build_snapshot,
    render,
    snapshot,
)
from relax.schemas import topics
from relax.schemas.v1 import ROLLOUTS, TRAIN_SAMPLES
from relax.streams.consumer import BatchConsumer
from relax.streams.producer import BatchProducer


def _consume_all(c: BatchConsumer, messages: int, max_polls: int = 40) -> None:
    got = 0
    for _ in range(max_polls):
        ds = c.poll(1.0)
        c.done(ds)
        got += len(ds)
        if got >= messages:
            break
    assert got == messages
    assert c.commit()


def test_lag_is_positive_while_a_consumer_is_stopped_and_zero_after_it_commits(bus, unique):
    from typer.testing import CliRunner

    from relax.infra.cli.app import app

    run = unique
    written = produce_run(bus, run, steps=3)
    src = topics.run_topic(run, "rollouts")
    g = topics.reward_group(run, "test")
    first = BatchConsumer(bus, g, [src], stage="reward.test")
    _consume_all(first, 6)  # 3 steps x 2 groups = 6 keyed messages
    first.close()  # stopped

    p = BatchProducer(bus)
    extra = rollout_rows(12, group_size=4, tokens=8)  # 3 more groups -> 3 messages
    p.send(src, pa.RecordBatch.from_pylist(extra, schema=ROLLOUTS))
    p.close()

    res = CliRunner().invoke(app, ["monitor", "--run", run, "--once", "--json",
                                   "--bootstrap", bus.bootstrap_servers])
    assert res.exit_code == 0, res.output
    snap = json.loads(res.output)
    assert snap["groups"][g]["lag"] == 3 and snap["groups"][g]["topics"] == {src: 3}
    assert sum(snap["groups"][g]["partitions"].values()) == 3
    assert snap["lag_total"] == 3
    # the rest of the snapshot: what the synthetic trainer wrote
    assert snap["staleness_hist"] == {"0": 18.0, "1": 9.0}
    assert [v["policy_version"] for v in snap["versions"]] == [1, 2, 3]
    assert [round(v["reward_mean"], 6) for v in snap["versions"]] == [0.2, 0.3, 0.4]
    assert {v["source"] for v in snap["versions"]} == {"metrics"}
    assert snap["trainer"]["steps"] == 3 and snap["trainer"]["data_wait_pct"] == 25.0
    assert snap["errors"][topics.errors_topic(src)] == 1 and snap["errors_total"] == 1
    assert snap["topics"][src]["records"] == 9
    assert snap["topics"][topics.run_topic(run, "metrics")]["records"] == 3
    assert set(snap["topics"]) == {t for t in written if not t.endswith(".errors")}

    second = BatchConsumer(bus, g, [src], stage="reward.test")
    _consume_all(second, 3)
    second.close()
    after = snapshot(bus, run)
    assert after["groups"][g]["lag"] == 0 and after["lag_total"] == 0


def test_monitor_refresh_reads_metrics_incrementally_and_gives_rates(bus, unique):
    run = unique
    produce_run(bus, run, steps=2)
    m = Monitor(bus, run)
    try:
        s1 = m.refresh()
        assert s1["topics"][f"{run}.rollouts"]["rows_per_s"] is None  # one reading: no rate
        metric_rows = m.reader.metrics.rows
        assert metric_rows == 2 * 10  # rows per step: testdata.trainer_metric_rows
        produce_run(bus, run, steps=1)
        s2 = m.refresh()
        assert m.reader.metrics.rows == metric_rows + 10  # only the new rows were folded
        assert s2["topics"][f"{run}.rollouts"]["rows_per_s"] > 0
        assert s2["topics"][f"{run}.metrics"]["records_per_s"] > 0
        assert len(s2["history"]) == 2
    finally:
        m.close()


def _reading(ts, hw, rows, nbytes, metrics=None, samples=None, committed=None):
    return Reading("r", ts, hw, committed or {}, rows, nbytes, metrics or MetricsFold(),
                   samples or SamplesFold())


def test_build_snapshot_is_pure_rates_lag_and_sample_fallback():
    samples = SamplesFold()
    rolls = rollout_rows(8, group_size=4, policy_version=5)
    samples.add(pa.Table.from_pylist(train_sample_rows(rolls, alternating_rewards(rolls)),
                                     schema=TRAIN_SAMPLES))
    hw1 = {"r.rollouts": {0: 10, 1: 0}, "r.rollouts.errors": {0: 2}, "prompts.x": {0: 4}}
    hw2 = {"r.rollouts": {0: 30, 1: 10}, "r.rollouts.errors": {0: 2}, "prompts.x": {0: 8}}
    committed = {"r.reward.a": {"r.rollouts": {0: 25}}, "r.idle": {}}
    before = _reading(100.0, hw1, {"r.rollouts": 40}, {"r.rollouts": 1_000_000})
    now = _reading(102.0, hw2, {"r.rollouts": 140}, {"r.rollouts": 5_000_000}, samples=samples,
                   committed=committed)
    s = build_snapshot(now, before)
    t = s["topics"]["r.rollouts"]
    assert (t["records"], t["records_per_s"], t["rows_per_s"], t["mb_per_s"]) == (40, 15.0, 50.0, 2.0)
    # a consumer group's input topic (not read): records/s from watermarks, no rows/s
    assert s["topics"]["prompts.x"] == {"partitions": 1, "records": 8, "records_per_s": 2.0,
                                        "rows_per_s": None, "mb_per_s": None}
    assert s["errors"] == {"r.rollouts.errors": 2} and s["errors_total"] == 2
    # partition 1 never committed: counts from offset 0
    assert s["groups"]["r.reward.a"] == {"lag": 15, "topics": {"r.rollouts": 15},
                                         "partitions": {"r.rollouts[0]": 5, "r.rollouts[1]": 10}}
    assert s["groups"]["r.idle"]["lag"] is None
    assert s["versions"] == [{"policy_version": 5, "reward_mean": 0.5, "accuracy": 0.5,
                              "samples": 8, "source": "train_samples"}]
    assert s["trainer"]["steps"] == 0 and s["trainer"]["data_wait_pct"] is None
    assert build_snapshot(now, before) == s  # same input, same output
    json.dumps(s)


def test_failed_reward_rows_count_as_errors_of_the_rewards_topic():
    """They are rows of <run>.rewards with error set (no error topic holds them): the
    monitor sums each reward stage's per-poll reward_errors."""
    m = MetricsFold()
    m.add([{"name": "reward_errors", "value": n, "policy_version": 1, "component": c,
            "ts": 0} for c, n in (("reward.a", 3.0), ("reward.a", 2.0), ("reward.b", 1.0),
                                  ("reward.a", 0.0))])
    hw = {"r.rewards": {0: 9}, "r.rewards.errors": {0: 0}, "r.rollouts.errors": {0: 4}}
    s = build_snapshot(_reading(10.0, hw, {}, {}, metrics=m))
    assert s["reward_errors"] == {"reward.a": 5, "reward.b": 1}
    assert s["errors_total"] == 4 + 6
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(render(s))
    row = next(x for x in console.export_text().splitlines() if "│ rewards " in x)
    assert row.split("│")[-2].strip() == "6"


def test_records_lost_to_retention_are_summed_per_stage_and_shown():
    """Each lost_to_retention row is one loss a stage's consumer found: the monitor sums
    them per component and shows the run's total in its head."""
    m = MetricsFold()
    m.add([{"name": "lost_to_retention", "value": n, "policy_version": None, "component": c,
            "ts": 0} for c, n in (("reward.a", 4.0), ("trainer", 2.0), ("reward.a", 1.0))])
    s = build_snapshot(_reading(10.0, {"r.rollouts": {0: 9}}, {}, {}, metrics=m))
    assert s["lost_to_retention"] == {"reward.a": 5, "trainer": 2}
    assert s["lost_to_retention_total"] == 7
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(render(s))
    assert "lost to retention 7" in console.export_text()
    quiet = build_snapshot(_reading(10.0, {"r.rollouts": {0: 9}}, {}, {}))
    assert quiet["lost_to_retention"] == {} and quiet["lost_to_retention_total"] == 0


def test_render_fits_80_columns_without_cutting_a_name():
    run = "demo-20261207-031245"
    hw = {f"{run}.rollouts": {0: 30}, f"{run}.train_samples": {0: 8}, "prompts.gsm8k": {0: 4}}
    committed = {f"{run}.reward.gsm8k": {f"{run}.rollouts": {0: 25}}}
    snap = build_snapshot(_reading(102.0, hw, {}, {}, committed=committed))
    snap["run"] = run
    snap["trainer"].update(policy_version=17, step_s_mean=12.34, data_wait_pct=3.4)
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(render(snap))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 80 and "\u2026" not in text  # no ellipsis
    for item in (f"run {run}", "policy_version 17", "step_s 12.34", "data wait 3.4% (last 10 steps)", "lag 5",
                 "errors 0", "rollouts", "train_samples", "prompts.gsm8k", "reward.gsm8k",
                 "rollouts=5", f"topics ({run}.*)"):
        assert item in text, item


@pytest.mark.parametrize("k", [0, 3])
def test_metrics_fold_staleness_histogram(k):
    f = MetricsFold()
    f.add([{"component": "trainer", "name": f"staleness_hist.{k}", "value": 4.0,
            "policy_version": 1},
           {"component": "trainer", "name": f"staleness_hist.{k}", "value": 2.0,
            "policy_version": 2}])
    assert f.staleness == {k: 6.0}


def test_metrics_fold_timeline_keeps_each_stages_busy_frac_rows():
    """``busy_frac`` rows become the stage timeline: per component, (ts in seconds,
    fraction) in read order, the newest TIMELINE_POINTS kept; a timestamp read back
    from Arrow (datetime) and one in ms since epoch give the same seconds."""
    import datetime as dt

    from relax.infra.observe.monitor_reader import TIMELINE_POINTS

    f = MetricsFold()
    f.add([{"ts": 1_700_000_005_000, "component": "rollout-0", "name": "busy_frac", "value": 0.5,
            "policy_version": None},
           {"ts": dt.datetime.fromtimestamp(1_700_000_010, dt.timezone.utc),
            "component": "rollout-0", "name": "busy_frac", "value": 1.0, "policy_version": None},
           {"ts": 1_700_000_007_000, "component": "trainer", "name": "busy_frac", "value": 0.25,
            "policy_version": 1},
           {"ts": 1_700_000_007_000, "component": "trainer", "name": "step_s", "value": 2.0,
            "policy_version": 1}])
    assert f.timeline == {"rollout-0": [(1_700_000_005.0, 0.5), (1_700_000_010.0, 1.0)],
                          "trainer": [(1_700_000_007.0, 0.25)]}
    f.add([{"ts": 1_800_000_000_000 + i, "component": "trainer", "name": "busy_frac",
            "value": 0.0, "policy_version": None} for i in range(TIMELINE_POINTS)])
    assert len(f.timeline["trainer"]) == TIMELINE_POINTS
    assert f.timeline["trainer"][0] == (1_800_000_000.0, 0.0)


def test_monitor_once_on_a_run_with_no_topics_says_so_and_exits_1(bus, unique):
    # e.g. the demo's run, whose own broker stopped with it: empty tables would read as idle
    from typer.testing import CliRunner

    from relax.infra.cli.app import app

    res = CliRunner().invoke(app, ["monitor", "--run", unique, "--once", "--json",
                                   "--bootstrap", bus.bootstrap_servers])
    assert res.exit_code == 1
    assert f"no topics of run '{unique}' on {bus.bootstrap_servers}" in res.output
    assert "--bootstrap" in res.output
