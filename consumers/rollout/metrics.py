"""The rollout stage's counters (:class:`RolloutStats`) and the metrics it writes to
``<run>.metrics`` (component = ``engine_id``; names from ``schemas.metric_names``)."""

from __future__ import annotations

from dataclasses import dataclass

from relax.schemas import metric_names as M

WEIGHT_WAIT_S = M.WEIGHT_WAIT_S


@dataclass
class RolloutStats:
    """Counters of one rollout instance."""

    groups: int = 0
    samples: int = 0
    tokens: int = 0
    generate_s: float = 0.0
    budget_waits: int = 0
    budget_wait_s: float = 0.0
    weight_waits: int = 0
    weight_wait_s: float = 0.0
    prompt_errors: int = 0
    epochs_started: int = 0
    repeated_prompts: int = 0
    claims_refused: int = 0  # groups claimed that another instance's claim got first


def emit_metrics(
    metrics,
    stats: RolloutStats,
    groups_in_flight: int,
    policy_version: int | None,
    tokens_per_s: float | None,
) -> None:
    """Write and flush one set of metrics through ``metrics`` (a
    :class:`relax.streams.metrics.MetricsWriter`): ``groups_in_flight``,
    ``budget_wait_s`` / ``weight_wait_s`` (cumulative seconds), ``groups_sampled``, and
    ``gen_tokens_per_s`` unless ``tokens_per_s`` is None; tagged with the engine's
    ``policy_version``."""
    values = {
        M.GROUPS_IN_FLIGHT: groups_in_flight,
        M.BUDGET_WAIT_S: stats.budget_wait_s,
        WEIGHT_WAIT_S: stats.weight_wait_s,
        M.GROUPS_SAMPLED: stats.groups,
    }
    if tokens_per_s is not None:
        values[M.GEN_TOKENS_PER_S] = tokens_per_s
    metrics.add_many(values, policy_version)
    metrics.flush()
