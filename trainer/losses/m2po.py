"""M2PO: second-moment trust policy optimisation for stale rollouts.

Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with
Stale Data on LLMs?" (arXiv 2510.01161). Instead of clipping every token whose ratio
leaves ``[1 - eps, 1 + eps]`` (which, as staleness grows, masks the informative
high-entropy tokens), M2PO bounds the second moment of the log importance ratio over
the batch, ``M2 = mean over loss tokens of (log r)^2``, and drops only the tokens that
push it over the threshold:

1. ``s_t = (log r_t)^2`` on every loss token, ``log r = logprobs - old_logprobs``
   (detached, clamped to ``[-20, 20]``: :func:`relax.trainer.losses.ratio.token_log_ratio`);
2. sort descending; drop the largest ``k`` for the smallest ``k`` such that the mean
   of the rest is ``< m2_threshold``; if no ``k`` does, keep only the smallest one;
3. ``loss_t = -r_t * A_t`` on the kept tokens, 0 on the dropped ones: no epsilon clip.

This is AReaL's ``_apply_m2po_masking`` / ``_get_m2po_loss_mask``
(``areal/engine/ppo/actor.py``, ``actor.m2_threshold``; the paper's threshold 0.04).
AReaL takes ``log r`` between the behaviour policy and the proximal policy (pi_theta
before the step) and then applies its decoupled PPO loss; relax does one optimizer step
per batch, so with ``trainer.old_logprobs: rollout`` (pi_old = the engine's behaviour
log-probs) the detached ``log r`` here is that same quantity, and the loss gradient
``-M r A grad log pi`` is the paper's objective.

The statistic is over the tokens this function is given: in the trainer, one
micro-batch, as AReaL computes it in its per-micro-batch loss function. A step that
fits in one micro-batch (``max_tokens_per_microbatch``) gets the whole batch's
statistic; with several micro-batches the masks (and the loss) depend on the split.
Dropped tokens stay in the loss's token count (like clipped tokens of ppo_clip; AReaL
divides by the kept tokens, a factor ``1 - masked share`` apart).

Metrics per token (``compute_policy_loss`` token-averages them): ``m2po_masked_frac``
(1 on a dropped loss token: its mean is the masked-token share) and ``m2`` (``s_t``:
its mean is the second moment before masking).
"""

from __future__ import annotations

import torch

from relax.trainer.losses.config import LossConfig
from relax.trainer.losses.ratio import token_log_ratio


def m2po_keep_mask(log_ratio: torch.Tensor, loss_mask: torch.Tensor,
                   threshold: float) -> torch.Tensor:
    """The tokens M2PO keeps: drop the largest ``(log r)^2`` until the mean of the rest
    is under ``threshold`` (steps 1-2 of the module docstring).

    Args:
        log_ratio: ``[B, T]`` float log importance ratio (its value is used, detached).
        loss_mask: ``[B, T]`` bool/int; only these tokens enter the statistic.
        threshold: the second-moment bound (> 0).

    Returns:
        ``[B, T]`` bool, a subset of ``loss_mask``; at least one token is kept when
        ``loss_mask`` has one.

    Raises:
        ValueError: ``threshold`` not > 0, or a shape mismatch.
    """
    if not threshold > 0:
        raise ValueError(f"m2_threshold must be > 0, got {threshold}")
    if log_ratio.shape != loss_mask.shape:
        raise ValueError(f"log_ratio shape {tuple(log_ratio.shape)} != loss_mask shape "
                         f"{tuple(loss_mask.shape)}")
    mask = loss_mask.bool()
    keep = torch.zeros_like(mask)
    m2 = log_ratio.detach().to(torch.float64).square()[mask]
    n = m2.numel()
    if n == 0:
        return keep
    ordered, order = torch.sort(m2, descending=True, stable=True)
    tail_sum = ordered.flip(0).cumsum(0).flip(0)  # sum of ordered[i:]
    tail_mean = tail_sum / torch.arange(n, 0, -1, dtype=torch.float64, device=m2.device)
    under = torch.nonzero(tail_mean < threshold)
    dropped = int(under[0]) if under.numel() else n - 1
    kept_sorted = torch.arange(n, device=m2.device) >= dropped
    kept = torch.empty_like(kept_sorted)
    kept[order] = kept_sorted
    keep[mask] = kept
    return keep


def m2po_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              loss_mask: torch.Tensor, cfg: LossConfig,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """M2PO loss (module docstring).

    Args:
        logprobs: ``[B, T]`` float32 current-policy log-probs (differentiable).
        old_logprobs: ``[B, T]`` float32 log-probs of the policy that sampled the tokens
            (``trainer.old_logprobs: rollout``).
        advantages: ``[B, T]`` float32.
        loss_mask: ``[B, T]``, the tokens of the second-moment statistic.
        cfg: uses ``m2_threshold``.

    Returns:
        ``(loss [B, T], metrics)``: loss ``-r A`` on kept tokens and exactly 0 (no
        gradient) on dropped ones; metrics ``m2po_masked_frac`` and ``m2`` per token.
    """
    log_ratio = token_log_ratio(logprobs, old_logprobs)
    mask = loss_mask.bool()
    keep = m2po_keep_mask(log_ratio, mask, cfg.m2_threshold)
    surrogate = -log_ratio.exp() * advantages
    loss = torch.where(keep, surrogate, torch.zeros_like(surrogate))
    return loss, {"m2po_masked_frac": (mask & ~keep).float(),
                  "m2": log_ratio.detach().square()}
