"""Model families through the broker (issue 56): each family's tiny recipe, every stage its
own process on the real broker, rows balanced and the encoders' weights moved."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.e2e
@pytest.mark.parametrize("model,groups", [("tiny-qwen2.5-vl", 1), ("tiny-qwen3-vl", 4)])
def test_video_recipe_through_the_broker_trains_the_tiny_vl_model(model, groups, broker,
                                                                   local_ray, tmp_path):
    """recipes/video_grpo.yaml on moving-square clips (tiny-qwen2.5-vl, and tiny-qwen3-vl
    by ``model=``), 3 steps (the third needs rollouts of version >= 1 at staleness 1): every
    rollout accounted; rollouts and train samples carry the prompt's frame strip (8 frames
    with their timestamps); each prompt holds its clip's 16 video tokens once (Qwen2.5-VL
    in one group, Qwen3-VL in 4 groups of 4, one per two frames); the engine
    sampled with published weights; the final model's vision encoder moved (scored by
    the parity test reward: the random model never answers right, and all-zero rewards
    give all-zero advantages, so no gradient at all)."""
    import uuid

    from testdata import PARITY_REWARD, RECIPES

    from relax.infra.control.launch import train
    from relax.infra.recipe.recipe import load_recipe
    from relax.schemas.media import video_frames
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table
    from relax.trainer.models import load_model, load_tokenizer

    run = "video" + uuid.uuid4().hex[:6]
    recipe = load_recipe(RECIPES / "video_grpo.yaml", [
        f"bootstrap_servers={broker}", f"run_root={tmp_path}", f"run={run}",
        "trainer.steps=3", "data.source=moving_square:train?size=16&seed=2", PARITY_REWARD,
        f"model={model}"])
    s = train(recipe, say=lambda _: None, timeout_s=500)
    assert s["steps"] == 3 and s["balanced"], s
    assert s["trained"] + s["stale"] + s["filtered"] + s["errors"] == s["sampled"] > 0, s
    bus = BusConfig(bootstrap_servers=broker)
    prompts = {r["prompt_id"]: r for r in read_table(bus, "prompts.moving-square").to_pylist()}
    rollouts = read_table(bus, f"{run}.rollouts").to_pylist()
    tok = load_tokenizer(model)
    pad, start = (tok.convert_tokens_to_ids(t) for t in ("<|video_pad|>", "<|vision_start|>"))
    for r in rollouts:
        (item,) = r["media"]
        assert item == prompts[r["prompt_id"]]["media"][0] and item["kind"] == "video"
        frames, stamps, _ = video_frames(item["data"])
        assert len(frames) == 8 and stamps == [i / 8 for i in range(8)]
        assert r["prompt_ids"].count(pad) == 16 and r["prompt_ids"].count(start) == groups
    assert max(r["policy_version_start"] for r in rollouts) >= 1
    samples = read_table(bus, f"{run}.train_samples").to_pylist()
    assert samples and all(x["media"] for x in samples)
    final = load_model(str(Path(s["run_dir"]) / "final_model")).state_dict()
    begin = load_model(model).state_dict()
    moved = max(float((final[k] - begin[k]).abs().max()) for k in final if "visual" in k)
    assert moved > 1e-5, moved


@pytest.mark.e2e
def test_omni_recipe_through_the_broker_trains_on_mixed_media(broker, local_ray, tmp_path):
    """recipes/omni_grpo.yaml (tiny-qwen2.5-omni on omni_mix: images, speech and clips in
    one data set), 3 steps: every rollout accounted; each rollout carries its prompt's one
    item, all three kinds among them, and holds that item's placeholders once (16 image
    or 16 video tokens, or the clip's audio tokens between one audio_bos and audio_eos);
    the final model's vision and audio encoders both moved (parity test reward)."""
    import uuid

    from testdata import PARITY_REWARD, RECIPES

    from relax.infra.control.launch import train
    from relax.infra.recipe.recipe import load_recipe
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table
    from relax.trainer.models import load_model, load_tokenizer

    run = "omni" + uuid.uuid4().hex[:6]
    recipe = load_recipe(RECIPES / "omni_grpo.yaml", [
        f"bootstrap_servers={broker}", f"run_root={tmp_path}", f"run={run}",
        "trainer.steps=3", "data.source=omni_mix:train?size=12&seed=2", PARITY_REWARD])
    s = train(recipe, say=lambda _: None, timeout_s=500)
    assert s["steps"] == 3 and s["balanced"], s
    assert s["trained"] + s["stale"] + s["filtered"] + s["errors"] == s["sampled"] > 0, s
    bus = BusConfig(bootstrap_servers=broker)
    prompts = {r["prompt_id"]: r for r in read_table(bus, "prompts.omni-mix").to_pylist()}
    assert len(prompts) == 12
    rollouts = read_table(bus, f"{run}.rollouts").to_pylist()
    tok = load_tokenizer("tiny-qwen2.5-omni")
    token = {k: tok.convert_tokens_to_ids(t) for k, t in
             (("image", "<|IMAGE|>"), ("video", "<|VIDEO|>"), ("audio", "<|AUDIO|>"),
              ("bos", "<|audio_bos|>"))}
    kinds = set()
    for r in rollouts:
        (item,) = r["media"]
        assert item == prompts[r["prompt_id"]]["media"][0]
        kinds.add(item["kind"])
        counts = {k: r["prompt_ids"].count(token[k]) for k in ("image", "video", "audio")}
        if item["kind"] == "audio":
            assert counts["audio"] > 20 and r["prompt_ids"].count(token["bos"]) == 1
            assert counts["image"] == counts["video"] == 0
        else:
            assert counts == {**dict.fromkeys(("image", "video", "audio"), 0), item["kind"]: 16}
    assert kinds == {"image", "audio", "video"}
    final = load_model(str(Path(s["run_dir"]) / "final_model")).state_dict()
    begin = load_model("tiny-qwen2.5-omni").state_dict()
    for part in ("visual", "audio_tower"):
        moved = max(float((final[k] - begin[k]).abs().max()) for k in final if part in k)
        assert moved > 1e-5, (part, moved)
