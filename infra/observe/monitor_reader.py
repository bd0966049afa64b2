"""The monitor's I/O half: :class:`RunReader` reads a run's topics, consumer groups and
new messages off the bus into a :class:`Reading`, folding metric and train_samples rows
into :class:`MetricsFold` / :class:`SamplesFold` as they arrive (see
:mod:`relax.infra.observe.monitor` for the snapshot built from readings). Nothing here commits
offsets or joins a consumer group.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from relax.schemas import metric_names as mn
from relax.schemas import topics as topic_names
from relax.streams.client import BusConfig
from relax.streams.lag import LagProbe

log = logging.getLogger(__name__)

TIMELINE_POINTS = 720
"""``busy_frac`` rows kept per stage (an hour of 5 s windows)."""
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
        timeline: ``{component: [(ts seconds, busy_frac), ...]}``, the newest
            :data:`TIMELINE_POINTS` ``busy_frac`` rows of each stage, in read order.
        reward_errors: ``{component: rows}``: reward rows that failed (each reward stage's
            per-poll ``reward_errors``, summed). They stay rows of ``<run>.rewards`` with
            their error set, not records of an error topic.
        lost_to_retention: ``{component: records}``: input records deleted by retention
            before the stage read them (its ``lost_to_retention`` rows, summed).
        evals: ``{policy_version: {name: value}}`` of the eval rows (component ``eval``:
            ``eval.before`` at 0, ``eval.every``'s after; the newest row of a name wins).
        rows: metric rows folded.
    """

    staleness: dict[int, float] = field(default_factory=dict)
    reward: dict[int, list] = field(default_factory=dict)
    accuracy: dict[int, list] = field(default_factory=dict)
    step_s: dict[int, float] = field(default_factory=dict)
    data_wait_s: dict[int, float] = field(default_factory=dict)
    samples_trained: dict[int, float] = field(default_factory=dict)
    latest: dict[str, dict[str, float]] = field(default_factory=dict)
    timeline: dict[str, list] = field(default_factory=dict)
    reward_errors: dict[str, float] = field(default_factory=dict)
    lost_to_retention: dict[str, float] = field(default_factory=dict)
    evals: dict[int, dict[str, float]] = field(default_factory=dict)
    rows: int = 0

    def add(self, rows: list[dict]) -> None:
        """Fold metric rows (dicts of the ``metrics`` schema) in read order."""
        for r in rows:
            self.rows += 1
            name, value, v, comp = r["name"], r["value"], r["policy_version"], r["component"]
            self.latest.setdefault(comp, {})[name] = value
            if name == mn.BUSY_FRAC:
                points = self.timeline.setdefault(comp, [])
                ts = r["ts"]  # a datetime (Arrow timestamp) or ms since epoch
                points.append((ts.timestamp() if hasattr(ts, "timestamp") else ts / 1000.0,
                               value))
                del points[:-TIMELINE_POINTS]
            if name == mn.REWARD_ERRORS:
                self.reward_errors[comp] = self.reward_errors.get(comp, 0.0) + value
            if name == mn.LOST_TO_RETENTION:
                self.lost_to_retention[comp] = self.lost_to_retention.get(comp, 0.0) + value
            if name.startswith(mn.STALENESS_HIST_PREFIX):
                k = name[len(mn.STALENESS_HIST_PREFIX):]
                if k.isdigit():
                    self.staleness[int(k)] = self.staleness.get(int(k), 0.0) + value
                continue
            if comp == mn.EVAL_COMPONENT and v is not None:
                self.evals.setdefault(v, {})[name] = value
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
        timeout_s: longest time one read waits for a message (seconds); what was read
            by then is shown.
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
        self._reader = None
        self._probe = LagProbe(cfg)  # one admin client for every read
        self._metrics_topic = topic_names.run_topic(run, topic_names.METRICS)
        self._samples_topic = topic_names.run_topic(run, topic_names.TRAIN_SAMPLES)

    def read(self) -> Reading:
        """One look at the run (admin requests over one client kept open, one fetch of
        the ends, then the new messages).

        Raises:
            kafka.errors.KafkaError: the cluster cannot be reached.
        """
        pr = self._probe
        existing = set(pr.list_topics())
        run_topics = sorted(t for t in existing if topic_names.run_of(t) == self.run)
        groups = [g for g in pr.list_groups() if g.startswith(self.run + ".")]
        committed: dict[str, dict[str, dict[int, int]]] = {}
        for g in groups:
            per: dict[str, dict[int, int]] = {}
            for (t, p), off in pr.group_offsets(g).items():
                per.setdefault(t, {})[p] = off
            committed[g] = per
        inputs = {t for per in committed.values() for t in per if t in existing}
        inputs |= {topic_names.errors_topic(t) for t in inputs
                   if topic_names.errors_topic(t) in existing}
        watched = sorted(set(run_topics) | inputs)
        hw: dict[str, dict[int, int]] = {}
        for (t, p), end in (pr.high_watermarks(watched) if watched else {}).items():
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
        from relax.streams.read import TopicReader

        todo = {}
        for t in topics:
            for p, end in hw.get(t, {}).items():
                pos = self.positions.setdefault((t, p), self._start(t, end))
                if end > pos:
                    todo[(t, p)] = (pos, end)
        if not todo:
            return
        if self._reader is None:
            self._reader = TopicReader(self.cfg, "monitor")
        nbytes = 0
        try:
            for m in self._reader.read_range(todo, self.timeout_s):
                nbytes += len(m.value or b"")
                self._fold(m)
                self.positions[(m.topic, m.partition)] = m.offset + 1
                if nbytes >= self.max_bytes:
                    return  # the rest next time
        except TimeoutError as e:  # a slow broker: show what was read, read on next time
            log.warning("monitor: %s", e)
            return
        for key, (_, end) in todo.items():  # to the end, past gaps of compacted topics
            self.positions[key] = end

    def _fold(self, m) -> None:
        from relax.streams.read import decoded

        t = m.topic
        self.bytes[t] = self.bytes.get(t, 0) + len(m.value or b"")
        table = decoded(m, topic_names.schema_for_topic(t))
        if table is None:
            return  # routed to <topic>.errors by whoever consumes it
        self.rows[t] = self.rows.get(t, 0) + table.num_rows
        if t == self._metrics_topic:
            self.metrics.add(table.to_pylist())
        elif t == self._samples_topic:
            self.samples.add(table)

    def close(self) -> None:
        """Close the Kafka clients."""
        self._probe.close()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
