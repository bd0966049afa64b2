"""Policy losses, aggregation and KL, as literal registries, and the trainer's entry point.

* ``POLICY_LOSSES[name](logprobs, old_logprobs, advantages, loss_mask, cfg)``
  -> ``(loss [B, T], metrics {name: [B, T]})``.
* ``LOSS_AGGREGATIONS[mode](values, loss_mask, *, global_tokens, global_seqs,
  norm_divisor)`` -> scalar.
* ``KL_ESTIMATORS[name](logprobs, ref_logprobs)`` -> ``[B, T]``.

:func:`compute_value_loss` is the critic's (PPO with a value model): the clipped value
loss of :mod:`.value`, aggregated the same way.

:func:`compute_policy_loss` is what the trainer calls once per micro-batch; with
``global_tokens`` / ``global_seqs`` counted over the whole optimizer step
(:func:`~relax.trainer.losses.aggregate.mask_counts` summed over micro-batches),
the micro-batch losses and metrics SUM to the full-batch values: call
``backward()`` on each and do not divide by the number of accumulation steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch

from relax.trainer.losses import aggregate, kl
from relax.trainer.losses.cispo import cispo_loss
from relax.trainer.losses.config import LossConfig, ValueLossConfig
from relax.trainer.losses.gspo import gspo_loss
from relax.trainer.losses.importance import rollout_importance_weights
from relax.trainer.losses.m2po import m2po_loss
from relax.trainer.losses.ppo_clip import ppo_clip_loss
from relax.trainer.losses.sapo import sapo_loss
from relax.trainer.losses.value import clipped_value_loss

POLICY_LOSSES = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "sapo": sapo_loss,
    "cispo": cispo_loss,
    "m2po": m2po_loss,
}

LOSS_AGGREGATIONS = {
    "token-mean": aggregate.token_mean,
    "seq-mean-token-mean": aggregate.seq_mean_token_mean,
    "seq-mean-token-sum": aggregate.seq_mean_token_sum,
    "seq-mean-token-sum-norm": aggregate.seq_mean_token_sum_norm,
}

KL_ESTIMATORS = {
    "k1": kl.k1,
    "k2": kl.k2,
    "k3": kl.k3,
    "low_var_kl": kl.k3,
}

F = TypeVar("F")


def pick(table: Mapping[str, F], name: str, what: str) -> F:
    """``table[name]``, or a ``ValueError`` naming ``what`` and listing the valid names."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(table)}")
    return table[name]


def compute_policy_loss(cfg: LossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                        advantages: torch.Tensor, loss_mask: torch.Tensor, *,
                        rollout_logprobs: torch.Tensor | None = None,
                        ref_logprobs: torch.Tensor | None = None,
                        entropy: torch.Tensor | None = None,
                        global_tokens: aggregate.Count, global_seqs: aggregate.Count,
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch: policy loss (x TIS/MIS weight), + KL, - entropy bonus.

    ``loss = agg(policy_loss * w) + kl_coef * agg(kl)  [kl_in == "loss"]
    - entropy_coef * agg(entropy)``, every ``agg`` being ``cfg.loss_agg_mode`` with the
    global counts. Inputs at masked positions are replaced by 0 before any maths, so
    NaN/inf there never reach the loss or the gradient.

    Args:
        cfg: the loss settings.
        logprobs: ``[B, T]`` float32 current-policy log-probs (differentiable), from
            :func:`relax.trainer.logprobs.token_logprobs`.
        old_logprobs: ``[B, T]`` float32 pi_old log-probs (detached).
        advantages: ``[B]`` or ``[B, T]`` float32 (detached).
        loss_mask: ``[B, T]`` bool/int.
        rollout_logprobs: ``[B, T]`` engine log-probs; required when ``cfg.is_mode``.
        ref_logprobs: ``[B, T]`` reference log-probs; required when ``kl_in == "loss"``
            and ``kl_coef > 0``.
        entropy: ``[B, T]`` per-token entropy (:func:`.entropy.token_entropy`);
            required when ``entropy_coef != 0``, else only reported.
        global_tokens: loss tokens in the whole optimizer step.
        global_seqs: sequences with a loss token in the whole optimizer step.

    Returns:
        ``(loss scalar, metrics {name: 0-dim detached tensor})``. Metrics are additive
        over micro-batches: ``policy_loss``, ``kl``, ``entropy`` (aggregated like the
        loss), ``ppo_kl`` (token mean of ``old - logprobs``) and the loss's own
        per-token metrics as token means (``clip_frac_low``, ``clip_frac_high``, ...).

    Raises:
        ValueError: on shape mismatch or a missing tensor the config needs.
    """
    mask = loss_mask.bool()
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages),
                    ("loss_mask", loss_mask)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs shape "
                             f"{tuple(logprobs.shape)}")

    def safe(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x, torch.zeros_like(x))

    logprobs = safe(logprobs)
    old = safe(old_logprobs.detach())
    per_token, token_metrics = pick(POLICY_LOSSES, cfg.policy_loss, "policy_loss")(
        logprobs, old, safe(advantages.detach()), mask, cfg)

    if cfg.is_mode is not None:
        if rollout_logprobs is None:
            raise ValueError(f"is_mode={cfg.is_mode!r} needs rollout_logprobs")
        weights, is_metrics = rollout_importance_weights(
            old, rollout_logprobs, mask, mode=cfg.is_mode, level=cfg.is_level, cap=cfg.is_cap)
        per_token = per_token * weights
        token_metrics.update(is_metrics)

    agg_fn = pick(LOSS_AGGREGATIONS, cfg.loss_agg_mode, "loss_agg_mode")

    def agg(values: torch.Tensor) -> torch.Tensor:
        return agg_fn(values, mask, global_tokens=global_tokens, global_seqs=global_seqs,
                      norm_divisor=cfg.seq_mean_token_sum_norm_divisor)

    def token_avg(values: torch.Tensor) -> torch.Tensor:
        return aggregate.token_mean(values.detach(), mask, global_tokens=global_tokens,
                                    global_seqs=global_seqs)

    loss = agg(per_token)
    metrics = {"policy_loss": loss.detach(), "ppo_kl": token_avg(old - logprobs)}

    if cfg.kl_in == "loss" and cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_in='loss' with kl_coef > 0 needs ref_logprobs")
        kl_value = agg(pick(KL_ESTIMATORS, cfg.kl_estimator, "kl_estimator")(
            logprobs, safe(ref_logprobs.detach())))
        loss = loss + cfg.kl_coef * kl_value
        metrics["kl"] = kl_value.detach()

    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy")
    if entropy is not None:
        entropy_value = agg(safe(entropy))
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * entropy_value
        metrics["entropy"] = entropy_value.detach()

    for name, values in token_metrics.items():
        metrics[name] = token_avg(values)
    return loss, metrics


def compute_value_loss(cfg: ValueLossConfig, values: torch.Tensor, old_values: torch.Tensor,
                       returns: torch.Tensor, loss_mask: torch.Tensor, *,
                       global_tokens: aggregate.Count, global_seqs: aggregate.Count,
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's loss of one micro-batch: ``agg(0.5 * max((v - R)^2, (clip(v) - R)^2))``
    (:func:`.value.clipped_value_loss`), ``agg`` being ``cfg.loss_agg_mode`` over the
    global counts, so micro-batch losses sum to the batch's (as :func:`compute_policy_loss`).
    With ``token-mean`` it is veRL's ``compute_value_loss`` and TRL's ``vf_loss``.

    Args:
        cfg: the value-loss settings.
        values: ``[B, T]`` float32 new critic values (differentiable).
        old_values: ``[B, T]`` float32 values of the critic that scored the rollout.
        returns: ``[B, T]`` float32 GAE returns.
        loss_mask: ``[B, T]`` bool/int; NaN/inf at masked positions never reach the loss.
        global_tokens, global_seqs: as :func:`compute_policy_loss`.

    Returns:
        ``(loss scalar, {"value_loss", "vf_clip_frac"})``, metrics 0-dim detached and
        additive over micro-batches (``vf_clip_frac`` a token mean).

    Raises:
        ValueError: on a shape mismatch.
    """
    mask = loss_mask.bool()
    for name, t in (("old_values", old_values), ("returns", returns), ("loss_mask", loss_mask)):
        if t.shape != values.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != values shape "
                             f"{tuple(values.shape)}")

    def safe(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x, torch.zeros_like(x))

    per_token, token_metrics = clipped_value_loss(
        safe(values), safe(old_values.detach()), safe(returns.detach()), clip_range=cfg.clip_range)
    loss = pick(LOSS_AGGREGATIONS, cfg.loss_agg_mode, "loss_agg_mode")(
        per_token, mask, global_tokens=global_tokens, global_seqs=global_seqs,
        norm_divisor=cfg.seq_mean_token_sum_norm_divisor)
    metrics = {"value_loss": loss.detach()}
    for name, v in token_metrics.items():
        metrics[name] = aggregate.token_mean(v, mask, global_tokens=global_tokens,
                                             global_seqs=global_seqs)
    return loss, metrics


__all__ = ["KL_ESTIMATORS", "LOSS_AGGREGATIONS", "POLICY_LOSSES", "LossConfig",
           "ValueLossConfig", "compute_policy_loss", "compute_value_loss", "pick"]
