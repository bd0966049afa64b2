"""GAE advantages and returns, and the clipped value loss (trainer/advantage/gae.py,
trainer/losses/value.py).

Reference values are worked out by hand from Schulman et al. 2016 (arXiv 1506.02438):
``delta_t = r_t + gamma V_{t+1} - V_t`` (Eq. 10), ``A_t = sum_l (gamma lam)^l delta_{t+l}``
(Eq. 16), ``R_t = A_t + V_t``; the value loss from PPO's clipped value objective as veRL's
``compute_value_loss`` / TRL's ``vf_loss`` write it. The working is in the comments.
"""

import math

import numpy as np
import pytest
import torch

from relax.trainer.advantage.gae import (
    gae_advantages,
    gae_for_rows,
    masked_whiten,
    outcome_token_rewards,
)
from relax.trainer.advantage.registry import compute_advantages
from relax.trainer.losses import aggregate
from relax.trainer.losses.config import ValueLossConfig
from relax.trainer.losses.registry import compute_value_loss
from relax.trainer.losses.value import clipped_value_loss

NAN = float("nan")


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected):
    torch.testing.assert_close(actual, t(expected), atol=1e-6, rtol=1e-6)


# one response of 3 tokens, outcome reward 1 on the last one
R3 = [[0.0, 0.0, 1.0]]
V3 = [[0.5, 0.6, 0.7]]
FULL3 = torch.ones(1, 3, dtype=torch.bool)


@pytest.mark.parametrize("gamma, lam, adv, ret", [
    # gamma = lam = 1 (Eq. 18): A_t = sum r - V_t = 1 - V_t; R_t = 1.
    (1.0, 1.0, [[0.5, 0.4, 0.3]], [[1.0, 1.0, 1.0]]),
    # gamma .9, lam .5: delta = [.9*.6-.5, .9*.7-.6, 1-.7] = [.04, .03, .3];
    # A2 = .3, A1 = .03 + .45*.3 = .165, A0 = .04 + .45*.165 = .11425.
    (0.9, 0.5, [[0.11425, 0.165, 0.3]], [[0.61425, 0.765, 1.0]]),
    # lam = 0 (Eq. 17): A_t = delta_t.
    (0.9, 0.0, [[0.04, 0.03, 0.3]], [[0.54, 0.63, 1.0]]),
    (1.0, 0.0, [[0.1, 0.1, 0.3]], [[0.6, 0.7, 1.0]]),
    # gamma = 0: A_t = r_t - V_t whatever lam; the return is the reward itself.
    (0.0, 1.0, [[-0.5, -0.6, 0.3]], [[0.0, 0.0, 1.0]]),
    (0.0, 0.0, [[-0.5, -0.6, 0.3]], [[0.0, 0.0, 1.0]]),
    # gamma 1, lam .5: delta = [.1, .1, .3]; A2 = .3, A1 = .1 + .15 = .25, A0 = .1 + .125.
    (1.0, 0.5, [[0.225, 0.25, 0.3]], [[0.725, 0.85, 1.0]]),
])
def test_hand_computed_values_and_gamma_lam_edges(gamma, lam, adv, ret):
    a, r = gae_advantages(t(R3), t(V3), FULL3, gamma=gamma, lam=lam)
    close(a, adv)
    close(r, ret)
    assert a.dtype == r.dtype == torch.float32


def test_last_token_bootstraps_from_zero():
    # the last token is terminal: delta = r - V, whatever gamma, lam
    a, r = gae_advantages(t([[2.0]]), t([[0.5]]), torch.ones(1, 1), gamma=0.99, lam=0.95)
    close(a, [[1.5]])
    close(r, [[2.0]])


def test_padding_after_the_response_is_not_a_step_and_nan_there_is_ignored():
    # mask [1, 1, 0]: the episode ends at t=1. delta1 = 1 - .6 = .4, delta0 = .6 - .5 = .1,
    # A = [.5, .4, 0]; the padded position holds garbage.
    rewards, values = t([[0.0, 1.0, NAN]]), t([[0.5, 0.6, NAN]])
    a, r = gae_advantages(rewards, values, torch.tensor([[1, 1, 0]]), gamma=1.0, lam=1.0)
    close(a, [[0.5, 0.4, 0.0]])
    close(r, [[1.0, 1.0, 0.0]])


def test_a_hole_in_the_mask_is_skipped_without_discount():
    # mask [1, 0, 1] (a tool output in the middle): t=1 is no step. gamma .9, lam .5:
    # A2 = 1 - .7 = .3; t=0 bootstraps from V2: delta0 = .9*.7 - .5 = .13,
    # A0 = .13 + .45*.3 = .265. The hole's reward (5) and value (9) are not used.
    a, r = gae_advantages(t([[0.0, 5.0, 1.0]]), t([[0.5, 9.0, 0.7]]),
                          torch.tensor([[1, 0, 1]]), gamma=0.9, lam=0.5)
    close(a, [[0.265, 0.0, 0.3]])
    close(r, [[0.765, 0.0, 1.0]])


def test_rows_are_independent_and_an_empty_row_is_zero():
    # row 0: 2 tokens, gamma=lam=1: A = [1 - .2, 1 - .4]; row 1: no loss token
    a, r = gae_advantages(t([[0.0, 1.0, 0.0], [3.0, 3.0, 3.0]]),
                          t([[0.2, 0.4, 0.0], [1.0, 1.0, 1.0]]),
                          torch.tensor([[1, 1, 0], [0, 0, 0]]), gamma=1.0, lam=1.0)
    close(a, [[0.8, 0.6, 0.0], [0.0, 0.0, 0.0]])
    close(r, [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])


def _verl_gae(rewards, values, mask, gamma, lam):
    """veRL ``compute_gae_advantage_return`` (verl/trainer/ppo/core_algos.py), its loop
    transcribed, without the whitening that follows it there."""
    nextvalues, lastgaelam, out = 0, 0, []
    for i in reversed(range(rewards.shape[-1])):
        delta = rewards[:, i] + gamma * nextvalues - values[:, i]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, i] * mask[:, i] + (1 - mask[:, i]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, i] + (1 - mask[:, i]) * lastgaelam
        out.append(lastgaelam)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.0, 0.5), (0.7, 0.0)])
def test_matches_verl_on_loss_tokens_with_holes_and_padding(gamma, lam):
    g = torch.Generator().manual_seed(7)
    rewards = torch.randn(4, 9, generator=g, dtype=torch.float64)
    values = torch.randn(4, 9, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1] * 9, [1, 1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 1, 1, 0, 1, 0],
                         [0, 1, 1, 0, 1, 1, 1, 1, 1]])
    a, r = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    va, vr = _verl_gae(rewards, values, mask.double(), gamma, lam)
    m = mask.bool()
    torch.testing.assert_close(a[m], va[m].float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r[m], vr[m].float(), atol=1e-5, rtol=1e-5)


def test_matches_the_sum_definition_without_holes():
    # Eq. 16 summed directly (not the backward recursion): A_t = sum_l (gamma lam)^l delta_{t+l}
    g = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)
    gamma, lam = 0.95, 0.8
    nxt = torch.cat([values[:, 1:], torch.zeros(2, 1)], dim=1)
    delta = rewards + gamma * nxt - values
    want = torch.stack([sum((gamma * lam) ** (k - i) * delta[:, k] for k in range(i, 6))
                        for i in range(6)], dim=1)
    a, _ = gae_advantages(rewards, values, torch.ones(2, 6), gamma=gamma, lam=lam)
    torch.testing.assert_close(a, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("field, kw", [("gamma", {"gamma": 1.5, "lam": 0.9}),
                                        ("lam", {"gamma": 1.0, "lam": -0.1})])
def test_gamma_and_lam_outside_unit_interval_fail(field, kw):
    with pytest.raises(ValueError, match=field):
        gae_advantages(t(R3), t(V3), FULL3, **kw)


def test_shape_mismatch_fails():
    with pytest.raises(ValueError, match="values shape"):
        gae_advantages(t(R3), t([[0.5, 0.6]]), FULL3, gamma=1.0, lam=1.0)


def test_outcome_token_rewards_go_on_the_last_loss_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    close(outcome_token_rewards(t([2.0, -1.0, 5.0]), mask),
          [[0.0, 0.0, 2.0, 0.0], [0.0, 0.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_gae_for_rows_of_different_lengths():
    # row 0: the gamma .9, lam .5 case above (reward 1 on its last token); row 1: mask
    # [1, 0], so its reward 2 sits on token 0, which is terminal: A0 = 2 - .5 = 1.5
    adv, ret = gae_for_rows(np.array([1.0, 2.0]),
                            [np.array([0.5, 0.6, 0.7]), np.array([0.5, 3.0])],
                            [np.array([1, 1, 1]), np.array([1, 0])], gamma=0.9, lam=0.5)
    assert np.concatenate(adv).tolist() == pytest.approx([0.11425, 0.165, 0.3, 1.5, 0.0])
    assert np.concatenate(ret).tolist() == pytest.approx([0.61425, 0.765, 1.0, 2.0, 0.0])
    assert [len(a) for a in adv] == [len(r) for r in ret] == [3, 2]
    with pytest.raises(ValueError, match="rollout 1: 1 values for 2 response tokens"):
        gae_for_rows(np.array([1.0, 2.0]), [np.zeros(1), np.zeros(1)],
                     [np.ones(1), np.ones(2)], gamma=1.0, lam=1.0)


def test_gae_gives_the_aggregator_zeros_for_the_trainer_critic_to_replace():
    # the values live in the trainer's critic (trainer/critic.py, tests/trainer/test_critic.py)
    out = compute_advantages("gae", torch.tensor([1.0, 0.0, 3.0]),
                             torch.zeros(3, dtype=torch.int64), gamma=0.99, lam=0.95)
    assert out.dtype == torch.float32 and out.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="lam must be in"):
        compute_advantages("gae", torch.ones(2), torch.zeros(2, dtype=torch.int64), lam=1.5)


def test_masked_whiten_unbiased_over_loss_tokens():
    # loss tokens 1, 2, 3 (the 100 is masked): mean 2, unbiased var ((1)+(0)+(1))/2 = 1
    out = masked_whiten(t([[1.0, 2.0, 100.0], [3.0, NAN, NAN]]),
                        torch.tensor([[1, 1, 0], [1, 0, 0]]))
    s = 1 / math.sqrt(1 + 1e-8)
    close(out, [[-s, 0.0, 0.0], [s, 0.0, 0.0]])
    close(masked_whiten(t([[4.0, 7.0]]), torch.tensor([[0, 1]])), [[0.0, 0.0]])


# ---- the clipped value loss ------------------------------------------------------------

V = [[1.0, 0.0, 2.0]]
V_OLD = [[0.8, 0.5, 2.0]]
RET = [[2.0, 1.0, 1.0]]
# c = 0.1:
# t0: (1 - 2)^2 = 1; clip(1, .7, .9) = .9 -> (.9 - 2)^2 = 1.21; max 1.21 -> .605 (clipped)
# t1: (0 - 1)^2 = 1; clip(0, .4, .6) = .4 -> .36; max 1 -> .5
# t2: (2 - 1)^2 = 1; clip(2, 1.9, 2.1) = 2 -> 1; max 1 -> .5 (a tie is not clipped)


def test_clipped_value_loss_per_token_hand_values():
    loss, m = clipped_value_loss(t(V), t(V_OLD), t(RET), clip_range=0.1)
    close(loss, [[0.605, 0.5, 0.5]])
    close(m["vf_clip_frac"], [[1.0, 0.0, 0.0]])
    plain, m = clipped_value_loss(t(V), t(V_OLD), t(RET), clip_range=None)
    close(plain, [[0.5, 0.5, 0.5]])
    close(m["vf_clip_frac"], [[0.0, 0.0, 0.0]])


def test_compute_value_loss_token_mean_value_gradient_and_mask():
    # a 4th, masked token with garbage: token mean over 3 = (.605 + .5 + .5) / 3 = .535.
    # d/dv: t0 clipped (clip is flat there) -> 0; t1: .5 * 2 (0 - 1) / 3 = -1/3;
    # t2: .5 * 2 (2 - 1) / 3 = 1/3; the masked token 0.
    v = torch.tensor([[1.0, 0.0, 2.0, NAN]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0]])
    n_tok, n_seq = aggregate.mask_counts(mask)
    loss, metrics = compute_value_loss(
        ValueLossConfig(clip_range=0.1), v, t([[0.8, 0.5, 2.0, NAN]]),
        t([[2.0, 1.0, 1.0, float("inf")]]), mask, global_tokens=n_tok, global_seqs=n_seq)
    loss.backward()
    assert loss.item() == pytest.approx(0.535, abs=1e-6)
    assert metrics["value_loss"].item() == pytest.approx(0.535, abs=1e-6)
    assert metrics["vf_clip_frac"].item() == pytest.approx(1 / 3, abs=1e-6)
    close(v.grad, [[0.0, -1 / 3, 1 / 3, 0.0]])


def test_value_loss_micro_batches_sum_to_the_batch():
    g = torch.Generator().manual_seed(5)
    v, old, ret = (torch.randn(4, 5, generator=g) for _ in range(3))
    mask = torch.tensor([[1] * 5, [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [0, 1, 1, 0, 0]])
    n_tok, n_seq = aggregate.mask_counts(mask)
    cfg = ValueLossConfig(clip_range=0.2)

    def run(idx):
        return compute_value_loss(cfg, v[idx], old[idx], ret[idx], mask[idx],
                                  global_tokens=n_tok, global_seqs=n_seq)[0].item()

    full = run(torch.arange(4))
    assert run(torch.tensor([0, 2])) + run(torch.tensor([1, 3])) == pytest.approx(full, abs=1e-6)


def test_value_loss_config_checks():
    assert ValueLossConfig().clip_range == 0.5
    with pytest.raises(ValueError, match="clip_range"):
        ValueLossConfig(clip_range=0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        ValueLossConfig(loss_agg_mode="token-sum")
