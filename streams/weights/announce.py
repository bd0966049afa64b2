"""Announcements of the weight channel on ``<run>.weights`` (WEIGHTS schema).

Weights never go through Kafka; only their announcements do.

Delivery: announcements are at-least-once records on a 1-partition topic (ordered);
subscribers read it group-less from the beginning (no commits).
"""

from __future__ import annotations

import logging

from relax.schemas import topics as topic_names
from relax.schemas.validate import validate
from relax.streams.client import BusConfig, ensure_topics
from relax.streams.follow import Follower, follow
from relax.streams.read import decode_or_reason

log = logging.getLogger(__name__)


def weights_topic(run: str) -> str:
    """``<run>.weights``."""
    return topic_names.run_topic(run, topic_names.WEIGHTS)


def ensure_weights_topic(cfg: BusConfig, run: str) -> str:
    """Create ``<run>.weights`` with one partition (announcements stay ordered)."""
    t = weights_topic(run)
    ensure_topics(cfg, {t: 1})
    return t


VERSION_ONLY = "version"
"""The transport of an announcement that carries a policy_version and no weights
(:meth:`~relax.streams.weights.publisher.WeightPublisher.announce_version`)."""


def newest_rows(rows: list[dict]) -> list[dict]:
    """``rows`` (announcements, oldest first) with only the newest of each transport (none
    of :data:`VERSION_ONLY`, which carry no weights): the
    last broadcast announcement, the last same-host (``shm``) one and the last
    ``checkpoint`` one with a URI, in their order. The publisher announces v+1 only after
    v's broadcast ended and keeps only the newest same-host file, and a restarted trainer
    announces from a new rendezvous, so every earlier live one is history (joining a dead
    publisher's store would only time out). A publisher announces its snapshots in
    policy_version order, and a restarted one counts again from its checkpoint (and
    deletes the dead one's snapshots from there on), so the last checkpoint row is the
    newest of the weights the run still has, even where an earlier row has a higher
    policy_version; an earlier one is superseded, and retention may already have
    deleted it."""
    last: dict[str, int] = {}
    for i, r in enumerate(rows):
        if r["transport"] == VERSION_ONLY:
            continue
        if r["transport"] != "checkpoint":
            last["shm" if r["transport"] == "shm" else "live"] = i
        elif r["checkpoint_uri"]:
            last["checkpoint"] = i
    keep = set(last.values())
    return [r for i, r in enumerate(rows) if i in keep]


class AnnouncementReader:
    """Reads ``<run>.weights`` announcements group-less from the beginning (no commits).

    Used by subscribers and by the rollout stage to learn the trainer's policy_version.
    Fetches wait at most ``BusConfig.fetch_wait_ms`` on the broker (the
    publisher's broadcast waits for subscribers to see its announcement, so its latency
    matters, but so does the CPU an idle reader burns). Records that are not a WEIGHTS
    batch (a null or empty value, a ``relax-schema`` header naming another schema, bytes
    that do not decode or fail validation) are logged with their ``topic[partition]@offset``
    and skipped, never raised (announcements are written by relax only). ``follower``:
    the process's shared :class:`~relax.streams.follow.Follower` to read on (None: a
    client of its own).
    """

    def __init__(self, cfg: BusConfig, run: str, follower: Follower | None = None):
        self.topic = ensure_weights_topic(cfg, run)
        self._reader = follow(cfg, self.topic, 1, "weights", follower)
        self.latest_version: int | None = None
        """The trainer's policy_version: the last announcement's (a publisher announces in
        version order; a restarted trainer counts again from its checkpoint, below the
        dead one's newest), None before any."""

    def poll(self, timeout_s: float = 0.0) -> list[dict]:
        """New announcement rows (dicts with the WEIGHTS fields), oldest first."""
        rows: list[dict] = []
        for m in self._reader.poll(timeout_s):
            table, why = decode_or_reason(m, "weights")
            if table is not None:
                try:
                    validate(table, "weights")
                except ValueError as e:
                    table, why = None, str(e)
            if table is None:
                log.warning("skipping unusable announcement at %s[%d]@%d: %s; expected a "
                            "'weights' batch", self.topic, m.partition, m.offset, why)
                continue
            rows.extend(table.to_pylist())
        if rows:
            self.latest_version = rows[-1]["policy_version"]
        return rows

    def poll_backlog(self, timeout_s: float = 2.0, quiet_s: float = 0.3) -> list[dict]:
        """Every announcement up to the end of the topic (a late joiner's whole history,
        which one fetch may not hold: a long run has hundreds): polls until a poll of
        ``quiet_s`` seconds returns nothing, after a first one of up to ``timeout_s``."""
        rows = self.poll(timeout_s)
        while True:
            more = self.poll(quiet_s)
            if not more:
                return rows
            rows += more

    def close(self) -> None:
        """Stop reading (and close the Kafka client unless it is a shared follower's)."""
        self._reader.close()
