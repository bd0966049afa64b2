"""Images through the rollout engine and the trainer (issue 17): the tiny SmolVLM-family
model, real easy-vqa PNGs, the model's own transformers processor.

C12 family on multimodal rows: the HF engine samples from text+image prompts (the
processor's expanded placeholders, pixel inputs at every prefill); the torch back end
recomputes the log-probs from the rows alone (prompt_ids, response_ids and the media
items by reference, pixel inputs rebuilt by the image processor) and gets the engine's
values in fp32. A train step moves the vision encoder's weights."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import torch

from relax.consumers.engines.base import SamplingParams
from relax.producers.media import MediaOptions, media_item
from relax.schemas.media import MEDIA_MARK
from relax.schemas.v1 import TRAIN_SAMPLES
from relax.trainer.batching import collate
from relax.trainer.multimodal import chat_with_media, encode_prompt, pixel_inputs

G, TEMPERATURE = 3, 0.7


def _vqa(n: int) -> list[tuple[str, str, bytes]]:
    from relax.producers.sources import read_source

    return [(r.record["question"], r.record["answer"], Path(r.record["image"]).read_bytes())
            for r in read_source(f"easy_vqa:test?size={n}&seed=4")]


@pytest.fixture(scope="module")
def vlm():
    from relax.consumers.engines.hf import HFEngine
    from relax.trainer.models import load_processor

    return HFEngine("tiny-vlm", engine_id="vlm-0", device="cpu"), load_processor("tiny-vlm")


def test_images_open_the_last_user_message_or_stay_where_their_mark_is():
    img = {"kind": "image", "uri": None, "data": b"", "mime": "image/png", "turn": 0}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What?"}]
    assert chat_with_media(msgs, [img]) == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
    marked = [{"role": "user", "content": f"A {MEDIA_MARK.format(kind='image')} B"}]
    assert chat_with_media(marked, [img])[0]["content"] == [
        {"type": "text", "text": "A "}, {"type": "image"}, {"type": "text", "text": " B"}]
    assert chat_with_media(msgs, None) is msgs
    with pytest.raises(ValueError, match="the messages mark 1 images, the row has 0"):
        chat_with_media(marked, [])


def test_the_processor_expands_each_image_and_the_trainer_rebuilds_the_same_pixels(vlm):
    _, proc = vlm
    (q, _, png), = _vqa(1)
    items = [media_item("image", png, "image", MediaOptions())]
    ids, pixels = encode_prompt(proc, [{"role": "user", "content": q}], items)
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image_id) == proc.image_seq_len == 16
    assert tuple(pixels["pixel_values"].shape) == (1, 1, 3, 64, 64)
    again = pixel_inputs(proc, items)
    assert pixels.keys() == again.keys()
    assert all(torch.equal(pixels[k], again[k]) for k in pixels)


def _train_rows(prompts, gens, media) -> pa.Table:
    rows = []
    for p, (ids, items) in enumerate(zip(prompts, media)):
        for k in range(G):
            g = gens[p * G + k]
            n = len(g.token_ids)
            rows.append(dict(
                rollout_id=f"g{p}/{k}", group_id=f"g{p}", prompt_id=f"p{p}", dataset="vqa",
                sample_index=k, group_size=G, prompt_ids=ids, response_ids=g.token_ids,
                loss_mask=[1] * n, logprobs=g.logprobs, ref_logprobs=None,
                advantages=[1.0 if k % 2 else -1.0] * n, reward=float(k % 2),
                reward_components=[("correct", float(k % 2))], token_policy_versions=None,
                policy_version_start=0, policy_version_end=0, finish_reason=g.finish_reason,
                temperature=TEMPERATURE, top_p=1.0, top_k=0, drop_reason=None, finished_at=0,
                media=items))
    return pa.Table.from_pylist(rows, schema=TRAIN_SAMPLES)


def test_trainer_logprobs_equal_the_engines_on_image_rows_and_a_step_moves_the_vision_side(vlm):
    """Three easy-vqa prompts (one with the image marked inside its message), G=3 samples
    each at temperature 0.7: max |rollout - trainer| log-prob <= 1e-5 (fp32, public case
    C12); two prompts with the same question text but different images are two prompts
    in the micro-batch; one AdamW step changes the vision encoder."""
    from relax.trainer.backends.torch_backend import TorchBackend
    from relax.trainer.config import TrainerConfig

    engine, proc = vlm
    vqa = _vqa(3)
    prompts, media, pixels = [], [], []
    for i, (q, _, png) in enumerate(vqa):
        items = [media_item("image", png, "image", MediaOptions())]
        content = q if i else f"{MEDIA_MARK.format(kind='image')}\n{q}"
        ids, pix = encode_prompt(proc, [{"role": "user", "content": content}], items)
        prompts.append(ids)
        media.append(items)
        pixels.append(pix)
    gens = engine.generate([p for p in prompts for _ in range(G)],
                           SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, seed=7),
                           media=[m for m in pixels for _ in range(G)])
    assert all(g.token_ids for g in gens)
    table = _train_rows(prompts, gens, media)
    mb = collate(table)
    assert mb.prompt_ids.shape[0] == 3 and len(mb.media) == 3

    backend = TorchBackend(TrainerConfig(model="tiny-vlm", optim={"lr": 1e-3}), device="cpu")
    with torch.no_grad():
        lp, _ = backend.logprobs(mb)
    mask = mb.response_mask.bool()
    diff = float((lp[mask] - mb.rollout_logprobs[mask]).abs().max())
    print(f"multimodal C12: {int(mask.sum())} tokens, max |rollout - trainer| = {diff:.2e}")
    assert diff <= 1e-5, diff

    # the engine without the images: another distribution (the images really are used)
    blind = engine.generate([prompts[0]], SamplingParams(max_new_tokens=1, temperature=1.0,
                                                         seed=1))
    seen = engine.generate([prompts[0]], SamplingParams(max_new_tokens=1, temperature=1.0,
                                                        seed=1), media=[pixels[0]])
    assert blind[0].token_ids != seen[0].token_ids or \
        abs(blind[0].logprobs[0] - seen[0].logprobs[0]) > 1e-4

    vision = {n: p.detach().clone() for n, p in backend.model.named_parameters()
              if "vision_model" in n}
    assert vision
    stats = backend.train_step([mb])
    moved = max(float((p.detach() - vision[n]).abs().max())
                for n, p in backend.model.named_parameters() if n in vision)
    assert stats["grad_norm"] > 0 and moved > 1e-5, (stats, moved)


@pytest.mark.e2e
def test_vqa_recipe_through_the_broker_trains_the_tiny_vlm(broker, local_ray, tmp_path):
    """recipes/vqa_grpo.yaml, 3 steps, every stage its own process on the real broker:
    every rollout accounted; rollouts and train samples carry the prompt's PNG bytes;
    the engine sampled with published weights; the final model's vision encoder moved
    (scored by the parity test reward: the random model never answers right, and all-zero
    rewards give all-zero advantages, so no gradient at all)."""
    import uuid

    from relax.infra.launch import train
    from relax.infra.recipe import load_recipe
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table
    from relax.trainer.models import load_model
    from testdata import PARITY_REWARD, RECIPES

    run = "vqa" + uuid.uuid4().hex[:6]
    recipe = load_recipe(RECIPES / "vqa_grpo.yaml", [
        f"bootstrap_servers={broker}", f"run_root={tmp_path}", f"run={run}",
        "trainer.steps=3", "data.source=easy_vqa:train?size=64&seed=2", PARITY_REWARD])
    s = train(recipe, say=lambda _: None, timeout_s=500)
    assert s["steps"] == 3 and s["balanced"], s
    assert s["trained"] + s["stale"] + s["filtered"] + s["errors"] == s["sampled"] > 0, s
    bus = BusConfig(bootstrap_servers=broker)
    prompts = {r["prompt_id"]: r for r in read_table(bus, "prompts.easy-vqa").to_pylist()}
    rollouts = read_table(bus, f"{run}.rollouts").to_pylist()
    for r in rollouts:
        (item,) = r["media"]
        assert item == prompts[r["prompt_id"]]["media"][0] and item["mime"] == "image/png"
        assert r["prompt_ids"].count(49152) == 16  # the processor's 16 <image> tokens
    assert max(r["policy_version_start"] for r in rollouts) >= 1
    samples = read_table(bus, f"{run}.train_samples").to_pylist()
    assert samples and all(x["media"] for x in samples)
    final = load_model(str(Path(s["run_dir"]) / "final_model")).state_dict()
    start = load_model("tiny-vlm").state_dict()
    moved = max(float((final[k] - start[k]).abs().max()) for k in final if "vision_model" in k)
    assert moved > 1e-5, moved
