"""Reward changes on the bus: announce one on ``<run>.reward_changes``, follow them.

Delivery: one partition (changes stay ordered), written by ``relax reward attach
--weight`` / ``relax reward detach`` (flushed and acknowledged before the command goes
on), read group-less from the beginning by the aggregator (no commits: the topic is the
whole state, a few rows per run). Rows that do not decode, or that fail
:class:`~relax.consumers.reward.plan.RewardChange`'s checks, are logged with their
offset and skipped (only relax writes this topic). The plan they build is in
:mod:`relax.consumers.reward.plan`.
"""

from __future__ import annotations

import logging
import time

import pyarrow as pa

from relax.consumers.reward.plan import RewardChange
from relax.schemas import topics
from relax.schemas.v1 import REWARD_CHANGES
from relax.streams.client import BusConfig, ensure_topics
from relax.streams.lag import high_watermarks
from relax.streams.producer import BatchProducer
from relax.streams.read import TopicReader, decoded_rows, read_last_rows

log = logging.getLogger(__name__)


def changes_topic(cfg: BusConfig, run: str) -> str:
    """``<run>.reward_changes``, created with one partition if missing."""
    t = topics.run_topic(run, topics.REWARD_CHANGES)
    ensure_topics(cfg, {t: 1})
    return t


def latest_policy_version(cfg: BusConfig, run: str) -> int:
    """The newest policy_version the run has announced weights for (``<run>.weights``)
    or the trainer has reached (``<run>.progress``); 0 before either exists."""
    seen = [0]
    for name in (topics.WEIGHTS, topics.PROGRESS):
        t = topics.run_topic(run, name)
        ensure_topics(cfg, {t: 1})
        seen += [r["policy_version"] for r in read_last_rows(cfg, t, 8) if "policy_version" in r]
    return max(seen)


def announce(cfg: BusConfig, run: str, action: str, reward_name: str, weight: float = 0.0,
             from_policy_version: int | None = None) -> RewardChange:
    """Write one reward change and wait for the broker's acknowledgement.

    Args:
        cfg: bus settings.
        run: run name.
        action: ``attach`` or ``detach``.
        reward_name: the reward_name to count or stop counting.
        weight: weight in the final reward (attach); ignored for detach (written 0.0).
        from_policy_version: the first group policy_version it counts for; default and
            least: :func:`latest_policy_version` + 2. Groups already sampled are untouched,
            and so are those of the next version, which a fast trainer may announce (and
            an engine sample) while this change is being written.

    Returns:
        the change as written.

    Raises:
        ValueError: bad action, or ``from_policy_version`` below the least.
    """
    latest = latest_policy_version(cfg, run)
    if from_policy_version is None:
        from_policy_version = latest + 2
    elif from_policy_version < latest + 2:
        raise ValueError(f"from_policy_version {from_policy_version}: run {run!r} is at "
                         f"policy_version {latest}; a change counts from {latest + 2} on "
                         "(groups of the next version may be sampled while it is written)")
    change = RewardChange(action, reward_name, float(weight) if action == "attach" else 0.0,
                          from_policy_version)
    row = {"ts": int(time.time() * 1000), **change.__dict__}
    producer = BatchProducer(cfg, producer_id=f"reward-{action}")
    try:
        producer.send(changes_topic(cfg, run), pa.RecordBatch.from_pylist([row], schema=REWARD_CHANGES))
        producer.flush()
    finally:
        producer.close()
    after = latest_policy_version(cfg, run)
    if after >= from_policy_version:  # only a trainer two versions on in ~0.2 s
        log.warning("reward change %s %r from policy_version %d was acknowledged when the "
                    "run was already at %d: groups of %d..%d may have been decided without "
                    "it", action, reward_name, from_policy_version, after, from_policy_version,
                    after)
    return change


def _changes(m) -> list[RewardChange]:
    out = []
    for r in decoded_rows(m, topics.REWARD_CHANGES, log):
        try:
            out.append(RewardChange.from_row(r))
        except ValueError as e:
            log.warning("%s[%d]@%d: skipped: %s", m.topic, m.partition, m.offset, e)
    return out


class ChangeFollower:
    """Follows ``<run>.reward_changes``: :meth:`poll` returns the changes not returned
    before, in announcement order. The first call returns every change up to the
    partition's end at that time (blocking until read), so a (re)started aggregator
    knows the whole plan before it decides a group."""

    def __init__(self, cfg: BusConfig, run: str):
        self.cfg = cfg
        self.topic = changes_topic(cfg, run)
        self._reader = TopicReader(cfg, "reward-changes")
        self._ends = TopicReader(cfg, "reward-changes-end")  # idle: no fetch ahead of it
        self._next = None  # next offset to read; None = not caught up yet
        self._pending: list[RewardChange] = []  # read, not yet returned

    def poll(self, timeout_s: float = 0.0, to_end: bool = False) -> list[RewardChange]:
        """New changes (waiting up to ``timeout_s`` seconds when there are none).

        Args:
            timeout_s: the longest wait for a first new record (seconds).
            to_end: also read up to the partition's end as of this call (one ListOffsets
                on the open connection, :meth:`TopicReader.log_end`): every change
                acknowledged before the call is returned, not only those the client has
                fetched.

        Raises:
            TimeoutError: no record came for 30 s before that end, or the first call's
                end could not be looked up (:func:`relax.streams.lag.high_watermarks`).
            kafka.errors.KafkaError: ``to_end`` and the broker did not answer.
            What was read stays for the next call either way.
        """
        if self._next is None:
            end = self._end()
            first = [c for m in self._reader.read_range({(self.topic, 0): (0, end)})
                     for c in _changes(m)]
            self._pending += first
            self._next = end
            self._reader.follow(self.topic, 1)
        self._take(self._reader.poll(timeout_s))
        if to_end:
            end = self._ends.log_end(self.topic)
            deadline = time.monotonic() + 30.0
            while self._next < end:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.topic}: no record for 30s before offset {end}")
                self._take(self._reader.poll(0.2))
        out, self._pending = self._pending, []
        return out

    def _end(self) -> int:
        return high_watermarks(self.cfg, [self.topic])[(self.topic, 0)]

    def _take(self, messages) -> None:
        """Queue the changes among ``messages`` at or past the next offset to return (a
        poll that raises keeps them for the next one)."""
        for m in messages:
            if m.offset >= self._next:
                self._pending += _changes(m)
                self._next = m.offset + 1

    def close(self) -> None:
        """Close the Kafka clients."""
        self._reader.close()
        self._ends.close()
