"""Policy losses, aggregation, KL, entropy, TIS/MIS and LossConfig (trainer/losses):
public cases C06, C07, C08, C09, C10, and properties (split invariance, masked
gradients, ratio 1)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from relax.trainer.losses import aggregate, config
from relax.trainer.losses.config import LossConfig
from relax.trainer.losses.entropy import token_entropy
from relax.trainer.losses.importance import rollout_importance_weights
from relax.trainer.losses.kl import k1, k2, k3, kl_in_reward
from relax.trainer.losses.ppo_clip import clipped_surrogate
from relax.trainer.losses.registry import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    compute_policy_loss,
    pick,
)

AGG_MODES = sorted(LOSS_AGGREGATIONS)
NORM = 7.0  # constant divisor for seq-mean-token-sum-norm


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def cfg_for(agg="token-mean", **kw):
    if agg == "seq-mean-token-sum-norm":
        kw.setdefault("seq_mean_token_sum_norm_divisor", NORM)
    return LossConfig(loss_agg_mode=agg, **kw)


def agg(mode, values, mask, tokens=None, seqs=None):
    n_tok, n_seq = aggregate.mask_counts(mask)
    return LOSS_AGGREGATIONS[mode](values, mask, global_tokens=n_tok if tokens is None else tokens,
                                   global_seqs=n_seq if seqs is None else seqs, norm_divisor=NORM)


def random_batch(seed, b=4, tt=6, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(b, tt, generator=g) * 2 - 0.05
    old = logprobs + torch.randn(b, tt, generator=g) * scale
    rollout = old + torch.randn(b, tt, generator=g) * 0.1
    ref = logprobs + torch.randn(b, tt, generator=g) * 0.2
    adv = torch.randn(b, generator=g)
    lengths = torch.randint(1, tt + 1, (b,), generator=g)
    mask = torch.arange(tt)[None, :] < lengths[:, None]
    entropy = torch.rand(b, tt, generator=g)
    return {"logprobs": logprobs, "old": old, "rollout": rollout, "ref": ref, "adv": adv,
            "mask": mask, "entropy": entropy}


# ---- C06: token-mean under gradient accumulation --------------------------------------

def test_c06_token_mean_micro_batches_weighted_by_tokens():
    mb1, mb2 = t([[1.0, 3.0]]), t([[5.0] * 6])
    parts = [aggregate.token_mean(x, torch.ones_like(x), global_tokens=8, global_seqs=2)
             for x in (mb1, mb2)]
    total = sum(parts).item()
    assert total == pytest.approx(4.25)
    assert total != pytest.approx(3.5)  # sample-weighted
    assert total != pytest.approx(2.125)  # divided again by the accumulation steps


@pytest.mark.parametrize("width", [2, 6, 9])
def test_c06_compute_policy_loss_sums_to_the_full_batch_value(width):
    # ratio 1 and advantages = -loss make the per-token PPO loss equal the case's values
    cfg = LossConfig()
    mb1_loss = torch.zeros(1, width)
    mb1_loss[0, :2] = t([1.0, 3.0])
    mb1_mask = torch.arange(width)[None, :] < 2
    mb2_loss, mb2_mask = t([[5.0] * 6]), torch.ones(1, 6, dtype=torch.bool)
    total = 0.0
    for loss_values, mask in ((mb1_loss, mb1_mask), (mb2_loss, mb2_mask)):
        lp = torch.full(loss_values.shape, -1.0)
        loss, _ = compute_policy_loss(cfg, lp, lp, -loss_values, mask, global_tokens=8,
                                      global_seqs=2)
        total += loss.item()
    assert total == pytest.approx(4.25, abs=1e-6)


@st.composite
def split_batches(draw):
    b = draw(st.integers(1, 6))
    tt = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(0, tt), min_size=b, max_size=b))
    values = draw(st.lists(st.floats(-10, 10, width=32), min_size=b * tt, max_size=b * tt))
    perm = draw(st.permutations(list(range(b))))
    cuts = sorted(draw(st.sets(st.integers(1, max(b - 1, 1)), max_size=b - 1))) if b > 1 else []
    mask = torch.arange(tt)[None, :] < t(lengths, torch.int64)[:, None]
    return t(values).reshape(b, tt), mask, perm, cuts


def micro_batches(perm, cuts):
    bounds = [0, *cuts, len(perm)]
    return [torch.tensor(perm[a:z]) for a, z in itertools.pairwise(bounds) if z > a]


@settings(max_examples=80, deadline=None)
@given(case=split_batches(), mode=st.sampled_from(AGG_MODES))
def test_every_aggregation_is_micro_batch_split_invariant(case, mode):
    values, mask, perm, cuts = case
    n_tok, n_seq = aggregate.mask_counts(mask)
    full = agg(mode, values, mask)
    parts = []
    for idx in micro_batches(perm, cuts):
        sub_mask = mask[idx]
        width = max(int(sub_mask.sum(-1).max()), 1)  # re-pad each micro-batch to its own width
        parts.append(agg(mode, values[idx][:, :width], sub_mask[:, :width], n_tok, n_seq))
    assert sum(parts).item() == pytest.approx(full.item(), abs=1e-4, rel=1e-5)


@pytest.mark.parametrize("policy_loss", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_compute_policy_loss_split_invariant_in_value_and_gradient(policy_loss, mode):
    d = random_batch(seed=3, b=5, tt=6)
    # m2po's mask is a statistic of the tokens of one call (AReaL's, per micro-batch): a
    # binding threshold depends on the split (tests/trainer/test_m2po.py); this one does not bind
    m2 = {"m2_threshold": 1e6} if policy_loss == "m2po" else {}
    cfg = cfg_for(mode, policy_loss=policy_loss, kl_coef=0.1, kl_in="loss", entropy_coef=0.01,
                  is_mode="tis", dual_clip_c=3.0 if policy_loss == "ppo_clip" else None, **m2)
    n_tok, n_seq = aggregate.mask_counts(d["mask"])

    def run(idx):
        lp = d["logprobs"][idx].clone().requires_grad_(True)
        loss, metrics = compute_policy_loss(
            cfg, lp, d["old"][idx], d["adv"][idx], d["mask"][idx],
            rollout_logprobs=d["rollout"][idx], ref_logprobs=d["ref"][idx],
            entropy=d["entropy"][idx], global_tokens=n_tok, global_seqs=n_seq)
        loss.backward()
        return loss.item(), lp.grad, metrics

    full_loss, full_grad, full_metrics = run(torch.arange(5))
    parts = [run(torch.tensor(i)) for i in ([0, 3], [1], [2, 4])]
    assert sum(p[0] for p in parts) == pytest.approx(full_loss, abs=1e-6)
    for i, (idx, part) in enumerate(zip(([0, 3], [1], [2, 4]), parts)):
        torch.testing.assert_close(part[1], full_grad[idx], atol=1e-6, rtol=1e-5)
    for name, value in full_metrics.items():
        assert sum(p[2][name].item() for p in parts) == pytest.approx(value.item(), abs=1e-5)


# ---- C07: masked positions contribute exactly 0 ---------------------------------------

def test_c07_token_mean_numerator_excludes_masked_positions():
    loss_mat = t([[2.0, 50.0], [4.0, -20.0]]).requires_grad_(True)
    mask = t([[1, 0], [1, 0]], torch.int64)
    value = agg("token-mean", loss_mat, mask)
    value.backward()
    assert value.item() == pytest.approx(3.0)
    assert value.item() != pytest.approx(18.0)
    assert loss_mat.grad.tolist() == [[0.5, 0.0], [0.5, 0.0]]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf"), 1e30])
def test_c07_family_nan_or_inf_at_masked_positions(mode, garbage):
    clean = t([[2.0, 0.0, 1.0], [4.0, 0.0, 0.0]])
    mask = t([[1, 0, 1], [1, 0, 0]], torch.int64)
    dirty = torch.where(mask.bool(), clean, t(garbage)).requires_grad_(True)
    value = agg(mode, dirty, mask)
    assert value.item() == pytest.approx(agg(mode, clean, mask).item())
    value.backward()
    assert torch.isfinite(dirty.grad).all()
    assert (dirty.grad[~mask.bool()] == 0).all()


# ---- C08: seq-mean-token-sum-norm ----------------------------------------------------

def test_c08_dr_grpo_aggregation_is_a_mean_over_sequences():
    loss_mat = t([[1, 1, 1, 9], [2, 2, 7, 7]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]], torch.int64)
    value = aggregate.seq_mean_token_sum_norm(loss_mat, mask, global_tokens=5, global_seqs=2,
                                              norm_divisor=4)
    assert value.item() == pytest.approx(0.875)
    assert value.item() != pytest.approx(1.75)
    # a configured constant replaces the horizon and does not depend on padding
    for width in (4, 6):
        padded = torch.zeros(2, width)
        padded[:, :4] = loss_mat
        padded_mask = torch.zeros(2, width, dtype=torch.int64)
        padded_mask[:, :4] = mask
        got = aggregate.seq_mean_token_sum_norm(padded, padded_mask, global_tokens=5,
                                                global_seqs=2, norm_divisor=8)
        assert got.item() == pytest.approx(0.4375)
    # one sequence per micro-batch gives the same total
    halves = [aggregate.seq_mean_token_sum_norm(loss_mat[i:i + 1], mask[i:i + 1], global_tokens=5,
                                                global_seqs=2, norm_divisor=4) for i in (0, 1)]
    assert sum(halves).item() == pytest.approx(0.875)


def test_c08_divisor_is_required():
    with pytest.raises(ValueError, match="norm_divisor"):
        aggregate.seq_mean_token_sum_norm(torch.ones(1, 2), torch.ones(1, 2), global_tokens=2,
                                          global_seqs=1)
    with pytest.raises(ValidationError, match="seq_mean_token_sum_norm_divisor"):
        LossConfig(loss_agg_mode="seq-mean-token-sum-norm")


def test_other_aggregation_values():
    loss_mat = t([[1, 1, 1, 9], [2, 2, 7, 7], [5, 5, 5, 5]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], torch.int64)
    assert aggregate.mask_counts(mask) == (5, 2)  # the empty row is not a sequence
    assert agg("token-mean", loss_mat, mask).item() == pytest.approx(7 / 5)
    assert agg("seq-mean-token-mean", loss_mat, mask).item() == pytest.approx((1 + 2) / 2)
    assert agg("seq-mean-token-sum", loss_mat, mask).item() == pytest.approx(3.5)
    assert agg("token-mean", loss_mat, torch.zeros_like(mask)).item() == 0


# ---- C09: KL estimators, clamps, placement --------------------------------------------

def test_c09_each_estimator_returns_its_own_value():
    lp, ref = t([-1.0]), t([-1.5])
    assert KL_ESTIMATORS["k1"](lp, ref).item() == pytest.approx(0.5)
    assert KL_ESTIMATORS["k2"](lp, ref).item() == pytest.approx(0.125)
    assert KL_ESTIMATORS["k3"](lp, ref).item() == pytest.approx(0.106531, abs=1e-6)
    assert KL_ESTIMATORS["low_var_kl"](lp, ref).item() == pytest.approx(0.106531, abs=1e-6)
    assert KL_ESTIMATORS["k1"](lp, ref).item() != pytest.approx(0.106531, abs=1e-4)
    assert KL_ESTIMATORS["k2"](lp, ref).item() != pytest.approx(0.106531, abs=1e-4)


@settings(max_examples=50, deadline=None)
@given(lp=st.floats(-8, 0), d=st.floats(-3, 3).filter(lambda x: abs(x) > 1e-2))
def test_c09_family_estimators_match_schulman_formulas(lp, d):
    logprobs, ref = t([lp]), t([lp - d])
    r = float(logprobs - ref)
    assert k1(logprobs, ref).item() == pytest.approx(r, abs=1e-5)
    assert k2(logprobs, ref).item() == pytest.approx(r * r / 2, abs=1e-5)
    assert k3(logprobs, ref).item() == pytest.approx(min(math.exp(-r) - 1 + r, 10), rel=1e-4,
                                                     abs=1e-5)
    for name, fn in (("k1", k1), ("k2", k2), ("k3", k3), ("low_var_kl", k3)):
        assert KL_ESTIMATORS[name] is fn  # no fall-through between names


def test_c09_low_var_kl_clamps_as_verl():
    assert k3(t([-4.0]), t([-1.0])).item() == 10.0  # e^3 - 3 - 1 = 16.09 -> 10
    assert k3(t([-1.0]), t([-30.0])).item() == 10.0  # -29 -> -20 -> ~19 -> 10
    assert k3(t([-1.0]), t([-30.0])).item() != pytest.approx(28.0)


def test_c09_kl_in_reward():
    scores, kl = t([[0, 0, 1.0]]), t([[0.2, 0.1, 0.3]])
    rewards = kl_in_reward(scores, kl, torch.ones(1, 3), kl_coef=0.1)
    torch.testing.assert_close(rewards, t([[-0.02, -0.01, 0.97]]))
    # with KL in the reward, the loss has no KL term
    cfg = LossConfig(kl_in="reward", kl_coef=0.1)
    lp = t([[-1.0, -1.0, -1.0]])
    loss, metrics = compute_policy_loss(cfg, lp, lp, torch.zeros(1), torch.ones(1, 3),
                                        ref_logprobs=lp - kl, global_tokens=3, global_seqs=1)
    assert loss.item() == 0 and "kl" not in metrics


def test_c09_kl_in_loss_adds_beta_times_aggregated_kl():
    cfg = LossConfig(kl_in="loss", kl_coef=0.1, kl_estimator="k1")
    lp, kl = t([[-1.0, -1.0, -1.0]]), t([[0.2, 0.1, 0.3]])
    loss, metrics = compute_policy_loss(cfg, lp, lp, torch.zeros(1), torch.ones(1, 3),
                                        ref_logprobs=lp - kl, global_tokens=3, global_seqs=1)
    assert loss.item() == pytest.approx(0.02, abs=1e-7)
    assert metrics["kl"].item() == pytest.approx(0.2, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_policy_loss(cfg, lp, lp, torch.zeros(1), torch.ones(1, 3), global_tokens=3,
                            global_seqs=1)


@pytest.mark.parametrize("kl_in", ["both", ["loss", "reward"], ("reward", "loss")])
def test_c09_kl_in_both_is_rejected(kl_in):
    with pytest.raises(ValidationError, match="never both"):
        LossConfig(kl_in=kl_in, kl_coef=0.1)


def test_kl_coef_without_placement_is_rejected():
    with pytest.raises(ValidationError, match="kl_in"):
        LossConfig(kl_coef=0.1)
    assert LossConfig(kl_in=["loss"], kl_coef=0.1).kl_in == "loss"


# ---- C10: PPO clip, clip-higher, dual-clip ---------------------------------------------

def ppo_token_loss(ratio, adv, eps_low=0.2, eps_high=0.2, dual_clip_c=None):
    cfg = LossConfig(clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip_c=dual_clip_c)
    lp = t([[math.log(ratio)]])
    loss, _ = POLICY_LOSSES["ppo_clip"](lp, torch.zeros(1, 1), t([[adv]]), torch.ones(1, 1), cfg)
    return loss.item()


def test_c10a_dual_clip_not_applied_to_positive_advantage():
    got = ppo_token_loss(0.5, 1.0, dual_clip_c=3.0)
    assert got == pytest.approx(-0.5)
    assert got != pytest.approx(-3.0)


def test_c10b_dual_clip_bounds_negative_advantage():
    assert ppo_token_loss(5.0, -1.0, dual_clip_c=3.0) == pytest.approx(3.0)
    assert ppo_token_loss(5.0, -1.0) == pytest.approx(5.0)  # plain PPO


def test_c10c_clip_higher():
    assert ppo_token_loss(1.3, 1.0) == pytest.approx(-1.2)
    got = ppo_token_loss(1.3, 1.0, eps_high=0.28)
    assert got == pytest.approx(-1.28)
    assert got != pytest.approx(-1.2)


@pytest.mark.parametrize("field, value", [("clip_eps_low", 3.0), ("clip_eps_low", 1.0),
                                          ("clip_eps_low", -0.1), ("clip_eps_high", -0.1),
                                          ("dual_clip_c", 1.0), ("dual_clip_c", 0.5)])
def test_c10d_config_rejects_bad_clip_bounds(field, value):
    with pytest.raises(ValidationError, match=field):
        LossConfig(**{field: value})


@settings(max_examples=200, deadline=None)
@given(ratio=st.floats(0.01, 20), adv=st.floats(-5, 5), eps_low=st.floats(0, 0.9),
       eps_high=st.floats(0, 2), c=st.one_of(st.none(), st.floats(1.01, 10)))
def test_c10_family_matches_scalar_reference(ratio, adv, eps_low, eps_high, c):
    clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
    expected = max(-ratio * adv, -clipped * adv)
    if c is not None and adv < 0:
        expected = min(expected, -c * adv)
    got = ppo_token_loss(ratio, adv, eps_low, eps_high, c)
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-4)
    if adv >= 0:  # dual clip never touches A >= 0
        assert got == pytest.approx(ppo_token_loss(ratio, adv, eps_low, eps_high), abs=1e-6)


def test_ppo_clip_metrics():
    ratio = t([[0.5, 1.5, 1.5, 0.5, 5.0]])
    adv = t([[-1.0, 1.0, -1.0, 1.0, -1.0]])
    _, m = clipped_surrogate(ratio, adv, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    assert m["clip_frac_low"].tolist() == [[1, 0, 0, 0, 0]]
    assert m["clip_frac_high"].tolist() == [[0, 1, 0, 0, 0]]
    assert m["dual_clip_frac"].tolist() == [[0, 0, 0, 0, 1]]


# ---- properties shared by the losses ---------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), name=st.sampled_from(["ppo_clip", "gspo"]),
       dual=st.booleans())
def test_ratio_one_gives_minus_mean_advantage_under_token_mean(seed, name, dual):
    d = random_batch(seed)
    cfg = LossConfig(policy_loss=name, dual_clip_c=3.0 if dual and name == "ppo_clip" else None)
    n_tok, n_seq = aggregate.mask_counts(d["mask"])
    loss, metrics = compute_policy_loss(cfg, d["logprobs"], d["logprobs"], d["adv"], d["mask"],
                                        global_tokens=n_tok, global_seqs=n_seq)
    adv_tokens = d["adv"][:, None].expand_as(d["mask"])[d["mask"]]
    assert loss.item() == pytest.approx(-adv_tokens.mean().item(), abs=1e-6)
    assert metrics["clip_frac_low"] == 0 and metrics["clip_frac_high"] == 0


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("is_mode", [None, "tis", "mis"])
def test_zero_gradient_at_masked_positions_even_with_nan(name, mode, is_mode):
    d = random_batch(seed=11)
    mask = d["mask"]
    nan = t(float("nan"))
    lp = torch.where(mask, d["logprobs"], nan).requires_grad_(True)
    cfg = cfg_for(mode, policy_loss=name, is_mode=is_mode, is_level="sequence", kl_in="loss",
                  kl_coef=0.05, entropy_coef=0.01)
    n_tok, n_seq = aggregate.mask_counts(mask)
    loss, metrics = compute_policy_loss(
        cfg, lp, torch.where(mask, d["old"], nan), d["adv"], mask,
        rollout_logprobs=torch.where(mask, d["rollout"], nan),
        ref_logprobs=torch.where(mask, d["ref"], -float("inf")),
        entropy=torch.where(mask, d["entropy"], nan), global_tokens=n_tok, global_seqs=n_seq)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(v) for v in metrics.values())
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[~mask] == 0).all()
    assert (lp.grad[mask] != 0).any()


# ---- GSPO, SAPO, CISPO ------------------------------------------------------------------

def test_gspo_sequence_ratio_is_the_masked_geometric_mean():
    lp = t([[-1.0, -2.0, -3.0]])
    old = t([[-1.2, -1.9, 5.0]])  # third position masked
    mask = t([[1, 1, 0]], torch.int64)
    cfg = LossConfig(policy_loss="gspo", clip_eps_low=0.5, clip_eps_high=0.5)
    _, m = POLICY_LOSSES["gspo"](lp, old, t([[1.0, 1.0, 1.0]]), mask, cfg)
    s = math.exp(((-1.0 + 1.2) + (-2.0 + 1.9)) / 2)
    assert m["seq_ratio"][0, :2].tolist() == pytest.approx([s, s], abs=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_gspo_token_form_gradient_equals_sequence_gradient(seed):
    d = random_batch(seed, scale=0.05)
    mask = d["mask"]
    cfg = LossConfig(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean",
                     clip_eps_low=0.02, clip_eps_high=0.03)
    n_tok, n_seq = aggregate.mask_counts(mask)
    lp = d["logprobs"].clone().requires_grad_(True)
    loss, _ = compute_policy_loss(cfg, lp, d["old"], d["adv"], mask, global_tokens=n_tok,
                                  global_seqs=n_seq)
    loss.backward()
    # sequence form: s_i = exp(mean_t(lp - old)), loss_i = max(-s A, -clip(s) A), mean over seqs
    lp2 = d["logprobs"].clone().requires_grad_(True)
    m = mask.float()
    s = (((lp2 - d["old"]) * m).sum(-1) / m.sum(-1)).exp()
    per_seq = torch.maximum(-s * d["adv"], -s.clamp(1 - 0.02, 1 + 0.03) * d["adv"])
    ref_loss = per_seq.mean()
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    torch.testing.assert_close(lp.grad, lp2.grad, atol=1e-6, rtol=1e-5)


def test_sapo_gate_values_and_unit_slope_at_ratio_one():
    cfg = LossConfig(policy_loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    lp = torch.full((1, 4), -1.0, requires_grad=True)
    old = t([[-1.0, -1.0, -1.0 - math.log(2), -1.0]])  # ratios 1, 1, 2, 1
    adv = t([[1.0, -1.0, 1.0, 0.0]])
    loss, _ = POLICY_LOSSES["sapo"](lp, old, adv, torch.ones(1, 4), cfg)
    sig = 1 / (1 + math.exp(-1.0))
    assert loss[0].tolist() == pytest.approx([-2.0, 1.0, -4 * sig, 0.0], abs=1e-5)
    loss[0, :2].sum().backward()
    assert lp.grad[0, :2].tolist() == pytest.approx([-1.0, 1.0], abs=1e-5)  # f'(1) = 1


def test_cispo_detached_clipped_weight_times_logprob():
    cfg = LossConfig(policy_loss="cispo", cispo_eps_high=1.0)
    lp = t([[-1.0, -1.0, -1.0]]).requires_grad_(True)
    old = t([[-1.0 - math.log(3), -1.0 + math.log(10), -1.0]])  # ratios 3, 0.1, 1
    adv = t([[1.0, -2.0, 0.5]])
    loss, m = POLICY_LOSSES["cispo"](lp, old, adv, torch.ones(1, 3), cfg)
    weights = [2.0, 0.1, 1.0]  # capped at 1 + 1.0; no floor by default
    assert loss[0].tolist() == pytest.approx([w * a for w, a in zip(weights, [1.0, -2.0, 0.5])],
                                             abs=1e-5)
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([-2.0, 0.2, -0.5], abs=1e-5)
    assert m["is_clip_frac"].tolist() == [[1, 0, 0]]
    floored = LossConfig(policy_loss="cispo", cispo_eps_high=1.0, cispo_eps_low=0.5)
    loss2, _ = POLICY_LOSSES["cispo"](lp, old, adv, torch.ones(1, 3), floored)
    assert loss2[0, 1].item() == pytest.approx(-0.5 * -2.0 * -1.0, abs=1e-5)


# ---- TIS / MIS ----------------------------------------------------------------------------

def test_tis_and_mis_token_level():
    old = t([[-1.0, -1.0, -1.0, 0.0]])
    rollout = t([[-1.0 - math.log(3), -1.0 + math.log(2), -1.0, float("nan")]])  # w = 3, 0.5, 1
    mask = t([[1, 1, 1, 0]], torch.int64)
    tis, m = rollout_importance_weights(old, rollout, mask, mode="tis", cap=2.0)
    assert tis[0].tolist() == pytest.approx([2.0, 0.5, 1.0, 0.0])
    assert m["is_capped_frac"][0].tolist() == [1, 0, 0, 0]
    mis, _ = rollout_importance_weights(old, rollout, mask, mode="mis", cap=2.0)
    assert mis[0].tolist() == pytest.approx([0.0, 0.5, 1.0, 0.0])


def test_tis_and_mis_sequence_level_use_the_product_of_token_ratios():
    old = t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    rollout = t([[-math.log(1.5), -math.log(1.5), 9.0], [math.log(2), 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 1, 1]], torch.int64)  # row 0: 1.5 * 1.5 = 2.25; row 1: 0.5
    tis, _ = rollout_importance_weights(old, rollout, mask, mode="tis", level="sequence", cap=2.0)
    torch.testing.assert_close(tis, t([[2.0, 2.0, 0.0], [0.5, 0.5, 0.5]]))
    mis, _ = rollout_importance_weights(old, rollout, mask, mode="mis", level="sequence", cap=2.0)
    torch.testing.assert_close(mis, t([[0.0, 0.0, 0.0], [0.5, 0.5, 0.5]]))


def test_is_weight_multiplies_the_per_token_loss():
    d = random_batch(seed=5)
    n_tok, n_seq = aggregate.mask_counts(d["mask"])
    kwargs = {"global_tokens": n_tok, "global_seqs": n_seq}
    plain, _ = compute_policy_loss(LossConfig(), d["logprobs"], d["old"], d["adv"], d["mask"],
                                   **kwargs)
    same, m = compute_policy_loss(LossConfig(is_mode="tis"), d["logprobs"], d["old"], d["adv"],
                                  d["mask"], rollout_logprobs=d["old"], **kwargs)
    assert same.item() == pytest.approx(plain.item(), abs=1e-7)
    assert m["is_weight"].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        compute_policy_loss(LossConfig(is_mode="mis"), d["logprobs"], d["old"], d["adv"],
                            d["mask"], **kwargs)


# ---- entropy -------------------------------------------------------------------------------

def test_token_entropy_matches_definition_and_mask():
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    for temperature in (1.0, 0.6):
        p = torch.softmax(logits / temperature, -1)
        naive = -(p * p.log()).sum(-1)
        got = token_entropy(logits, temperature=temperature, chunk_rows=2)
        torch.testing.assert_close(got, naive, atol=1e-6, rtol=1e-5)
    masked = token_entropy(logits, mask)
    assert (masked[0, 3:] == 0).all() and (masked[1] > 0).all()


def test_entropy_bonus_lowers_the_loss():
    d = random_batch(seed=1)
    n_tok, n_seq = aggregate.mask_counts(d["mask"])
    kwargs = {"entropy": d["entropy"], "global_tokens": n_tok, "global_seqs": n_seq}
    base, m = compute_policy_loss(LossConfig(), d["logprobs"], d["old"], d["adv"], d["mask"],
                                  **kwargs)
    bonus, _ = compute_policy_loss(LossConfig(entropy_coef=0.1), d["logprobs"], d["old"],
                                   d["adv"], d["mask"], **kwargs)
    assert bonus.item() == pytest.approx(base.item() - 0.1 * m["entropy"].item(), abs=1e-7)
    with pytest.raises(ValueError, match="entropy"):
        compute_policy_loss(LossConfig(entropy_coef=0.1), d["logprobs"], d["old"], d["adv"],
                            d["mask"], global_tokens=n_tok, global_seqs=n_seq)


# ---- registries and config -------------------------------------------------------------------

def test_registries_match_config_names():
    assert tuple(POLICY_LOSSES) == config.POLICY_LOSS_NAMES
    assert tuple(LOSS_AGGREGATIONS) == config.LOSS_AGG_MODES
    assert tuple(KL_ESTIMATORS) == config.KL_ESTIMATOR_NAMES


@pytest.mark.parametrize("field, value, valid", [
    ("policy_loss", "ppo", "ppo_clip, gspo, sapo, cispo"),
    ("loss_agg_mode", "mean", "token-mean"),
    ("kl_estimator", "k4", "k1, k2, k3, low_var_kl"),
])
def test_unknown_names_list_the_valid_ones(field, value, valid):
    with pytest.raises(ValidationError, match=valid):
        LossConfig(**{field: value})


def test_pick_lists_valid_names():
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl"):
        pick(KL_ESTIMATORS, "k4", "kl_estimator")


def test_config_is_frozen_and_strict():
    cfg = LossConfig()
    with pytest.raises(ValidationError):
        cfg.clip_eps_low = 0.1
    with pytest.raises(ValidationError, match="extra"):
        LossConfig(clip_ratio=0.2)


def test_shape_mismatch_fails_loudly():
    with pytest.raises(ValueError, match="loss_mask"):
        compute_policy_loss(LossConfig(), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2),
                            torch.ones(2, 4), global_tokens=6, global_seqs=2)
