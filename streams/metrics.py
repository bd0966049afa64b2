"""Metrics as data: every stage writes ``(ts, component, name, value, policy_version)``
rows to ``<run>.metrics`` (keyed by component), read by ``relax monitor`` and the
dashboard. Names carry their unit as a suffix (``_s``, ``_bytes``, ``_tokens``).
"""

from __future__ import annotations

import threading
import time

import pyarrow as pa

from relax.schemas import topics
from relax.schemas.v1 import METRICS
from relax.streams.client import ensure_topics
from relax.streams.producer import BatchProducer


class MetricsWriter:
    """Buffers metric rows of one component and sends them with :meth:`flush`.

    Args:
        producer: the stage's producer (metrics go out with its next flush).
        run: run name; rows go to ``<run>.metrics``.
        component: e.g. ``trainer``, ``rollout-0``, ``reward.gsm8k``.

    Creates ``<run>.metrics`` (1 partition, so readers see one order) if it does not
    exist: a send to a missing topic would stall the producer's flush. Safe to share
    between threads (the trainer's step and its input thread's consumer write to one).
    """

    def __init__(self, producer: BatchProducer, run: str, component: str):
        self.producer, self.component = producer, component
        self.topic = topics.run_topic(run, topics.METRICS)
        ensure_topics(producer.cfg, {self.topic: 1})
        self._rows: list[dict] = []
        self._lock = threading.Lock()

    def add(self, name: str, value: float, policy_version: int | None = None) -> None:
        """Record one value now."""
        row = {"ts": int(time.time() * 1000), "component": self.component,
               "name": name, "value": float(value), "policy_version": policy_version}
        with self._lock:
            self._rows.append(row)

    def add_many(self, values: dict[str, float], policy_version: int | None = None) -> None:
        """Record several values with the same timestamp."""
        for k, v in values.items():
            self.add(k, v, policy_version)

    def flush(self) -> int:
        """Queue the buffered rows on the producer (the caller flushes the producer);
        returns the number of rows queued."""
        with self._lock:
            rows, self._rows = self._rows, []
        if rows:
            self.producer.send(self.topic, pa.RecordBatch.from_pylist(rows, schema=METRICS))
        return len(rows)
