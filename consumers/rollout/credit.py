"""The rollout stage's credit: how many groups the run may have started, which groups a
claim on the shared claim log is granted, and how fresh the weights of a new group
must be.

Pure functions and one small state machine (:class:`ClaimLedger`) over plain numbers
and group_ids (no Kafka, no engine, no stage); counts are whole groups (one prompt
sampled ``group_size`` times), versions are trainer policy_versions. The stage
(:class:`relax.consumers.rollout.stage.RolloutStage`) reads their inputs from the bus
(:mod:`relax.consumers.rollout.claims` for the claim log).

Sources of the formulas:

* the staleness budget ``B = (max_staleness + 1) * batch_groups``: docs/architecture.md
  section 4, :func:`relax.schemas.versions.in_flight_budget`;
* the run's allowance from the trainer's progress (``consumed + min(B, needed)``):
  docs/design-notes.md, "Rollout credit from the trainer's progress";
* one credit for every instance, granted in the order of a shared log: docs/design-notes.md,
  "Dynamic credit: claims on one ordered log".
"""

from __future__ import annotations

from collections.abc import Sequence

from relax.schemas.versions import in_flight_budget


def groups_decided(trainer_version: int, batch_groups: int, groups_consumed: int | None) -> int:
    """Groups the trainer decided (trained or dropped) since the run began: its own
    ``groups_consumed`` report from ``<run>.progress`` when there is one, else
    ``batch_groups`` per policy_version (a trainer that reported nothing yet)."""
    if groups_consumed is not None:
        return max(0, groups_consumed)
    return max(0, trainer_version) * batch_groups


def run_allowance(
    trainer_version: int,
    max_staleness: int,
    batch_groups: int,
    groups_consumed: int | None = None,
    groups_needed: int | None = None,
) -> int:
    """Groups the whole run may have started since it began, every rollout instance
    together: ``consumed + min(B, needed)`` with ``consumed`` from
    :func:`groups_decided`, ``B = in_flight_budget(max_staleness, batch_groups)`` and
    ``needed`` the groups the trainer still needs (unlimited when unknown).

    ``groups_consumed`` is paired with the ``groups_needed`` of the same report: mixing
    it with a count inferred from a newer policy_version would let the run start groups
    it never trains.

    Raises:
        ValueError: ``max_staleness < 0`` or ``batch_groups < 1`` (from
            :func:`relax.schemas.versions.in_flight_budget`).
    """
    cap = in_flight_budget(max_staleness, batch_groups)
    if groups_needed is not None:
        cap = min(cap, max(0, groups_needed))
    return groups_decided(trainer_version, batch_groups, groups_consumed) + cap


def credit_left(allowance: int, granted: int) -> int:
    """Groups any instance may still claim now: the run's :func:`run_allowance` less the
    groups granted so far on the claim log (``granted``). 0 or less: wait for the
    trainer."""
    return allowance - granted


def groups_in_flight(granted: int, decided: int) -> int:
    """Groups granted (started by some instance) that the trainer has not decided yet,
    never below 0 (``decided`` from :func:`groups_decided`)."""
    return max(0, granted - decided)


def groups_per_call(credit: int, groups_per_generate: int) -> int:
    """Groups to take from the prompt queue for one engine call: at most
    ``groups_per_generate``, and no more than the ``credit`` left (called with
    ``credit > 0``)."""
    return min(credit, groups_per_generate)


class ClaimLedger:
    """The run's granted groups, rebuilt by every reader of the claim log in log order.

    A claim asks for some group_ids under the claimant's view of the run's allowance
    (:func:`run_allowance`). :meth:`apply` grants, in the claim's order, the group_ids not
    granted before while the granted count stays within that allowance; a group_id
    granted before is granted again for free (a prompt delivered again after a crash or
    a rebalance: the same group, counted once). Every reader applies the same claims in
    the same order, so every instance agrees on every grant without talking to the
    others, and a restarted one rebuilds the same ledger from the log.

    Attributes:
        granted: every group_id granted so far.
    """

    def __init__(self) -> None:
        self.granted: set[str] = set()

    @property
    def count(self) -> int:
        """Groups granted so far (distinct group_ids)."""
        return len(self.granted)

    def apply(self, group_ids: Sequence[str], allowance: int) -> list[str]:
        """Apply one claim; returns the group_ids of ``group_ids`` it holds after the
        claim (granted now or before), in claim order."""
        room = allowance - len(self.granted)
        for g in group_ids:
            if g in self.granted:
                continue
            if room <= 0:
                break
            self.granted.add(g)
            room -= 1
        return [g for g in group_ids if g in self.granted]


def oldest_usable_version(
    announced_version: int | None,
    reported_version: int | None,
    groups_in_flight: int,
    batch_groups: int,
    max_staleness: int,
) -> int | None:
    """The oldest policy_version a group started now may be sampled with.

    The trainer's version is the newer of ``announced_version`` (``<run>.weights``) and
    ``reported_version`` (the policy_version of its ``groups_consumed`` report). A group
    started now is consumed ``groups_in_flight // batch_groups`` steps later (the run's
    groups already in flight go first), and must then have staleness <=
    ``max_staleness``. None when both versions are unknown."""
    versions = [v for v in (announced_version, reported_version) if v is not None]
    if not versions:
        return None
    return max(versions) + groups_in_flight // batch_groups - max_staleness


def report_lags(announced_version: int | None, reported_version: int | None) -> bool:
    """Whether the trainer announced a policy_version (``<run>.weights``) that its latest
    progress report (``<run>.progress``) has not reached. The trainer writes the report
    right after the announcement; until it arrives, the groups that step consumed still
    count as in flight, so :func:`oldest_usable_version` is a step too new and a rollout
    would wait for weights the trainer is not about to send."""
    return (announced_version is not None and reported_version is not None
            and reported_version < announced_version)
