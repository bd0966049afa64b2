"""Helpers for tests that run a stage on the real broker: publish prompts, write the
trainer's progress as the trainer does, run a stage in a thread, wait for a condition."""

from __future__ import annotations

import threading
import time

import pyarrow as pa

from relax.schemas import topics
from relax.schemas.v1 import PROMPTS
from relax.schemas.validate import validate
from relax.streams.client import ensure_topics
from relax.streams.producer import BatchProducer


def publish_prompts(bus, dataset: str, rows: list[dict], partitions: int = 1) -> None:
    """Write ``rows`` (schema ``prompts``, validated) to ``prompts.<dataset>``."""
    topic = topics.prompts_topic(dataset)
    ensure_topics(bus, {topic: partitions})
    p = BatchProducer(bus)
    batch = pa.RecordBatch.from_pylist(rows, schema=PROMPTS)
    validate(batch, "prompts")
    p.send(topic, batch)
    p.close()


def trainer_progress(bus, run: str, consumed: int, needed: int, version: int = 2) -> None:
    """Write the trainer's progress as the trainer does (``<run>.progress``), as of its
    policy_version ``version``."""
    from relax.streams.progress import PROGRESS_KEY, progress_row

    p = BatchProducer(bus)
    topic = topics.run_topic(run, topics.PROGRESS)
    ensure_topics(bus, {topic: 1})
    p.send(topic, progress_row(consumed, needed, version), key=PROGRESS_KEY)
    p.close()


def wait_for(cond, timeout_s: float = 90.0, what: str = "condition") -> None:
    """Poll ``cond()`` every 50 ms until true; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout_s}s")
        time.sleep(0.05)


class StageRunner:
    """Runs a stage in a thread; ``stop()`` ends it and re-raises its exception."""

    def __init__(self, stage, **kw):
        self.stage, self.error, self._stop = stage, None, threading.Event()

        def main():
            try:
                stage.run(self._stop.is_set, **kw)
            except BaseException as e:  # re-raised in the test thread
                self.error = e

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()

    def check(self):
        if self.error is not None:
            raise self.error

    def stop(self, wake=None):
        """Set the stop flag, call ``wake()`` (ends a long wait the stage is in, which
        would otherwise run to its timeout), join, re-raise the stage's exception."""
        self._stop.set()
        if wake is not None:
            wake()
        self.thread.join(timeout=60)
        self.check()
