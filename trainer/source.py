"""The trainer's input: train samples assembled into global batches, by staleness.

Consumes ``<run>.train_samples`` in consumer group ``<run>.trainer``, reading ahead
in a thread while the trainer trains. For every group that arrives, each row is
decided once (the ledger remembers, so a redelivered row is skipped): a row with
``drop_reason`` is recorded as filtered or error on arrival; the others are admitted
iff their staleness at the trainer's policy_version when the batch is assembled is
<= max_staleness (``schemas.versions.admit``; queue time counts). A batch is
``batch_groups`` groups with at least one admitted row each.

Offsets: deliveries are finished when every group in them is decided and (for
admitted ones) trained; the consumer commits only when the trainer checkpoints
(:meth:`SampleSource.commit`), so a restart resumes at the checkpoint's input
positions (also restored by seeking on assignment).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

from relax.schemas import topics
from relax.schemas.versions import admit
from relax.streams.client import BusConfig
from relax.streams.codec import group_by_key
from relax.streams.consumer import BatchConsumer, Delivery
from relax.streams.stage import run_loop
from relax.trainer.ledger import Ledger, outcome_of, reward_names


@dataclass
class Batch:
    """One global batch.

    Attributes:
        groups: admitted rows, one table per group (``train_samples`` schema).
        staleness: staleness of every admitted row.
        wait_s: seconds spent waiting for data.
        dropped: ``{outcome: rows}`` decided while assembling it (stale, filtered, error).
        filtered: ``(reward, reward_components)`` of the rows filtered upstream since the
            previous batch (e.g. zero-variance groups): sampled, scored, not trained, but
            part of what the policy produced.
    """

    groups: list[pa.Table]
    staleness: list[int]
    wait_s: float
    dropped: dict[str, int] = field(default_factory=dict)
    deliveries: list[Delivery] = field(default_factory=list)
    filtered: list[tuple[float, list]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """Admitted rows."""
        return sum(g.num_rows for g in self.groups)


class SampleSource:
    """Assembles batches from ``<run>.train_samples``, reading ahead in a thread.

    A background thread polls the topic while the trainer trains: rows with a
    ``drop_reason`` are decided (ledger) as soon as they arrive and whole dropped
    groups are reported through ``on_drop`` at once, so the rollout stage's credit
    comes back without waiting for the next step; the other groups queue up. The
    staleness decision waits for :meth:`next_batch`, since it depends on the
    trainer's policy_version then. The Kafka consumer, the ledger and the queue are
    used under one lock.

    In a sync run (``max_staleness`` 0) the thread holds from :meth:`next_batch`'s
    batch to :meth:`trained`: a group written while the trainer trains was sampled
    before the step's new weights, so nothing it could read then is admissible, and its
    fetch loop would take CPU from the step (a group consumer's fetch round trips, the
    reading thread and the broker: about 0.02 cores). The group membership lives on
    (kafka-python's heartbeat runs in its I/O thread; ``max_poll_interval_ms`` is 600 s).

    Args:
        bus: bus settings.
        run: run name.
        ledger: the trainer's ledger (shared with the checkpoint).
        batch_groups: groups per batch (N).
        max_staleness: admission bound.
        offsets: ``{topic: {partition: offset}}`` from a checkpoint: partitions are
            sought there when assigned.
        on_drop: called (from the reading thread) with the number of whole groups just
            dropped, so the rollout stage can replace them promptly.
        start_version: the trainer's policy_version at start (recorded with drops).
        metrics: a :class:`~relax.streams.metrics.MetricsWriter` for the consumer it
            makes: input records lost to retention become ``lost_to_retention`` rows
            (:class:`~relax.streams.consumer.BatchConsumer`).
        consumer: the stage's consumer of ``<run>.train_samples`` in the trainer's
            consumer group, made by the stage contract (its ``on_assign`` must call
            :meth:`seek_assigned`); used by the reading thread alone, and not closed by
            :meth:`close`. None: make one (with ``metrics``), closed by :meth:`close`.
        start: start the reading thread now; False: at :meth:`start` (a caller whose
            ``on_assign`` reaches this object through an attribute sets it first: the
            thread's first poll joins the group and calls ``on_assign``).
    """

    def __init__(self, bus: BusConfig, run: str, ledger: Ledger, *, batch_groups: int,
                 max_staleness: int, offsets: dict[str, dict[str, int]] | None = None,
                 on_drop: Callable[[int], None] | None = None, poll_timeout_s: float = 0.2,
                 start_version: int = 0, metrics=None, consumer: BatchConsumer | None = None,
                 start: bool = True):
        self.ledger, self.batch_groups, self.max_staleness = ledger, batch_groups, max_staleness
        self.topic = topics.run_topic(run, topics.TRAIN_SAMPLES)
        self._offsets = offsets or {}
        self.on_drop = on_drop
        self.poll_timeout_s = poll_timeout_s
        self._own_consumer = consumer is None
        self.consumer = consumer or BatchConsumer(
            bus, topics.group(run, "trainer"), [self.topic], stage="trainer",
            on_assign=self.seek_assigned, metrics=metrics)
        self._queue: deque[tuple[Delivery, pa.Table]] = deque()
        # (partition, offset, generation) -> undecided groups of that delivery; the
        # generation keeps a message redelivered after a rebalance apart from its first copy
        self._open: dict[tuple[int, int, int], int] = {}
        self._sought: set[int] = set()  # partitions already placed at the checkpoint's offset
        self._dropped_rows: Counter = Counter()
        self._filtered: list[tuple[float, list]] = []
        self.groups_dropped = 0
        self.groups_trained = 0
        self.duplicates = 0
        self._version = start_version
        # two locks: ``_lock`` guards the queue, the ledger and the open deliveries and is
        # held only briefly; ``_io`` guards the consumer (kafka-python is not thread-safe)
        # and is held by the reading thread through each blocking poll. Holding one lock
        # through the poll starved the trainer: the reading thread re-took it at once
        # after every poll, and next_batch / trained waited seconds to get it (py-spy,
        # issue 19). Deliveries the trainer finishes are handed to the consumer by the
        # reading thread (or by positions/commit). Lock order: ``_lock`` before ``_io``;
        # the reading thread never waits for ``_lock`` while it holds ``_io``.
        self._lock = threading.RLock()
        self._io = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._finished: list[Delivery] = []  # finished by the trainer, not yet done()
        self._closed = threading.Event()
        self._may_read = threading.Event()  # cleared while a sync run's step trains
        self._may_read.set()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read_ahead, name="relax-trainer-input",
                                        daemon=True)
        self._started = False
        if start:
            self.start()

    def start(self) -> None:
        """Start the reading thread (the first call only)."""
        if not self._started:
            self._started = True
            self._thread.start()

    def seek_assigned(self, tps) -> None:
        """On an assignment (the consumer's ``on_assign``): the first assignment of a
        partition starts at the checkpoint's offset; a later one (a rebalance, e.g. after
        a broker restart) at the group's committed offset, which is never behind it (rows
        already decided come again and are skipped as duplicates by the ledger)."""
        saved = self._offsets.get(self.topic, {})
        for tp in tps:
            if str(tp.partition) in saved and tp.partition not in self._sought:
                self.consumer.kafka.seek(tp, int(saved[str(tp.partition)]))
            self._sought.add(tp.partition)

    # ------------------------------------------------------------ reading thread
    def _read_ahead(self) -> None:
        try:
            run_loop(self._read_turn, self._closed.is_set)
        except BaseException as e:  # surfaced to the trainer by next_batch
            with self._arrived:
                self._error = e
                self._arrived.notify_all()

    def _read_turn(self) -> int:
        if not self._may_read.wait(1.0):  # run_loop checks _closed between turns
            return 0
        dropped = self._read_once()
        self._report_drop(dropped)
        return dropped

    def _read_once(self) -> int:
        """One poll: decide dropped rows, queue the rest; returns whole groups dropped."""
        finished = self._take_finished()  # _lock first, never while holding _io
        with self._io:
            self.consumer.done(finished)
            deliveries = self.consumer.poll(self.poll_timeout_s)
        with self._lock:
            dropped = 0
            for d in deliveries:
                parts = group_by_key(d.table, "group_id")
                self._open[(d.partition, d.offset, d.generation)] = len(parts)
                for _, g in parts:
                    rest, decided = self._screen(g)
                    if rest is not None:
                        self._queue.append((d, rest))
                        continue
                    if decided:
                        dropped += 1
                        self.groups_dropped += 1
                    self._decided(d, self._finished)
            if deliveries:
                self._arrived.notify_all()
            return dropped

    def _take_finished(self) -> list[Delivery]:
        """The deliveries finished since the last call, for ``consumer.done``. Lock order:
        ``_lock`` before ``_io``, always (the reading thread takes them one at a time)."""
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def _screen(self, g: pa.Table) -> tuple[pa.Table | None, int]:
        """Record rows with a drop_reason; skip duplicates. Returns the rows still to be
        admitted (None if none) and how many rows were decided now."""
        keep, decided = [], 0
        rewards = g.column("reward").to_pylist()
        names = reward_names(g)
        for i, (rid, reason) in enumerate(zip(g.column("rollout_id").to_pylist(),
                                              g.column("drop_reason").to_pylist())):
            if rid in self.ledger:
                self.duplicates += 1
                continue
            if reason is not None:
                outcome = outcome_of(reason)
                self.ledger.record(rid, outcome, self._version, rewards=names[i])
                self._dropped_rows[outcome] += 1
                if outcome == "filtered":
                    self._filtered.append((rewards[i], g.column("reward_components")[i].as_py()))
                decided += 1
                continue
            keep.append(i)
        if not keep:
            return None, decided
        return (g if len(keep) == g.num_rows else g.take(pa.array(keep))), decided

    def _decided(self, d: Delivery, finished: list[Delivery]) -> None:
        key = (d.partition, d.offset, d.generation)
        self._open[key] -= 1
        if self._open[key] == 0:
            del self._open[key]
            finished.append(d)

    # ------------------------------------------------------------ trainer side
    def next_batch(self, policy_version: int, should_stop: Callable[[], bool]) -> Batch | None:
        """Block until ``batch_groups`` groups are admitted at ``policy_version`` (None if
        ``should_stop()`` turns true first). Stale rows go to the ledger at once; whole
        groups dropped as stale are reported through ``on_drop`` before waiting for more
        (their replacements may be what this batch waits for); admitted rows are
        recorded by :meth:`trained`.

        Raises:
            whatever stopped the reading thread (a broken broker connection, ...).
        """
        t0 = time.perf_counter()
        groups: list[pa.Table] = []
        stale: list[int] = []
        used: list[Delivery] = []
        taken: set[str] = set()
        stale_rows = 0
        dropped_groups = reported = 0
        with self._arrived:
            self._version = policy_version
            while len(groups) < self.batch_groups:
                if self._error is not None:
                    raise RuntimeError("the trainer's input thread failed") from self._error
                if should_stop():
                    return None
                if not self._queue:
                    if dropped_groups > reported:
                        # the credit of dropped groups comes back now, not when the
                        # batch completes: the batch may need their replacements
                        self._report_drop(dropped_groups - reported)
                        reported = dropped_groups
                    self._arrived.wait(0.5)
                    continue
                d, g = self._queue.popleft()
                keep, decided = [], 0
                names = reward_names(g)
                for i, row in enumerate(g.select(
                        ["rollout_id", "policy_version_start", "policy_version_end",
                         "token_policy_versions"]).to_pylist()):
                    rid = row["rollout_id"]
                    if rid in self.ledger or rid in taken:
                        self.duplicates += 1
                        continue
                    decided += 1
                    start, end = row["policy_version_start"], row["policy_version_end"]
                    if end > policy_version:  # made by weights of a branch lost in a restart
                        self.ledger.record(rid, "stale", policy_version, end - policy_version,
                                           rewards=names[i])
                        stale_rows += 1
                        continue
                    a = admit(policy_version, start, end, self.max_staleness,
                              row["token_policy_versions"])
                    if not a.admitted:
                        self.ledger.record(rid, "stale", policy_version, a.staleness,
                                           rewards=names[i])
                        stale_rows += 1
                        continue
                    keep.append(i)
                    stale.append(a.staleness)
                    taken.add(rid)
                if keep:
                    groups.append(g.take(pa.array(keep)))
                    used.append(d)
                else:
                    if decided:  # not when every row was a duplicate decided earlier
                        dropped_groups += 1
                        self.groups_dropped += 1
                    self._decided(d, self._finished)
            dropped = dict(self._dropped_rows)
            self._dropped_rows.clear()
            filtered, self._filtered = self._filtered, []
        dropped["stale"] = dropped.get("stale", 0) + stale_rows
        self._report_drop(dropped_groups - reported)
        if self.max_staleness == 0:
            self._may_read.clear()  # until trained(): see the class docstring
        return Batch(groups, stale, time.perf_counter() - t0, dropped, used, filtered)

    def _report_drop(self, groups: int) -> None:
        if groups and self.on_drop is not None:
            self.on_drop(groups)

    def trained(self, batch: Batch, policy_version: int) -> None:
        """Record the batch's rows as trained (at ``policy_version``, before the step's
        increment, with the staleness admission measured for each) and finish their
        deliveries; a sync run's reading thread goes on."""
        stale = iter(batch.staleness)  # one per admitted row, in the groups' row order
        with self._lock:
            for g, d in zip(batch.groups, batch.deliveries):
                for rid, names in zip(g.column("rollout_id").to_pylist(), reward_names(g)):
                    self.ledger.record(rid, "trained", policy_version, next(stale),
                                       rewards=names)
                self.groups_trained += 1
                self._decided(d, self._finished)
        self._may_read.set()

    def locked(self):
        """The lock the reading thread takes: hold it to read the ledger consistently
        (e.g. while a checkpoint saves it)."""
        return self._lock

    def positions(self) -> dict[str, dict[str, int]]:
        """``{topic: {partition: next offset}}`` that a checkpoint taken now may resume
        from (the finished prefix of every partition)."""
        with self._lock, self._io:
            self.consumer.done(self._take_finished())
            out = {t: dict(parts) for t, parts in self._offsets.items()}
            for (topic, partition), off in self.consumer.positions().items():
                out.setdefault(topic, {})[str(partition)] = off
            return out

    def commit(self) -> None:
        """Commit the finished prefix (call right after a checkpoint is on disk)."""
        with self._lock, self._io:
            self.consumer.done(self._take_finished())
            self.consumer.commit()

    def close(self) -> None:
        """Stop the reading thread and close the consumer if it made it (no commit)."""
        self._closed.set()
        self._may_read.set()
        if self._started:
            self._thread.join(timeout=10)
        if self._own_consumer:
            with self._io:
                self.consumer.close()
