"""One group-less client that follows several topics for a process (:class:`Follower`).

An idle Kafka reader is a fetch round trip every wait (``BusConfig.fetch_wait_ms``), in its
process and in the broker, and a relax process often follows several small control
topics at once: the rollout stage reads the weight announcements (for the trainer's
policy_version), its weight subscriber reads them again in its own thread, and it reads
the trainer's progress. Each with its own :class:`~relax.streams.read.TopicReader`, that
is three fetch loops while the stage waits; on one :class:`Follower` it is one, whose
fetch asks for every followed partition (``benchmarks/JOURNAL.md`` has what one loop
costs).

Each :meth:`Follower.follow` returns a :class:`Followed` view with the reader's
``poll(timeout_s)``. The views may be polled from different threads: one poll at a time
fetches (the client is not thread-safe) and hands every record to the views of its
partition; the others wait for their own records or their timeout. Every view reads its
partitions from the beginning, and two views of one partition each get every record
once (a later view seeks the partition back; the earlier one skips what it already had).
"""

from __future__ import annotations

import threading
import time
import uuid

from relax.streams.client import BusConfig, consumer_kwargs


class Followed:
    """One topic's view of a :class:`Follower` (made by :meth:`Follower.follow`)."""

    def __init__(self, follower: Follower, topic: str, partitions: int):
        self.follower, self.topic = follower, topic
        self.next: dict[int, int] = {p: 0 for p in range(partitions)}
        self.records: list = []
        self.owns_follower = False  # made by :func:`follow` without a follower: close it too

    def poll(self, timeout_s: float = 0.0) -> list:
        """The records that arrived on this view's partitions since the last call
        (waiting up to ``timeout_s`` seconds for a first one), in offset order within a
        partition: kafka-python ``ConsumerRecord``s."""
        return self.follower._poll(self, timeout_s)

    def close(self) -> None:
        """Stop following (the partitions leave the client's assignment when no other
        view reads them)."""
        self.follower._unfollow(self)
        if self.owns_follower:
            self.follower.close()


def follow(cfg: BusConfig, topic: str, partitions: int, name: str,
           follower: Follower | None = None) -> Followed:
    """A view of ``topic`` on ``follower``, or on a follower of its own (closed with the
    view) when None: the readers of control topics take a process's shared follower
    where there is one."""
    if follower is not None:
        return follower.follow(topic, partitions)
    view = Follower(cfg, name).follow(topic, partitions)
    view.owns_follower = True
    return view


class Follower:
    """A group-less Kafka client whose views (:meth:`follow`) share one fetch loop.

    Args:
        cfg: bus settings (the fetch wait is ``cfg.fetch_wait_ms``, as for every reader).
        name: part of the client id (``relax-<name>-<random>``), for the broker's logs.
    """

    def __init__(self, cfg: BusConfig, name: str = "follow"):
        from kafka import KafkaConsumer

        client_id = f"relax-{name}-{uuid.uuid4().hex[:6]}"
        self._kc = KafkaConsumer(**consumer_kwargs(cfg, None, client_id))
        self._views: list[Followed] = []
        self._cond = threading.Condition()
        self._fetching = False
        self.closed = False

    def follow(self, topic: str, partitions: int) -> Followed:
        """A view of partitions ``0..partitions-1`` of ``topic``, read from the beginning."""
        from kafka import TopicPartition

        view = Followed(self, topic, partitions)
        with self._cond:
            while self._fetching:  # the client is another thread's until its poll returns
                self._cond.wait()
            held = self._kc.assignment()
            new = [TopicPartition(topic, p) for p in range(partitions)]
            self._kc.assign(list(held | set(new)))
            self._kc.resume(*new)
            self._kc.seek_to_beginning(*new)  # the earlier views skip what they had
            self._views.append(view)
        return view

    def _unfollow(self, view: Followed) -> None:
        from kafka import TopicPartition

        with self._cond:
            while self._fetching:
                self._cond.wait()
            if view not in self._views:
                return
            self._views.remove(view)
            if self.closed:
                return
            kept = {(v.topic, p) for v in self._views for p in v.next}
            self._kc.assign([TopicPartition(t, p) for t, p in kept])

    def _hand_out(self, polled: dict) -> None:
        """Give each record to the views of its partition that have not had it."""
        for tp, msgs in polled.items():
            for v in self._views:
                nxt = v.next.get(tp.partition) if v.topic == tp.topic else None
                if nxt is None:
                    continue
                fresh = [m for m in msgs if m.offset >= nxt]
                if fresh:
                    v.records.extend(fresh)
                    v.next[tp.partition] = fresh[-1].offset + 1

    def _poll(self, view: Followed, timeout_s: float) -> list:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                left = deadline - time.monotonic()
                if view.records or self.closed:
                    break
                if not self._fetching:
                    self._fetching = True
                    self._cond.release()
                    try:
                        polled = self._kc.poll(timeout_ms=max(0, int(left * 1000)))
                    finally:
                        self._cond.acquire()
                        self._fetching = False
                        self._cond.notify_all()
                    self._hand_out(polled)
                    if left <= 0:
                        break
                elif left > 0:
                    self._cond.wait(left)
                else:
                    break
            out, view.records = view.records, []
        return out

    def close(self) -> None:
        """Close the Kafka client (every view's :meth:`Followed.poll` returns nothing after)."""
        with self._cond:
            while self._fetching:
                self._cond.wait()
            if not self.closed:
                self.closed = True
                self._kc.close(autocommit=False)
