"""The trainer's data-wait that the staleness bound alone forces, with perfect hand-offs.

With ``max_staleness`` s, step j's batch is consumed at the trainer's policy_version
j-1 and must have staleness <= s (``schemas.versions.admit``), so it is sampled with
weights of version >= j-1-s, which exist only once step j-1-s has ended. One rollout
makes one batch in ``gen_s`` seconds, one batch after another. So the trainer waits
whenever the steps since the weights of its next batch were published took less time
than that batch's generation, even if publishing, sending, the bus and the stages cost
nothing. That wait is a floor under ``data_wait_pct`` that no framework can go below
at this staleness, on these training times and this generation time.

Source: the staleness rule of docs/architecture.md, section 4 (the same one that sets
the rollout's credit and the oldest weights a group may start with,
``consumers.rollout.credit.oldest_usable_version``).
"""

from __future__ import annotations

from collections.abc import Sequence


def data_wait_floor(own_s: Sequence[float], gen_s: float, max_staleness: int) -> list[float]:
    """Each step's data-wait (seconds) with perfect hand-offs.

    Step 1's batch and the next ``max_staleness`` ones are sampled with version 0
    weights before step 1 ends (start-up), so steps 1..s+1 wait 0 here. Batch j > s+1
    starts when both the rollout is done with batch j-1 and step j-1-s has ended; step j
    starts when step j-1 has ended and batch j is done.

    Args:
        own_s: ``[N]`` float seconds each step kept the trainer busy (its step time less
            its data-wait), steps 1..N in order.
        gen_s: seconds one batch takes to generate and score (e.g. the one-thread loop's
            generation time per step, measured with the other core busy).
        max_staleness: the run's ``trainer.max_staleness`` (s >= 0).

    Returns:
        ``[N]`` float seconds: the wait before each step.

    Raises:
        ValueError: ``max_staleness < 0``, ``gen_s < 0`` or a negative ``own_s``.
    """
    if max_staleness < 0 or gen_s < 0 or any(t < 0 for t in own_s):
        raise ValueError(f"need max_staleness >= 0, gen_s >= 0 and own_s >= 0, got "
                         f"{max_staleness}, {gen_s}, {list(own_s)}")
    ends: list[float] = []  # ends[j - 1]: when step j ended
    waits: list[float] = []
    made = float("-inf")  # when the rollout finished the batch before
    for j, own in enumerate(own_s, start=1):
        prev_end = ends[-1] if ends else 0.0
        if j <= max_staleness + 1:
            wait = 0.0
        else:
            made = max(made, ends[j - 2 - max_staleness]) + gen_s
            wait = max(0.0, made - prev_end)
        waits.append(wait)
        ends.append(prev_end + wait + own)
    return waits


def floor_pct(own_s: Sequence[float], gen_s: float, max_staleness: int) -> float:
    """The floor's share of the steps' time in percent, steps 2..N (the window of
    ``data_wait_pct`` in ``e2e_vs_trl``): ``100 * sum(wait) / sum(wait + own)``; 0.0
    for fewer than 2 steps. Arguments and errors as :func:`data_wait_floor`."""
    waits = data_wait_floor(own_s, gen_s, max_staleness)[1:]
    total = sum(waits) + sum(own_s[1:])
    return 100 * sum(waits) / total if total > 0 else 0.0
