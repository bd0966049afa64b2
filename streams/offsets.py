"""Which offset a consumer may commit: the next one to read, never past a record in flight.

Kafka's committed offset is the offset of the NEXT record to read (public case
C29: after processing offsets 0..41 the commit is 42). :class:`OffsetTracker`
records, per partition, the offsets handed out and those finished; the
committable offset is one past the longest finished prefix, so a record still
in flight (or failed and not yet routed) holds the commit back even when later
records are done. Offsets need not be contiguous (compacted topics, control
records): the tracker only relies on their order.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable


class OffsetTracker:
    """Per-partition bookkeeping of received and finished offsets.

    Keys are any hashable partition id (e.g. ``kafka.TopicPartition``).
    """

    def __init__(self) -> None:
        self._pending: dict[Hashable, deque[int]] = {}
        self._done: dict[Hashable, set[int]] = {}
        self._next: dict[Hashable, int] = {}
        self._committed: dict[Hashable, int] = {}

    def received(self, tp: Hashable, offset: int) -> None:
        """A record at ``offset`` was handed to processing (offsets arrive in order).

        Raises:
            ValueError: if offsets of one partition do not increase.
        """
        q = self._pending.setdefault(tp, deque())
        last = q[-1] if q else self._next.get(tp, -1) - 1
        if offset <= last:
            raise ValueError(f"offset {offset} of {tp} received after {last}: offsets must increase")
        q.append(offset)
        self._done.setdefault(tp, set())

    def done(self, tp: Hashable, offset: int) -> None:
        """The record at ``offset`` is finished: its outputs (or its error record) are flushed.

        Raises:
            KeyError: if the offset was never received (or already retired).
        """
        q = self._pending.get(tp)
        if not q or offset < q[0] or offset not in q:
            raise KeyError(f"offset {offset} of {tp} is not in flight")
        done = self._done[tp]
        done.add(offset)
        while q and q[0] in done:
            done.discard(q[0])
            self._next[tp] = q.popleft() + 1

    def in_flight(self, tp: Hashable | None = None) -> int:
        """Records received and not finished (one partition, or all)."""
        if tp is not None:
            return len(self._pending.get(tp, ())) - len(self._done.get(tp, ()))
        return sum(len(q) - len(self._done.get(t, ())) for t, q in self._pending.items())

    def committable(self) -> dict[Hashable, int]:
        """``{tp: next offset}`` for partitions whose commit point moved since the last
        :meth:`mark_committed`: one past the longest finished prefix."""
        return {tp: n for tp, n in self._next.items() if self._committed.get(tp) != n}

    def positions(self) -> dict[Hashable, int]:
        """``{tp: next offset}`` of every partition with a finished prefix (committed or
        not): where a checkpoint taken now resumes."""
        return dict(self._next)

    def mark_committed(self, offsets: dict[Hashable, int]) -> None:
        """Record that ``offsets`` were committed to the broker."""
        self._committed.update(offsets)

    def forget(self, tps) -> None:
        """Drop all state of partitions no longer assigned (after a rebalance)."""
        for tp in tps:
            for d in (self._pending, self._done, self._next, self._committed):
                d.pop(tp, None)
