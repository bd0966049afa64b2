"""Stall detection: which stage of a run is alive but not moving, and why.

Two signals per stage, both read by the controller
(:class:`relax.infra.control.controller.Controller`):

* **loop age**: seconds since the stage last asked ``should_stop()``. Every stage loop
  asks once per turn (a poll, a generate call, a wait for data of at most a second), so
  a loop age over ``stall_timeout_s`` means the stage is stuck inside one call (a
  blocked socket, a deadlock, a GIL-holding spin); a stage whose process does not even
  answer the heartbeat counts the same, from its last answer. The clock starts at the
  first ``should_stop()``: building a model and joining a consumer group is start-up,
  not a stall.
* **input progress**: for stages that commit after every poll (rewards, reference,
  aggregate), the committed offsets of their consumer group over their input topics. A
  stage whose input has records it has not committed (lag > 0) and whose committed
  offsets did not move for ``stall_timeout_s`` is alive but not doing the work that waits
  for it. The rollout stage (waits for credit by design) and the trainer (commits only
  with checkpoints, waits for whole batches) are judged by loop age alone; a run in which
  no optimizer step happens for ``step_timeout_s`` fails with the stall report.

Pure bookkeeping here; the controller does the I/O and the restarts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relax.schemas import topics


def input_group(run: str, kind: str, name: str) -> tuple[str, list[str]] | None:
    """``(consumer group, input topics)`` of a stage judged by input progress, or None
    for kinds judged by loop age alone (rollout, trainer).

    Args:
        run: run name.
        kind: stage kind (``reward``, ``aggregate``, ``reference``, ...).
        name: stage name (``reward.<reward name>`` for rewards; ``reference`` or
            ``teacher`` for the reference kind).
    """
    rollouts = topics.run_topic(run, topics.ROLLOUTS)
    if kind == "reward":
        return topics.reward_group(run, name.split(".", 1)[1]), [rollouts]
    if kind == "reference":  # the reference or the teacher: its name is its role
        return topics.group(run, name), [rollouts]
    if kind == "aggregate":
        ins = [rollouts, topics.run_topic(run, topics.REWARDS)]
        return topics.group(run, "aggregate"), ins
    return None


@dataclass
class StageWatch:
    """What the controller last saw of one stage.

    Attributes:
        since: monotonic seconds when ``committed`` last changed (or watching began).
        committed: ``{(topic, partition): committed offset}`` at ``since``.
        lag: records of its inputs not yet committed, at the last look.
    """

    since: float
    committed: dict = field(default_factory=dict)
    lag: int = 0


def input_stalled(w: StageWatch, committed: dict, lag: int, now: float, timeout_s: float) -> bool:
    """Update ``w`` with a new look at a stage's consumer group and say whether it is
    stalled: input waiting (``lag > 0``) and no commit for ``timeout_s`` seconds.

    Args:
        w: the stage's watch (updated in place).
        committed: ``{(topic, partition): committed offset}`` now.
        lag: uncommitted input records now.
        now: monotonic seconds.
        timeout_s: stall limit (seconds).
    """
    if committed != w.committed or lag == 0:
        w.since, w.committed = now, dict(committed)
    w.lag = lag
    return lag > 0 and now - w.since > timeout_s


def loop_stalled(answered: bool, loop_age_s: float | None, unanswered_s: float,
                 timeout_s: float) -> str | None:
    """Why a stage counts as hung by its heartbeat, or None.

    Args:
        answered: the heartbeat answered this time.
        loop_age_s: seconds since the stage last asked ``should_stop()``; None while it
            is still starting (building its model and clients: not judged here, a run
            whose stage never starts fails by ``step_timeout_s``).
        unanswered_s: seconds since the heartbeat last answered.
        timeout_s: stall limit (seconds).
    """
    if not answered:
        if unanswered_s > timeout_s:
            return f"its process has not answered a heartbeat for {unanswered_s:.0f}s"
        return None
    if loop_age_s is not None and loop_age_s > timeout_s:
        return f"its loop has been inside one call for {loop_age_s:.0f}s"
    return None


def broker_state_lost(seen_records: int | None, records_now: int | None) -> bool:
    """Whether the broker lost the run's topics since the last look: the metrics topic
    (only ever appended to) holds fewer records than were seen, or is gone (None). Kafka
    keeps its log on disk, so a restart of it never trips this; a broker that comes back
    without its data (a new folder, lost disks) does.

    Args:
        seen_records: records of ``<run>.metrics`` at the last look (None: never seen).
        records_now: records now (None: the topic does not exist).
    """
    if seen_records is None:
        return False
    return records_now is None or records_now < seen_records
