"""Model families through the broker (issue 56): one case per family, every stage its own
process on the real broker, rows balanced, the rollout sampling with trained weights and the
weights that matter moved.

Each case is as cheap as it can be and still show that: ``mode=sync`` (max_staleness 0)
with 2 steps of 2 groups, so the second step trains only on rollouts the engine sampled
with the weights of the first (policy_version 1), a handful of prompts, no eval; the
weights are compared as saved tensors (safetensors), without building the models again."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

CHEAP = ["mode=sync", "trainer.steps=2", "trainer.batch_groups=2"]
"""Overrides of every case: 2 on-policy steps of 2 groups (8 rollouts a step)."""


def _train(recipe_file: str, broker: str, tmp_path, run: str, *overrides: str) -> dict:
    """Run ``recipes/<recipe_file>`` with :data:`CHEAP` and ``overrides`` on ``broker``
    (parity test reward: the random models never answer right, and all-zero rewards give
    all-zero advantages, so no gradient at all), the model built first; checks the
    summary: 2 steps, every rollout accounted, balanced. Returns the summary."""
    from testdata import PARITY_REWARD, RECIPES

    from relax.infra.control.launch import train
    from relax.infra.recipe.recipe import load_recipe
    from relax.trainer.models import model_path

    recipe = load_recipe(RECIPES / recipe_file, [
        f"bootstrap_servers={broker}", f"run_root={tmp_path}", f"run={run}", PARITY_REWARD,
        *CHEAP, *overrides])
    model_path(recipe.model)  # built here once (a fresh cache), not by two stages at once
    s = train(recipe, say=lambda _: None, timeout_s=400)
    assert s["steps"] == 2 and s["balanced"], s
    assert s["trained"] + s["stale"] + s["filtered"] + s["errors"] == s["sampled"] > 0, s
    return s


def _rollouts(broker: str, run: str) -> list[dict]:
    """The run's rollouts; policy_version 0 and 1 among them (the first step's weights
    reached the engine; 2 as well when it sampled again before the run stopped)."""
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table

    rows = read_table(BusConfig(bootstrap_servers=broker), f"{run}.rollouts").to_pylist()
    assert {0, 1} <= {r["policy_version_start"] for r in rows}, rows
    return rows


def _moved(s: dict, model: str, *parts: str) -> dict[str, float]:
    """``{part: largest |final - initial| over the tensors whose name holds part}`` of the
    run's final model against ``model``'s initial weights; checks the final model is of
    ``model``'s family (same ``model_type``, the same tensors)."""
    from safetensors.torch import load_file

    from relax.trainer.models import model_path

    final_dir, begin_dir = Path(s["run_dir"]) / "final_model", Path(model_path(model))
    kind = json.loads((begin_dir / "config.json").read_text())["model_type"]
    assert json.loads((final_dir / "config.json").read_text())["model_type"] == kind
    final = load_file(final_dir / "model.safetensors")
    begin = load_file(begin_dir / "model.safetensors")
    assert final.keys() == begin.keys()
    return {p: max(float((final[k] - begin[k]).abs().max()) for k in final if p in k)
            for p in parts}


def _prompts(broker: str, dataset: str) -> dict[str, dict]:
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table

    rows = read_table(BusConfig(bootstrap_servers=broker), f"prompts.{dataset}").to_pylist()
    return {r["prompt_id"]: r for r in rows}


@pytest.mark.e2e
@pytest.mark.parametrize(("model", "kind", "parts"), [
    ("tiny-qwen3", "qwen3", ("self_attn.q_norm", "self_attn.k_norm", "mlp.down_proj")),
    ("tiny-qwen3-moe", "qwen3_moe", ("mlp.gate.weight", "mlp.experts.", "self_attn.q_norm"))])
def test_text_recipe_through_the_broker_trains_the_tiny_qwen3_model(model, kind, parts, broker,
                                                                    local_ray, tmp_path):
    """recipes/tiny_ci.yaml on tiny-qwen3 (dense) and tiny-qwen3-moe (4 experts, 2 routed),
    2 on-policy steps: balanced, every rollout accounted and text only, the engine sampled
    the second step's rollouts with the first step's weights; the final model is the
    family's (model_type) and its Qwen3 parts moved: the q/k norms, and for the MoE the
    router (``mlp.gate``) and the experts."""
    run = "qwen3" + uuid.uuid4().hex[:6]
    s = _train("tiny_ci.yaml", broker, tmp_path, run, f"model={model}")
    for r in _rollouts(broker, run):
        assert r["media"] is None and r["prompt_ids"] and r["response_ids"]
    moved = _moved(s, model, *parts)
    assert json.loads((Path(s["run_dir"]) / "final_model" / "config.json").read_text())[
        "model_type"] == kind
    assert min(moved.values()) > 1e-5, moved


@pytest.mark.e2e
@pytest.mark.parametrize("model,groups", [("tiny-qwen2.5-vl", 1), ("tiny-qwen3-vl", 4)])
def test_video_recipe_through_the_broker_trains_the_tiny_vl_model(model, groups, broker,
                                                                   local_ray, tmp_path):
    """recipes/video_grpo.yaml on 4 moving-square clips (tiny-qwen2.5-vl, and tiny-qwen3-vl
    by ``model=``), 2 on-policy steps: every rollout accounted; rollouts and train samples
    carry the prompt's frame strip (8 frames with their timestamps); each prompt holds its
    clip's 16 video tokens once (Qwen2.5-VL in one group, Qwen3-VL in 4 groups of 4, one
    per two frames); the engine sampled with the first step's weights; the final model's
    vision encoder moved."""
    from relax.schemas.media import video_frames
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table
    from relax.trainer.models import model_path

    run = "video" + uuid.uuid4().hex[:6]
    s = _train("video_grpo.yaml", broker, tmp_path, run, f"model={model}",
               "data.source=moving_square:train?size=4&seed=2")
    prompts = _prompts(broker, "moving-square")
    config = json.loads((Path(model_path(model)) / "config.json").read_text())
    pad, start = config["video_token_id"], config["vision_start_token_id"]
    for r in _rollouts(broker, run):
        (item,) = r["media"]
        assert item == prompts[r["prompt_id"]]["media"][0] and item["kind"] == "video"
        frames, stamps, _ = video_frames(item["data"])
        assert len(frames) == 8 and stamps == [i / 8 for i in range(8)]
        assert r["prompt_ids"].count(pad) == 16 and r["prompt_ids"].count(start) == groups
    samples = read_table(BusConfig(bootstrap_servers=broker), f"{run}.train_samples").to_pylist()
    assert samples and all(x["media"] for x in samples)
    moved = _moved(s, model, "visual")
    assert moved["visual"] > 1e-5, moved


@pytest.mark.e2e
@pytest.mark.parametrize("model, fewest_audio, group", [("tiny-qwen2.5-omni", 21, 4),
                                                        ("tiny-qwen3-omni", 13, 8)])
def test_omni_recipe_through_the_broker_trains_on_mixed_media(broker, local_ray, tmp_path,
                                                              model, fewest_audio, group):
    """recipes/omni_grpo.yaml (tiny-qwen2.5-omni on omni_mix: an image, a spoken sum and a
    clip in one data set; and the same with tiny-qwen3-omni), 2 on-policy steps: every
    rollout accounted; each rollout carries its prompt's one item, all three kinds among
    them, and holds that item's placeholders once (16 image or 16 video tokens, or the
    clip's audio tokens, at least ``fewest_audio`` (25 a second for Qwen2.5-Omni, 13 for
    Qwen3-Omni), between one audio start and end token); the engine sampled with the first
    step's weights; the final model's vision and audio encoders both moved (a ``group`` of
    samples a prompt: Qwen3-Omni's 4 samples of the spoken sum all had one reward, so no
    gradient reached its audio encoder; with 8 that is 1 chance in 128 a group)."""
    from relax.trainer.models import model_path

    run = "omni" + uuid.uuid4().hex[:6]
    s = _train("omni_grpo.yaml", broker, tmp_path, run, "data.source=omni_mix:train?size=3&seed=2",
               f"model={model}", f"rollout.group_size={group}")
    prompts = _prompts(broker, "omni-mix")
    assert len(prompts) == 3
    config = json.loads((Path(model_path(model)) / "config.json").read_text())
    token = {k: config.get(f"{k}_token_index", config.get(f"{k}_token_id"))
             for k in ("image", "video", "audio")}
    kinds = set()
    for r in _rollouts(broker, run):
        (item,) = r["media"]
        assert item == prompts[r["prompt_id"]]["media"][0]
        kinds.add(item["kind"])
        counts = {k: r["prompt_ids"].count(t) for k, t in token.items()}
        if item["kind"] == "audio":
            assert counts["audio"] >= fewest_audio
            assert r["prompt_ids"].count(config["audio_start_token_id"]) == 1
            assert counts["image"] == counts["video"] == 0
        else:
            assert counts == {**dict.fromkeys(token, 0), item["kind"]: 16}
    assert kinds == {"image", "audio", "video"}
    moved = _moved(s, model, "visual", "audio_tower")
    assert min(moved.values()) > 1e-5, moved
