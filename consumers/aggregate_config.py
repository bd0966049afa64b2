"""The aggregate stage's settings (:class:`AggregateConfig`) and how a joined group becomes
train samples (:class:`AdvantageConfig`, read by
:func:`relax.consumers.samples.build_train_samples`): torch-free, so the recipe's checks load
them in processes without torch (the driver, the reward stage).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relax.trainer.advantage.names import check_estimator
from relax.trainer.losses.config import KL_ESTIMATOR_NAMES


class SoftOverlong(BaseModel):
    """DAPO soft overlong punishment: penalty rising linearly to ``penalty`` over the last
    ``cache_length`` tokens before ``max_length`` (tokens)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    max_length: int = Field(gt=0)
    cache_length: int = Field(gt=0)
    penalty: float = Field(1.0, gt=0)


class AdvantageConfig(BaseModel):
    """How a joined group becomes train samples.

    Attributes:
        estimator: a key of ``ADVANTAGE_ESTIMATORS``.
        estimator_options: keyword options of the estimator (e.g. ``{"eps": 1e-4}``).
        rewards: counted reward names and their weights; the final reward is the
            weighted sum. Other reward names on the topic are ignored.
        dynamic_sampling: drop groups with zero reward variance (DAPO).
        overlong_filter: zero the loss_mask of truncated rollouts (DAPO).
        soft_overlong: DAPO soft overlong punishment, or None.
        kl_in_reward_coef: > 0 puts a sequence KL penalty into the reward (needs
            ref_logprobs); the loss must then not add KL (the trainer's config check).
        kl_estimator: k1 | k2 | k3 | low_var_kl (= k3) for the KL-in-reward penalty.
        ref_logprobs: join ``<run>.ref_logprobs`` and carry them on the train samples even
            without a KL-in-reward penalty (the loss's KL needs them: recipe ``kl.in: loss``).
        distill_coef: > 0 turns on on-policy distillation: join ``<run>.teacher_logprobs``
            (the teacher stage) and add ``-distill_coef x (logprobs - teacher_logprobs)``
            to every loss token's advantage (step 7 of the module docstring).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    estimator: str = "grpo"
    estimator_options: dict[str, float | bool] = Field(default_factory=dict)
    rewards: dict[str, float] = Field(default_factory=lambda: {"math": 1.0})
    dynamic_sampling: bool = False
    overlong_filter: bool = False
    soft_overlong: SoftOverlong | None = None
    kl_in_reward_coef: float = Field(0.0, ge=0)
    kl_estimator: str = Field("k1", description="one of KL_ESTIMATOR_NAMES")
    ref_logprobs: bool = False
    distill_coef: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _check(self):
        check_estimator(self.estimator)  # gae: refused, naming the missing critic
        if not self.rewards:
            raise ValueError("rewards: at least one counted reward name is needed")
        if self.kl_estimator not in KL_ESTIMATOR_NAMES:
            raise ValueError(f"unknown kl_estimator {self.kl_estimator!r}; valid: "
                             f"{', '.join(KL_ESTIMATOR_NAMES)}")
        return self

    @property
    def needs_ref(self) -> bool:
        """Whether reference log-probs are joined and put on the samples."""
        return self.kl_in_reward_coef > 0 or self.ref_logprobs

    @property
    def needs_teacher(self) -> bool:
        """Whether teacher log-probs are joined (on-policy distillation)."""
        return self.distill_coef > 0


class AggregateConfig(BaseModel):
    """Configuration of the aggregator stage.

    Attributes:
        run: run name.
        partitions: partition count of the run's co-partitioned topics.
        advantage: rewards counted, estimator and filters.
        group_timeout_s: emit an incomplete group this long after its first row (seconds).
        poll_timeout_s: consumer poll timeout (seconds).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    run: str
    partitions: int = Field(4, ge=1)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    group_timeout_s: float = Field(300.0, gt=0)
    poll_timeout_s: float = Field(0.5, gt=0)
