"""The stage contract: a stage declares what it reads and writes, and :func:`run_stage`
wires it.

A stage (a subclass of :class:`Stage`) says:

* ``config_type``: the class of its config (what a user sets; never the bus);
* :meth:`Stage.declare`: its :class:`Declaration`: the run, its metrics component and
  producer id, its :class:`Input` (topics, consumer group name, from-beginning or not,
  the rebalance hooks it needs) and its :class:`OutTopic` list (partition counts; every
  input topic's ``.errors`` topic is an error output of the stage);
* :meth:`Stage.build`: make its engine, function or state given the :class:`Wiring`
  (bus, producer, consumer, metrics writer);
* :meth:`Stage.turn`: one turn (:func:`relax.streams.stage.process_once` for a consuming
  stage); :meth:`Stage.hooks` the hooks of :func:`relax.streams.stage.run_loop` it needs
  (readiness gate, wait, periodic metrics, ...); :meth:`Stage.finish` what it writes at a
  normal end; :meth:`Stage.close` closing what ``build`` made (a weight subscriber, a
  worker pool, a follower).

:func:`run_stage` owns the rest, the same for every stage: create the declared topics,
the :class:`~relax.streams.producer.BatchProducer`, the
:class:`~relax.streams.consumer.BatchConsumer` (its error producer is the stage's
producer), the :class:`~relax.streams.metrics.MetricsWriter`, the
:class:`~relax.streams.stage.BusyWindow`, the periodic flush, the final flush and commit,
and the clean-up in one ``finally``. The delivery contract is
:mod:`relax.streams.stage`'s (at-least-once; outputs flushed before the input offsets
commit; a :class:`~relax.streams.stage.RecordError` sends its record to
``<topic>.errors``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from relax.schemas.topics import errors_topic
from relax.streams.client import BusConfig, ensure_topics, topic_partitions
from relax.streams.consumer import BatchConsumer
from relax.streams.metrics import MetricsWriter
from relax.streams.producer import BatchProducer
from relax.streams.stage import BusyWindow, run_loop


@dataclass(frozen=True)
class Input:
    """What a stage reads.

    Attributes:
        topics: the input topics (the first is the one co-partitioned outputs follow).
        group: the consumer group id (``relax.schemas.topics.group`` and friends).
        stage: the stage's name in error rows and the consumer's log lines.
        from_beginning: where a new consumer group starts (earliest or latest).
        must_exist: the first topic must exist before the stage starts (a stage attached
            to a run); else ValueError naming it.
        partitions: create the input topics that are missing with this many partitions
            (an existing one must have as many); None: create none.
        on_assign, on_revoke: called with the ``TopicPartition`` s on a rebalance (on the
            consumer's I/O thread).
    """

    topics: tuple[str, ...]
    group: str
    stage: str
    from_beginning: bool = True
    must_exist: bool = False
    partitions: int | None = None
    on_assign: Callable[[Any], None] | None = None
    on_revoke: Callable[[Any], None] | None = None


@dataclass(frozen=True)
class OutTopic:
    """A topic a stage writes, created if missing.

    Attributes:
        topic: its name.
        partitions: its partition count; None: as many as the first input topic has
            (co-partitioned, keyed by group_id).
        strict: an existing topic with another count is a ValueError (co-partitioned
            topics always are); False: an existing topic is left as it is.
    """

    topic: str
    partitions: int | None = None
    strict: bool = True


@dataclass(frozen=True)
class Declaration:
    """A stage's wiring, as data: ``run``, the metrics ``component``, the producer's
    ``producer_id``, its :class:`Input` (None: a stage that reads no topic with a
    consumer group, e.g. the eval stage, fed by the weight channel) and its
    :class:`OutTopic` s."""

    run: str
    component: str
    producer_id: str
    input: Input | None
    outputs: tuple[OutTopic, ...] = ()

    def error_topics(self) -> list[str]:
        """The stage's error outputs: ``<topic>.errors`` of every input topic."""
        return [errors_topic(t) for t in self.input.topics] if self.input else []


@dataclass(frozen=True)
class Hooks:
    """The :func:`relax.streams.stage.run_loop` hooks a stage needs (None: not used).
    ``periodic`` is followed by a flush of the producer."""

    ready: Callable[[], bool] | None = None
    wait: Callable[[], None] | None = None
    before: Callable[[], None] | None = None
    periodic: Callable[[], None] | None = None
    every_s: float = 10.0
    exit_when_idle_s: float | None = None
    idle_counts: Callable[[], bool] | None = None
    done: Callable[[], bool] | None = None


@dataclass
class Wiring:
    """What :func:`run_stage` made for a stage: its bus, producer, consumer (None when it
    declares no input) and metrics writer (all closed by the contract, not the stage)."""

    bus: BusConfig
    producer: BatchProducer
    consumer: BatchConsumer | None
    metrics: MetricsWriter


class Stage:
    """Base of a stage on the contract (module docstring). A subclass sets
    ``kind`` and ``config_type``, takes ``(cfg, bus)`` and implements :meth:`declare`,
    :meth:`build` and :meth:`turn`; the other methods are optional."""

    kind: ClassVar[str] = ""
    """The stage kind: the controller's name for it (``relax.infra.control.runners``)."""
    config_type: ClassVar[type] = object
    """The class of the stage's config."""
    commit_at_end: ClassVar[bool] = True
    """Commit the consumer's offsets at the end of :func:`run_stage` (the trainer's commit
    with its checkpoints instead: an offset past its newest checkpoint would skip records
    its restored ledger does not hold)."""
    busy_window: ClassVar[bool] = True
    """Write ``busy_frac`` per window from the turns (the trainer writes its own per step,
    from its wait for data inside the turn)."""

    bus: BusConfig
    stats: Any = None
    should_stop: Callable[[], bool] = staticmethod(lambda: False)
    """The run's stop signal, set by :func:`run_stage` before :meth:`build`, for a turn
    that blocks (the trainer's wait for a batch)."""

    def declare(self) -> Declaration:
        """The stage's topics, group and names (:class:`Declaration`)."""
        raise NotImplementedError

    def build(self, w: Wiring) -> None:
        """Make what the turn needs, given the wiring (before the first turn)."""

    def turn(self) -> int:
        """One turn; returns the work done (0 when idle)."""
        raise NotImplementedError

    def hooks(self) -> Hooks:
        """The loop hooks the stage needs (default: none)."""
        return Hooks()

    def finish(self) -> None:
        """At a normal end, before the final flush and commit (e.g. last metrics)."""

    def close(self) -> None:
        """Close what :meth:`build` made (runs before the consumer and producer close,
        also when the stage raised)."""


def ensure_declared_topics(bus: BusConfig, d: Declaration) -> None:
    """Create the topics ``d`` declares that are missing: the inputs (when
    ``d.input.partitions`` is set), the outputs, the error topics of the inputs (1
    partition each).

    Raises:
        ValueError: ``d.input.must_exist`` and the first input topic is missing (names
            the run and the topic); a co-partitioned or strict output (or a created input)
            exists with another partition count.
    """
    inputs = list(d.input.topics) if d.input else []
    first = inputs[0] if inputs else None
    names = inputs + [o.topic for o in d.outputs] + d.error_topics()
    have = topic_partitions(bus, names)
    if d.input and d.input.must_exist and not have.get(first):
        raise ValueError(f"run {d.run!r} has no topic {first!r}: is the run name right, "
                         f"and has the run started?")
    want: dict[str, int] = {}
    if d.input and d.input.partitions is not None:
        want.update({t: d.input.partitions for t in d.input.topics})
    for o in d.outputs:
        n = o.partitions if o.partitions is not None else (
            have.get(first) or (d.input.partitions if d.input else None))
        if n is None:
            raise ValueError(f"{o.topic!r} is co-partitioned with {first!r}, which does not exist")
        if o.strict or o.partitions is None or not have.get(o.topic):
            want[o.topic] = n
    want.update({t: 1 for t in d.error_topics() if not have.get(t)})
    ensure_topics(bus, want)


@contextmanager
def wired(stage: Stage) -> Iterator[Wiring]:
    """The stage's topics, producer, consumer and metrics writer, built into the stage
    (:meth:`Stage.build`); on exit, the stage's own clean-up, then the consumer (no
    commit beyond what was flushed) and the producer: the one ``finally`` of a stage.

    Raises:
        ValueError: the stage was made without a bus.
        whatever :func:`ensure_declared_topics` or :meth:`Stage.build` raise.
    """
    d = stage.declare()
    bus = stage.bus
    if bus is None:
        raise ValueError(f"{type(stage).__name__} {d.component!r} was made without a bus: "
                         f"pass the BusConfig to its constructor to run it")
    ensure_declared_topics(bus, d)
    producer = BatchProducer(bus, producer_id=d.producer_id)
    consumer = None
    try:
        metrics = MetricsWriter(producer, d.run, d.component)
        i = d.input
        if i is not None:
            consumer = BatchConsumer(bus, i.group, list(i.topics), stage=i.stage,
                                     from_beginning=i.from_beginning, error_producer=producer,
                                     on_assign=i.on_assign, on_revoke=i.on_revoke,
                                     metrics=metrics)
        w = Wiring(bus, producer, consumer, metrics)
        stage.build(w)
        yield w
    finally:
        try:
            stage.close()
        finally:
            if consumer is not None:
                consumer.close()
            producer.close()


def run_stage(stage: Stage, should_stop: Callable[[], bool] = lambda: False) -> Any:
    """Run ``stage`` until ``should_stop()`` (or its hooks end it): wire it
    (:func:`wired`), run its turns under :func:`relax.streams.stage.run_loop` with its
    hooks and a :class:`~relax.streams.stage.BusyWindow` (``busy_frac``), flush the
    producer after each ``periodic`` hook; at a normal end :meth:`Stage.finish`, flush
    the metrics and the producer, commit (unless :attr:`Stage.commit_at_end` is False);
    close everything whatever happened.

    Returns:
        ``stage.stats`` (the stage's counters).

    Raises:
        whatever the stage raises (nothing after the failed turn is committed).
    """
    stage.should_stop = should_stop
    with wired(stage) as w:
        h = stage.hooks()
        periodic = None
        if h.periodic is not None:
            def periodic() -> None:
                h.periodic()
                w.producer.flush()
        run_loop(stage.turn, should_stop, ready=h.ready, wait=h.wait, before=h.before,
                 periodic=periodic, every_s=h.every_s, exit_when_idle_s=h.exit_when_idle_s,
                 idle_counts=h.idle_counts, done=h.done,
                 busy=BusyWindow(w.metrics) if stage.busy_window else None)
        stage.finish()
        w.metrics.flush()
        w.producer.flush()
        if stage.commit_at_end and w.consumer is not None:
            w.consumer.commit()
    return stage.stats
