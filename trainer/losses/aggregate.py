"""Loss aggregation ``[B, T] -> scalar`` that does not depend on the micro-batch split.

Every mode divides by a GLOBAL count passed in by the caller (the whole optimizer
step's batch: every micro-batch, every data-parallel rank), so the sum of the
micro-batch results equals the full-batch value and no extra division by the
number of accumulation steps is needed (public case C06, verl #5625; ms-swift
#10117 divided a second time). With data parallelism, gradients must then be
SUMMED across ranks (or the averaged gradient multiplied by the world size).

Modes (verl ``agg_loss`` names; ``m`` = loss_mask, ``x`` = per-token values):

* ``token-mean``: ``sum_{b,t} m x / global_tokens`` (DAPO).
* ``seq-mean-token-mean``: ``sum_b (sum_t m x / sum_t m) / global_seqs`` (GRPO).
* ``seq-mean-token-sum``: ``sum_b sum_t m x / global_seqs``.
* ``seq-mean-token-sum-norm``: ``sum_b sum_t m x / (global_seqs * norm_divisor)``
  with a constant ``norm_divisor`` (Dr.GRPO, arXiv 2503.20783; public case C08, verl
  #3741 / PR #5417: a mean over sequences, not a sum).

``global_tokens`` counts loss tokens; ``global_seqs`` counts sequences with at least
one loss token (:func:`mask_counts`), so fully masked (e.g. overlong-filtered) rows
do not dilute the mean. Masked positions contribute exactly 0 to the value and to
the gradient even when they hold NaN or inf: values are selected with
``torch.where``, never multiplied by the mask (C07, alibaba/ROLL PR #444).
Counts of 0 are treated as 1 (an all-masked batch gives loss 0, zero gradient).
"""

from __future__ import annotations

import torch

Count = int | float | torch.Tensor


def mask_counts(loss_mask: torch.Tensor) -> tuple[int, int]:
    """``(loss tokens, sequences with >= 1 loss token)`` of a ``[B, T]`` mask.

    Sum these over every micro-batch (and rank) of a step to get ``global_tokens``
    and ``global_seqs``.
    """
    m = loss_mask.bool()
    return int(m.sum()), int(m.any(dim=-1).sum())


def _masked(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    if values.shape != loss_mask.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != loss_mask shape "
                         f"{tuple(loss_mask.shape)}")
    return torch.where(loss_mask.bool(), values, torch.zeros_like(values))


def _positive(count: Count) -> Count:
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def token_mean(values: torch.Tensor, loss_mask: torch.Tensor, *, global_tokens: Count,
               global_seqs: Count, norm_divisor: float | None = None) -> torch.Tensor:
    """``sum(m * x) / global_tokens``. values ``[B, T]`` float, loss_mask ``[B, T]``; -> scalar."""
    return _masked(values, loss_mask).sum() / _positive(global_tokens)


def seq_mean_token_mean(values: torch.Tensor, loss_mask: torch.Tensor, *, global_tokens: Count,
                        global_seqs: Count, norm_divisor: float | None = None) -> torch.Tensor:
    """``sum_b mean_t(x_b over its loss tokens) / global_seqs`` (``[B, T]`` -> scalar)."""
    per_seq = _masked(values, loss_mask).sum(dim=-1)
    tokens = loss_mask.bool().sum(dim=-1).clamp(min=1)
    return (per_seq / tokens).sum() / _positive(global_seqs)


def seq_mean_token_sum(values: torch.Tensor, loss_mask: torch.Tensor, *, global_tokens: Count,
                       global_seqs: Count, norm_divisor: float | None = None) -> torch.Tensor:
    """``sum_b sum_t(x_b over its loss tokens) / global_seqs`` (``[B, T]`` -> scalar)."""
    return _masked(values, loss_mask).sum() / _positive(global_seqs)


def seq_mean_token_sum_norm(values: torch.Tensor, loss_mask: torch.Tensor, *,
                            global_tokens: Count, global_seqs: Count,
                            norm_divisor: float | None = None) -> torch.Tensor:
    """``sum_b sum_t(x_b) / (global_seqs * norm_divisor)`` (``[B, T]`` -> scalar).

    ``norm_divisor`` is a constant (tokens), e.g. the maximum response length; the
    padded width of a micro-batch would break split invariance, so it is required.
    """
    if norm_divisor is None or not norm_divisor > 0:
        raise ValueError(f"seq-mean-token-sum-norm needs a constant norm_divisor > 0, "
                         f"got {norm_divisor}")
    return _masked(values, loss_mask).sum() / (_positive(global_seqs) * norm_divisor)
