"""On-policy distillation through the whole pipeline (issue 16): a teacher stage (the
reference stage with its own frozen model) scores every rollout, the aggregator
subtracts ``distill_coef x (logprobs - teacher_logprobs)`` from each loss token's
advantage, the trainer reports the teacher KL. Every stage its own process, the real
broker; the teacher is the tiny run's trained ``final_model``."""

from __future__ import annotations

import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from testdata import tiny_recipe

from relax.schemas import metric_names as M
from relax.streams.client import BusConfig
from relax.streams.read import read_table
from relax.trainer.advantage.registry import compute_advantages

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("local_ray")]

COEF = 0.5


def test_distillation_run_uses_the_teachers_logprobs_per_token(tiny_run, broker, tmp_path):
    from relax.consumers.reference import response_logprobs
    from relax.infra.control.launch import train
    from relax.trainer.models import load_model

    _, first = tiny_run
    teacher_dir = Path(first["run_dir"]) / "final_model"
    run = "opd" + uuid.uuid4().hex[:6]
    recipe = tiny_recipe(broker, tmp_path, run, f"teacher.model={teacher_dir}",
                         f"advantage.distill_coef={COEF}")
    lines: list[str] = []
    s = train(recipe, say=lines.append, timeout_s=500)
    assert s["steps"] == 3 and s["balanced"], (s, lines)

    bus = BusConfig(bootstrap_servers=broker)
    every = read_table(bus, f"{run}.train_samples").to_pylist()
    assert not [r for r in every if r["drop_reason"] == "filtered_group_timeout"]
    samples = [r for r in every if r["drop_reason"] is None]
    assert samples and all(r["teacher_logprobs"] is not None for r in samples)
    # the teacher's log-probs are the trained model's, at the student's positions
    teacher = load_model(str(teacher_dir))
    some = samples[:6]
    want = response_logprobs(teacher, [r["prompt_ids"] for r in some],
                             [r["response_ids"] for r in some], some[0]["temperature"])
    for r, w in zip(some, want):
        assert r["teacher_logprobs"] == pytest.approx(w, abs=1e-4)
    # advantage = GRPO outcome advantage - COEF x (logprobs - teacher) on loss tokens
    groups = defaultdict(list)
    for r in samples:
        groups[r["group_id"]].append(r)
    differs = 0
    for rows in groups.values():
        outcome = []
        for r in rows:
            adv, lp = np.asarray(r["advantages"]), np.asarray(r["logprobs"])
            mask, t = np.asarray(r["loss_mask"]), np.asarray(r["teacher_logprobs"])
            base = adv + COEF * (lp - t) * mask
            assert np.allclose(base, base[0], atol=1e-4), (base, r["rollout_id"])
            outcome.append(base[0])
            differs += int(np.abs(lp - t)[mask == 1].max(initial=0) > 1e-3)
        if len(rows) == rows[0]["group_size"]:
            grpo = compute_advantages("grpo", torch.tensor([r["reward"] for r in rows]),
                                      torch.zeros(len(rows), dtype=torch.int64))
            assert outcome == pytest.approx(grpo.tolist(), abs=1e-4)
    assert differs > 0  # the teacher is not the student
    kl = {m["policy_version"]: m["value"] for m in read_table(bus, f"{run}.metrics").to_pylist()
          if m["name"] == M.TEACHER_KL}
    assert sorted(kl) == [1, 2, 3] and all(np.isfinite(v) for v in kl.values()), kl
