"""KL to the reference policy: k1, k2, k3 estimators, in the loss or in the reward.

Estimators of ``KL(pi_theta || pi_ref)`` per token from samples of pi_theta
(J. Schulman, "Approximating KL Divergence", 2020, http://joschu.net/blog/kl-approx.html),
with ``d = logprobs - ref_logprobs``:

* ``k1 = d`` (unbiased, high variance, can be negative);
* ``k2 = d^2 / 2`` (biased, low variance);
* ``k3 = exp(-d) - 1 + d`` (unbiased, >= 0, low variance), named ``low_var_kl`` in
  verl. With verl's clamps (``kl_penalty_forward`` in ``core_algos.py``): ``-d`` is
  clamped to ``[-20, 20]`` before ``exp`` and the result to ``[-10, 10]``.

Each name maps to its own function (public case C09: a fall-through once turned
k1/k2 into k3). Placement: ``LossConfig.kl_in`` is ``"loss"`` (``compute_policy_loss``
adds ``kl_coef * aggregate(kl)``) or ``"reward"`` (the advantage stage calls
:func:`kl_in_reward`), never both.
"""

from __future__ import annotations

import torch

K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``logprobs - ref_logprobs``; ``[B, T]`` float32 -> ``[B, T]`` float32."""
    return logprobs - ref_logprobs


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``(logprobs - ref_logprobs)^2 / 2``; ``[B, T]`` float32 -> ``[B, T]`` float32."""
    return 0.5 * (logprobs - ref_logprobs).square()


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``clamp(exp(x) - x - 1, -10, 10)`` with ``x = clamp(ref_logprobs - logprobs, -20, 20)``
    (low_var_kl, verl's clamps); ``[B, T]`` float32 -> ``[B, T]`` float32."""
    x = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (x.exp() - x - 1).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)


def kl_in_reward(token_scores: torch.Tensor, kl: torch.Tensor, loss_mask: torch.Tensor,
                 kl_coef: float) -> torch.Tensor:
    """Token rewards with the KL penalty: ``token_scores - kl_coef * kl`` on loss tokens.

    Used by the advantage stage when ``kl_in == "reward"`` (then the loss gets no KL
    term). verl ``compute_rewards`` / ``apply_kl_penalty``; public case C09 input 3.

    Args:
        token_scores: ``[B, T]`` float32 (e.g. the outcome reward on the last token).
        kl: ``[B, T]`` float32 per-token KL estimate (k1/k2/k3 of rollout vs reference).
        loss_mask: ``[B, T]``; other positions keep their score.
        kl_coef: beta.

    Returns:
        ``[B, T]`` float32 token rewards.
    """
    return torch.where(loss_mask.bool(), token_scores - kl_coef * kl, token_scores)
