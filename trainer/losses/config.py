"""``LossConfig``: the settings of the policy loss, checked when built (no torch here).

Field units and rules are in each field's description. Cross-field rules:

* KL to the reference goes in the reward OR in the loss, never both (public case
  C09, verl #211); ``kl_coef > 0`` needs ``kl_in``.
* ``0 <= clip_eps_low < 1`` (else the lower bound ``1 - eps`` never binds, C10d),
  ``clip_eps_high >= 0``, ``dual_clip_c > 1`` (C10; opendilab/PPOxFamily #95).
* An option of one policy loss (:data:`OPTION_OWNERS`, e.g. ``dual_clip_c`` of
  ``ppo_clip``) set for another one is an error (it would silently do nothing).
* ``m2po`` needs ``trainer.old_logprobs: rollout`` (checked by ``TrainerConfig``): its
  ratio is to the behaviour policy.
* ``seq-mean-token-sum-norm`` needs a constant divisor (C08: fixed across steps and
  micro-batches, e.g. max_new_tokens).

The name tuples below mirror the registries in ``relax.trainer.losses`` (a test
keeps them equal); they live here so that this module imports without torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

POLICY_LOSS_NAMES = ("ppo_clip", "gspo", "sapo", "cispo", "m2po")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm")
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3", "low_var_kl")
OPTION_OWNERS = {
    "dual_clip_c": ("ppo_clip",),
    "sapo_tau_pos": ("sapo",),
    "sapo_tau_neg": ("sapo",),
    "cispo_eps_low": ("cispo",),
    "cispo_eps_high": ("cispo",),
    "m2_threshold": ("m2po",),
}
"""The policy losses that read each loss-specific option (``trainer/losses/<name>.py``);
setting one away from its default for another policy loss is an error, not a no-op.
(``clip_eps_low/high`` are read by ppo_clip and gspo and accepted with every loss.)"""


def _one_of(value: str, valid: tuple[str, ...], what: str) -> str:
    if value not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(valid)}")
    return value


class LossConfig(BaseModel):
    """Policy-loss settings (frozen). See the module docstring for the cross-field rules."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy_loss: str = Field("ppo_clip", description="one of POLICY_LOSS_NAMES")
    loss_agg_mode: str = Field("token-mean", description="one of LOSS_AGG_MODES")
    clip_eps_low: float = Field(0.2, description="PPO lower clip: ratio >= 1 - clip_eps_low")
    clip_eps_high: float = Field(
        0.2, description="PPO upper clip: ratio <= 1 + clip_eps_high (DAPO clip-higher: 0.28)")
    dual_clip_c: float | None = Field(
        None, description="dual-clip constant c > 1 (loss <= -c * A where A < 0); None = off")
    sapo_tau_pos: float = Field(1.0, gt=0, description="SAPO gate temperature where A > 0")
    sapo_tau_neg: float = Field(1.05, gt=0, description="SAPO gate temperature where A <= 0")
    cispo_eps_low: float | None = Field(
        None, ge=0, description="CISPO IS-weight floor 1 - eps; None = no floor (MiniMax-M1)")
    cispo_eps_high: float = Field(
        4.0, ge=0, description="CISPO IS-weight cap 1 + eps (TRL/ScaleRL epsilon_max 5.0 = 1 + 4.0)")
    m2_threshold: float = Field(
        0.04, gt=0, description="M2PO bound on the mean (log ratio)^2 of the kept tokens "
        "(AReaL actor.m2_threshold; 0.04 in the M2PO paper)")
    kl_coef: float = Field(0.0, ge=0, description="beta, weight of the KL to the reference")
    kl_estimator: str = Field("k3", description="one of KL_ESTIMATOR_NAMES")
    kl_in: Literal["loss", "reward"] | None = Field(
        None, description="where the KL goes: 'loss', 'reward' (advantage stage) or None")
    entropy_coef: float = Field(0.0, description="loss -= entropy_coef * aggregated entropy")
    is_mode: Literal["tis", "mis"] | None = Field(
        None, description="rollout-vs-trainer correction: truncated (tis) or masked (mis) IS")
    is_level: Literal["token", "sequence"] = Field(
        "token", description="IS weight per token or per sequence (product of token ratios)")
    is_cap: float = Field(2.0, gt=0, description="TIS truncates weights at is_cap; MIS zeroes above")
    seq_mean_token_sum_norm_divisor: float | None = Field(
        None, gt=0, description="constant divisor of seq-mean-token-sum-norm, in tokens")

    @field_validator("policy_loss")
    @classmethod
    def _policy_loss_known(cls, v: str) -> str:
        return _one_of(v, POLICY_LOSS_NAMES, "policy_loss")

    @field_validator("loss_agg_mode")
    @classmethod
    def _agg_known(cls, v: str) -> str:
        return _one_of(v, LOSS_AGG_MODES, "loss_agg_mode")

    @field_validator("kl_estimator")
    @classmethod
    def _kl_known(cls, v: str) -> str:
        return _one_of(v, KL_ESTIMATOR_NAMES, "kl_estimator")

    @field_validator("kl_in", mode="before")
    @classmethod
    def _kl_in_one_place(cls, v: object) -> object:
        places = set(v) if isinstance(v, (list, tuple, set, frozenset)) else {v}
        if "both" in places or {"loss", "reward"} <= places:
            raise ValueError("KL to the reference goes either in the reward or in the loss, "
                             "never both: set kl_in to 'reward' or 'loss'")
        if isinstance(v, (list, tuple, set, frozenset)):
            return next(iter(places), None)
        return v

    @field_validator("clip_eps_low")
    @classmethod
    def _eps_low_range(cls, v: float) -> float:
        if not 0 <= v < 1:
            raise ValueError(f"clip_eps_low must satisfy 0 <= clip_eps_low < 1 (the lower bound is "
                             f"1 - clip_eps_low), got {v}")
        return v

    @field_validator("clip_eps_high")
    @classmethod
    def _eps_high_range(cls, v: float) -> float:
        if v < 0:
            raise ValueError(f"clip_eps_high must be >= 0, got {v}")
        return v

    @field_validator("dual_clip_c")
    @classmethod
    def _dual_clip_range(cls, v: float | None) -> float | None:
        if v is not None and not v > 1:
            raise ValueError(f"dual_clip_c must be > 1 (or None = off), got {v}")
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> LossConfig:
        for option, owners in OPTION_OWNERS.items():
            if self.policy_loss not in owners and \
                    getattr(self, option) != type(self).model_fields[option].default:
                raise ValueError(f"{option} applies to policy_loss {' / '.join(owners)} only, "
                                 f"not {self.policy_loss!r}: remove it or change policy_loss")
        if self.kl_coef > 0 and self.kl_in is None:
            raise ValueError("kl_coef > 0 needs kl_in = 'loss' or 'reward'")
        if (self.loss_agg_mode == "seq-mean-token-sum-norm"
                and self.seq_mean_token_sum_norm_divisor is None):
            raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs a constant "
                             "seq_mean_token_sum_norm_divisor (e.g. max_new_tokens)")
        return self


class ValueLossConfig(BaseModel):
    """The critic's value-loss settings (frozen): :mod:`relax.trainer.losses.value`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    clip_range: float | None = Field(
        0.5, gt=0, description="value clip c: the new value stays within c of the old one "
        "(veRL critic cliprange_value 0.5; TRL PPOConfig cliprange_value 0.2); None = off")
    loss_agg_mode: str = Field("token-mean", description="one of LOSS_AGG_MODES")
    seq_mean_token_sum_norm_divisor: float | None = Field(
        None, gt=0, description="constant divisor of seq-mean-token-sum-norm, in tokens")

    @field_validator("loss_agg_mode")
    @classmethod
    def _agg_known(cls, v: str) -> str:
        return _one_of(v, LOSS_AGG_MODES, "loss_agg_mode")

    @model_validator(mode="after")
    def _divisor(self) -> ValueLossConfig:
        if (self.loss_agg_mode == "seq-mean-token-sum-norm"
                and self.seq_mean_token_sum_norm_divisor is None):
            raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs a constant "
                             "seq_mean_token_sum_norm_divisor (e.g. max_new_tokens)")
        return self
