"""REINFORCE++ and REINFORCE++-baseline (Hu et al., arXiv 2501.03262).

* REINFORCE++: global batch normalisation of the outcome rewards,
  ``A_i = (r_i - mean_batch) / (std_batch + eps)``; groups are not used.
* REINFORCE++-baseline: subtract the group mean, then divide by the std of those
  centred values over the whole batch, ``A_i = c_i / (std_batch(c) + eps)`` with
  ``c_i = r_i - mean_g``. ``c`` already has batch mean 0 (each group sums to 0, a
  singleton gives 0), so no second mean is subtracted and each group still sums to 0.

In a run these are computed by the trainer over each step's whole batch
(:mod:`relax.trainer.advantage.batch`), not by the aggregator over one group.

Stds are sample stds (``n - 1``). In the baseline variant a zero-variance group
(``std_g <= zero_std_atol``) gets exactly 0, as in every group estimator. When the batch std is zero (within
``zero_std_atol``) the centred values are returned unscaled (all zero then).

Convention vs verl (``compute_reinforce_plus_plus*_outcome_advantage``): verl
whitens the per-token returns (``masked_whiten``), i.e. weights each sample by its
number of response tokens and uses ``sqrt(var + 1e-8)``; relax normalises over
samples (one outcome reward per sample), so long responses do not dominate the
statistics. With a KL-in-reward penalty the per-token rewards are handled by
``relax.trainer.losses.kl.kl_in_reward``, not here.
"""

from __future__ import annotations

import torch

from relax.trainer.advantage.groups import (ZERO_STD_ATOL, check_rewards, group_stats,
                                              zero_variance)

REINFORCE_PP_EPS = 1e-6


def _scale_by_batch_std(centred: torch.Tensor, eps: float, zero_std_atol: float) -> torch.Tensor:
    if centred.numel() < 2:
        return centred
    std = centred.std(unbiased=True)
    return centred if std <= zero_std_atol else centred / (std + eps)


def reinforce_pp_advantages(rewards: torch.Tensor, group_ids: torch.Tensor | None = None, *,
                            eps: float = REINFORCE_PP_EPS,
                            zero_std_atol: float = ZERO_STD_ATOL) -> torch.Tensor:
    """REINFORCE++ advantages: rewards normalised over the whole batch.

    Args:
        rewards: ``[N]`` float32 outcome rewards.
        group_ids: ``[N]`` int64, accepted for a uniform signature and ignored.
        eps: added to the batch std.
        zero_std_atol: a batch std at most this skips the division.

    Returns:
        ``[N]`` float32 with batch mean 0.
    """
    check_rewards(rewards)
    r = rewards.to(torch.float64)
    return _scale_by_batch_std(r - r.mean(), eps, zero_std_atol).to(torch.float32)


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *,
                                     eps: float = REINFORCE_PP_EPS,
                                     zero_std_atol: float = ZERO_STD_ATOL) -> torch.Tensor:
    """REINFORCE++-baseline: group-mean subtraction, then division by the batch std.

    Args:
        rewards: ``[N]`` float32 outcome rewards.
        group_ids: ``[N]`` int64 group of each sample (any labels, any order).
        eps: added to the batch std of the centred rewards.
        zero_std_atol: a batch std at most this skips the division.

    Returns:
        ``[N]`` float32; each group sums to 0.
    """
    stats = group_stats(rewards, group_ids)
    centred = rewards.to(torch.float64) - stats.mean
    centred = torch.where(zero_variance(stats.std, zero_std_atol), torch.zeros_like(centred), centred)
    return _scale_by_batch_std(centred, eps, zero_std_atol).to(torch.float32)
