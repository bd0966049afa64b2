"""The rollout stage's prompt queue: prompt rows delivered and not yet sampled, which
prompt messages are finished (then committed), and the epoch of each prompt partition
(rewound to offset 0 for the next epoch, recorded on ``<run>.rollout_state`` first).
See the package docstring (:mod:`relax.consumers.rollout`), "Delivery" and "Epochs"."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass

from relax.consumers.rollout.config import RolloutConfig
from relax.consumers.rollout.metrics import RolloutStats
from relax.consumers.rollout.state import saved_state

log = logging.getLogger(__name__)

HANDED_KEEP = 1024
"""Groups of revoked partitions an instance keeps in its pending record (the new owner
reads them right after its assignment; a rebalance hands over at most the groups in
flight)."""


@dataclass
class PromptItem:
    """One prompt row waiting to be sampled, and the delivery it came in
    (``media_inputs``: its images' / audio's model inputs once rendered, for a
    multimodal model; :func:`relax.trainer.multimodal.encode_prompt`)."""

    delivery: object
    row: dict
    epoch: int
    media_inputs: dict | None = None

    @property
    def group_id(self) -> str:
        """``<prompt_id>:<epoch>``: the group sampled from this prompt in this epoch."""
        return f"{self.row['prompt_id']}:{self.epoch}"


def _read_to_end(kc, tp) -> bool:
    """Whether assigned partition ``tp`` was fetched up to its high watermark; False when
    it was revoked meanwhile. ``KafkaConsumer.position`` talks to the group coordinator
    before it reads the position, so a rebalance in that round trip (a broker restart
    makes one) takes ``tp`` away and kafka-python 3.0 raises KeyError or
    IllegalStateError for it."""
    from kafka.errors import IllegalStateError

    hw = kc.highwater(tp)
    if hw is None:
        return False
    try:
        return kc.position(tp) >= hw
    except (KeyError, IllegalStateError):
        return False


def message_key(d) -> tuple:
    """``(topic, partition, offset)`` of a delivery (one prompt message)."""
    return (d.topic, d.partition, d.offset)


class PromptQueue:
    """The prompts one rollout instance has taken from its consumer and not finished.

    Attributes:
        items: prompt rows waiting to be sampled, in delivery order.
        remaining: ``{message_key: rows of that message not yet finished}``.
        epoch: ``{TopicPartition: epoch}`` of the partitions seen.
        revoked: prompt partitions taken away by a rebalance (filled by the consumer's
            I/O thread through :meth:`note_revoked`).
        pending_gids: ``{message_key: group_ids produced}`` of messages not yet
            committed.
        exhausted_partitions: partitions sampled for every epoch.
        saved_epochs: ``{(topic, partition): epoch}`` from ``<run>.rollout_state``
            (set before the first fetch).
        producer: the stage's :class:`relax.streams.producer.BatchProducer` (set before
            the first fetch): writes epoch records, flushed before a commit.
    """

    def __init__(self, cfg: RolloutConfig, state_topic: str, stats: RolloutStats):
        self.cfg = cfg
        self.stats = stats
        self._state_topic = state_topic
        self.items: list[PromptItem] = []
        self.remaining: dict[tuple, int] = {}
        self.epoch: dict = {}
        self.revoked: set = set()  # prompt partitions taken away by a rebalance (I/O thread)
        self.assigned: set = set()  # prompt partitions held now (the I/O thread's callbacks)
        self._revoked_lock = threading.Lock()
        self.pending_gids: dict[tuple, list[str]] = {}  # prompt message -> groups produced
        # groups produced here for prompts of partitions a rebalance took away, not
        # committed: kept in this instance's pending record for the new owner
        self.handed_gids: list[str] = []
        # every instance's pending groups as read at the last assignment: produced, not
        # committed; their prompts come again to whoever holds the partition now
        self.others_pending: set[str] = set()
        self._assigned = threading.Event()  # set by the I/O thread's on_assign
        self.exhausted_partitions: set = set()
        self.saved_epochs: dict[tuple[str, int], int] = {}
        self.producer = None

    def regrants(self, granted: set[str], started: set[str]) -> list[PromptItem]:
        """Queued prompts whose groups are in ``granted`` (the claim log granted them
        before, to an instance that died or lost the partition before producing them)
        and neither in ``started`` (by this instance) nor in :attr:`others_pending`
        (produced by another): they need no new credit."""
        return [it for it in self.items if it.group_id in granted
                and it.group_id not in started and it.group_id not in self.others_pending]

    def fetch(self, consumer) -> None:
        """Poll ``consumer`` for prompts; with none queued, rewind finished partitions
        (:meth:`maybe_next_epoch`)."""
        self.enqueue(consumer, consumer.poll(self.cfg.poll_timeout_s))
        if not self.items:
            self.maybe_next_epoch(consumer)

    def note_revoked(self, partitions) -> None:
        """The consumer's ``on_revoke`` callback (its I/O thread): remember ``partitions``
        (TopicPartitions) until the stage thread's next :meth:`drop_revoked`."""
        with self._revoked_lock:
            self.revoked.update(partitions)
            self.assigned.difference_update(partitions)

    def drop_revoked(self) -> None:
        """Forget the queued prompts of partitions a rebalance took away: their new owner
        samples them (sampling them here too would spend credit on duplicates). The
        groups already produced for their uncommitted prompts move to
        :attr:`handed_gids` (the newest :data:`HANDED_KEEP`), which stay in this
        instance's pending record: the new owner reads them and does not sample those
        prompts again."""
        with self._revoked_lock:
            gone = {(tp.topic, tp.partition) for tp in self.revoked}
            self.revoked = set()
        if not gone:
            return
        self.items = [i for i in self.items if (i.delivery.topic, i.delivery.partition) not in gone]
        self.remaining = {k: n for k, n in self.remaining.items() if k[:2] not in gone}
        handed = [g for k, gids in self.pending_gids.items() if k[:2] in gone for g in gids]
        self.handed_gids = (self.handed_gids + handed)[-HANDED_KEEP:]
        self.pending_gids = {k: g for k, g in self.pending_gids.items() if k[:2] not in gone}

    def note_assigned(self, partitions) -> None:
        """The consumer's ``on_assign`` callback (its I/O thread): partitions came here;
        the stage thread's next :meth:`enqueue` reads the run's rollout state again first
        (:meth:`learn_state`)."""
        with self._revoked_lock:
            self.assigned.update(partitions)
        self._assigned.set()

    def learn_state(self) -> None:
        """After an assignment, read ``<run>.rollout_state`` again: every partition's
        epoch (a partition that was another instance's, or this one's before a
        rebalance, goes on in the epoch its last owner saved, not in one remembered
        from before) and every instance's pending groups (:attr:`others_pending`).
        Prompts fetched with a stale epoch would be sampled again under group_ids the
        run already has (a scale-out sampled the tail of an epoch twice, 14 of 160
        groups)."""
        if not self._assigned.is_set():
            return
        self._assigned.clear()
        saved = saved_state(self.producer.cfg, self._state_topic)
        self.saved_epochs = saved.epochs
        self.epoch.clear()
        self.others_pending = {g for gids in saved.pending.values() for g in gids}
        log.info("%s: partitions assigned; epochs %s; %d groups produced and not committed",
                 self.cfg.engine_id, {f"{t}[{p}]": e for (t, p), e in saved.epochs.items()},
                 len(self.others_pending))

    def enqueue(self, consumer, deliveries) -> None:
        """Queue the rows of ``deliveries`` with their partition's epoch (an empty
        message is done at once)."""
        from kafka import TopicPartition

        self.drop_revoked()
        self.learn_state()
        for d in deliveries:
            tp = TopicPartition(d.topic, d.partition)
            epoch = self.epoch.setdefault(tp, self.saved_epochs.get((tp.topic, tp.partition), 0))
            rows = d.table.to_pylist()
            if not rows:
                consumer.done(d)
                continue
            self.remaining[message_key(d)] = len(rows)
            self.items.extend(PromptItem(d, r, epoch) for r in rows)

    def maybe_next_epoch(self, consumer) -> None:
        """Rewind partitions whose prompts were all sampled, if ``epochs`` allows."""
        from kafka.errors import RebalanceInProgressError
        from kafka.structs import OffsetAndMetadata

        kc = consumer.kafka
        for tp in kc.assignment():
            if tp in self.exhausted_partitions or not _read_to_end(kc, tp):
                continue
            if any(k[0] == tp.topic and k[1] == tp.partition for k in self.remaining):
                continue
            epoch = self.epoch.setdefault(tp, self.saved_epochs.get((tp.topic, tp.partition), 0))
            if epoch + 1 >= self.cfg.epochs:
                self.exhausted_partitions.add(tp)
                continue
            consumer.commit()
            if tp not in kc.assignment():  # revoked during the commit's round trip
                continue
            # the new epoch is durable before any offset of it is committed: a restart
            # never samples an epoch's group_ids twice (at worst, killed between the two
            # writes, it skips that epoch)
            self._save_epoch(tp, epoch + 1)
            try:
                kc.commit({tp: OffsetAndMetadata(0, "", -1)})
            except RebalanceInProgressError as e:
                # a member joined or left meanwhile: the partition stays in epoch `epoch`
                # at its end (as committed), for whichever member holds it next
                log.warning("%s: %s[%d] stays in epoch %d: the group is rebalancing (%s)",
                            self.cfg.engine_id, tp.topic, tp.partition, epoch, e)
                self._save_epoch(tp, epoch)
                continue
            consumer._tracker.forget([tp])  # offsets restart at 0 for the next epoch
            kc.seek(tp, 0)
            self.epoch[tp] = epoch + 1
            self.stats.epochs_started += 1
            log.info("%s: %s[%d] epoch %d", self.cfg.engine_id, tp.topic, tp.partition, epoch + 1)

    def _save_epoch(self, tp, epoch: int) -> None:
        """Record ``epoch`` of partition ``tp`` on ``<run>.rollout_state`` (flushed)."""
        self.producer.send_value(self._state_topic, json.dumps(
            {"topic": tp.topic, "partition": tp.partition, "epoch": epoch}).encode(),
            key=f"{tp.topic}:{tp.partition}".encode())
        self.producer.flush()

    def exhausted(self, consumer) -> bool:
        """Every prompt partition assigned to ``consumer`` has been sampled for all epochs
        and nothing is queued (False while no partition is assigned)."""
        assigned = consumer.kafka.assignment()
        return (
            bool(assigned)
            and all(tp in self.exhausted_partitions for tp in assigned)
            and not self.items
            and not self.remaining
        )

    def finish(self, consumer, items: list[PromptItem]) -> None:
        """Count ``items`` (taken from :attr:`items`) as finished; messages with no row
        left are done: the producer is flushed, then they are committed."""
        done = []
        for item in items:
            k = message_key(item.delivery)
            if k not in self.remaining:  # its partition was revoked meanwhile
                continue
            self.remaining[k] -= 1
            if self.remaining[k] == 0:
                del self.remaining[k]
                self.pending_gids.pop(k, None)  # committed below
                done.append(item.delivery)
        if done:
            self.producer.flush()
            consumer.done(done)
            consumer.commit()
