"""GAE: generalized advantage estimation from per-token rewards and a critic's values.

Schulman, Moritz, Levine, Jordan, Abbeel, "High-Dimensional Continuous Control Using
Generalized Advantage Estimation" (ICLR 2016, arXiv 1506.02438), section 3:

* TD residual (Eq. 10): ``delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)``;
* GAE(gamma, lambda) (Eq. 16): ``A_t = sum_{l >= 0} (gamma * lambda)^l * delta_{t+l}``,
  computed backwards as ``A_t = delta_t + gamma * lambda * A_{t+1}``;
* ``lambda = 0`` gives ``A_t = delta_t`` (Eq. 17) and ``lambda = 1`` gives
  ``A_t = sum_l gamma^l r_{t+l} - V(s_t)`` (Eq. 18);
* the value target (the critic's return) is ``R_t = A_t + V(s_t)``, the
  lambda-return (section 5, as PPO, Schulman et al. 2017, arXiv 1707.06347, Eq. 11-12).

One token is one step; the episode ends after the last loss token (``V = 0`` there:
a finished response has no future reward). Tokens with ``loss_mask == 0`` inside a
response (tool output, observations: a mask with holes) are not steps: they get no TD
residual and no discount, and the step before a hole bootstraps from the value of the
next loss token after it. This is veRL's ``compute_gae_advantage_return``
(``verl/trainer/ppo/core_algos.py``) token for token on loss tokens; veRL copies the
next loss token's advantage into the masked positions, relax writes 0 there (no loss
ever reads them). TRL's ``PPOTrainer`` runs the same recurrence without the mask (its
padding sits after the response with values and rewards 0, so the results agree on
unpadded tokens); it has no holes.

Both veRL and TRL then whiten the advantages over the whole batch's loss tokens
(:func:`masked_whiten`); that is a separate call here, because it needs the global
batch (like :mod:`relax.trainer.advantage.batch`), not one group.

Where it runs (``advantage.estimator: gae``,
:data:`~relax.trainer.advantage.names.CRITIC_ESTIMATORS`): in the trainer
process, which holds the critic (:mod:`relax.trainer.critic`): its values of the step's
batch, :func:`gae_advantages` per row, :func:`masked_whiten` over the batch. The
aggregator writes 0 advantages for such an estimator (:func:`trainer_computed`); the
trainer replaces them.
"""

from __future__ import annotations

import numpy as np
import torch

WHITEN_EPS = 1e-8
"""Added to the variance before the square root (veRL and TRL ``masked_whiten``)."""


def trainer_computed(rewards: torch.Tensor, group_ids: torch.Tensor, *, gamma: float = 1.0,
                     lam: float = 1.0) -> torch.Tensor:
    """The aggregator's advantages for
    :data:`~relax.trainer.advantage.names.CRITIC_ESTIMATORS`: ``[N]`` float32 zeros.
    GAE needs the critic's values, which the trainer holds; it replaces these with
    :func:`gae_advantages` of the step's batch (``gamma`` and ``lam`` are accepted, as
    ``advantage.estimator_options``, and used there).

    Raises:
        ValueError: gamma or lam outside ``[0, 1]``.
    """
    for name, v in (("gamma", gamma), ("lam", lam)):
        if not 0 <= v <= 1:
            raise ValueError(f"advantage.estimator_options.{name} must be in [0, 1], got {v}")
    return torch.zeros(rewards.shape, dtype=torch.float32)


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, *,
                   gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns (module docstring), per token.

    Args:
        rewards: ``[B, T]`` float per-token rewards (e.g. the outcome reward on the last
            loss token, :func:`outcome_token_rewards`, minus a KL penalty per token).
        values: ``[B, T]`` float critic values ``V(s_t)`` of the state before token ``t``.
        loss_mask: ``[B, T]`` bool/int, 1 on the tokens that are steps.
        gamma: discount per token, in ``[0, 1]``.
        lam: GAE lambda, in ``[0, 1]``.

    Returns:
        ``(advantages [B, T] float32, returns [B, T] float32)``, both 0 where
        ``loss_mask`` is 0. ``returns = advantages + values`` on loss tokens.

    Raises:
        ValueError: on shape mismatch, or gamma / lam outside ``[0, 1]``.
    """
    for name, t in (("values", values), ("loss_mask", loss_mask)):
        if t.shape != rewards.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != rewards shape "
                             f"{tuple(rewards.shape)}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, T], got shape {tuple(rewards.shape)}")
    for name, v in (("gamma", gamma), ("lam", lam)):
        if not 0 <= v <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {v}")
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=torch.float64, device=rewards.device)
    r = torch.where(mask, rewards.to(torch.float64), zero)  # NaN at masked positions is ignored
    v = torch.where(mask, values.to(torch.float64), zero)
    next_value = torch.zeros(rewards.shape[0], dtype=torch.float64, device=rewards.device)
    last_adv = torch.zeros_like(next_value)
    adv = torch.zeros_like(r)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        step_adv = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * last_adv
        last_adv = torch.where(m, step_adv, last_adv)
        next_value = torch.where(m, v[:, t], next_value)
        adv[:, t] = torch.where(m, step_adv, zero)
    returns = torch.where(mask, adv + v, zero)
    return adv.to(torch.float32), returns.to(torch.float32)


def gae_for_rows(rewards: np.ndarray, values: list[np.ndarray], loss_masks: list[np.ndarray],
                 *, gamma: float, lam: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """GAE of rollouts of any lengths, as the aggregator holds them: each rollout's
    outcome reward on its last loss token (:func:`outcome_token_rewards`), then
    :func:`gae_advantages`.

    Args:
        rewards: ``[N]`` float final rewards.
        values: per rollout, ``[T_i]`` float critic values of its response tokens.
        loss_masks: per rollout, ``[T_i]`` 0/1 loss_mask.
        gamma, lam: as :func:`gae_advantages`.

    Returns:
        ``(advantages, returns)``: per rollout, ``[T_i]`` float32 each (0 off the mask).

    Raises:
        ValueError: a rollout's values and loss_mask differ in length, or the counts of
            rewards, values and masks differ (naming the rollout).
    """
    if not len(rewards) == len(values) == len(loss_masks):
        raise ValueError(f"{len(rewards)} rewards, {len(values)} value rows and "
                         f"{len(loss_masks)} loss_masks: expected one of each per rollout")
    for i, (v, m) in enumerate(zip(values, loss_masks)):
        if len(v) != len(m):
            raise ValueError(f"rollout {i}: {len(v)} values for {len(m)} response tokens")
    lengths = [len(m) for m in loss_masks]
    width = max(lengths, default=0)
    pad_v = np.zeros((len(lengths), width), dtype=np.float32)
    pad_m = np.zeros((len(lengths), width), dtype=bool)
    for i, (v, m) in enumerate(zip(values, loss_masks)):
        pad_v[i, :len(v)] = v
        pad_m[i, :len(m)] = np.asarray(m, dtype=bool)
    mask = torch.from_numpy(pad_m)
    token_rewards = outcome_token_rewards(torch.as_tensor(np.asarray(rewards)), mask)
    adv, ret = gae_advantages(token_rewards, torch.from_numpy(pad_v), mask, gamma=gamma, lam=lam)
    return ([adv[i, :n].numpy() for i, n in enumerate(lengths)],
            [ret[i, :n].numpy() for i, n in enumerate(lengths)])


def outcome_token_rewards(scores: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards of outcome scores: each row's score on its last loss token, 0
    elsewhere (veRL's ``token_level_scores``; TRL puts the score on the last response
    token). A row with no loss token gets no reward.

    Args:
        scores: ``[B]`` float, one outcome reward per row.
        loss_mask: ``[B, T]`` bool/int.

    Returns:
        ``[B, T]`` float32.
    """
    mask = loss_mask.bool()
    t = mask.shape[1]
    last = torch.where(mask, torch.arange(t, device=mask.device), -1).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = scores.to(torch.float32)[rows]
    return out


def masked_whiten(values: torch.Tensor, loss_mask: torch.Tensor, *,
                  eps: float = WHITEN_EPS) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the loss tokens, the unbiased variance
    (``n - 1``), as veRL's and TRL's ``masked_whiten(shift_mean=True)``.

    Args:
        values: ``[B, T]`` float (e.g. GAE advantages of the whole batch).
        loss_mask: ``[B, T]`` bool/int; masked positions are ignored and set to 0.

    Returns:
        ``[B, T]`` float32. With fewer than 2 loss tokens every loss token is 0 (veRL
        raises there; a one-token batch has no spread to whiten by).
    """
    if values.shape != loss_mask.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != loss_mask shape "
                         f"{tuple(loss_mask.shape)}")
    mask = loss_mask.bool()
    x = values.to(torch.float64)
    n = int(mask.sum())
    if n < 2:
        return torch.zeros(values.shape, dtype=torch.float32, device=values.device)
    picked = x[mask]
    mean = picked.mean()
    var = (picked - mean).square().sum() / (n - 1)
    out = torch.where(mask, (x - mean) * torch.rsqrt(var + eps), torch.zeros_like(x))
    return out.to(torch.float32)
