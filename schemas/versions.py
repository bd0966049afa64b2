"""policy_version and staleness, defined once (docs/architecture.md, section 4).

* ``policy_version`` = the number of optimizer steps applied to the weights
  (0 = the initial model). The trainer after its k-th step holds version k.
* A rollout records ``policy_version_start`` (weights at its first sampled
  token) and ``policy_version_end`` (at its last); with partial rollouts, the
  version of every token.
* ``off_policy_steps`` = weight updates that happened while it was generated
  (``end - start``), one per update, never two (public case C25).
* ``staleness`` = trainer version when the sample is consumed minus the oldest
  version that generated any of its tokens. Time spent queued counts (C27).
* A sample is admitted iff ``staleness <= max_staleness``; ``max_staleness = 0``
  is strictly on-policy (sync mode), so a rollout that spans an update is never
  admitted then (C25: the bound is inclusive and exact).

Pure Python, no torch: imported by every stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _check_version(name: str, v: int) -> None:
    if v < 0:
        raise ValueError(f"{name} must be a policy_version >= 0, got {v}")


def off_policy_steps(policy_version_start: int, policy_version_end: int) -> int:
    """Weight updates that happened while one rollout was being generated.

    Raises:
        ValueError: if a version is negative or ``end < start``.
    """
    _check_version("policy_version_start", policy_version_start)
    if policy_version_end < policy_version_start:
        raise ValueError(f"policy_version_end {policy_version_end} < policy_version_start "
                         f"{policy_version_start}")
    return policy_version_end - policy_version_start


def oldest_version(policy_version_start: int,
                   token_policy_versions: Sequence[int] | None = None) -> int:
    """The oldest policy_version that produced any token of a sample: the minimum of
    ``policy_version_start`` and the per-token versions (partial rollouts)."""
    if token_policy_versions:
        return min(policy_version_start, min(token_policy_versions))
    return policy_version_start


def staleness(trainer_version: int, policy_version_start: int,
              token_policy_versions: Sequence[int] | None = None) -> int:
    """Staleness of a sample consumed by the trainer at ``trainer_version``.

    ``trainer_version - oldest_version(...)``, so the time a sample waited in the
    queue counts (public case C27: generated under v5, consumed at v8 -> 3).

    Raises:
        ValueError: if the sample claims a version newer than the trainer's (a
            sample from the future means two runs share a topic or a bug).
    """
    _check_version("trainer_version", trainer_version)
    oldest = oldest_version(policy_version_start, token_policy_versions)
    _check_version("policy_version_start", oldest)
    if oldest > trainer_version:
        raise ValueError(f"sample policy_version {oldest} is newer than the trainer's "
                         f"{trainer_version}")
    return trainer_version - oldest


@dataclass(frozen=True, slots=True)
class Admission:
    """Outcome of :func:`admit`: ``admitted`` and the measured ``staleness``."""

    admitted: bool
    staleness: int
    reason: str | None = None


def admit(trainer_version: int, policy_version_start: int, policy_version_end: int,
          max_staleness: int, token_policy_versions: Sequence[int] | None = None) -> Admission:
    """Decide whether the trainer at ``trainer_version`` may train on a sample.

    Admit iff ``staleness <= max_staleness`` (inclusive). Since the trainer's
    version is at least ``policy_version_end``, staleness >= off_policy_steps, so
    with ``max_staleness = 0`` a sample that spans a weight update is rejected.

    Raises:
        ValueError: for negative versions, ``end < start``, ``end > trainer_version``
            or ``max_staleness < 0``.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    off_policy_steps(policy_version_start, policy_version_end)
    if policy_version_end > trainer_version:
        raise ValueError(f"policy_version_end {policy_version_end} is newer than the trainer's "
                         f"{trainer_version}")
    s = staleness(trainer_version, policy_version_start, token_policy_versions)
    if s <= max_staleness:
        return Admission(True, s)
    return Admission(False, s, f"staleness {s} > max_staleness {max_staleness}")


DEFAULT_BATCH_GROUPS = 2
"""Groups the trainer consumes per step where a config does not say (the rollout's and
the trainer's configs share it; a recipe sets both from its ``batch_groups``)."""


def in_flight_budget(max_staleness: int, batch_groups: int) -> int:
    """Most groups the rollout stage may have in flight (sampled or being sampled but
    not yet trained): ``(max_staleness + 1) * batch_groups`` (docs/architecture.md, section 4)."""
    if max_staleness < 0 or batch_groups < 1:
        raise ValueError(f"need max_staleness >= 0 and batch_groups >= 1, got "
                         f"{max_staleness}, {batch_groups}")
    return (max_staleness + 1) * batch_groups


def admit_batch(trainer_version: int, policy_version_start: Sequence[int],
                policy_version_end: Sequence[int], max_staleness: int,
                token_policy_versions: Sequence[Sequence[int] | None] | None = None,
                ) -> list[Admission]:
    """:func:`admit` for every row of a batch (e.g. the ``policy_version_start`` /
    ``policy_version_end`` / ``token_policy_versions`` columns of ``train_samples``
    as Python lists), with the same rule and the same errors.

    Raises:
        ValueError: if the columns differ in length, or as :func:`admit` for any row.
    """
    n = len(policy_version_start)
    tokens = [None] * n if token_policy_versions is None else token_policy_versions
    if len(policy_version_end) != n or len(tokens) != n:
        raise ValueError(f"columns differ in length: {n} starts, {len(policy_version_end)} ends, "
                         f"{len(tokens)} token_policy_versions")
    return [admit(trainer_version, s, e, max_staleness, t)
            for s, e, t in zip(policy_version_start, policy_version_end, tokens, strict=True)]
