"""The stage loop every consumer stage uses: consume -> function -> produce -> commit.

Delivery contract (at-least-once, docs/architecture.md, section 3):

* Input: one consumer group per stage (``<run>.<stage>``); partitions are
  shared among the group's instances, so adding an instance scales the stage.
* For each polled :class:`~relax.streams.consumer.Delivery` the stage function
  returns output batches ``[(topic, batch), ...]``; they are produced keyed by
  their key column (``group_id``), so a group's rows stay in one partition.
* A function raising :class:`RecordError` sends that record (the decoded rows as
  an Arrow IPC stream, with topic, partition, offset, row and reason) to
  ``<topic>.errors``; the stage goes on. Any other exception stops the stage
  (let the controller restart it): nothing after the failed record is committed.
* After a poll's outputs are flushed (``BatchProducer.flush`` raised nothing),
  the input offsets are committed: the committed offset is the next one to read.
  A crash between flush and commit redelivers those inputs; downstream drops
  duplicates by rollout_id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pyarrow as pa

from relax.streams.codec import encode
from relax.streams.consumer import BatchConsumer, Delivery
from relax.streams.errors import error_row
from relax.streams.producer import BatchProducer

log = logging.getLogger(__name__)

Output = tuple[str, pa.RecordBatch | pa.Table]
StageFn = Callable[[Delivery], Iterable[Output]]


class RecordError(ValueError):
    """Raised by a stage function for a record it cannot process; the record goes to
    the error topic of its source. ``row`` is the bad row's index, when known."""

    def __init__(self, message: str, row: int | None = None):
        self.row = row
        super().__init__(message)


@dataclass
class StageStats:
    """Counters of one stage loop: polls, input messages and rows, output rows,
    records routed to error topics, commits, seconds spent in the function."""

    polls: int = 0
    messages: int = 0
    rows_in: int = 0
    rows_out: int = 0
    errors: int = 0
    commits: int = 0
    busy_s: float = 0.0


def process_once(consumer: BatchConsumer, producer: BatchProducer, fn: StageFn, *,
                 stage: str, poll_timeout_s: float = 1.0, max_records: int | None = None,
                 stats: StageStats | None = None) -> int:
    """One turn of the loop: poll, run ``fn`` per delivery, produce, flush, commit.

    Returns:
        the number of deliveries processed (0 when the poll was empty).
    """
    stats = stats if stats is not None else StageStats()
    deliveries = consumer.poll(poll_timeout_s, max_records)
    stats.polls += 1
    if not deliveries:
        consumer.commit()  # errors routed during decode still move the offset
        return 0
    t0 = time.perf_counter()
    for d in deliveries:
        stats.messages += 1
        stats.rows_in += d.table.num_rows
        try:
            outputs = list(fn(d))
        except RecordError as e:
            stats.errors += 1
            producer.send_errors(d.topic, [error_row(
                source_topic=d.topic, source_partition=d.partition, source_offset=d.offset,
                row=e.row, stage=stage, error=str(e), key=d.key, value=encode(d.table),
                headers=list(d.headers.items()))])
            continue
        for topic, batch in outputs:
            stats.rows_out += batch.num_rows
            producer.send(topic, batch)
    stats.busy_s += time.perf_counter() - t0
    producer.flush()
    consumer.done(deliveries)
    if consumer.commit():
        stats.commits += 1
    return len(deliveries)


def run_stage(consumer: BatchConsumer, producer: BatchProducer, fn: StageFn, *, stage: str,
              should_stop: Callable[[], bool], poll_timeout_s: float = 1.0,
              max_records: int | None = None, stats: StageStats | None = None) -> StageStats:
    """Run :func:`process_once` until ``should_stop()`` is true; returns the counters.
    See the module docstring for the delivery contract."""
    stats = stats if stats is not None else StageStats()
    while not should_stop():
        process_once(consumer, producer, fn, stage=stage, poll_timeout_s=poll_timeout_s,
                     max_records=max_records, stats=stats)
    return stats
