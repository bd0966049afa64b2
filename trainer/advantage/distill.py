"""On-policy distillation: per-token advantages from a teacher's log-probs.

The student samples a response; the teacher scores the same tokens. The per-token
reverse KL ``KL(student || teacher)`` is estimated on the student's own samples by
``log pi_s(y_t) - log pi_t(y_t)`` (Schulman's k1), and its negative, scaled by
``coef`` (lambda), is the token's advantage:
``A_t = -coef * (logprobs_t - teacher_logprobs_t)``.
A policy-gradient loss on these advantages minimises the reverse KL to the teacher.

References: Agarwal et al., "On-Policy Distillation of Language Models: Learning
from Self-Generated Mistakes" (GKD, arXiv 2306.13649); Thinking Machines Lab,
"On-Policy Distillation" (2025), per-token reverse-KL advantage; TRL's GKD/GOLD
trainers. Both log-prob tensors must come from temperature-scaled logits the same
way (``relax.trainer.logprobs.token_logprobs``) and be masked by lengths, never by
token values (public case C24).
"""

from __future__ import annotations

import torch


def distill_advantages(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                       loss_mask: torch.Tensor, *, coef: float = 1.0) -> torch.Tensor:
    """Per-token advantage ``-coef * (logprobs - teacher_logprobs)`` on loss tokens.

    Args:
        logprobs: ``[B, T]`` float32 student log-probs of the sampled tokens.
        teacher_logprobs: ``[B, T]`` float32 teacher log-probs of the same tokens.
        loss_mask: ``[B, T]`` bool/int, 1 on the positions to train.
        coef: lambda, the weight of the reverse-KL advantage.

    Returns:
        ``[B, T]`` float32, exactly 0 where ``loss_mask`` is 0 (even if the inputs
        hold NaN or inf there). Detached: advantages carry no gradient.
    """
    if logprobs.shape != teacher_logprobs.shape or logprobs.shape != loss_mask.shape:
        raise ValueError(f"shapes differ: logprobs {tuple(logprobs.shape)}, teacher_logprobs "
                         f"{tuple(teacher_logprobs.shape)}, loss_mask {tuple(loss_mask.shape)}")
    reverse_kl = logprobs.detach().float() - teacher_logprobs.detach().float()
    return torch.where(loss_mask.bool(), -coef * reverse_kl, torch.zeros_like(reverse_kl))
