"""What a run is doing, read off the bus (``relax monitor``; the dashboard reuses it).

Three layers, so the numbers can be tested without a terminal or a browser:

* :class:`RunReader` (I/O, in :mod:`relax.infra.observe.monitor_reader` with the row folds
  and :class:`Reading`): on each :meth:`~RunReader.read` it lists the run's
  topics and consumer groups (``<run>.*``), reads the high watermark of every
  partition (from a fetch, see :mod:`relax.streams.lag`), each group's committed offsets, and the messages
  written since the previous read (group-less, positions kept between reads:
  ``<run>.metrics`` from offset 0, ``<run>.train_samples`` from offset 0 unless the
  trainer's reward metrics are already there, the other run topics from where they
  were when first seen). It returns a :class:`Reading`.
* :func:`build_snapshot` (pure): a JSON-ready dict from a reading and the one
  before it: per topic records, records/s, rows/s and MB/s; per consumer group lag
  (high watermark - committed offset per partition; a partition never committed
  counts from 0); the staleness histogram (sum of the trainer's
  ``staleness_hist.<k>`` rows); reward and accuracy per policy_version (the
  trainer's ``reward_mean`` / ``accuracy`` rows, else computed from
  ``train_samples`` grouped by ``policy_version_start``); greedy held-out accuracy per
  policy_version (the ``eval`` rows: ``eval.before`` and ``eval.every``); trainer step time and
  data-wait %; error records per ``<topic>.errors``; input records lost to retention
  per stage (the sum of its ``lost_to_retention`` rows).
* :func:`render` (pure) draws a snapshot with rich; :func:`watch` refreshes it live.

:class:`Monitor` ties reader and snapshot together and keeps a short history
(lag and rates over time) for the dashboard. Nothing here commits offsets or
joins a consumer group, so watching a run never changes it.
"""

from __future__ import annotations

import json
import time
from collections import deque

from relax.infra.observe.monitor_reader import MetricsFold, Reading, RunReader, SamplesFold
from relax.schemas import metric_names as mn
from relax.schemas import topics as topic_names
from relax.streams.client import BusConfig

RECENT_STEPS = 10
"""Trainer steps averaged for step time and data-wait %."""


# --- the snapshot (pure) ----------------------------------------------------------------


def _rate(now: float | None, before: float | None, dt: float | None) -> float | None:
    if now is None or before is None or not dt or dt <= 0:
        return None
    return max(0.0, (now - before) / dt)


def build_snapshot(reading: Reading, previous: Reading | None = None) -> dict:
    """A JSON-ready summary of ``reading`` (rates need ``previous``, else they are None).

    Returns:
        ``{"run", "ts", "topics": {topic: {partitions, records, records_per_s,
        rows_per_s, mb_per_s}}, "errors": {error topic: records}, "reward_errors":
        {reward component: failed reward rows}, "errors_total" (both together),
        "lost_to_retention": {component: records}, "lost_to_retention_total",
        "groups": {group: {lag, topics: {topic: lag}, partitions: {"topic[p]": lag}}},
        "lag_total", "staleness_hist": {"k": samples}, "versions": [{policy_version,
        reward_mean, accuracy, samples, source}], "evals": [{policy_version, accuracy, n,
        correct, reward_errors, seconds}] (oldest first; accuracy in [0, 1]), "eval": the
        newest of them or None, "trainer": {steps, policy_version,
        step_s, step_s_mean, data_wait_s, data_wait_pct}, "latest": {component:
        {name: value}}, "timeline": {component: [[ts, busy_frac], ...]}}``. Rates are per second (MB = 10**6 bytes); lag counts
        Kafka messages (records), not rows.
    """
    dt = reading.ts - previous.ts if previous is not None else None
    topics: dict[str, dict] = {}
    errors: dict[str, int] = {}
    for t, parts in sorted(reading.watermarks.items()):
        records = sum(parts.values())
        if t.endswith(topic_names.ERRORS_SUFFIX):
            errors[t] = records
            continue
        prev = previous if previous is not None and t in previous.watermarks else None
        # rows and bytes are counted for the run's topics only (a group's inputs: None)
        read = prev is not None and t in reading.rows and t in prev.rows
        mbps = _rate(reading.bytes[t], prev.bytes[t], dt) if read else None
        topics[t] = {
            "partitions": len(parts),
            "records": records,
            "records_per_s": _rate(records, sum(prev.watermarks[t].values()) if prev else None,
                                   dt),
            "rows_per_s": _rate(reading.rows[t], prev.rows[t], dt) if read else None,
            "mb_per_s": mbps / 1e6 if mbps is not None else None,
        }
    groups: dict[str, dict] = {}
    for g, per in sorted(reading.committed.items()):
        lag_topics: dict[str, int] = {}
        lag_parts: dict[str, int] = {}
        for t, offs in sorted(per.items()):
            total = 0
            for p, end in sorted(reading.watermarks.get(t, {}).items()):
                lag = max(0, end - offs.get(p, 0))
                lag_parts[f"{t}[{p}]"] = lag
                total += lag
            lag_topics[t] = total
        groups[g] = {"lag": sum(lag_topics.values()) if per else None,
                     "topics": lag_topics, "partitions": lag_parts}
    return {
        "run": reading.run,
        "ts": reading.ts,
        "topics": topics,
        "errors": errors,
        "reward_errors": {c: int(n) for c, n in sorted(reading.metrics.reward_errors.items())},
        "errors_total": sum(errors.values()) + int(sum(reading.metrics.reward_errors.values())),
        "lost_to_retention": {c: int(n) for c, n in
                              sorted(reading.metrics.lost_to_retention.items())},
        "lost_to_retention_total": int(sum(reading.metrics.lost_to_retention.values())),
        "groups": groups,
        "lag_total": sum(g["lag"] or 0 for g in groups.values()),
        "staleness_hist": {str(k): reading.metrics.staleness[k]
                           for k in sorted(reading.metrics.staleness)},
        "versions": _versions(reading.metrics, reading.samples),
        "evals": (evals := eval_points(reading.metrics.evals)),
        "eval": evals[-1] if evals else None,
        "trainer": _trainer(reading.metrics),
        "latest": {c: dict(sorted(v.items())) for c, v in sorted(reading.metrics.latest.items())},
        "timeline": {c: [list(p) for p in pts]
                     for c, pts in sorted(reading.metrics.timeline.items())},
    }


def _versions(metrics: MetricsFold, samples: SamplesFold) -> list[dict]:
    """Reward/accuracy per policy_version: from the trainer's metric rows when there are
    any (policy_version = the trainer's version after the step), else from the
    train_samples rows (policy_version = the rollouts' policy_version_start). One
    source per curve, never mixed."""
    if metrics.reward or metrics.accuracy:
        out = []
        for v in sorted(set(metrics.reward) | set(metrics.accuracy)):
            r, a = metrics.reward.get(v), metrics.accuracy.get(v)
            n = metrics.samples_trained.get(v)
            out.append({"policy_version": v, "reward_mean": r[0] / r[1] if r else None,
                        "accuracy": a[0] / a[1] if a else None,
                        "samples": int(n) if n is not None else None, "source": "metrics"})
        return out
    return [{"policy_version": v, "reward_mean": s[1] / s[0], "accuracy": s[2] / s[0],
             "samples": s[0], "source": "train_samples"}
            for v, s in sorted(samples.versions.items())]


def eval_points(evals: dict[int, dict[str, float]]) -> list[dict]:
    """The held-out evals of a run, oldest policy_version first, from
    :attr:`MetricsFold.evals` (a version without its ``eval_accuracy`` row is left out;
    ``n``, ``correct``, ``reward_errors`` and ``seconds`` are None when their row is
    missing)."""
    def count(v):
        return int(v) if v is not None else None

    return [{"policy_version": v, "accuracy": e[mn.EVAL_ACCURACY], "n": count(e.get(mn.EVAL_N)),
             "correct": count(e.get(mn.EVAL_CORRECT)),
             "reward_errors": count(e.get(mn.EVAL_REWARD_ERRORS)), "seconds": e.get(mn.EVAL_S)}
            for v, e in sorted(evals.items()) if mn.EVAL_ACCURACY in e]


def _trainer(metrics: MetricsFold) -> dict:
    steps = sorted(metrics.step_s)
    recent = steps[-RECENT_STEPS:]
    step_total = sum(metrics.step_s[v] for v in recent)
    wait_total = sum(metrics.data_wait_s.get(v, 0.0) for v in recent)
    last = steps[-1] if steps else None
    return {
        "steps": len(steps),
        "policy_version": last,
        "step_s": metrics.step_s[last] if last is not None else None,
        "step_s_mean": step_total / len(recent) if recent else None,
        "data_wait_s": metrics.data_wait_s.get(last) if last is not None else None,
        "data_wait_pct": 100.0 * wait_total / step_total if step_total > 0 else None,
    }


# --- the monitor (reader + snapshots + history) ----------------------------------------


class Monitor:
    """Snapshots of one run, with the last ``history`` of lag and rates kept for charts.

    Args:
        cfg: bus settings. run: run name. history: snapshots of history to keep.
    """

    def __init__(self, cfg: BusConfig, run: str, history: int = 720):
        self.reader = RunReader(cfg, run)
        self.previous: Reading | None = None
        self.history: deque[dict] = deque(maxlen=history)

    def refresh(self) -> dict:
        """Read the bus and return a snapshot (see :func:`build_snapshot`) with
        ``"history": [{"ts", "lag": {group: lag}, "rows_per_s": {topic: rate}}]``."""
        reading = self.reader.read()
        snap = build_snapshot(reading, self.previous)
        self.previous = reading
        self.history.append({"ts": snap["ts"],
                             "lag": {g: v["lag"] for g, v in snap["groups"].items()},
                             "rows_per_s": {t: v["rows_per_s"] for t, v in snap["topics"].items()}})
        snap["history"] = list(self.history)
        return snap

    def close(self) -> None:
        """Close the reader's Kafka client."""
        self.reader.close()


def snapshot(cfg: BusConfig, run: str) -> dict:
    """One snapshot of ``run`` (no rates: they need two readings); see :func:`build_snapshot`."""
    m = Monitor(cfg, run)
    try:
        snap = m.refresh()
    finally:
        m.close()
    snap.pop("history")
    return snap


# --- terminal view ---------------------------------------------------------------------


def _fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _short(name: str, run: str) -> str:
    """``name`` without the ``<run>.`` prefix every topic and consumer group of a run
    carries (the head names the run); other names (a shared prompts topic) stay whole."""
    return name[len(run) + 1:] if name.startswith(run + ".") else name


def render(snap: dict):
    """A rich renderable of a snapshot: topics, consumer groups, staleness histogram,
    reward/accuracy per policy_version, held-out evals, trainer timings, errors. Fits 80 columns: the
    head's items flow onto more lines, and names drop the run's prefix and fold."""
    from rich.columns import Columns
    from rich.console import Group
    from rich.table import Column, Table

    tr, run, ev = snap["trainer"], snap["run"], snap["eval"]
    head = Columns([f"[b]run[/b] {run}",
                    f"[b]policy_version[/b] {_fmt(tr['policy_version'])}",
                    f"[b]step_s[/b] {_fmt(tr['step_s_mean'])}",
                    f"[b]data wait[/b] {_fmt(tr['data_wait_pct'], 1)}% (last {RECENT_STEPS} steps)",
                    f"[b]lag[/b] {snap['lag_total']}",
                    f"[b]errors[/b] {snap['errors_total']}",
                    f"[b]lost to retention[/b] {snap['lost_to_retention_total']}",
                    f"[b]eval[/b] {_fmt(ev['accuracy'], 3)} at v{ev['policy_version']}"
                    if ev else "[b]eval[/b] -",
                    time.strftime("%H:%M:%S", time.localtime(snap["ts"]))], padding=(0, 3))
    topics = Table(Column("topic", overflow="fold"), "partitions", "records", "records/s",
                   "rows/s", "MB/s", "errors", title=f"topics ({run}.*)", title_justify="left")
    failed_rewards = sum(snap["reward_errors"].values())
    for t, v in snap["topics"].items():
        errors = snap["errors"].get(topic_names.errors_topic(t), 0)
        if t == topic_names.run_topic(run, topic_names.REWARDS):
            errors += failed_rewards  # failed reward rows: rows of this topic, error set
        topics.add_row(_short(t, run), str(v["partitions"]), str(v["records"]),
                       _fmt(v["records_per_s"], 1), _fmt(v["rows_per_s"], 1),
                       _fmt(v["mb_per_s"], 3), str(errors))
    groups = Table(Column("consumer group", overflow="fold"), "lag",
                   Column("per topic", overflow="fold"),
                   title="consumer groups (lag in records)", title_justify="left")
    for g, v in snap["groups"].items():
        groups.add_row(_short(g, run), _fmt(v["lag"]),
                       "  ".join(f"{_short(t, run)}={n}" for t, n in v["topics"].items())
                       or "no committed offsets")
    hist = Table("staleness", "samples", "", title="staleness histogram", title_justify="left")
    total = max(snap["staleness_hist"].values(), default=0) or 1
    for k, n in snap["staleness_hist"].items():
        hist.add_row(k, _fmt(n, 0), "#" * max(1, int(30 * n / total)) if n else "")
    versions = Table("policy_version", "reward_mean", "accuracy", "samples", "source",
                     title="reward per policy_version (last 10)", title_justify="left")
    for v in snap["versions"][-10:]:
        versions.add_row(str(v["policy_version"]), _fmt(v["reward_mean"], 3),
                         _fmt(v["accuracy"], 3), _fmt(v["samples"]), v["source"])
    evals = Table("policy_version", "eval accuracy", "correct", "n", "seconds",
                  title="greedy held-out accuracy (last 10)", title_justify="left")
    for e in snap["evals"][-10:]:
        evals.add_row(str(e["policy_version"]), _fmt(e["accuracy"], 3), _fmt(e["correct"]),
                      _fmt(e["n"]), _fmt(e["seconds"], 1))
    return Group(head, topics, groups, hist, versions, *([evals] if snap["evals"] else []))


def watch(cfg: BusConfig, run: str, interval_s: float = 2.0, should_stop=None) -> None:
    """Refresh a live terminal view every ``interval_s`` seconds until Ctrl-C (or
    ``should_stop()`` is true)."""
    from rich.live import Live

    m = Monitor(cfg, run)
    try:
        with Live(render(m.refresh()), refresh_per_second=4, screen=False) as live:
            while not (should_stop and should_stop()):
                time.sleep(interval_s)
                live.update(render(m.refresh()))
    except KeyboardInterrupt:
        pass
    finally:
        m.close()


def to_json(snap: dict) -> str:
    """A snapshot as one line of JSON."""
    return json.dumps(snap, sort_keys=True)
