"""RLOO: REINFORCE leave-one-out advantages (Ahmadian et al., arXiv 2402.14740).

``A_i = r_i - mean_{j != i} r_j``, which equals ``(r_i - mean_g) * n / (n - 1)``
(verl ``compute_rloo_outcome_advantage`` uses the same identity). A singleton group
has no baseline and gets 0; a zero-variance group (``std_g <= zero_std_atol``)
gets exactly 0.

Optional LOO std normalisation: divide by ``std_{j != i}(r_j) + eps``, the sample std
(``n - 2`` in the denominator) of the other samples. Where that std is zero (within
``zero_std_atol``; also when fewer than two others exist) the advantage is left
unnormalised, as NVIDIA-NeMo/RL PR #1519: dividing by ``eps`` would give +-1e6
(public case C03).

The LOO variance is computed from centred sums, without a loop:
``sum_{j != i} (r_j - mean_{-i})^2 = D - d_i^2 (1 + 1/m)`` where ``d_i = r_i - mean_g``,
``D = sum_g d^2`` and ``m = n - 1``.
"""

from __future__ import annotations

import torch

from relax.trainer.advantage.groups import ZERO_STD_ATOL, group_stats, zero_variance

RLOO_EPS = 1e-6


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, scale_std: bool = False,
                    eps: float = RLOO_EPS, zero_std_atol: float = ZERO_STD_ATOL) -> torch.Tensor:
    """Leave-one-out advantages, optionally divided by the leave-one-out std.

    Args:
        rewards: ``[N]`` float32 outcome rewards.
        group_ids: ``[N]`` int64 group of each sample (any labels, any order).
        scale_std: divide by ``std_{j != i} + eps`` where that std exceeds ``zero_std_atol``.
        eps: added to the LOO std in the denominator.
        zero_std_atol: LOO stds at most this skip normalisation.

    Returns:
        ``[N]`` float32. Without ``scale_std`` each group sums to 0.
    """
    stats = group_stats(rewards, group_ids)
    n = stats.size.to(torch.float64)
    m = n - 1
    d = rewards.to(torch.float64) - stats.mean
    no_signal = (m == 0) | zero_variance(stats.std, zero_std_atol)
    adv = torch.where(no_signal, torch.zeros_like(d), d * n / m.clamp(min=1))
    if not scale_std:
        return adv.to(torch.float32)
    loo_sq = (stats.sq_dev - d * d * (1 + 1 / m.clamp(min=1))).clamp(min=0)
    loo_std = torch.where(m > 1, (loo_sq / (m - 1).clamp(min=1)).sqrt(), torch.zeros_like(d))
    scaled = adv / (loo_std + eps)
    adv = torch.where(zero_variance(loo_std, zero_std_atol), adv, scaled)
    return adv.to(torch.float32)


def rloo_std_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """:func:`rloo_advantages` with LOO std normalisation on (``[N]`` -> ``[N]`` float32)."""
    return rloo_advantages(rewards, group_ids, scale_std=True)
