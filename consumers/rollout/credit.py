"""The rollout stage's credit: how many groups an instance may start, how many of its
groups are in flight, and how fresh the weights of a new group must be.

Pure functions of plain numbers (no Kafka, no engine, no stage); counts are whole
groups (one prompt sampled ``group_size`` times), versions are trainer
policy_versions. The stage (:class:`relax.consumers.rollout.stage.RolloutStage`) reads
its inputs from the bus and calls these.

Sources of the formulas:

* the staleness budget ``B = (max_staleness + 1) * batch_groups``: docs/architecture.md
  section 4, :func:`relax.schemas.versions.in_flight_budget`;
* the credit from the trainer's progress (``consumed + min(B, needed)``): docs/design-notes.md,
  "Rollout credit from the trainer's progress";
* the groups a restarted instance inherits: docs/design-notes.md, "A restarted rollout
  instance inherits its predecessor's groups in flight";
* the split over instances and the weights a new group needs: the package docstring
  (:mod:`relax.consumers.rollout`, "Staleness budget" and "Weights").
"""

from __future__ import annotations

from relax.schemas.versions import in_flight_budget


def share(total: int, instance_index: int = 0, num_instances: int = 1) -> int:
    """Instance ``instance_index``'s part of ``total`` split over ``num_instances``
    (near-equal parts that sum to ``total``)."""
    return (total + num_instances - 1 - instance_index) // num_instances


def instance_budget(
    trainer_version: int,
    base_version: int,
    max_staleness: int,
    batch_groups: int,
    instance_index: int = 0,
    num_instances: int = 1,
    groups_consumed: int | None = None,
    groups_needed: int | None = None,
) -> int:
    """Groups instance ``instance_index`` may have started in all (since it started).

    ``consumed`` = groups the trainer decided since then: ``groups_consumed`` (trained or
    dropped, from ``<run>.progress``) when known, else ``batch_groups`` per
    policy_version since ``base_version`` (a trainer that reports no progress). The run
    may have ``consumed + min(B, needed)`` groups started,
    ``B = in_flight_budget(max_staleness, batch_groups)`` and ``needed``
    the groups the trainer still needs (unlimited when unknown); this instance gets its
    :func:`share` of that (see :mod:`relax.consumers.rollout`, "Staleness budget").

    Raises:
        ValueError: ``max_staleness < 0`` or ``batch_groups < 1`` (from
            :func:`relax.schemas.versions.in_flight_budget`).
    """
    if groups_consumed is not None:
        # the trainer's own count, paired with the ``needed`` of the same report: mixing
        # it with a count inferred from a newer policy_version would let the stage start
        # groups the run never trains
        consumed = groups_consumed
    else:
        consumed = max(0, trainer_version - base_version) * batch_groups
    cap = in_flight_budget(max_staleness, batch_groups)
    if groups_needed is not None:
        cap = min(cap, max(0, groups_needed))
    return share(consumed + cap, instance_index, num_instances)


def consumed_since(groups_consumed: int | None, consumed_at_start: int) -> int | None:
    """Groups the trainer decided since the stage started: its latest ``groups_consumed``
    report less the one it had written when the stage started (``consumed_at_start``,
    0 when none), never below 0 (a trainer restarted from an older checkpoint reports
    a lower count). None while the trainer has reported nothing."""
    if groups_consumed is None:
        return None
    return max(0, groups_consumed - consumed_at_start)


def credit_left(
    trainer_version: int,
    base_version: int,
    max_staleness: int,
    batch_groups: int,
    groups_started: int,
    instance_index: int = 0,
    num_instances: int = 1,
    groups_consumed: int | None = None,
    groups_needed: int | None = None,
) -> int:
    """Groups instance ``instance_index`` may still start now: its
    :func:`instance_budget` less the ``groups_started`` it counts (its own since it
    started, plus :func:`inherited_in_flight`). 0 or less: wait for the trainer.

    Raises:
        ValueError: as :func:`instance_budget`.
    """
    allowed = instance_budget(
        trainer_version,
        base_version,
        max_staleness,
        batch_groups,
        instance_index,
        num_instances,
        groups_consumed=groups_consumed,
        groups_needed=groups_needed,
    )
    return allowed - groups_started


def groups_per_call(credit: int, groups_per_generate: int) -> int:
    """Groups to take from the prompt queue for one engine call: at most
    ``groups_per_generate``, and no more than the ``credit`` left (called with
    ``credit > 0``)."""
    return min(credit, groups_per_generate)


def groups_in_flight(
    trainer_version: int,
    base_version: int,
    batch_groups: int,
    groups_started: int,
    instance_index: int = 0,
    num_instances: int = 1,
    groups_consumed: int | None = None,
) -> int:
    """Groups instance ``instance_index`` started that the trainer has not decided yet
    (its :func:`share` of the decided ones), never below 0.

    Unlike :func:`instance_budget`, ``consumed`` here is the larger of ``batch_groups``
    per policy_version since ``base_version`` and ``groups_consumed`` (None = 0)."""
    consumed = max(0, trainer_version - base_version)
    consumed *= batch_groups
    consumed = max(consumed, groups_consumed or 0)
    mine = share(consumed, instance_index, num_instances)
    return max(0, groups_started - mine)


def inherited_in_flight(
    started_total: int,
    consumed_at_start: int,
    instance_index: int = 0,
    num_instances: int = 1,
) -> int:
    """Groups a (re)started instance counts as started when it starts: its
    :func:`share` of what every instance of the run started in all (``started_total``,
    from ``<run>.rollout_state``) less the groups the trainer had decided then
    (``consumed_at_start``), never below 0. They hold credit as if this instance had
    started them: exact for one instance; with several, the instances together count
    at least the groups really in flight (the others count their own as well), so an
    instance removed by a scale-in leaves no group uncounted."""
    return share(max(0, started_total - consumed_at_start), instance_index, num_instances)


def oldest_usable_version(
    announced_version: int | None,
    reported_version: int | None,
    groups_in_flight: int,
    batch_groups: int,
    max_staleness: int,
    num_instances: int = 1,
) -> int | None:
    """The oldest policy_version a group started now may be sampled with.

    The trainer's version is the newer of ``announced_version`` (``<run>.weights``) and
    ``reported_version`` (the policy_version of its ``groups_consumed`` report). A group
    started now is consumed ``groups_in_flight * num_instances // batch_groups`` steps
    later (the groups already in flight go first; ``groups_in_flight`` is this
    instance's, taken as every instance's), and must then have staleness <=
    ``max_staleness``. None when both versions are unknown."""
    versions = [v for v in (announced_version, reported_version) if v is not None]
    if not versions:
        return None
    ahead = groups_in_flight * num_instances // batch_groups
    return max(versions) + ahead - max_staleness
