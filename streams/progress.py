"""The trainer's progress on ``<run>.progress`` (schema ``progress``, compacted, one
partition, key ``trainer``): groups_consumed, groups_needed and policy_version, written
by the trainer after every decision and checkpoint, read by the rollout stage's credit
(:mod:`relax.consumers.rollout.credit`). A copy goes to ``<run>.metrics`` for people;
the credit reads only this topic, so the run's correctness does not ride on the
metrics (docs/architecture.md, section 4)."""

from __future__ import annotations

import logging
import time

import pyarrow as pa

from relax.schemas import topics
from relax.schemas.v1 import PROGRESS
from relax.streams.client import BusConfig, ensure_topics
from relax.streams.follow import Follower, follow
from relax.streams.read import decoded_rows

log = logging.getLogger(__name__)

PROGRESS_KEY = b"trainer"
"""The key of every progress record: compaction keeps the latest."""


def progress_row(groups_consumed: int, groups_needed: int, policy_version: int) -> pa.RecordBatch:
    """One ``progress`` row, stamped now.

    Args:
        groups_consumed: groups the trainer decided since the run began (>= 0).
        groups_needed: groups the remaining steps need (>= 0).
        policy_version: the trainer's policy_version (optimizer steps applied).

    Returns:
        a 1-row RecordBatch of schema ``progress``.
    """
    return pa.RecordBatch.from_pylist([{
        "ts": int(time.time() * 1000), "policy_version": int(policy_version),
        "groups_consumed": int(groups_consumed), "groups_needed": int(groups_needed),
    }], schema=PROGRESS)


class TrainerProgress:
    """Follows ``<run>.progress`` from the beginning (group-less; creates the topic if
    missing). ``consumed`` and ``needed`` are the latest values (the trainer is the only
    writer, on one partition, so the latest is the truth even when a restarted trainer
    goes back to its checkpoint's count), ``version`` the trainer's policy_version when
    it wrote them; all None until the trainer wrote one. Records that do not decode are
    logged and skipped. ``follower``: the process's shared
    :class:`~relax.streams.follow.Follower` to read on (None: a client of its own)."""

    def __init__(self, cfg: BusConfig, run: str, follower: Follower | None = None):
        self.topic = topics.run_topic(run, topics.PROGRESS)
        ensure_topics(cfg, {self.topic: 1})
        self._reader = follow(cfg, self.topic, 1, "progress", follower)
        self.consumed: int | None = None
        self.needed: int | None = None
        self.version: int | None = None

    def poll(self, timeout_s: float = 0.0) -> None:
        """Read what arrived (waiting up to ``timeout_s``)."""
        for m in self._reader.poll(timeout_s):
            for r in decoded_rows(m, "progress", log):
                self.consumed, self.needed = r["groups_consumed"], r["groups_needed"]
                self.version = r["policy_version"]

    def close(self) -> None:
        """Stop reading (and close the Kafka client unless it is a shared follower's)."""
        self._reader.close()
