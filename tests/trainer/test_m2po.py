"""M2PO (trainer/losses/m2po.py): the second-moment mask of AReaL's
``_get_m2po_loss_mask`` and the unclipped loss ``-M r A`` of Zheng et al. 2025
(arXiv 2510.01161), with values worked out by hand in the comments."""

import math

import pytest
import torch
from pydantic import ValidationError

from relax.trainer.config import TrainerConfig
from relax.trainer.losses import aggregate
from relax.trainer.losses.config import LossConfig
from relax.trainer.losses.m2po import m2po_keep_mask
from relax.trainer.losses.registry import compute_policy_loss

NAN = float("nan")

# four loss tokens, log r = [.1, -.5, .3, .05] -> (log r)^2 = [.01, .25, .09, .0025]
LOG_R = torch.tensor([[0.1, -0.5, 0.3, 0.05]])
FULL = torch.ones(1, 4, dtype=torch.bool)


@pytest.mark.parametrize("threshold, keep", [
    # sorted .25, .09, .01, .0025; means of the tails: .088125, .034167, .00625, .0025
    (0.1, [1, 1, 1, 1]),     # .088125 < .1: nothing dropped
    (0.04, [1, 0, 1, 1]),    # drop .25 (log r -.5): .034167 < .04
    (0.02, [1, 0, 0, 1]),    # drop .25 and .09: .00625 < .02
    (0.005, [0, 0, 0, 1]),   # drop three: .0025 < .005
    (0.001, [0, 0, 0, 1]),   # no tail is under it: keep only the smallest (AReaL)
])
def test_keep_mask_hand_values(threshold, keep):
    got = m2po_keep_mask(LOG_R.double(), FULL, threshold)
    assert got.tolist() == [[bool(k) for k in keep]]


def test_under_is_strict():
    # (log r)^2 = [1, .25] (exact in binary), mean .625: a threshold equal to it drops the 1
    log_r, mask = torch.tensor([[1.0, 0.5]]), torch.ones(1, 2)
    assert m2po_keep_mask(log_r, mask, 0.625).tolist() == [[False, True]]
    assert m2po_keep_mask(log_r, mask, 0.625 + 1e-9).tolist() == [[True, True]]


def test_keep_mask_ignores_masked_positions():
    # a huge log ratio (and NaN) on masked positions is not in the statistic
    log_r = torch.tensor([[0.1, -0.5, 9.0], [0.3, NAN, 0.05]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert m2po_keep_mask(log_r, mask, 0.04).tolist() == [[True, False, False],
                                                          [True, False, True]]
    assert not m2po_keep_mask(log_r, torch.zeros(2, 3), 0.04).any()


def _brute_force_dropped(m2: list[float], threshold: float) -> int:
    """The definition read literally: the smallest k such that, without the k largest,
    the mean is under the threshold (all but one when none is)."""
    ordered = sorted(m2, reverse=True)
    for k in range(len(ordered)):
        rest = ordered[k:]
        if sum(rest) / len(rest) < threshold:
            return k
    return len(ordered) - 1


@pytest.mark.parametrize("seed", range(20))
def test_keep_mask_matches_the_definition(seed):
    g = torch.Generator().manual_seed(seed)
    log_r = torch.randn(3, 7, generator=g, dtype=torch.float64) * 0.4
    mask = torch.rand(3, 7, generator=g) < 0.8
    threshold = float(torch.rand(1, generator=g)) * 0.2 + 1e-3
    keep = m2po_keep_mask(log_r, mask, threshold)
    m2 = log_r.square()[mask].tolist()
    k = _brute_force_dropped(m2, threshold)
    assert int((mask & ~keep).sum()) == k
    assert not (keep & ~mask).any()
    if k:  # every dropped token is at least as large as every kept one
        assert log_r.square()[mask & ~keep].min() >= log_r.square()[keep].max()
    assert log_r.square()[keep].mean() < threshold or int(keep.sum()) == 1


def _loss(cfg, lp, old, adv, mask):
    n_tok, n_seq = aggregate.mask_counts(mask)
    return compute_policy_loss(cfg, lp, old, adv, mask, global_tokens=n_tok, global_seqs=n_seq)


def test_loss_value_gradient_and_masked_share():
    # old = -1, lp = -1 + log r; A = [1, 1, -1, 2]; threshold .04 drops token 1.
    # loss_t = -exp(log r) A on kept tokens: -e^.1, 0, +e^.3, -2 e^.05; token mean over 4:
    # (-1.1051709 + 1.3498588 - 2.1025422) / 4 = -0.4644636.
    # d loss / d lp_t = -r_t A_t / 4: [-0.2762927, 0, 0.3374647, -0.5256356].
    old = torch.full((1, 4), -1.0)
    lp = (old + LOG_R).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, 2.0]])
    loss, metrics = _loss(LossConfig(policy_loss="m2po", m2_threshold=0.04), lp, old, adv, FULL)
    loss.backward()
    assert loss.item() == pytest.approx(-0.4644636, abs=1e-6)
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.2762927, 0.0, 0.3374647, -0.5256356]]),
                               atol=1e-6, rtol=1e-6)
    assert metrics["m2po_masked_frac"].item() == pytest.approx(0.25)
    assert metrics["m2"].item() == pytest.approx(0.088125, abs=1e-6)  # before masking


def test_no_epsilon_clip():
    # one token, ratio e^.5 = 1.6487, far outside any PPO clip range; the threshold .3 > .25
    # keeps it: loss -1.6487 A and gradient -1.6487 A (ppo_clip would give a 0 gradient)
    lp = torch.tensor([[0.0]], requires_grad=True)
    old, adv = torch.tensor([[-0.5]]), torch.tensor([[2.0]])
    loss, _ = _loss(LossConfig(policy_loss="m2po", m2_threshold=0.3), lp, old, adv,
                    torch.ones(1, 1))
    loss.backward()
    assert loss.item() == pytest.approx(-2 * math.exp(0.5), abs=1e-6)
    assert lp.grad.item() == pytest.approx(-2 * math.exp(0.5), abs=1e-6)


def test_gradient_is_zero_on_dropped_and_masked_tokens_even_with_nan():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 5, generator=g) - 0.1
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    log_r = torch.randn(3, 5, generator=g) * 0.4
    lp = torch.where(mask.bool(), old + log_r, torch.tensor(NAN)).requires_grad_(True)
    adv = torch.randn(3, generator=g)
    loss, metrics = _loss(LossConfig(policy_loss="m2po", m2_threshold=0.04), lp,
                          torch.where(mask.bool(), old, torch.tensor(NAN)), adv, mask)
    loss.backward()
    keep = m2po_keep_mask(log_r, mask, 0.04)
    dropped = mask.bool() & ~keep
    assert dropped.any() and keep.any()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert (lp.grad[dropped] == 0).all() and (lp.grad[~mask.bool()] == 0).all()
    assert (lp.grad[keep] != 0).all()
    assert metrics["m2po_masked_frac"].item() == pytest.approx(dropped.sum().item() / 11)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_no_mask_case_is_the_plain_policy_gradient_loss(agg):
    # a threshold over every (log r)^2: M2PO is -r A, the importance-sampled policy gradient
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(4, 6, generator=g) - 0.1
    log_r = torch.randn(4, 6, generator=g) * 0.3
    mask = torch.arange(6)[None, :] < torch.tensor([[6], [3], [5], [1]])
    adv = torch.randn(4, generator=g)
    lp = (old + log_r).requires_grad_(True)
    loss, metrics = _loss(LossConfig(policy_loss="m2po", m2_threshold=1e3, loss_agg_mode=agg),
                          lp, old, adv, mask)
    loss.backward()
    ref_lp = (old + log_r).requires_grad_(True)
    per_token = -(ref_lp - old).exp() * adv[:, None]
    n_tok, n_seq = aggregate.mask_counts(mask)
    if agg == "token-mean":
        ref = per_token[mask].sum() / n_tok
    else:
        ref = sum(per_token[i][mask[i]].mean() for i in range(4)) / n_seq
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    torch.testing.assert_close(lp.grad, ref_lp.grad.nan_to_num(0.0), atol=1e-6, rtol=1e-6)
    assert metrics["m2po_masked_frac"].item() == 0


def test_at_ratio_one_the_gradient_is_reinforce():
    # lp == old: r = 1, M2 = 0, nothing dropped; d loss / d lp_t = -A_t / N
    lp = torch.tensor([[-0.3, -1.2, -0.7]], requires_grad=True)
    adv = torch.tensor([[2.0, -1.0, 0.5]])
    loss, metrics = _loss(LossConfig(policy_loss="m2po"), lp, lp.detach(), adv,
                          torch.ones(1, 3))
    loss.backward()
    assert loss.item() == pytest.approx(-1.5 / 3)
    torch.testing.assert_close(lp.grad, -adv / 3)
    assert metrics["m2"].item() == 0 and metrics["m2po_masked_frac"].item() == 0


def test_one_micro_batch_is_the_batch_statistic_and_a_split_changes_it():
    # rows: log r [.1, -.5] and [.3, .05]: together as LOG_R (drop -.5 at .04). Split
    # alone, row 0's tail means are .13, .01 -> drops -.5 as well; row 1's mean
    # (.09 + .0025) / 2 = .04625 >= .04 -> drops .3, which the batch statistic keeps.
    log_r = LOG_R.view(2, 2)
    mask = torch.ones(2, 2, dtype=torch.bool)
    assert m2po_keep_mask(log_r, mask, 0.04).tolist() == [[True, False], [True, True]]
    split = [m2po_keep_mask(log_r[i:i + 1], mask[i:i + 1], 0.04)[0].tolist() for i in range(2)]
    assert split == [[True, False], [False, True]]


def test_config():
    assert LossConfig(policy_loss="m2po").m2_threshold == 0.04
    with pytest.raises(ValidationError, match="m2_threshold"):
        LossConfig(policy_loss="m2po", m2_threshold=0)
    with pytest.raises(ValidationError, match="m2_threshold applies to policy_loss m2po"):
        LossConfig(policy_loss="ppo_clip", m2_threshold=0.1)
    TrainerConfig(loss=LossConfig(policy_loss="m2po"))  # old_logprobs: rollout, the default
    for old in ("recompute", "detached"):
        with pytest.raises(ValidationError, match="m2po.*needs old_logprobs 'rollout'"):
            TrainerConfig(loss=LossConfig(policy_loss="m2po"), old_logprobs=old)


def test_keep_mask_rejects_bad_input():
    with pytest.raises(ValueError, match="m2_threshold must be > 0"):
        m2po_keep_mask(LOG_R, FULL, 0.0)
    with pytest.raises(ValueError, match="shape"):
        m2po_keep_mask(LOG_R, torch.ones(2, 2), 0.04)


def test_ties_drop_a_whole_prefix_of_the_order():
    # (log r)^2 all .09: no tail mean is under .05 -> keep exactly one token
    keep = m2po_keep_mask(torch.tensor([[0.3, -0.3, 0.3]]), torch.ones(1, 3), 0.05)
    assert int(keep.sum()) == 1


def test_a_trainer_step_with_m2po_reports_the_masked_share():
    # the torch back end on the tiny model: rollout log-probs = the model's own plus noise
    # of std .15 on each token, so (log r)^2 averages ~.0225 and the largest few are dropped
    import dataclasses

    from testdata import train_sample_table

    from relax.streams.codec import group_by_key
    from relax.trainer.backends.torch_backend import TorchBackend
    from relax.trainer.batching import micro_batches

    b = TorchBackend(TrainerConfig(optim={"lr": 1e-3},
                                   loss=LossConfig(policy_loss="m2po", m2_threshold=0.01)))
    groups = [g for _, g in group_by_key(train_sample_table(3, seed=4), "group_id")]
    [mb] = micro_batches(groups, 100_000)
    with torch.no_grad():
        lp = b.logprobs(mb)[0]
    noise = torch.randn(lp.shape, generator=torch.Generator().manual_seed(0)) * 0.15
    mb = dataclasses.replace(mb, rollout_logprobs=lp + noise)
    mask = mb.loss_mask.bool()
    want = m2po_keep_mask(-noise, mask, 0.01)
    before = {k: v.clone() for k, v in b.named_tensors().items()}
    stats = b.train_step([mb])
    share = int((mask & ~want).sum()) / int(mask.sum())
    assert 0 < share < 0.5
    assert stats["m2po_masked_frac"] == pytest.approx(share, abs=1e-6)
    assert stats["m2"] == pytest.approx(float(noise[mask].square().mean()), rel=1e-3)
    assert any(not torch.equal(v, before[k]) for k, v in b.named_tensors().items())
