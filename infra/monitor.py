"""What a run is doing, read off the bus (``relax monitor``; the dashboard reuses it).

Three layers, so the numbers can be tested without a terminal or a browser:

* :class:`RunReader` (I/O): on each :meth:`~RunReader.read` it lists the run's
  topics and consumer groups (``<run>.*``), reads the high watermark of every
  partition (from a fetch: ListOffsets is wrong on Tansu, see
  :mod:`relax.streams.lag`), each group's committed offsets, and the messages
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
  ``train_samples`` grouped by ``policy_version_start``); trainer step time and
  data-wait %; error records per ``<topic>.errors``.
* :func:`render` (pure) draws a snapshot with rich; :func:`watch` refreshes it live.

:class:`Monitor` ties reader and snapshot together and keeps a short history
(lag and rates over time) for the dashboard. Nothing here commits offsets or
joins a consumer group, so watching a run never changes it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from relax.schemas import metric_names as mn
from relax.schemas import topics as topic_names
from relax.streams.client import BusConfig

RECENT_STEPS = 10
"""Trainer steps averaged for step time and data-wait %."""


# --- folding rows into aggregates (pure, incremental) ---------------------------------


@dataclass
class MetricsFold:
    """Aggregates of ``<run>.metrics`` rows seen so far.

    Attributes:
        staleness: ``{k: samples}`` summed over every ``staleness_hist.<k>`` row.
        reward / accuracy: ``{policy_version: [sum, count]}`` of trainer rows.
        step_s / data_wait_s: ``{policy_version: seconds}`` of trainer rows (last value).
        samples_trained: ``{policy_version: samples}`` of trainer rows (summed).
        latest: ``{component: {name: value}}``, the newest value of every metric.
        rows: metric rows folded.
    """

    staleness: dict[int, float] = field(default_factory=dict)
    reward: dict[int, list] = field(default_factory=dict)
    accuracy: dict[int, list] = field(default_factory=dict)
    step_s: dict[int, float] = field(default_factory=dict)
    data_wait_s: dict[int, float] = field(default_factory=dict)
    samples_trained: dict[int, float] = field(default_factory=dict)
    latest: dict[str, dict[str, float]] = field(default_factory=dict)
    rows: int = 0

    def add(self, rows: list[dict]) -> None:
        """Fold metric rows (dicts of the ``metrics`` schema) in read order."""
        for r in rows:
            self.rows += 1
            name, value, v, comp = r["name"], r["value"], r["policy_version"], r["component"]
            self.latest.setdefault(comp, {})[name] = value
            if name.startswith(mn.STALENESS_HIST_PREFIX):
                k = name[len(mn.STALENESS_HIST_PREFIX):]
                if k.isdigit():
                    self.staleness[int(k)] = self.staleness.get(int(k), 0.0) + value
                continue
            if v is None or not comp.startswith("trainer"):
                continue
            if name == mn.REWARD_MEAN:
                acc = self.reward.setdefault(v, [0.0, 0])
                acc[0] += value
                acc[1] += 1
            elif name == mn.ACCURACY:
                acc = self.accuracy.setdefault(v, [0.0, 0])
                acc[0] += value
                acc[1] += 1
            elif name == mn.STEP_S:
                self.step_s[v] = value
            elif name == mn.DATA_WAIT_S:
                self.data_wait_s[v] = value
            elif name == mn.SAMPLES_TRAINED:
                self.samples_trained[v] = self.samples_trained.get(v, 0.0) + value


@dataclass
class SamplesFold:
    """Per ``policy_version_start``: ``[samples, reward sum, samples with reward > 0]`` of
    the ``train_samples`` rows seen so far (rows with a null reward are skipped)."""

    versions: dict[int, list] = field(default_factory=dict)

    def add(self, table) -> None:
        """Fold a ``train_samples`` table."""
        for v, r in zip(table.column("policy_version_start").to_pylist(),
                        table.column("reward").to_pylist()):
            if r is None:
                continue
            acc = self.versions.setdefault(v, [0, 0.0, 0])
            acc[0] += 1
            acc[1] += r
            acc[2] += r > 0


# --- reading the bus ---------------------------------------------------------------


@dataclass
class Reading:
    """Everything one :meth:`RunReader.read` saw.

    Attributes:
        run: run name. ts: wall time of the read (seconds since epoch).
        watermarks: ``{topic: {partition: high watermark}}`` of the run's topics, their
            error topics and the topics its consumer groups committed on.
        committed: ``{group: {topic: {partition: committed offset}}}`` for groups ``<run>.*``.
        rows / bytes: ``{topic: rows / message bytes read}`` since the reader started
            (cumulative; rates come from two readings).
        metrics / samples: aggregates of the metrics and train_samples rows read so far.
    """

    run: str
    ts: float
    watermarks: dict[str, dict[int, int]]
    committed: dict[str, dict[str, dict[int, int]]]
    rows: dict[str, int]
    bytes: dict[str, int]
    metrics: MetricsFold
    samples: SamplesFold


class RunReader:
    """Reads a run's state from the bus incrementally (see the module docstring).

    Args:
        cfg: bus settings.
        run: run name.
        max_bytes_per_read: stop reading new messages after this many bytes in one
            :meth:`read` (the rest comes next time), so refreshes stay short.
        timeout_s: longest time one read spends fetching messages (seconds).
    """

    def __init__(self, cfg: BusConfig, run: str, max_bytes_per_read: int = 64 << 20,
                 timeout_s: float = 10.0):
        self.cfg, self.run = cfg, topic_names.check_name("run", run)
        self.max_bytes, self.timeout_s = max_bytes_per_read, timeout_s
        self.positions: dict[tuple[str, int], int] = {}
        self.rows: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.metrics = MetricsFold()
        self.samples = SamplesFold()
        self._consumer = None
        self._metrics_topic = topic_names.run_topic(run, topic_names.METRICS)
        self._samples_topic = topic_names.run_topic(run, topic_names.TRAIN_SAMPLES)

    def read(self) -> Reading:
        """One look at the run (about 3 admin/fetch round trips plus the new messages).

        Raises:
            kafka.errors.KafkaError: the cluster cannot be reached.
        """
        from relax.streams.client import list_topics
        from relax.streams.lag import group_offsets, high_watermarks, list_groups

        existing = set(list_topics(self.cfg))
        run_topics = sorted(t for t in existing if topic_names.run_of(t) == self.run)
        groups = [g for g in list_groups(self.cfg) if g.startswith(self.run + ".")]
        committed: dict[str, dict[str, dict[int, int]]] = {}
        for g in groups:
            per: dict[str, dict[int, int]] = {}
            for (t, p), off in group_offsets(self.cfg, g).items():
                per.setdefault(t, {})[p] = off
            committed[g] = per
        inputs = {t for per in committed.values() for t in per if t in existing}
        inputs |= {topic_names.errors_topic(t) for t in inputs
                   if topic_names.errors_topic(t) in existing}
        watched = sorted(set(run_topics) | inputs)
        hw: dict[str, dict[int, int]] = {}
        for (t, p), end in (high_watermarks(self.cfg, watched) if watched else {}).items():
            hw.setdefault(t, {})[p] = end
        for t in run_topics:  # topics read for rates (others get no rows/s)
            self.rows.setdefault(t, 0)
            self.bytes.setdefault(t, 0)
        # metrics first: once the trainer reports reward, train_samples is not re-read
        self._read_new([t for t in run_topics if t == self._metrics_topic], hw)
        self._read_new([t for t in run_topics if t != self._metrics_topic], hw)
        return Reading(self.run, time.time(), hw, committed, dict(self.rows), dict(self.bytes),
                       self.metrics, self.samples)

    def _start(self, topic: str, end: int) -> int:
        # metrics are read from the start (history of the curves), train_samples too
        # unless the trainer already reports reward (then they are not needed); other
        # topics only for rates, from where they are when first seen
        if topic == self._metrics_topic:
            return 0
        if topic == self._samples_topic and not (self.metrics.reward or self.metrics.accuracy):
            return 0
        return end

    def _read_new(self, topics: list[str], hw: dict[str, dict[int, int]]) -> None:
        from kafka import KafkaConsumer, TopicPartition

        from relax.streams.client import consumer_kwargs

        todo = {}
        for t in topics:
            for p, end in hw.get(t, {}).items():
                pos = self.positions.setdefault((t, p), self._start(t, end))
                if end > pos:
                    todo[TopicPartition(t, p)] = end
        if not todo:
            return
        if self._consumer is None:
            self._consumer = KafkaConsumer(**consumer_kwargs(
                self.cfg, None, f"relax-monitor-{uuid.uuid4().hex[:6]}"))
        c = self._consumer
        c.assign(list(todo))
        c.resume(*todo)  # kafka-python keeps the paused state when the assignment is unchanged
        for tp in todo:
            c.seek(tp, self.positions[(tp.topic, tp.partition)])
        deadline, nbytes = time.monotonic() + self.timeout_s, 0
        while todo and time.monotonic() < deadline and nbytes < self.max_bytes:
            for tp, msgs in c.poll(timeout_ms=200).items():
                end = todo.get(tp)
                if end is None:
                    continue
                for m in msgs:
                    if m.offset >= end:
                        break
                    nbytes += len(m.value)
                    self._fold(m)
                    self.positions[(tp.topic, tp.partition)] = m.offset + 1
                if c.position(tp) >= end:
                    self.positions[(tp.topic, tp.partition)] = max(
                        self.positions[(tp.topic, tp.partition)], min(c.position(tp), end))
                    todo.pop(tp)
                    c.pause(tp)

    def _fold(self, m) -> None:
        from relax.streams.codec import DecodeError, decode

        t = m.topic
        self.bytes[t] = self.bytes.get(t, 0) + len(m.value)
        name = topic_names.schema_for_topic(t)
        try:
            table = decode(m.value, name)
        except (DecodeError, ValueError):
            return  # routed to <topic>.errors by whoever consumes it
        self.rows[t] = self.rows.get(t, 0) + table.num_rows
        if t == self._metrics_topic:
            self.metrics.add(table.to_pylist())
        elif t == self._samples_topic:
            self.samples.add(table)

    def close(self) -> None:
        """Close the Kafka client."""
        if self._consumer is not None:
            self._consumer.close(autocommit=False)
            self._consumer = None


# --- the snapshot (pure) ----------------------------------------------------------------


def _rate(now: float | None, before: float | None, dt: float | None) -> float | None:
    if now is None or before is None or not dt or dt <= 0:
        return None
    return max(0.0, (now - before) / dt)


def build_snapshot(reading: Reading, previous: Reading | None = None) -> dict:
    """A JSON-ready summary of ``reading`` (rates need ``previous``, else they are None).

    Returns:
        ``{"run", "ts", "topics": {topic: {partitions, records, records_per_s,
        rows_per_s, mb_per_s}}, "errors": {error topic: records}, "errors_total",
        "groups": {group: {lag, topics: {topic: lag}, partitions: {"topic[p]": lag}}},
        "lag_total", "staleness_hist": {"k": samples}, "versions": [{policy_version,
        reward_mean, accuracy, samples, source}], "trainer": {steps, policy_version,
        step_s, step_s_mean, data_wait_s, data_wait_pct}, "latest": {component:
        {name: value}}}``. Rates are per second (MB = 10**6 bytes); lag counts
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
        "errors_total": sum(errors.values()),
        "groups": groups,
        "lag_total": sum(g["lag"] or 0 for g in groups.values()),
        "staleness_hist": {str(k): reading.metrics.staleness[k]
                           for k in sorted(reading.metrics.staleness)},
        "versions": _versions(reading.metrics, reading.samples),
        "trainer": _trainer(reading.metrics),
        "latest": {c: dict(sorted(v.items())) for c, v in sorted(reading.metrics.latest.items())},
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


def render(snap: dict):
    """A rich renderable of a snapshot: topics, consumer groups, staleness histogram,
    reward/accuracy per policy_version, trainer timings, errors."""
    from rich.console import Group
    from rich.table import Table

    tr = snap["trainer"]
    head = Table.grid(padding=(0, 3))
    head.add_row(f"[b]run[/b] {snap['run']}",
                 f"[b]policy_version[/b] {_fmt(tr['policy_version'])}",
                 f"[b]step_s[/b] {_fmt(tr['step_s_mean'])}",
                 f"[b]data wait[/b] {_fmt(tr['data_wait_pct'], 1)}%",
                 f"[b]lag[/b] {snap['lag_total']}",
                 f"[b]errors[/b] {snap['errors_total']}",
                 time.strftime("%H:%M:%S", time.localtime(snap["ts"])))
    topics = Table("topic", "partitions", "records", "records/s", "rows/s", "MB/s", "errors",
                   title="topics", title_justify="left")
    for t, v in snap["topics"].items():
        topics.add_row(t, str(v["partitions"]), str(v["records"]), _fmt(v["records_per_s"], 1),
                       _fmt(v["rows_per_s"], 1), _fmt(v["mb_per_s"], 3),
                       str(snap["errors"].get(topic_names.errors_topic(t), 0)))
    groups = Table("consumer group", "lag", "per topic", title="consumer groups (lag in records)",
                   title_justify="left")
    for g, v in snap["groups"].items():
        groups.add_row(g, _fmt(v["lag"]), "  ".join(f"{t}={n}" for t, n in v["topics"].items())
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
    return Group(head, topics, groups, hist, versions)


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
