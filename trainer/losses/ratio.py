"""Log importance ratios ``log pi_theta - log pi_old``, token and sequence level.

The log-ratio is clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp``
(verl ``compute_policy_loss_vanilla`` and its rollout-correction helper use 20), so
a garbage log-prob cannot overflow; values that far out are clipped by every loss
anyway.
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0


def token_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``clamp(logprobs - old_logprobs, -20, 20)``, ``[B, T]`` float32; differentiable in
    ``logprobs``, ``old_logprobs`` is detached."""
    return (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def masked_sequence_sum(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T] -> [B, 1]`` sum over loss tokens (masked positions selected out, NaN-safe)."""
    return torch.where(loss_mask.bool(), values, torch.zeros_like(values)).sum(-1, keepdim=True)


def sequence_mean_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                            loss_mask: torch.Tensor) -> torch.Tensor:
    """GSPO's ``log s_i = mean over loss tokens of (logprobs - old_logprobs)``.

    Args:
        logprobs, old_logprobs: ``[B, T]`` float32; loss_mask: ``[B, T]``.

    Returns:
        ``[B, 1]`` float32, clamped to ``[-20, 20]``; 0 for a row with no loss token.
    """
    total = masked_sequence_sum(logprobs - old_logprobs.detach(), loss_mask)
    tokens = loss_mask.bool().sum(-1, keepdim=True).clamp(min=1)
    return (total / tokens).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
