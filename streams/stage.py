"""The stage loop every stage uses: :func:`run_loop` drives turns with the hooks that
differ between stages (a readiness gate, what runs before each turn, periodic metrics,
an idle exit); :func:`process_once` is the turn of a consuming stage: consume ->
function -> produce -> flush -> commit.

Who uses what: the reward stage (a batch function), the reference stage (a per-record
function) and the aggregator (a per-record join plus an ``after`` hook that emits the
groups that are ready) run :func:`process_once` turns; the rollout stage's turn is
gated by its credit (its input is a prompt queue it fills only when it may start
groups); the trainer's input thread runs :meth:`SampleSource._read_once` turns. All of
them run under :func:`run_loop`.

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
import resource
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import pyarrow as pa

from relax.schemas import metric_names as M
from relax.streams.codec import encode
from relax.streams.consumer import BatchConsumer, Delivery
from relax.streams.errors import error_row
from relax.streams.producer import BatchProducer

log = logging.getLogger(__name__)

class Output(NamedTuple):
    """One output batch of a stage function: ``batch`` goes to ``topic`` (keyed by its
    schema's key column), as schema ``schema`` (default: the topic's) and to
    ``partition`` (default: by key). A plain ``(topic, batch)`` tuple also works."""

    topic: str
    batch: pa.RecordBatch | pa.Table
    schema: str | None = None
    partition: int | None = None


StageFn = Callable[[Delivery], Iterable[tuple]]
BatchFn = Callable[[list[Delivery]], Iterable[tuple]]


class RecordError(ValueError):
    """Raised by a stage function for a record it cannot process; the record goes to
    the error topic of its source. ``row`` is the bad row's index, when known."""

    def __init__(self, message: str, row: int | None = None):
        self.row = row
        super().__init__(message)


class StageConfigError(RuntimeError):
    """A stage cannot run as configured, and a restart would fail the same way (a reward
    function that fails its warm-up call, say): the controller fails the run at once
    instead of spending its restarts."""


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


def process_once(consumer: BatchConsumer, producer: BatchProducer, fn: StageFn | None = None,
                 *, stage: str, batch_fn: BatchFn | None = None,
                 after: Callable[[], None] | None = None, poll_timeout_s: float = 1.0,
                 max_records: int | None = None, stats: StageStats | None = None) -> int:
    """One turn of a consuming stage: poll, run the function, produce, flush, commit.

    Args:
        consumer, producer: the stage's.
        fn: per delivery -> outputs; a :class:`RecordError` routes that record to
            ``<topic>.errors`` and the turn goes on.
        stage: the stage's name in error rows.
        batch_fn: instead of ``fn``, every delivery of the poll at once -> outputs (a
            stage that scores a batch; its per-row failures are its own output rows).
        after: run every turn, after the function and before the flush, polled
            records or not (the aggregator emits the groups that are ready or timed out).
        poll_timeout_s, max_records: of the poll.
        stats: counters to add to.

    Returns:
        the number of deliveries processed (0 when the poll was empty).

    Raises:
        whatever ``fn``, ``batch_fn`` or ``after`` raise besides RecordError: nothing of
        this poll is committed (the delivery contract, module docstring).
    """
    if (fn is None) == (batch_fn is None):
        raise ValueError("process_once takes exactly one of fn and batch_fn")
    stats = stats if stats is not None else StageStats()
    deliveries = consumer.poll(poll_timeout_s, max_records)
    stats.polls += 1
    t0 = time.perf_counter()
    if deliveries:
        if batch_fn is not None:
            stats.messages += len(deliveries)
            stats.rows_in += sum(d.table.num_rows for d in deliveries)
            _send(producer, batch_fn(deliveries), stats)
        for d in deliveries if fn is not None else ():
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
            _send(producer, outputs, stats)
    if after is not None:
        after()
    if deliveries:
        stats.busy_s += time.perf_counter() - t0
    producer.flush()
    consumer.done(deliveries)
    if consumer.commit():  # errors routed during decode move the offset too
        stats.commits += 1
    return len(deliveries)


def _send(producer: BatchProducer, outputs: Iterable[tuple], stats: StageStats) -> None:
    for o in outputs:
        out = Output(*o)
        stats.rows_out += out.batch.num_rows
        producer.send(out.topic, out.batch, schema=out.schema, partition=out.partition)


BUSY_WINDOW_S = 5.0
"""Seconds between a stage loop's ``busy_frac`` rows."""


def memory_metrics() -> dict[str, float]:
    """This process's peak memory so far: ``peak_rss_mb`` (``getrusage``'s ``ru_maxrss``,
    kB on Linux, as MB of 10^6 bytes) and, where torch is imported and has initialised
    CUDA, ``gpu_peak_mb`` (``torch.cuda.max_memory_allocated``, MB). Never imports torch."""
    out = {M.PEAK_RSS_MB: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        out[M.GPU_PEAK_MB] = torch.cuda.max_memory_allocated() / 1e6
    return out


class BusyWindow:
    """A stage loop's busy fraction per window, written as metric ``busy_frac`` (the
    dashboard's stage timeline), with the process's :func:`memory_metrics`.

    Args:
        metrics: the stage's writer (rows are queued on its producer; the stage's next
            flush sends them).
        window_s: seconds per row.
        clock: monotonic seconds (tests give a fake one).
    """

    def __init__(self, metrics, window_s: float = BUSY_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        self.metrics, self.window_s, self.clock = metrics, window_s, clock
        self.start = clock()
        self.busy_s = 0.0

    def record(self, seconds: float, worked: bool) -> float | None:
        """Count one turn of ``seconds`` (busy when it ``worked``); at the end of a
        window write its busy fraction (in [0, 1]) and return it, else None."""
        if worked:
            self.busy_s += seconds
        now = self.clock()
        span = now - self.start
        if span < self.window_s:
            return None
        return self._write(span, now)

    def close(self) -> float | None:
        """Write the open window's busy fraction when the loop ends (a stage that ends,
        or lives less than one window, still shows on the timeline); None when no time
        passed since the last row."""
        now = self.clock()
        span = now - self.start
        return self._write(span, now) if span > 0 else None

    def _write(self, span: float, now: float) -> float:
        frac = min(1.0, self.busy_s / span)
        self.metrics.add(M.BUSY_FRAC, frac)
        self.metrics.add_many(memory_metrics())
        self.metrics.flush()
        self.start, self.busy_s = now, 0.0
        return frac


def run_loop(turn: Callable[[], int], should_stop: Callable[[], bool], *,
             ready: Callable[[], bool] | None = None, wait: Callable[[], None] | None = None,
             before: Callable[[], None] | None = None,
             periodic: Callable[[], None] | None = None, every_s: float = 10.0,
             exit_when_idle_s: float | None = None,
             idle_counts: Callable[[], bool] | None = None,
             done: Callable[[], bool] | None = None,
             busy: BusyWindow | None = None) -> None:
    """Run a stage's turns until ``should_stop()`` (or ``done()``, or idle too long).

    Each round: ``before()`` (e.g. follow new weights, surface a helper thread's error);
    then, if ``ready()`` is false (the readiness gate: no credit, weights behind),
    ``wait()`` (which must keep the consumer's group membership alive), else ``turn()``;
    then ``periodic()`` when ``every_s`` seconds passed since its last call; then
    ``done()`` (e.g. the prompts are exhausted) ends the loop.

    Args:
        turn: one turn; returns the work done (deliveries, groups), 0 when idle.
        should_stop: checked before every round.
        ready, wait: the readiness gate and what to do while it is closed.
        before, periodic, every_s: hooks (``every_s`` in seconds).
        exit_when_idle_s: end after this many seconds of turns that did no work (None
            or 0: never).
        idle_counts: whether a turn without work counts as idle now (default: always;
            the reward stage counts only while it owns partitions).
        done: ends the loop when true after a round.
        busy: the stage's :class:`BusyWindow` (turns that did work count as busy; the
            readiness wait and empty turns as idle; the open window is written when the
            loop ends, not when it raises).
    """
    idle_since: float | None = None
    last_periodic = time.monotonic()
    while not should_stop():
        if before is not None:
            before()
        t0 = busy.clock() if busy is not None else 0.0
        if ready is not None and not ready():
            if wait is not None:
                wait()
            n = 0
        else:
            n = turn()
        if busy is not None:
            busy.record(busy.clock() - t0, bool(n))
        now = time.monotonic()
        if periodic is not None and now - last_periodic >= every_s:
            periodic()
            last_periodic = now
        if n or (idle_counts is not None and not idle_counts()):
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif exit_when_idle_s and now - idle_since >= exit_when_idle_s:
            break
        if done is not None and done():
            break
    if busy is not None:
        busy.close()
