"""build_train_samples: one joined group -> train samples (pure, no Kafka)."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
from testdata import rollout_rows

from relax.consumers.aggregate_config import AdvantageConfig, SoftOverlong
from relax.consumers.samples import build_train_samples
from relax.schemas import validate
from relax.schemas.v1 import ROLLOUTS


def _group(n=4, tokens=3):
    rows = rollout_rows(n, group_size=n, tokens=tokens)
    return rows, pa.Table.from_pylist(rows, schema=ROLLOUTS)


def _cells(rows, values, name="math"):
    return {r["rollout_id"]: {name: (v, None)} for r, v in zip(rows, values)}


def test_grpo_group_advantages_broadcast_per_token():
    rows, t = _group()
    out = build_train_samples(t, _cells(rows, [1, 0, 0, 0]), None, AdvantageConfig())
    validate(out, "train_samples")
    adv = out.column("advantages").to_pylist()
    want = [1.5, -0.5, -0.5, -0.5]  # C05: mean 0.25, sample std 0.5 (eps 1e-4)
    for a, w in zip(adv, want):
        assert len(a) == 3 and all(math.isclose(x, w / (1 + 2e-4), rel_tol=1e-3) for x in a)
    assert out.column("drop_reason").to_pylist() == [None] * 4
    assert out.column("reward_components").to_pylist()[0] == [("math", 1.0)]


def test_weighted_rewards_abstain_and_error():
    rows, t = _group()
    cells = {r["rollout_id"]: {"math": (1.0, None), "fmt": (0.5, None)} for r in rows}
    cells[rows[1]["rollout_id"]]["fmt"] = (None, None)            # abstains: adds 0
    cells[rows[2]["rollout_id"]]["math"] = (None, "TimeoutError")  # failed: dropped
    cfg = AdvantageConfig(rewards={"math": 1.0, "fmt": 0.2})
    out = build_train_samples(t, cells, None, cfg)
    assert out.column("reward").to_pylist() == pytest.approx([1.1, 1.0, 0.1, 1.1])
    assert out.column("drop_reason").to_pylist() == [None, None, "error_reward", None]
    assert out.column("advantages").to_pylist()[2] == [0.0, 0.0, 0.0]


def test_c02_timeout_uneven_group_stats_over_present_rollouts():
    rows, t = _group(3)
    cells = _cells(rows[:2], [0, 1])
    out = build_train_samples(t, cells, None, AdvantageConfig(), timed_out={rows[2]["rollout_id"]})
    a = [x[0] for x in out.column("advantages").to_pylist()]
    assert a[0] == pytest.approx(-0.70711, abs=1e-3) and a[1] == pytest.approx(0.70711, abs=1e-3)
    assert a[2] == 0
    assert out.column("drop_reason").to_pylist() == [None, None, "filtered_group_timeout"]


def test_dynamic_sampling_drops_zero_variance_group_but_emits_rows():
    rows, t = _group()
    out = build_train_samples(t, _cells(rows, [1, 1, 1, 1]), None,
                              AdvantageConfig(dynamic_sampling=True))
    assert out.column("drop_reason").to_pylist() == ["filtered_zero_variance"] * 4
    out = build_train_samples(t, _cells(rows, [1, 1, 1, 1]), None, AdvantageConfig())
    assert out.column("drop_reason").to_pylist() == [None] * 4
    assert all(x == 0 for a in out.column("advantages").to_pylist() for x in a)


def test_c23_overlong_filter_by_finish_reason_not_token():
    rows, _ = _group(2)
    rows[0].update(response_ids=[5, 6, 9], finish_reason="stop")    # ends with end-of-turn 9
    rows[1].update(response_ids=[5, 6, 7], finish_reason="length")  # hit max tokens
    t = pa.Table.from_pylist(rows, schema=ROLLOUTS)
    out = build_train_samples(t, _cells(rows, [1, 0]), None, AdvantageConfig(overlong_filter=True))
    assert out.column("loss_mask").to_pylist() == [[1, 1, 1], [0, 0, 0]]
    assert out.column("drop_reason").to_pylist() == [None, None]


def test_soft_overlong_penalty_and_kl_in_reward():
    rows, t = _group(2, tokens=4)
    ref = {r["rollout_id"]: [-0.75] * 4 for r in rows}  # rollout logprobs are -0.25
    cfg = AdvantageConfig(kl_in_reward_coef=0.1, kl_estimator="k1",
                          soft_overlong=SoftOverlong(max_length=4, cache_length=2))
    out = build_train_samples(t, _cells(rows, [1, 0]), ref, cfg)
    # k1 per token = 0.5, 4 tokens -> 2.0; x 0.1 = 0.2; length 4 = max -> penalty -1
    assert out.column("reward").to_pylist() == pytest.approx([1 - 1 - 0.2, 0 - 1 - 0.2])
    assert out.column("ref_logprobs").to_pylist()[0] == [-0.75] * 4


def _verl_kl_in_reward(score, logprob, ref_logprob, mask, beta, kl_penalty):
    """verl's path for an outcome estimator, written out from verl/trainer/ppo/
    core_algos.py (``kl_penalty_forward``) and ray_trainer.py (``apply_kl_penalty``:
    ``token_level_rewards = token_level_scores - beta * kld``; GRPO's outcome advantage
    then takes ``token_level_rewards.sum(-1)``); the score sits on the last token."""
    import torch

    lp, rl = torch.tensor(logprob, dtype=torch.float64), torch.tensor(ref_logprob, dtype=torch.float64)
    if kl_penalty in ("kl", "k1"):
        kld = lp - rl
    elif kl_penalty in ("mse", "k2"):
        kld = 0.5 * (lp - rl).square()
    else:  # low_var_kl / k3
        kl = torch.clamp(rl - lp, min=-20, max=20)
        kld = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    m = torch.tensor(mask, dtype=torch.float64)
    scores = torch.zeros_like(lp)
    scores[-1] = score
    return float((scores - beta * kld * m).sum())


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_in_reward_matches_verl_where_clamps_bind(estimator):
    rows, _ = _group(2, tokens=4)
    lps = [[-0.25, -3.0, -30.0, -0.5], [-1.0, -0.1, -2.0, -40.0]]
    refs = [[-0.75, -0.2, -1.0, -8.0], [-26.0, -0.1, -0.3, -0.2]]  # |d| > 20 in both
    masks = [[1, 1, 1, 0], [1, 1, 1, 1]]
    for r, lp, m in zip(rows, lps, masks):
        r.update(logprobs=lp, loss_mask=m)
    t = pa.Table.from_pylist(rows, schema=ROLLOUTS)
    ref = {r["rollout_id"]: x for r, x in zip(rows, refs)}
    cfg = AdvantageConfig(kl_in_reward_coef=0.05, kl_estimator=estimator)
    out = build_train_samples(t, _cells(rows, [1, 0]), ref, cfg)
    want = [_verl_kl_in_reward(s, lp, rl, m, 0.05, estimator)
            for s, lp, rl, m in zip([1, 0], lps, refs, masks)]
    assert out.column("reward").to_pylist() == pytest.approx(want, rel=1e-6)  # float32 column


def test_unknown_kl_estimator_lists_valid():
    with pytest.raises(ValueError, match="low_var_kl"):
        AdvantageConfig(kl_estimator="k4")


def test_missing_counted_reward_is_an_error():
    rows, t = _group(2)
    with pytest.raises(KeyError):
        build_train_samples(t, _cells(rows[:1], [1]), None, AdvantageConfig())


def test_unknown_estimator_lists_valid():
    with pytest.raises(ValueError, match="grpo"):
        AdvantageConfig(estimator="nope")


def test_gae_is_accepted_and_left_to_the_trainer_critic():
    # the aggregator writes 0 advantages; the trainer's critic computes GAE (trainer/critic.py)
    assert AdvantageConfig(estimator="gae").estimator == "gae"


def test_distillation_adds_the_teachers_reverse_kl_per_loss_token():
    """distill_coef c: every kept row's token advantage is the outcome advantage minus
    c x (logprobs - teacher_logprobs) on loss tokens, the outcome advantage alone on the
    others; dropped rows stay 0; teacher_logprobs are carried; a kept row without them
    is an error."""
    import numpy as np

    rows, _ = _group(4, tokens=3)
    rows[0]["loss_mask"] = [1, 0, 1]
    rows[3]["finish_reason"] = "error"
    t = pa.Table.from_pylist(rows, schema=ROLLOUTS)
    teacher = {r["rollout_id"]: [lp - 0.1 * (k + 1) for k, lp in enumerate(r["logprobs"])]
               for r in rows}
    cfg = AdvantageConfig(distill_coef=2.0)
    plain = build_train_samples(t, _cells(rows, [1, 0, 0, 0]), None, AdvantageConfig())
    out = build_train_samples(t, _cells(rows, [1, 0, 0, 0]), None, cfg, teacher_logprobs=teacher)
    validate(out, "train_samples")
    for r, a, base, m in zip(rows, out.column("advantages").to_pylist(),
                             plain.column("advantages").to_pylist(),
                             out.column("loss_mask").to_pylist()):
        if r["finish_reason"] == "error":
            assert a == [0.0, 0.0, 0.0]
            continue
        kl = np.asarray(r["logprobs"]) - np.asarray(teacher[r["rollout_id"]])  # 0.1, 0.2, 0.3
        want = np.asarray(base) - 2.0 * kl * np.asarray(m)
        assert a == pytest.approx(want.tolist(), abs=1e-5)
    assert out.column("teacher_logprobs").to_pylist()[1] == pytest.approx(teacher[rows[1]["rollout_id"]])
    assert plain.column("teacher_logprobs").null_count == 4
    missing = {k: v for k, v in teacher.items() if k != rows[2]["rollout_id"]}
    with pytest.raises(KeyError, match="teacher_logprobs for rollout"):
        build_train_samples(t, _cells(rows, [1, 0, 0, 0]), None, cfg, teacher_logprobs=missing)
