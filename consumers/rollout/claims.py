"""The rollout instances' shared credit: claims on ``<run>.rollout_claims``.

Before it samples, an instance appends a claim (the group_ids it wants to start and its
view of the run's allowance, :func:`relax.consumers.rollout.credit.run_allowance`) to the
one-partition claim log, then reads the log up to its own claim. Every instance applies
every claim in log order to its :class:`~relax.consumers.rollout.credit.ClaimLedger`, so
all of them agree on what was granted: a fast instance takes the credit a slow one
leaves, an instance that joins reads the log and counts every group in flight, and one
that leaves (or dies) holds nothing back (its prompts come again to another instance
and their group_ids are granted again for free). See docs/design-notes.md, "Dynamic
credit: claims on one ordered log".
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Sequence

from relax.consumers.rollout.credit import ClaimLedger
from relax.schemas import topics
from relax.streams.client import BusConfig, ensure_topics
from relax.streams.lag import high_watermarks
from relax.streams.read import TopicReader

log = logging.getLogger(__name__)

CLAIM_FETCH_WAIT_MS = 10
"""The claim reader's longest empty fetch (``fetch_max_wait_ms``): it is polled only
around a claim, so it never spins; with the default 200 ms, every claim made after an
``allowance()`` poll waited for its own record on a broker that answers a waiting
fetch late."""


class ClaimTimeout(TimeoutError):
    """An instance's own claim did not come back from the claim log in time."""


class ClaimLog:
    """One instance's view of ``<run>.rollout_claims``: :meth:`claim` to take credit,
    :meth:`poll` to learn the others' claims, :attr:`ledger` for what is granted.

    Args:
        cfg: bus settings.
        run: the run name.
        engine_id: this instance (written into its claims, for people).
        producer: a :class:`relax.streams.producer.BatchProducer` (flushed by
            :meth:`claim`).
        timeout_s: how long :meth:`catch_up` and :meth:`claim` wait for the log.
        fetch_wait_ms: the claim reader's longest empty fetch (:data:`CLAIM_FETCH_WAIT_MS`).

    Raises:
        TimeoutError: the log's end could not be read within ``timeout_s``.
    """

    def __init__(self, cfg: BusConfig, run: str, engine_id: str, producer,
                 timeout_s: float = 30.0, fetch_wait_ms: int = CLAIM_FETCH_WAIT_MS):
        self.topic = topics.rollout_claims_topic(run)
        self.engine_id = engine_id
        self.ledger = ClaimLedger()
        self.claims_read = 0
        self._producer = producer
        self._timeout_s = timeout_s
        self._prefix = f"{engine_id}/{uuid.uuid4().hex[:8]}/"
        self._seq = 0
        self._mine: dict[str, list[str]] = {}
        ensure_topics(cfg, {self.topic: 1})
        # polled on demand, never idle in a loop: a short fetch wait costs no CPU, and a
        # claim is read back ~5 ms after it is written instead of at ~half the default
        # wait (the fetch left waiting by the last poll, benchmarks/bus_latency.py)
        self._reader = TopicReader(cfg, "claims", fetch_wait_ms=fetch_wait_ms)
        self._reader.follow(self.topic, 1)
        self._next_offset = 0
        self.catch_up(high_watermarks(cfg, [self.topic], timeout_s).get((self.topic, 0), 0))

    @property
    def granted(self) -> int:
        """Groups granted so far, every instance together."""
        return self.ledger.count

    def _apply(self, m) -> None:
        self._next_offset = m.offset + 1
        try:
            r = json.loads(m.value)
            gids, allowance = [str(g) for g in r["group_ids"]], int(r["allowance"])
            cid = str(r["claim"])
        except (ValueError, KeyError, TypeError) as e:
            # every reader skips the same record, so they still agree
            log.error("%s@%d: expected {claim, group_ids, allowance} JSON, got %r (%s); "
                      "skipped", self.topic, m.offset, m.value[:80], e)
            return
        held = self.ledger.apply(gids, allowance)
        self.claims_read += 1
        if cid.startswith(self._prefix):
            self._mine[cid] = held

    def poll(self, timeout_s: float = 0.0) -> None:
        """Apply the claims that arrived (waiting up to ``timeout_s``)."""
        for m in self._reader.poll(timeout_s):
            self._apply(m)

    def catch_up(self, end: int) -> None:
        """Apply every claim before offset ``end``.

        Raises:
            TimeoutError: not there within ``timeout_s``.
        """
        deadline = time.monotonic() + self._timeout_s
        while self._next_offset < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.topic}: read to offset {self._next_offset} of "
                                   f"{end} in {self._timeout_s}s")
            self.poll(0.2)

    def claim(self, group_ids: Sequence[str], allowance: int) -> list[str]:
        """Claim ``group_ids`` under ``allowance``; returns those this instance may
        start (in order), after every claim before it on the log.

        Raises:
            ClaimTimeout: the claim was not read back within ``timeout_s``.
            relax.streams.producer.DeliveryError: the claim could not be written.
        """
        if not group_ids:
            return []
        self._seq += 1
        cid = f"{self._prefix}{self._seq}"
        self._producer.send_value(self.topic, json.dumps(
            {"claim": cid, "engine_id": self.engine_id, "group_ids": list(group_ids),
             "allowance": int(allowance)}).encode(), key=self.engine_id.encode())
        self._producer.flush()
        deadline = time.monotonic() + self._timeout_s
        while cid not in self._mine:
            if time.monotonic() > deadline:
                raise ClaimTimeout(f"{self.topic}: claim {cid} not read back in "
                                   f"{self._timeout_s}s")
            self.poll(0.2)
        return self._mine.pop(cid)

    def close(self) -> None:
        """Close the Kafka client."""
        self._reader.close()
