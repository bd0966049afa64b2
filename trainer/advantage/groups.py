"""Per-group reward statistics, vectorised with ``index_add_`` (no loop over groups).

Shared by every group estimator (GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline) and by
the DAPO dynamic-sampling filter, so "zero variance" means one thing everywhere.

Conventions (public cases C01, C02):

* Groups are given by ``group_ids [N] int64``: any integer labels, samples in any
  order (interleaved prompts are fine). Position never defines a group.
* ``std`` is the sample standard deviation (Bessel, ``n - 1``) of the group, the
  convention of ``torch.std``, TRL (``nanstd``) and verl. A singleton group has
  ``std = 0`` (not NaN).
* A group has zero variance iff ``std <= atol`` (default ``ZERO_STD_ATOL``), a
  tolerance rather than ``std > 0``, so rewards like 0.3 and 0.1 + 0.2 count as equal.
* Statistics are computed in float64; estimators return float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

ZERO_STD_ATOL = 1e-6
"""A group whose reward std is at most this is a zero-variance group."""


class GroupStats(NamedTuple):
    """Statistics of each sample's group, broadcast back to the samples (all ``[N]``)."""

    mean: torch.Tensor
    """group mean, float64"""
    std: torch.Tensor
    """group sample std (n - 1), float64; 0 for singletons"""
    size: torch.Tensor
    """group size, int64"""
    sq_dev: torch.Tensor
    """sum over the group of squared deviations from the group mean, float64"""


def check_rewards(rewards: torch.Tensor, group_ids: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` unless ``rewards`` is a finite ``[N]`` tensor and
    ``group_ids`` (if given) an integer ``[N]`` tensor."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape [N], got {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite (null/abstained rewards are resolved upstream)")
    if group_ids is None:
        return
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids shape {tuple(group_ids.shape)} != rewards shape "
                         f"{tuple(rewards.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> GroupStats:
    """Mean, sample std, size and squared-deviation sum of each sample's group.

    Args:
        rewards: ``[N]`` float, one scalar reward per sample.
        group_ids: ``[N]`` int64, the group (prompt sampling group) of each sample.

    Returns:
        :class:`GroupStats`, every field ``[N]`` (per sample, in input order).
    """
    check_rewards(rewards, group_ids)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    r = rewards.to(torch.float64)
    n_groups = counts.numel()
    sums = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, inverse, r)
    mean = (sums / counts)[inverse]
    dev = r - mean
    sq = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, inverse, dev * dev)
    sq_dev = sq[inverse]
    size = counts[inverse]
    std = (sq_dev / (size - 1).clamp(min=1)).sqrt()
    return GroupStats(mean=mean, std=std, size=size, sq_dev=sq_dev)


def zero_variance(std: torch.Tensor, atol: float = ZERO_STD_ATOL) -> torch.Tensor:
    """``[N] bool``: True where the group's reward std is at most ``atol``."""
    return std <= atol
