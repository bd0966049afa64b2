"""The trainer's progress as the rollout stage reads it (:class:`TrainerProgress`):
``groups_consumed`` / ``groups_needed`` on ``<run>.metrics``, the input of its credit
(:mod:`relax.consumers.rollout.credit`)."""

from __future__ import annotations

import logging

from relax.schemas import metric_names as M
from relax.schemas import topics
from relax.streams.client import BusConfig, ensure_topics

log = logging.getLogger(__name__)


class TrainerProgress:
    """The trainer's ``groups_consumed`` / ``groups_needed`` metrics (component
    ``trainer`` on ``<run>.metrics``), read group-less from the beginning: the rollout
    stage's credit. ``consumed`` and ``needed`` are the latest values (the trainer is
    their only writer, on one partition, so the latest is the truth even when a
    restarted trainer goes back to its checkpoint's count), ``version`` the trainer's
    policy_version when it wrote them (all None until the trainer wrote one).
    Undecodable records are skipped (logged)."""

    def __init__(self, cfg: BusConfig, run: str):
        from kafka import KafkaConsumer, TopicPartition

        from relax.streams.client import consumer_kwargs, topic_partitions

        self.topic = topics.run_topic(run, topics.METRICS)
        n = topic_partitions(cfg, [self.topic]).get(self.topic, 0)
        if not n:
            ensure_topics(cfg, {self.topic: 1})
            n = 1
        self._kc = KafkaConsumer(**consumer_kwargs(cfg, None))
        tps = [TopicPartition(self.topic, p) for p in range(n)]
        self._kc.assign(tps)
        self._kc.seek_to_beginning(*tps)
        self.consumed: int | None = None
        self.needed: int | None = None
        self.version: int | None = None

    def poll(self, timeout_s: float = 0.0) -> None:
        """Read what arrived (waiting up to ``timeout_s``)."""
        from relax.streams.codec import DecodeError, decode

        for msgs in self._kc.poll(timeout_ms=int(timeout_s * 1000)).values():
            for m in msgs:
                if m.key not in (None, b"trainer"):
                    continue
                try:
                    rows = decode(m.value, "metrics").to_pylist()
                except (DecodeError, ValueError) as e:
                    log.warning(
                        "skipping undecodable metrics record %s@%d: %s", self.topic, m.offset, e
                    )
                    continue
                for r in rows:
                    if r["component"] != "trainer":
                        continue
                    if r["name"] == M.GROUPS_CONSUMED:
                        self.consumed = int(r["value"])
                        if r["policy_version"] is not None:
                            self.version = int(r["policy_version"])
                    elif r["name"] == M.GROUPS_NEEDED:
                        self.needed = int(r["value"])

    def close(self) -> None:
        """Close the Kafka client."""
        self._kc.close(autocommit=False)
