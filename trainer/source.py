"""The trainer's input: train samples assembled into global batches, by staleness.

Consumes ``<run>.train_samples`` in consumer group ``<run>.trainer``. For every
group that arrives, each row is decided once (the ledger remembers, so a
redelivered row is skipped): a row with ``drop_reason`` is recorded as filtered or
error; the others are admitted iff their staleness at the trainer's current
policy_version is <= max_staleness (``schemas.versions.admit``; queue time counts:
a group carried over to the next step is judged again then). A batch is
``batch_groups`` groups with at least one admitted row each.

Offsets: deliveries are finished when every group in them is decided and (for
admitted ones) trained; the consumer commits only when the trainer checkpoints
(:meth:`SampleSource.commit`), so a restart resumes at the checkpoint's input
positions (also restored by seeking on assignment).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

from relax.schemas import topics
from relax.schemas.versions import admit
from relax.streams.client import BusConfig
from relax.streams.codec import group_by_key
from relax.streams.consumer import BatchConsumer, Delivery
from relax.trainer.ledger import Ledger, outcome_of


@dataclass
class Batch:
    """One global batch.

    Attributes:
        groups: admitted rows, one table per group (``train_samples`` schema).
        staleness: staleness of every admitted row.
        wait_s: seconds spent waiting for data.
        dropped: ``{outcome: rows}`` decided while assembling it (stale, filtered, error).
    """

    groups: list[pa.Table]
    staleness: list[int]
    wait_s: float
    dropped: dict[str, int] = field(default_factory=dict)
    deliveries: list[Delivery] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """Admitted rows."""
        return sum(g.num_rows for g in self.groups)


class SampleSource:
    """Assembles batches from ``<run>.train_samples``.

    Args:
        bus: bus settings.
        run: run name.
        ledger: the trainer's ledger (shared with the checkpoint).
        batch_groups: groups per batch (N).
        max_staleness: admission bound.
        offsets: ``{topic: {partition: offset}}`` from a checkpoint: partitions are
            sought there when assigned.
        on_drop: called with the number of whole groups dropped (so the rollout stage
            can replace them promptly).
    """

    def __init__(self, bus: BusConfig, run: str, ledger: Ledger, *, batch_groups: int,
                 max_staleness: int, offsets: dict[str, dict[str, int]] | None = None,
                 on_drop: Callable[[int], None] | None = None):
        self.ledger, self.batch_groups, self.max_staleness = ledger, batch_groups, max_staleness
        self.topic = topics.run_topic(run, topics.TRAIN_SAMPLES)
        self._offsets = offsets or {}
        self.on_drop = on_drop
        self.consumer = BatchConsumer(bus, topics.group(run, "trainer"), [self.topic],
                                      stage="trainer", on_assign=self._seek)
        self._queue: deque[tuple[Delivery, pa.Table]] = deque()
        self._open: dict[tuple[int, int], int] = {}  # (partition, offset) -> undecided groups
        self.groups_dropped = 0
        self.groups_trained = 0
        self.duplicates = 0

    def _seek(self, tps) -> None:
        saved = self._offsets.get(self.topic, {})
        for tp in tps:
            if str(tp.partition) in saved:
                self.consumer.kafka.seek(tp, int(saved[str(tp.partition)]))

    def _fill(self, timeout_s: float) -> None:
        for d in self.consumer.poll(timeout_s):
            parts = group_by_key(d.table, "group_id")
            self._open[(d.partition, d.offset)] = len(parts)
            for _, g in parts:
                self._queue.append((d, g))

    def _decided(self, d: Delivery, finished: list[Delivery]) -> None:
        key = (d.partition, d.offset)
        self._open[key] -= 1
        if self._open[key] == 0:
            del self._open[key]
            finished.append(d)

    def next_batch(self, policy_version: int, should_stop: Callable[[], bool],
                   poll_timeout_s: float = 0.5) -> Batch | None:
        """Block until ``batch_groups`` groups are admitted at ``policy_version`` (None if
        ``should_stop()`` turns true first). Decisions on dropped rows go to the ledger
        at once; admitted rows are recorded by :meth:`trained`."""
        t0 = time.perf_counter()
        groups: list[pa.Table] = []
        stale: list[int] = []
        dropped = {"stale": 0, "filtered": 0, "error": 0}
        used: list[Delivery] = []
        finished: list[Delivery] = []
        taken: set[str] = set()
        while len(groups) < self.batch_groups:
            if should_stop():
                return None
            if not self._queue:
                self._fill(poll_timeout_s)
                continue
            d, g = self._queue.popleft()
            keep = []
            decided = 0
            for i, row in enumerate(g.select(["rollout_id", "drop_reason", "policy_version_start",
                                              "policy_version_end", "token_policy_versions"]
                                             ).to_pylist()):
                rid = row["rollout_id"]
                if rid in self.ledger or rid in taken:
                    self.duplicates += 1
                    continue
                decided += 1
                if row["drop_reason"] is not None:
                    outcome = outcome_of(row["drop_reason"])
                    self.ledger.record(rid, outcome, policy_version)
                    dropped[outcome] += 1
                    continue
                start, end = row["policy_version_start"], row["policy_version_end"]
                if end > policy_version:  # made by weights of a branch lost in a restart
                    self.ledger.record(rid, "stale", policy_version, end - policy_version)
                    dropped["stale"] += 1
                    continue
                a = admit(policy_version, start, end, self.max_staleness,
                          row["token_policy_versions"])
                if not a.admitted:
                    self.ledger.record(rid, "stale", policy_version, a.staleness)
                    dropped["stale"] += 1
                    continue
                keep.append(i)
                stale.append(a.staleness)
                taken.add(rid)
            if keep:
                groups.append(g.take(pa.array(keep)))
                used.append(d)
            else:
                if decided:  # a group of duplicates was decided before: not a new drop
                    self.groups_dropped += 1
                    if self.on_drop is not None:
                        self.on_drop(1)
                self._decided(d, finished)
        self.consumer.done(finished)
        return Batch(groups, stale, time.perf_counter() - t0, dropped, used)

    def trained(self, batch: Batch, policy_version: int) -> None:
        """Record the batch's rows as trained (at ``policy_version``, before the step's
        increment) and finish their deliveries."""
        finished: list[Delivery] = []
        for g, d in zip(batch.groups, batch.deliveries):
            for rid in g.column("rollout_id").to_pylist():
                self.ledger.record(rid, "trained", policy_version)
            self.groups_trained += 1
            self._decided(d, finished)
        self.consumer.done(finished)

    def positions(self) -> dict[str, dict[str, int]]:
        """``{topic: {partition: next offset}}`` that a checkpoint taken now may resume
        from (the finished prefix of every partition)."""
        out = {t: dict(parts) for t, parts in self._offsets.items()}
        for (topic, partition), off in self.consumer.positions().items():
            out.setdefault(topic, {})[str(partition)] = off
        return out

    def commit(self) -> None:
        """Commit the finished prefix (call right after a checkpoint is on disk)."""
        self.consumer.commit()

    def close(self) -> None:
        """Close the consumer (no commit)."""
        self.consumer.close()
