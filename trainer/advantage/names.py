"""The advantage estimators by name and where each runs: torch-free, for the configs'
checks (the recipe, ``AdvantageConfig``, ``TrainerConfig``) in processes without torch.
The functions behind the names are :data:`relax.trainer.advantage.registry.ADVANTAGE_ESTIMATORS`
(its keys are :data:`ESTIMATOR_NAMES`: ``tests/trainer/test_advantage.py``).
"""

from __future__ import annotations

ESTIMATOR_NAMES = ("grpo", "dr_grpo", "rloo", "rloo_std", "reinforce_pp",
                   "reinforce_pp_baseline", "gae")
"""Every estimator of ``advantage.estimator``."""

BATCH_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline")
"""Estimators whose statistics span the global batch (computed by the trainer)."""

CRITIC_ESTIMATORS = ("gae",)
"""Estimators computed by the trainer's critic (:mod:`relax.trainer.critic`), not by the
aggregator."""


def check_estimator(name: str) -> str:
    """``name`` if it is one of :data:`ESTIMATOR_NAMES`.

    Raises:
        ValueError: an unknown name (listing the valid ones).
    """
    if name not in ESTIMATOR_NAMES:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: "
                         f"{', '.join(ESTIMATOR_NAMES)}")
    return name
