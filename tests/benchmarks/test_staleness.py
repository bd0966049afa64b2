"""``benchmarks/staleness.py``: one run's figures from its metric rows, the cells over
seeds, and their table in RESULTS.md (the runs themselves are the benchmark's)."""

import pytest

from relax.benchmarks import results_md
from relax.benchmarks.staleness import cells, summarize


def _trainer(version: int, **values: float) -> list[dict]:
    return [{"component": "trainer", "policy_version": version, "name": k, "value": v}
            for k, v in {"step_s": 1.0, **values}.items()]


def _eval(version: int, accuracy: float) -> dict:
    return {"component": "eval", "policy_version": version, "name": "eval_accuracy",
            "value": accuracy}


def _rows() -> list[dict]:
    return [*_trainer(1, staleness_mean=0.0, staleness_max=0, samples_trained=16,
                      tokens_trained=100, clip_frac_low=0.01, clip_frac_high=0.03,
                      reward_mean_trained=0.25),
            *_trainer(2, staleness_mean=3.0, staleness_max=4, samples_trained=48,
                      tokens_trained=300, clip_frac_low=0.0, clip_frac_high=0.08,
                      samples_dropped_stale=2, reward_mean_trained=0.75),
            _eval(0, 0.3), _eval(2, 0.5),
            {"component": "rollout-0", "policy_version": 2, "name": "step_s", "value": 9.0}]


def test_a_run_is_weighted_by_samples_and_tokens():
    r = summarize(_rows(), "ppo_clip", steps=2)
    assert r["staleness_mean"] == pytest.approx((0 * 16 + 3 * 48) / 64)
    assert r["staleness_max"] == 4
    # clipped share: (low + high) per step, weighted by the step's trained tokens
    assert r["masked_token_share"] == pytest.approx((0.04 * 100 + 0.08 * 300) / 400)
    assert r["accuracy_curve"] == {"0": 0.3, "2": 0.5} and r["accuracy_after"] == 0.5
    assert (r["samples_trained"], r["samples_dropped_stale"]) == (64, 2)
    assert r["reward_trained_last5"] == pytest.approx(0.5)
    assert "m2_mean" not in r


def test_m2po_reads_its_own_masked_share_and_a_short_run_is_an_error():
    rows = [*_trainer(1, samples_trained=8, tokens_trained=50, m2po_masked_frac=0.1, m2=0.2,
                      clip_frac_high=0.5)]
    r = summarize(rows, "m2po", steps=1)
    assert r["masked_token_share"] == pytest.approx(0.1) and r["m2_mean"] == pytest.approx(0.2)
    assert r["accuracy_after"] is None
    with pytest.raises(ValueError, match="trained 1 of 2 steps"):
        summarize(rows, "m2po", steps=2)
    with pytest.raises(ValueError, match="the trainer restarted: policy_versions 1-1"):
        summarize([*rows, *_trainer(1, samples_trained=8)], "m2po", steps=1)


def _doc() -> dict:
    run = {"loss": "m2po", "max_staleness": 16, "wall_s": 100.0, "staleness_mean": 10.0,
           "staleness_max": 16, "masked_token_share": 0.01}
    runs = [{**run, "seed": 1, "accuracy_after": 0.5}, {**run, "seed": 2, "accuracy_after": 0.6},
            {**run, "seed": 3, "error": "rc 1: boom"}]
    return {"settings": {"recipe": "recipes/arith_m2po_async.yaml", "steps": 32,
                         "batch_groups": 2, "group_size": 8, "trained_samples": 512,
                         "eval_size": 100},
            "base": {"accuracy": 0.29}, "runs": runs, "cells": cells(runs, [0, 16])}


def test_cells_count_the_finished_seeds_and_the_table_shows_them():
    doc = _doc()
    m2po16 = next(c for c in doc["cells"] if (c["loss"], c["max_staleness"]) == ("m2po", 16))
    assert m2po16["seeds"] == [1, 2]
    assert m2po16["accuracy_after_mean"] == pytest.approx(0.55)
    assert m2po16["accuracy_after_std"] == pytest.approx(0.0707, abs=1e-4)
    grpo0 = next(c for c in doc["cells"] if (c["loss"], c["max_staleness"]) == ("grpo", 0))
    assert grpo0["seeds"] == [] and grpo0["accuracy_after_mean"] is None
    headline, lines = results_md.staleness(doc)
    assert headline == "m2po s=16 0.55"
    assert "| m2po | 16 | 2 | 0.55 | 0.0707 | 0.50, 0.60 | 10 | 16 | 1.00% | 100 |" in lines
    assert "| grpo | 0 | 0 | - | - |  | - | - | - | - |" in lines
