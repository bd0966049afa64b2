"""CISPO: clipped IS-weight policy optimisation (MiniMax-M1, arXiv 2506.13585, Eq. 4-5).

``loss = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logprobs`` with
``r = exp(logprobs - old_logprobs)``. The IS weight is clipped and detached, so
every token keeps a REINFORCE gradient ``w A grad log pi`` (PPO's clip would zero
the gradient of clipped tokens). MiniMax-M1 sets no lower bound (``eps_low`` large);
``cispo_eps_low = None`` does that. TRL's ``loss_type="cispo"`` caps at
``epsilon_high`` = ``1 + cispo_eps_high`` with no floor (ScaleRL's eps_max = 5.0);
verl's clips with ``[1 - clip_ratio_low, 1 + clip_ratio_high]``.

The loss value is not the surrogate objective (it is ``-w A log pi``); only its
gradient is meaningful.
"""

from __future__ import annotations

import torch

from relax.trainer.losses.config import LossConfig
from relax.trainer.losses.ratio import token_log_ratio


def cispo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               loss_mask: torch.Tensor, cfg: LossConfig,
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO loss.

    Args:
        logprobs: ``[B, T]`` float32 current-policy log-probs (differentiable).
        old_logprobs: ``[B, T]`` float32 pi_old log-probs.
        advantages: ``[B, T]`` float32.
        loss_mask: ``[B, T]`` (unused: aggregation masks).
        cfg: uses ``cispo_eps_low`` (None = no floor) and ``cispo_eps_high``.

    Returns:
        ``(loss [B, T], metrics)`` with ``is_clip_frac`` (weight clipped) per token.
    """
    ratio = token_log_ratio(logprobs, old_logprobs).exp().detach()
    floor = None if cfg.cispo_eps_low is None else 1 - cfg.cispo_eps_low
    weight = ratio.clamp(min=floor, max=1 + cfg.cispo_eps_high)
    loss = -weight * advantages * logprobs
    return loss, {"is_clip_frac": (weight != ratio).float()}
