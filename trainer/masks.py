"""Masks built from lengths, never from token values.

With ``pad_token_id == eos_token_id`` (common: many chat models pad with EOS), a
mask like ``token_ids != pad_id`` hides the terminating EOS, so the model never
learns to stop, and hides prompt tokens that happen to equal that id (chat
markers). Public case C24 (huggingface/trl PR #6357). Lengths come from the rollout
(``len(response_ids)``, the prompt length), so they are always right.
"""

from __future__ import annotations

from typing import Literal

import torch


def lengths_to_mask(lengths: torch.Tensor, width: int, *,
                    padding_side: Literal["right", "left"] = "right") -> torch.Tensor:
    """Boolean mask of the real positions of padded sequences.

    Args:
        lengths: ``[B]`` int64 true lengths (``0 <= length <= width``).
        width: padded length ``T``.
        padding_side: ``"right"`` (completions: real tokens first) or ``"left"``
            (prompts left-padded for generation: real tokens last).

    Returns:
        ``[B, T]`` bool, True on real tokens.
    """
    if lengths.dim() != 1:
        raise ValueError(f"lengths must have shape [B], got {tuple(lengths.shape)}")
    if bool((lengths < 0).any()) or bool((lengths > width).any()):
        raise ValueError(f"lengths must lie in [0, {width}], got {lengths.tolist()}")
    positions = torch.arange(width, device=lengths.device)[None, :]
    if padding_side == "right":
        return positions < lengths[:, None]
    if padding_side == "left":
        return positions >= (width - lengths)[:, None]
    raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")


def completion_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, T]`` bool loss/label mask of right-padded completions: the first
    ``lengths[b]`` positions, the terminating EOS included (C24)."""
    return lengths_to_mask(lengths, width, padding_side="right")
