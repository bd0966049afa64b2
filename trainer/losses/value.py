"""The critic's clipped value loss (PPO).

Per token, with the critic's new prediction ``v``, its prediction when the rollout was
scored ``v_old`` and the GAE return ``R`` (:func:`relax.trainer.advantage.gae.gae_advantages`):

``loss = 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)``

The clip keeps the new value within ``c`` of the old one, as the policy ratio is kept
near 1 (the value clipping of OpenAI baselines' ``ppo2``; Engstrom et al.,
"Implementation Matters in Deep Policy Gradients", ICLR 2020, arXiv 2005.12729,
section 3, "Value function clipping"). This
is veRL's ``compute_value_loss`` and TRL's ``PPOTrainer`` value loss (``vf_loss``),
both ``0.5 * masked_mean(max(...))``: the aggregation here is the caller's
(``token-mean`` gives their value). ``c = None`` is the unclipped squared error.

Metric ``vf_clip_frac`` (per token): 1 where the clipped term is the larger one, i.e.
where the clip sets the loss (veRL ``vf_clipfrac``: ``vf_losses2 > vf_losses1``).
"""

from __future__ import annotations

import torch


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       *, clip_range: float | None,
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped value loss (module docstring).

    Args:
        values: ``[B, T]`` float32 new critic predictions (differentiable).
        old_values: ``[B, T]`` float32 predictions of the critic that scored the rollout.
        returns: ``[B, T]`` float32 GAE returns (value targets).
        clip_range: ``c`` (> 0), or None for no clipping.

    Returns:
        ``(loss [B, T] float32, {"vf_clip_frac": [B, T] float32 detached})``; masking
        and aggregation are the caller's.
    """
    returns = returns.detach()
    plain = (values - returns).square()
    if clip_range is None:
        return 0.5 * plain, {"vf_clip_frac": torch.zeros_like(plain.detach())}
    old = old_values.detach()
    clipped = (torch.clamp(values, old - clip_range, old + clip_range) - returns).square()
    loss = 0.5 * torch.maximum(plain, clipped)
    return loss, {"vf_clip_frac": (clipped.detach() > plain.detach()).float()}
