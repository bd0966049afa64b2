"""GRPO and Dr.GRPO group-relative advantages for outcome rewards.

GRPO (DeepSeekMath, arXiv 2402.03300, section 4.1.2): ``A_i = (r_i - mean_g) /
(std_g + eps)`` over the samples of the same prompt group. ``std_g`` is the sample
std (``n - 1``, as ``torch.std``, TRL and verl); ``eps`` sits outside the square
root, default ``1e-4`` as TRL's GRPOTrainer (verl uses ``1e-6``).

Dr.GRPO (arXiv 2503.20783): mean-centring only, ``A_i = r_i - mean_g``; dividing by
the std up-weights low-variance (too easy or too hard) prompts.

Both: a singleton group gets 0, and a zero-variance group (``std <= atol``) gets
exactly 0 (public cases C01, C02, C05).
"""

from __future__ import annotations

import torch

from relax.trainer.advantage.groups import ZERO_STD_ATOL, group_stats, zero_variance

GRPO_EPS = 1e-4


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = GRPO_EPS,
                    scale_std: bool = True, zero_std_atol: float = ZERO_STD_ATOL) -> torch.Tensor:
    """GRPO advantages ``(r - mean_g) / (std_g + eps)`` (or ``r - mean_g`` without std).

    Args:
        rewards: ``[N]`` float32, one outcome reward per sample.
        group_ids: ``[N]`` int64, the group of each sample (any labels, any order).
        eps: added to the std in the denominator.
        scale_std: divide by the group std (GRPO); False is Dr.GRPO.
        zero_std_atol: groups with ``std <= zero_std_atol`` get exactly 0.

    Returns:
        ``[N]`` float32 advantages, in input order; each group sums to 0.
    """
    stats = group_stats(rewards, group_ids)
    centred = rewards.to(torch.float64) - stats.mean
    adv = centred / (stats.std + eps) if scale_std else centred
    adv = torch.where(zero_variance(stats.std, zero_std_atol), torch.zeros_like(adv), adv)
    return adv.to(torch.float32)


def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *,
                       zero_std_atol: float = ZERO_STD_ATOL) -> torch.Tensor:
    """Dr.GRPO advantages ``r - mean_g`` (arXiv 2503.20783): GRPO without the std.

    Args:
        rewards: ``[N]`` float32; group_ids: ``[N]`` int64.

    Returns:
        ``[N]`` float32; each group sums to 0.
    """
    return grpo_advantages(rewards, group_ids, scale_std=False, zero_std_atol=zero_std_atol)
