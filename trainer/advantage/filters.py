"""Sample filters and length shaping applied by the advantage stage (DAPO, arXiv 2503.14476).

* Dynamic sampling (DAPO section 3.2): drop groups whose rewards have no variance
  (all right or all wrong): they give zero advantage and only dilute the batch.
  Zero variance is ``std <= atol`` (tolerance, not ``std > 0``), the same test the
  estimators use (``relax.trainer.advantage.groups``).
* Overlong filtering (DAPO section 3.4): a truncated sample (``finish_reason ==
  "length"``) keeps its row but its ``loss_mask`` becomes all 0.
* Soft overlong punishment (DAPO Eq. 13): a reward penalty that grows linearly over
  the last ``cache_length`` tokens before ``max_length``.

Truncation is decided by the engine's ``finish_reason`` or by lengths, never by
the last token id: models may end turns with a chat token that differs from the
tokenizer's EOS id (public case C23, SkyRL PR #1319).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from relax.trainer.advantage.groups import ZERO_STD_ATOL, group_stats, zero_variance

TRUNCATED_REASONS = frozenset({"length"})
"""finish_reason values that mean "cut off by the token limit"."""


def keep_groups_with_variance(rewards: torch.Tensor, group_ids: torch.Tensor, *,
                              atol: float = ZERO_STD_ATOL) -> torch.Tensor:
    """DAPO dynamic sampling: which samples belong to a group with reward variance.

    Args:
        rewards: ``[N]`` float32 outcome rewards.
        group_ids: ``[N]`` int64 group of each sample (any labels, any order).
        atol: groups with reward std ``<= atol`` are dropped (singletons too).

    Returns:
        ``[N]`` bool, True = keep.
    """
    return ~zero_variance(group_stats(rewards, group_ids).std, atol)


def overlong_filter(loss_mask: torch.Tensor, finish_reasons: Sequence[str], *,
                    reasons: Collection[str] = TRUNCATED_REASONS) -> torch.Tensor:
    """Zero the ``loss_mask`` of samples whose ``finish_reason`` is in ``reasons``.

    Args:
        loss_mask: ``[B, T]`` int/bool loss mask.
        finish_reasons: ``B`` engine stop reasons (``schemas.v1.FINISH_REASONS``).
        reasons: the reasons that mean truncated; default ``{"length"}``.

    Returns:
        a new ``[B, T]`` mask of the same dtype; other rows are unchanged.
    """
    if len(finish_reasons) != loss_mask.shape[0]:
        raise ValueError(f"{len(finish_reasons)} finish_reasons for {loss_mask.shape[0]} samples")
    truncated = torch.tensor([r in reasons for r in finish_reasons], dtype=torch.bool,
                             device=loss_mask.device)
    return torch.where(truncated[:, None], torch.zeros_like(loss_mask), loss_mask)


def soft_overlong_penalty(response_lengths: torch.Tensor, *, max_length: int,
                          cache_length: int) -> torch.Tensor:
    """DAPO soft overlong punishment (Eq. 13), added to the outcome reward.

    ``0`` if ``L <= max_length - cache_length``;
    ``(max_length - cache_length - L) / cache_length`` (from 0 down to -1) inside the
    last ``cache_length`` tokens; ``-1`` beyond ``max_length``.

    Args:
        response_lengths: ``[N]`` int64 generated tokens per sample (not inferred from
            token values).
        max_length: ``L_max``, the maximum response length (tokens).
        cache_length: ``L_cache``, the punishment window (tokens), ``0 < L_cache <= L_max``.

    Returns:
        ``[N]`` float32 penalties in ``[-1, 0]``.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got {cache_length}, {max_length}")
    length = response_lengths.to(torch.float64)
    start = max_length - cache_length
    penalty = ((start - length) / cache_length).clamp(min=-1.0, max=0.0)
    return penalty.to(torch.float32)
