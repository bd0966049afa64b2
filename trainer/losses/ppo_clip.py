"""PPO clipped surrogate with asymmetric clip-higher and dual-clip.

Per token, with ``r = exp(logprobs - old_logprobs)`` and advantage ``A``:

``loss = max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A)``  (PPO, Schulman et al.
arXiv 1707.06347; the GRPO objective, DeepSeekMath arXiv 2402.03300, without its KL
term). ``eps_high > eps_low`` is DAPO's clip-higher (arXiv 2503.14476, 0.28 / 0.2).

Dual-clip (Ye et al., arXiv 1912.09729; verl ``compute_policy_loss_vanilla``): where
``A < 0`` only, ``loss = min(loss, -c A)`` with a constant ``c > 1``, bounding the
loss of a very large ratio at ``c |A|``. Applied where ``A >= 0`` it would replace
the objective with ``c A`` (tianshou #433, public case C10).

Metrics (per token, 0/1 floats; ``compute_policy_loss`` token-averages them):
``clip_frac_low`` (``r < 1 - eps_low`` and ``A < 0``), ``clip_frac_high``
(``r > 1 + eps_high`` and ``A > 0``), the regions where the clip binds (TRL's
``clip_ratio/low_mean`` and ``high_mean``), and ``dual_clip_frac``.
"""

from __future__ import annotations

import torch

from relax.trainer.losses.config import LossConfig
from relax.trainer.losses.ratio import token_log_ratio


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, *, eps_low: float,
                      eps_high: float, dual_clip_c: float | None = None,
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss for a given ratio (token or GSPO sequence ratio).

    Args:
        ratio: ``[B, T]`` float32 importance ratio (carries the gradient).
        advantages: ``[B, T]`` float32.
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]``.
        dual_clip_c: dual-clip constant (> 1), applied where ``A < 0``; None = off.

    Returns:
        ``(loss [B, T] float32, metrics {name: [B, T] float32, detached})``.
    """
    surr = -advantages * ratio
    surr_clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = torch.maximum(surr, surr_clipped)
    r = ratio.detach()
    metrics = {
        "clip_frac_low": ((r < 1 - eps_low) & (advantages < 0)).float(),
        "clip_frac_high": ((r > 1 + eps_high) & (advantages > 0)).float(),
    }
    if dual_clip_c is not None:
        floor = -advantages * dual_clip_c
        negative = advantages < 0
        metrics["dual_clip_frac"] = (negative & (loss.detach() > floor)).float()
        loss = torch.where(negative, torch.minimum(loss, floor), loss)
    return loss, metrics


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  loss_mask: torch.Tensor, cfg: LossConfig,
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO-clip loss (GRPO / DAPO / dual-clip per ``cfg``).

    Args:
        logprobs: ``[B, T]`` float32 current-policy log-probs (differentiable).
        old_logprobs: ``[B, T]`` float32 log-probs of the policy that sampled (pi_old).
        advantages: ``[B, T]`` float32.
        loss_mask: ``[B, T]`` (unused: aggregation masks).
        cfg: uses ``clip_eps_low``, ``clip_eps_high``, ``dual_clip_c``.

    Returns:
        ``(loss [B, T], metrics)``; see :func:`clipped_surrogate`.
    """
    ratio = token_log_ratio(logprobs, old_logprobs).exp()
    return clipped_surrogate(ratio, advantages, eps_low=cfg.clip_eps_low,
                             eps_high=cfg.clip_eps_high, dual_clip_c=cfg.dual_clip_c)
