"""Off-policy correction between the trainer's and the rollout engine's log-probs.

The engine (SGLang/vLLM, bf16, other kernels) samples from ``pi_rollout``, which
differs from the trainer's ``pi_old`` even for identical weights. The loss is
multiplied by a detached weight ``w = pi_old / pi_rollout``:

* TIS, truncated importance sampling: ``min(w, cap)`` (Yao, Liu et al., "Your
  Efficient RL Framework Secretly Brings You Off-Policy RL Training", 2025,
  https://fengyao.notion.site/off-policy-rl; cap 2 there).
* MIS, masked importance sampling: ``w`` if ``w <= cap`` else 0 (Liu, Li et al.,
  "When Speed Kills Stability", 2025; verl rollout correction "rejection" modes).

Level ``token``: ``w_t = exp(old_t - rollout_t)``. Level ``sequence``: one weight per
sequence, the product of the token ratios ``exp(sum_t (old_t - rollout_t))``, on
every token. Log-ratios are clamped to ``[-20, 20]`` before ``exp`` (verl
``rollout_corr_helper`` SAFETY_BOUND). Both log-prob tensors must use the same
temperature-scaled, full-vocabulary convention (``relax.trainer.logprobs``).
"""

from __future__ import annotations

from typing import Literal

import torch

from relax.trainer.losses.ratio import LOG_RATIO_CLAMP, masked_sequence_sum


def rollout_importance_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                               loss_mask: torch.Tensor, *, mode: Literal["tis", "mis"],
                               level: Literal["token", "sequence"] = "token", cap: float = 2.0,
                               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached TIS/MIS weights ``[B, T]`` for the per-token loss.

    Args:
        old_logprobs: ``[B, T]`` float32 trainer log-probs of the sampled tokens (pi_old).
        rollout_logprobs: ``[B, T]`` float32 log-probs reported by the rollout engine.
        loss_mask: ``[B, T]``; masked positions get weight 0 (NaN there is ignored).
        mode: ``"tis"`` (truncate at ``cap``) or ``"mis"`` (zero above ``cap``).
        level: ``"token"`` or ``"sequence"``.
        cap: the threshold ``C`` (> 0).

    Returns:
        ``(weights [B, T] float32, metrics)``; metrics per token: ``is_weight`` (the
        raw weight, for the mean) and ``is_capped_frac`` (1 where ``w > cap``).
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    mask = loss_mask.bool()
    log_w = torch.where(mask, old_logprobs.detach() - rollout_logprobs.detach(),
                        torch.zeros_like(old_logprobs))
    if level == "sequence":
        log_w = masked_sequence_sum(log_w, mask).expand_as(log_w)
    elif level != "token":
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    w = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    capped = w > cap
    if mode == "tis":
        weights = w.clamp(max=cap)
    elif mode == "mis":
        weights = torch.where(capped, torch.zeros_like(w), w)
    else:
        raise ValueError(f"mode must be 'tis' or 'mis', got {mode!r}")
    zero = torch.zeros_like(w)
    weights = torch.where(mask, weights, zero)
    return weights, {"is_weight": torch.where(mask, w, zero),
                     "is_capped_frac": (capped & mask).float()}
