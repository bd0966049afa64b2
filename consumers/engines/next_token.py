"""Picking the next token from temperature-scaled logits: top-k / top-p filtering and
one exact sample per row (the HF engine's sampling step)."""

from __future__ import annotations

import torch


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens top-k / top-p sampling excludes.

    ``scaled``: ``[B, V]`` float32 logits / temperature. Top-p keeps a token iff the
    probability mass of the tokens ranked before it is ``< top_p`` (the rule of
    ``relax.trainer.logprobs.top_p_log_mass``); at least one token is always kept.
    """
    out = scaled
    if top_k and top_k < scaled.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = out.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One exact sample per row of ``probs`` (``[B, V]``, rows sum to 1, masked tokens 0)
    by inverse-CDF: one uniform per row and a binary search in the float64 cumulative
    sum. Much faster on CPU than ``torch.multinomial`` or a Gumbel race, which draw V
    random numbers per row. Returns ``[B, 1]`` int64."""
    cdf = probs.double().cumsum(dim=-1)
    u = (
        torch.rand((probs.shape[0], 1), generator=gen, device=probs.device, dtype=torch.float64)
        * cdf[:, -1:]
    )
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)


__all__ = ["filter_logits", "sample"]
