"""GSPO: Group Sequence Policy Optimization (Zheng et al., Qwen, arXiv 2507.18071).

The importance ratio is per sequence, the geometric mean of the token ratios over
the loss tokens: ``s_i = exp(mean_t (log pi_theta(y_t) - log pi_old(y_t)))``, and is
clipped PPO-style (the paper's ranges are much smaller than token PPO's, e.g.
3e-4 / 4e-4).

Token form (the paper's GSPO-token, Eq. 13-14), used here so that per-token
advantages also work: ``s_{i,t} = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]``,
i.e. in log space ``log s_{i,t} = log_pi - sg[log_pi] + sg[log s_i]``. Its value
is ``s_i`` at every token and, with the sequence advantage on every token, its
gradient under ``seq-mean-token-mean`` equals the sequence-level GSPO gradient
(checked against TRL's ``importance_sampling_level="sequence"`` in the tests).
verl ``compute_policy_loss_gspo`` uses the same form.
"""

from __future__ import annotations

import torch

from relax.trainer.losses.config import LossConfig
from relax.trainer.losses.ppo_clip import clipped_surrogate
from relax.trainer.losses.ratio import sequence_mean_log_ratio


def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              loss_mask: torch.Tensor, cfg: LossConfig,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token clipped loss.

    Args:
        logprobs: ``[B, T]`` float32 current-policy log-probs (differentiable).
        old_logprobs: ``[B, T]`` float32 pi_old log-probs.
        advantages: ``[B, T]`` float32 (the sequence advantage on every token).
        loss_mask: ``[B, T]``, the tokens of the sequence ratio.
        cfg: uses ``clip_eps_low``, ``clip_eps_high``.

    Returns:
        ``(loss [B, T], metrics)`` with ``clip_frac_low`` / ``clip_frac_high`` per token
        (a whole sequence is clipped or not) and ``seq_ratio``.
    """
    log_seq = sequence_mean_log_ratio(logprobs.detach(), old_logprobs, loss_mask)
    log_token = logprobs - logprobs.detach() + log_seq
    ratio = log_token.exp()
    loss, metrics = clipped_surrogate(ratio, advantages, eps_low=cfg.clip_eps_low,
                                      eps_high=cfg.clip_eps_high)
    metrics["seq_ratio"] = ratio.detach()
    return loss, metrics
