"""Advantage estimators over outcome rewards, and the DAPO filters.

Every estimator in ``ADVANTAGE_ESTIMATORS`` is a pure function
``fn(rewards [N] float32, group_ids [N] int64, **options) -> advantages [N] float32``
(samples in any order; group statistics per ``group_id``). Per-token advantages
for the ``advantages`` column are the sample's value on every loss token.
On-policy distillation is per token and lives in :mod:`.distill`; GAE (PPO with a
critic) is per token too, from token rewards and values: :mod:`.gae`; its entry here
(``gae``) gives the aggregator 0s, replaced by the trainer's critic.
"""

from __future__ import annotations

import torch

from relax.trainer.advantage.gae import trainer_computed
from relax.trainer.advantage.grpo import dr_grpo_advantages, grpo_advantages
from relax.trainer.advantage.names import check_estimator
from relax.trainer.advantage.reinforce_pp import (
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)
from relax.trainer.advantage.rloo import rloo_advantages, rloo_std_advantages

ADVANTAGE_ESTIMATORS = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "rloo_std": rloo_std_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
    "gae": trainer_computed,
}


def compute_advantages(name: str, rewards: torch.Tensor, group_ids: torch.Tensor,
                       **options: object) -> torch.Tensor:
    """Run the estimator ``name`` from ``ADVANTAGE_ESTIMATORS``.

    Args:
        name: estimator name.
        rewards: ``[N]`` float32 outcome rewards.
        group_ids: ``[N]`` int64 group of each sample.
        **options: keyword options of that estimator (e.g. ``eps``).

    Returns:
        ``[N]`` float32 advantages.

    Raises:
        ValueError: for an unknown name, listing the valid ones.
    """
    check_estimator(name)
    return ADVANTAGE_ESTIMATORS[name](rewards, group_ids, **options)


__all__ = ["ADVANTAGE_ESTIMATORS", "compute_advantages"]
