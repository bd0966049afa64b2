"""Advantage estimators and filters (trainer/advantage): public cases C01, C02, C03,
C05, C23, C24 (distillation positions), and properties over random groups."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.trainer.advantage.distill import distill_advantages
from relax.trainer.advantage.filters import (
    keep_groups_with_variance,
    overlong_filter,
    soft_overlong_penalty,
)
from relax.trainer.advantage.grpo import dr_grpo_advantages, grpo_advantages
from relax.trainer.advantage.names import BATCH_ESTIMATORS, CRITIC_ESTIMATORS, ESTIMATOR_NAMES
from relax.trainer.advantage.registry import ADVANTAGE_ESTIMATORS, compute_advantages
from relax.trainer.advantage.reinforce_pp import (
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)
from relax.trainer.advantage.rloo import rloo_advantages
from relax.trainer.masks import completion_mask

GROUP_ESTIMATORS = ["grpo", "dr_grpo", "rloo", "rloo_std", "reinforce_pp_baseline"]


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def flat_groups(groups):
    """rewards [N] and group_ids [N] from a list of reward lists."""
    rewards = [r for g in groups for r in g]
    ids = [i for i, g in enumerate(groups) for _ in g]
    return t(rewards), t(ids, torch.int64)


def reference_grpo(groups, eps, scale_std=True):
    """Loop reference: per group mean and sample std (n - 1), singleton -> 0."""
    out = []
    for g in groups:
        x = torch.tensor(g, dtype=torch.float64)
        std = x.std() if len(g) > 1 else torch.tensor(0.0, dtype=torch.float64)
        if std <= 1e-6:
            out += [0.0] * len(g)
        else:
            out += ((x - x.mean()) / (std + eps if scale_std else 1)).tolist()
    return torch.tensor(out, dtype=torch.float32)


# ---- C01: statistics per prompt group, any sample order -----------------------------

def test_c01_grpo_stats_per_group_not_per_batch():
    rewards, ids = flat_groups([[1, 0], [1, 1]])
    adv = grpo_advantages(rewards, ids, eps=1e-4)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(adv, t([a, -a, 0, 0]), atol=1e-6, rtol=0)
    assert abs(adv[0].item() - 0.70701) < 1e-5
    wrong = t([0.5, -1.5, 0.5, 0.5])
    assert not torch.allclose(adv, wrong, atol=1e-2)
    assert adv[2:].abs().max() == 0  # P2 (two equal answers) gets exactly 0


def test_c01_interleaved_order_gives_the_same_advantages():
    # [P1a, P2a, P1b, P2b] with prompt ids attached
    rewards, ids = t([1, 1, 0, 1]), t([7, 3, 7, 3], torch.int64)
    adv = grpo_advantages(rewards, ids, eps=1e-4)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(adv, t([a, 0, -a, 0]), atol=1e-6, rtol=0)


# ---- C02: uneven and singleton groups ----------------------------------------------

C02_GROUPS = [[1, 0, 0, 0], [1, 1, 1], [0, 1], [1]]


def test_c02_uneven_and_singleton_groups_get_their_own_baseline():
    rewards, ids = flat_groups(C02_GROUPS)
    adv = grpo_advantages(rewards, ids, eps=1e-4)
    expected = t([1.5, -0.5, -0.5, -0.5, 0, 0, 0, -0.70711, 0.70711, 0])
    torch.testing.assert_close(adv, expected, atol=1e-3, rtol=0)
    torch.testing.assert_close(adv, reference_grpo(C02_GROUPS, 1e-4), atol=1e-6, rtol=0)
    assert torch.isfinite(adv).all()
    assert adv[4:7].abs().max() == 0 and adv[9] == 0  # G1 and G3 carry no signal
    assert not torch.isclose(adv, t(0.77460), atol=1e-3).any()  # global baseline


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_c02_every_estimator_is_finite_on_uneven_and_singleton_groups(name):
    rewards, ids = flat_groups(C02_GROUPS)
    adv = compute_advantages(name, rewards, ids)
    assert adv.dtype == torch.float32 and adv.shape == rewards.shape
    assert torch.isfinite(adv).all()
    if name in GROUP_ESTIMATORS:
        assert adv[9] == 0  # singleton
        assert adv[4:7].abs().max() == 0  # zero-variance group


# ---- C03: RLOO with leave-one-out std -----------------------------------------------

def test_c03_rloo_loo_std_zero_skips_normalisation():
    rewards, ids = t([1, 0, 0, 0]), t([0, 0, 0, 0], torch.int64)
    adv = rloo_advantages(rewards, ids, scale_std=True, eps=1e-6)
    torch.testing.assert_close(adv, t([1.0, -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)]),
                               atol=1e-5, rtol=0)
    assert adv.abs().max() <= 1.0  # typical wrong: 1,000,000 for sample 0


@pytest.mark.parametrize("n, odd", [(3, 1.0), (4, 0.0), (8, 1.0), (5, 2.5)])
def test_c03_family_odd_one_out_is_never_divided_by_eps(n, odd):
    rewards = t([odd] + [0.5] * (n - 1))
    adv = rloo_advantages(rewards, torch.zeros(n, dtype=torch.int64), scale_std=True)
    assert adv[0].item() == pytest.approx((odd - 0.5), abs=1e-6)  # unnormalised
    assert adv.abs().max() < 10


def test_rloo_plain_is_leave_one_out_baseline():
    groups = [[1, 0, 0, 0], [0.2, 0.9, 0.4], [3.0, 1.0]]
    rewards, ids = flat_groups(groups)
    expected = []
    for g in groups:
        for i, r in enumerate(g):
            others = g[:i] + g[i + 1:]
            expected.append(r - sum(others) / len(others))
    torch.testing.assert_close(rloo_advantages(rewards, ids), t(expected), atol=1e-6, rtol=0)


def test_rloo_std_matches_loop_reference():
    groups = [[0.1, 0.7, 0.3, 0.9, 0.2], [1, 0, 1]]
    rewards, ids = flat_groups(groups)
    expected = []
    for g in groups:
        for i, r in enumerate(g):
            others = torch.tensor(g[:i] + g[i + 1:], dtype=torch.float64)
            a = r - others.mean().item()
            std = others.std().item() if len(others) > 1 else 0.0
            expected.append(a if std <= 1e-6 else a / (std + 1e-6))
    got = rloo_advantages(rewards, ids, scale_std=True)
    torch.testing.assert_close(got, t(expected), atol=1e-5, rtol=0)


# ---- C05: Dr.GRPO is plain mean-centring --------------------------------------------

C05_GROUPS = [[1, 0, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0, 0, 0, 0, 0]]


def test_c05_with_std():
    rewards, ids = flat_groups(C05_GROUPS)
    adv = grpo_advantages(rewards, ids, eps=1e-4)
    expected = t([1.5, -0.5, -0.5, -0.5, 0.5, 0.5, 0.5, -1.5, 2.47487] + [-0.35355] * 7)
    torch.testing.assert_close(adv, expected, atol=2e-3, rtol=0)
    torch.testing.assert_close(adv, reference_grpo(C05_GROUPS, 1e-4), atol=1e-6, rtol=0)


def test_c05_without_std_is_mean_centring():
    rewards, ids = flat_groups(C05_GROUPS)
    adv = dr_grpo_advantages(rewards, ids)
    expected = t([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75, 0.875] + [-0.125] * 7)
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    # typical wrong: still dividing by std (+eps)
    assert not torch.allclose(adv, grpo_advantages(rewards, ids), atol=1e-2)
    for lo, hi in [(0, 4), (4, 8), (8, 16)]:
        assert abs(adv[lo:hi].sum().item()) < 1e-6


# ---- properties over random groups ----------------------------------------------------

@st.composite
def grouped_rewards(draw, binary=None):
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=6))
    is_binary = draw(st.booleans()) if binary is None else binary
    value = st.sampled_from([0.0, 1.0]) if is_binary else st.floats(-5, 5, width=32)
    groups = [[draw(value) for _ in range(n)] for n in sizes]
    perm = draw(st.permutations(list(range(sum(sizes)))))
    labels = draw(st.lists(st.integers(-1000, 1000), min_size=len(sizes), max_size=len(sizes),
                           unique=True))
    return groups, perm, labels


def shuffled(groups, perm, labels):
    rewards, ids = flat_groups(groups)
    ids = t(labels, torch.int64)[ids]
    p = torch.tensor(perm)
    return rewards[p], ids[p], p


@settings(max_examples=60, deadline=None)
@given(case=grouped_rewards(), name=st.sampled_from(sorted(ADVANTAGE_ESTIMATORS)))
def test_permuting_samples_permutes_advantages(case, name):
    groups, perm, labels = case
    rewards, ids = flat_groups(groups)
    ids = t(labels, torch.int64)[ids]
    p = torch.tensor(perm)
    straight = compute_advantages(name, rewards, ids)
    permuted = compute_advantages(name, rewards[p], ids[p])
    torch.testing.assert_close(permuted, straight[p], atol=1e-5, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(case=grouped_rewards(), name=st.sampled_from(["grpo", "dr_grpo", "rloo",
                                                      "reinforce_pp_baseline"]))
def test_group_advantages_sum_to_zero_per_group(case, name):
    rewards, ids, _ = shuffled(*case)
    adv = compute_advantages(name, rewards, ids).double()
    for g in ids.unique():
        members = adv[ids == g]
        scale = max(1.0, members.abs().max().item())
        assert abs(members.sum().item()) <= 1e-5 * scale * len(members)


@settings(max_examples=60, deadline=None)
@given(case=grouped_rewards())
def test_grpo_matches_loop_reference(case):
    groups, _, _ = case
    rewards, ids = flat_groups(groups)
    for scale_std in (True, False):
        got = grpo_advantages(rewards, ids, scale_std=scale_std)
        torch.testing.assert_close(got, reference_grpo(groups, 1e-4, scale_std), atol=1e-5,
                                   rtol=1e-5)


def test_zero_variance_uses_a_tolerance():
    a = torch.tensor(0.3, dtype=torch.float32)
    b = torch.nextafter(a, torch.tensor(1.0))
    rewards, ids = torch.stack([a, b, a]), t([0, 0, 0], torch.int64)
    for name in GROUP_ESTIMATORS:
        assert compute_advantages(name, rewards, ids).abs().max() == 0, name
    assert not keep_groups_with_variance(rewards, ids).any()


def test_reinforce_pp_is_global_batch_normalisation():
    rewards = t([1, 0, 0, 1, 1, 0.5])
    adv = reinforce_pp_advantages(rewards, t([0, 0, 1, 1, 2, 2], torch.int64))
    r = rewards.double()
    torch.testing.assert_close(adv, ((r - r.mean()) / (r.std() + 1e-6)).float())
    assert abs(adv.mean().item()) < 1e-6 and adv.double().std().item() == pytest.approx(1, abs=1e-5)
    # groups are ignored
    torch.testing.assert_close(adv, reinforce_pp_advantages(rewards, t([0] * 6, torch.int64)))
    assert reinforce_pp_advantages(t([1, 1, 1])).abs().max() == 0


def test_reinforce_pp_baseline_centres_per_group_then_divides_by_batch_std():
    groups = [[1, 0, 0, 0], [1, 1, 0], [0.5]]
    rewards, ids = flat_groups(groups)
    centred = torch.cat([torch.tensor(g, dtype=torch.float64) - sum(g) / len(g) for g in groups])
    expected = (centred / (centred.std() + 1e-6)).float()
    torch.testing.assert_close(reinforce_pp_baseline_advantages(rewards, ids), expected)


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="grpo.*rloo"):
        compute_advantages("ppo", t([1, 0]), t([0, 0], torch.int64))


@pytest.mark.parametrize("rewards, ids", [
    (t([1, float("nan")]), t([0, 0], torch.int64)),
    (t([[1, 0]]), t([[0, 0]], torch.int64)),
    (t([1, 0]), t([0, 0, 1], torch.int64)),
    (t([1, 0]), t([0.0, 1.0])),
])
def test_bad_inputs_fail_loudly(rewards, ids):
    with pytest.raises(ValueError):
        grpo_advantages(rewards, ids)


# ---- filters --------------------------------------------------------------------------

def test_dynamic_sampling_drops_groups_without_variance():
    rewards, ids = flat_groups([[1, 0], [1, 1], [0, 0, 0], [1], [0.2, 0.9, 0.2]])
    keep = keep_groups_with_variance(rewards, ids)
    assert keep.tolist() == [True, True] + [False] * 6 + [True] * 3


@pytest.mark.parametrize("reasons", [["stop", "length"], ["length", "stop", "stop"],
                                     ["abort", "length", "error", "stop"], ["stop"] * 3])
def test_c23_family_only_finish_reason_decides(reasons):
    loss_mask = torch.ones(len(reasons), 3, dtype=torch.int8)
    out = overlong_filter(loss_mask, reasons)
    assert out.sum(-1).tolist() == [0 if r == "length" else 3 for r in reasons]
    assert out.dtype == torch.int8 and loss_mask.sum() == 3 * len(reasons)  # input untouched


def test_c23_overlong_filter_uses_finish_reason_not_eos_id():
    # tokenizer eos id = 2; the model ends its turn with 9. A = [5, 6, 9] "stop",
    # B = [5, 6, 7] "length". The filter never sees token ids.
    mask = torch.ones(2, 3, dtype=torch.int64)
    out = overlong_filter(mask, ["stop", "length"])
    assert out[0].tolist() == [1, 1, 1]  # typical wrong: zeroed because 9 != eos 2
    assert out[1].tolist() == [0, 0, 0]


def test_overlong_filter_checks_lengths_and_other_reasons():
    mask = torch.ones(3, 2)
    assert overlong_filter(mask, ["abort", "token_budget", "length"],
                           reasons={"length", "token_budget"}).sum(-1).tolist() == [2, 0, 0]
    with pytest.raises(ValueError):
        overlong_filter(mask, ["stop"])


def test_soft_overlong_penalty_dapo_eq13():
    lengths = t([10, 16, 17, 18, 20, 25], torch.int64)
    got = soft_overlong_penalty(lengths, max_length=20, cache_length=4)
    torch.testing.assert_close(got, t([0, 0, -0.25, -0.5, -1, -1]))
    with pytest.raises(ValueError):
        soft_overlong_penalty(lengths, max_length=20, cache_length=0)


# ---- on-policy distillation -----------------------------------------------------------

def test_distill_advantage_is_negative_reverse_kl():
    student = t([[-1.0, -2.0, -0.5]])
    teacher = t([[-1.5, -1.0, -0.5]])
    adv = distill_advantages(student, teacher, torch.ones(1, 3), coef=2.0)
    torch.testing.assert_close(adv, t([[-1.0, 2.0, 0.0]]))


def test_c24_distillation_uses_the_length_mask_with_pad_equal_eos():
    completion = torch.tensor([[5, 6, 9, 9, 9]])  # pad id == eos id == 9, true length 3
    mask = completion_mask(torch.tensor([3]), completion.shape[1])
    student = t([[-1.0, -1.0, -0.2, float("nan"), float("nan")]])
    teacher = t([[-0.5, -2.0, -0.1, float("inf"), -3.0]])
    adv = distill_advantages(student, teacher, mask)
    assert (adv != 0).tolist() == [[True, True, True, False, False]]  # EOS position trained
    assert torch.isfinite(adv).all()
    wrong_mask = completion != 9
    assert wrong_mask.sum() == 2 and mask.sum() == 3


def test_the_torch_free_names_are_the_registry_s_estimators():
    """The configs check names against :mod:`relax.trainer.advantage.names` (no torch);
    the aggregator runs :data:`ADVANTAGE_ESTIMATORS`: the two lists are one."""
    assert tuple(ADVANTAGE_ESTIMATORS) == ESTIMATOR_NAMES
    assert set(BATCH_ESTIMATORS) | set(CRITIC_ESTIMATORS) < set(ESTIMATOR_NAMES)
