"""SAPO: Soft Adaptive Policy Optimization (Gao et al., Qwen, arXiv 2511.20347).

Hard clipping is replaced by a smooth gate of the token ratio
``r = exp(logprobs - old_logprobs)``:
``f(r) = (4 / tau) * sigmoid(tau * (r - 1))``, ``loss = -f(r) * A``, with
temperature ``tau_pos`` where ``A > 0`` and ``tau_neg`` where ``A <= 0``
(``tau_neg > tau_pos`` damps negative updates faster). ``f'(1) = 1``, so near
on-policy the gradient equals the plain policy gradient; at ``r = 1`` the loss
value is ``-2 A / tau``. Same form and defaults (1.0 / 1.05) as TRL
``loss_type="sapo"``.
"""

from __future__ import annotations

import torch

from relax.trainer.losses.config import LossConfig
from relax.trainer.losses.ratio import token_log_ratio


def sapo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              loss_mask: torch.Tensor, cfg: LossConfig,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO soft-gated loss.

    Args:
        logprobs: ``[B, T]`` float32 current-policy log-probs (differentiable).
        old_logprobs: ``[B, T]`` float32 pi_old log-probs.
        advantages: ``[B, T]`` float32.
        loss_mask: ``[B, T]`` (unused: aggregation masks).
        cfg: uses ``sapo_tau_pos``, ``sapo_tau_neg``.

    Returns:
        ``(loss [B, T], metrics)`` with ``gate`` = ``sigmoid(tau (r - 1))`` per token.
    """
    ratio = token_log_ratio(logprobs, old_logprobs).exp()
    tau = torch.where(advantages > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1))
    loss = -(4 / tau) * gate * advantages
    return loss, {"gate": gate.detach()}
