"""Which rewards count for a group, and with what weight, in a run whose rewards change
while it trains.

A run starts with the recipe's counted rewards (``advantage.rewards``: name -> weight).
``relax reward attach NAME --weight W`` and ``relax reward detach NAME`` announce a
:class:`RewardChange` on ``<run>.reward_changes`` that counts from a policy_version on:
two past the latest announced when it was written (the next one may be announced, and
sampled, while the change is being written); the aggregator reads the topic to its end
before it decides a group of a newer version than it last read it for. A group counts
the rewards of the plan at its **group policy_version**, the smallest
``policy_version_start`` of its rollouts:

* a group sampled (even partly) before the announcement has a smaller version and keeps
  the rewards it started with: it is never left waiting for a reward that will not
  score it, and never re-weighed;
* a group sampled after it waits for the new reward (attach) or no longer waits for
  the old one (detach).

The decision depends only on the announced changes and the rollouts' versions, not on
when the aggregator read them, so a restarted aggregator that replays its changelog
decides every group the same way. Pure logic, no I/O (the bus side is
:mod:`relax.consumers.reward.changes`).
"""

from __future__ import annotations

from dataclasses import dataclass

ATTACH = "attach"
DETACH = "detach"
ACTIONS = (ATTACH, DETACH)


@dataclass(frozen=True)
class RewardChange:
    """One announced change (a row of schema ``reward_changes``).

    Attributes:
        action: ``attach`` (count ``reward_name`` with ``weight``; a counted name gets the
            new weight) or ``detach`` (stop counting it).
        reward_name: the ``reward_name`` its scores carry on ``<run>.rewards``.
        weight: weight in the final reward (0.0 for detach).
        from_policy_version: groups with group policy_version >= this use the change.
    """

    action: str
    reward_name: str
    weight: float
    from_policy_version: int

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"reward change action {self.action!r}: expected one of "
                             f"{', '.join(ACTIONS)}")
        if self.from_policy_version < 0:
            raise ValueError(f"reward change from_policy_version {self.from_policy_version}: "
                             "expected >= 0")

    @classmethod
    def from_row(cls, row: dict) -> "RewardChange":
        """From a decoded ``reward_changes`` row (extra fields such as ``ts`` ignored)."""
        return cls(row["action"], row["reward_name"], float(row["weight"]),
                   int(row["from_policy_version"]))


class RewardPlan:
    """The counted rewards as a function of the group policy_version.

    Args:
        base: the recipe's counted rewards (name -> weight); must not be empty.

    Raises:
        ValueError: ``base`` is empty.
    """

    def __init__(self, base: dict[str, float]):
        if not base:
            raise ValueError("a reward plan needs at least one counted reward")
        self.base = dict(base)
        self.changes: list[RewardChange] = []

    def at(self, policy_version: int) -> dict[str, float]:
        """The counted rewards (name -> weight) of a group with this group policy_version:
        the base, then every change with ``from_policy_version <= policy_version`` in
        announcement order."""
        out = dict(self.base)
        for c in self.changes:
            if c.from_policy_version <= policy_version:
                if c.action == ATTACH:
                    out[c.reward_name] = c.weight
                else:
                    out.pop(c.reward_name, None)
        return out

    def names(self) -> set[str]:
        """Every reward name any version of the plan counts."""
        return set(self.base) | {c.reward_name for c in self.changes if c.action == ATTACH}

    def apply(self, change: RewardChange) -> str | None:
        """Add ``change`` at the end. Returns None when applied, or why it was refused
        (a detach of a name not counted at its version, or one that would leave a group
        with no counted reward); a refused change is not applied."""
        if change.action == DETACH and change.reward_name not in self.at(change.from_policy_version):
            return (f"detach {change.reward_name!r} from policy_version "
                    f"{change.from_policy_version}: it is not counted there")
        self.changes.append(change)
        versions = {change.from_policy_version} | {c.from_policy_version for c in self.changes
                                                   if c.from_policy_version > change.from_policy_version}
        if any(not self.at(v) for v in versions):
            self.changes.pop()
            return (f"detach {change.reward_name!r} from policy_version "
                    f"{change.from_policy_version}: no counted reward would be left")
        return None


def group_policy_version(policy_version_starts: list[int]) -> int:
    """A group's policy_version for the plan: the smallest ``policy_version_start`` of its
    rollouts (a group sampled partly before a change keeps the old rewards).

    Raises:
        ValueError: no rollouts.
    """
    if not policy_version_starts:
        raise ValueError("a group without rollouts has no policy_version")
    return min(policy_version_starts)
