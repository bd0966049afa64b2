"""Model families (issue 56): the family table, and per family a tiny random model whose
rollout log-probs (HF engine) equal the trainer's (torch back end) and the reference
stage's at the same weights in fp32 (public case C12), with its media inputs
(Qwen2.5-VL, Qwen3-VL: ``image_grid_thw`` and multimodal RoPE positions) carried through
the engine's prefill and the trainer's forward."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from relax.consumers.engines.base import SamplingParams
from relax.consumers.engines.hf import HFEngine
from relax.producers.media import MediaOptions, media_item
from relax.schemas.media import MEDIA_MARK
from relax.schemas.v1 import TRAIN_SAMPLES
from relax.trainer.batching import collate
from relax.trainer.families import FAMILIES, cat_keys_of, family_of, mrope_positions
from relax.trainer.multimodal import (
    chat_with_media,
    encode_prompt,
    images_of,
    media_inputs,
    stack_media,
    unexpanded_ids,
    videos_of,
)

G, TEMPERATURE = 3, 0.7


def _rows(prompts, gens, media=None) -> pa.Table:
    rows = []
    for p, ids in enumerate(prompts):
        for k in range(G):
            g = gens[p * G + k]
            n = len(g.token_ids)
            rows.append(dict(
                rollout_id=f"g{p}/{k}", group_id=f"g{p}", prompt_id=f"p{p}", dataset="d",
                sample_index=k, group_size=G, prompt_ids=ids, response_ids=g.token_ids,
                loss_mask=[1] * n, logprobs=g.logprobs, ref_logprobs=None,
                advantages=[1.0 if k % 2 else -1.0] * n, reward=float(k % 2),
                reward_components=[("correct", float(k % 2))], token_policy_versions=None,
                policy_version_start=0, policy_version_end=0, finish_reason=g.finish_reason,
                temperature=TEMPERATURE, top_p=1.0, top_k=0, drop_reason=None, finished_at=0,
                media=media[p] if media else None))
    return pa.Table.from_pylist(rows, schema=TRAIN_SAMPLES)


def _c12(name: str, engine, prompts, inputs=None, media=None):
    """Engine samples (G per prompt, one left-padded batch), then the torch back end's
    log-probs of the same rows: ``(max |rollout - trainer|, backend, micro-batch, max
    |rollout - reference stage|)``."""
    from relax.consumers.reference import ref_batch
    from relax.trainer.backends.torch_backend import TorchBackend
    from relax.trainer.config import TrainerConfig

    gens = engine.generate([p for p in prompts for _ in range(G)],
                           SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, seed=7),
                           media=[m for m in inputs for _ in range(G)] if inputs else None)
    assert all(g.token_ids for g in gens)
    table = _rows(prompts, gens, media)
    mb = collate(table)
    backend = TorchBackend(TrainerConfig(model=name, optim={"lr": 1e-3}), device="cpu")
    with torch.no_grad():
        lp, _ = backend.logprobs(mb)
    mask = mb.response_mask.bool()
    diff = float((lp[mask] - mb.rollout_logprobs[mask]).abs().max())
    rows = table.to_pylist()
    ref = ref_batch(engine.model, rows, 0, processor=backend.processor)
    ref_diff = max(abs(a - b) for r, lp in zip(rows, ref.column("ref_logprobs").to_pylist())
                   for a, b in zip(lp, r["logprobs"]))
    print(f"{name} C12: {int(mask.sum())} tokens, max |rollout - trainer| = {diff:.2e}, "
          f"|rollout - reference| = {ref_diff:.2e}")
    return diff, backend, mb, ref_diff


# ------------------------------------------------------------------ the table


def test_each_model_type_has_one_family_and_unknown_media_models_are_refused():
    from transformers import Idefics3Config, LlamaConfig, Qwen2AudioConfig, Qwen3Config

    from relax.trainer.qwen import tiny_qwen3_config

    assert family_of(Idefics3Config()).name == "idefics3"
    assert family_of(Qwen2AudioConfig()).name == "qwen2-audio"
    assert family_of(LlamaConfig()).name == family_of(Qwen3Config()).name == "text"
    assert family_of(tiny_qwen3_config(moe=True)).name == "text"
    owners = [t for f in FAMILIES.values() for t in f.model_types]
    assert len(owners) == len(set(owners))  # no model_type in two families
    odd = LlamaConfig()
    odd.vision_config = {"hidden_size": 8}
    with pytest.raises(ValueError, match="model_type 'llama' takes media but is of no known "
                                         "family; known: idefics3 .*qwen2.5-vl"):
        family_of(odd)
    assert cat_keys_of({"image_grid_thw", "pixel_values"}) == {"image_grid_thw", "pixel_values"}
    assert cat_keys_of({"pixel_attention_mask", "pixel_values"}) == set()
    assert cat_keys_of({"input_features"}) == {"input_features"}
    video = {"pixel_values_videos", "video_grid_thw"}
    assert cat_keys_of(video) == video  # Qwen2.5-VL and Qwen3-VL alike
    assert cat_keys_of(video | {"second_per_grid_ts"}) == video | {"second_per_grid_ts"}
    assert cat_keys_of({"input_features", "feature_attention_mask", "video_second_per_grid"}) \
        == {"input_features", "feature_attention_mask", "video_second_per_grid"}  # Omni
    from transformers import Qwen2_5OmniThinkerConfig, Qwen3OmniMoeThinkerConfig

    assert family_of(Qwen2_5OmniThinkerConfig()).name == "qwen2.5-omni"
    assert family_of(Qwen3OmniMoeThinkerConfig()).name == "qwen3-omni"
    with pytest.raises(ValueError, match=r"media inputs \['pixel_values'\]: 5 families take "
                                         r"them \(idefics3, qwen2.5-vl, qwen3-vl, "
                                         r"qwen2.5-omni, qwen3-omni\) with 2 batching rules"):
        cat_keys_of({"pixel_values"})
    with pytest.raises(ValueError, match="0 families take them"):
        cat_keys_of({"input_values"})


def test_stack_media_concatenates_the_families_item_keys_and_pads_the_others():
    vl = FAMILIES["qwen2.5-vl"]
    a = {"pixel_values": torch.ones(16, 4), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    b = {"pixel_values": 2 * torch.ones(64, 4), "image_grid_thw": torch.tensor([[1, 8, 8]])}
    out = stack_media([a, {}, b], vl)
    assert out["pixel_values"].shape == (80, 4) and out["pixel_values"][16:].eq(2).all()
    assert out["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 8]]
    one = {"pixel_values": torch.ones(1, 2, 3, 8, 8),
           "pixel_attention_mask": torch.ones(1, 2, 8, 8, dtype=torch.bool)}
    padded = stack_media([one, {}])  # Idefics3, found by its keys
    assert padded["pixel_values"].shape == (2, 2, 3, 8, 8)
    assert padded["pixel_values"][1].eq(0).all() and not padded["pixel_attention_mask"][1].any()


# ------------------------------------------------------------------ Qwen3 text


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_qwen3_engine_logprobs_equal_the_trainers(name):
    """Three prompts of different lengths (left padding), G=3 samples at T=0.7: max
    |rollout - trainer| <= 1e-5 (fp32), dense and MoE; one AdamW step moves the weights
    (the MoE's experts too)."""
    engine = HFEngine(name, engine_id=f"{name}-0", device="cpu")
    assert type(engine.model).__name__ == ("Qwen3MoeForCausalLM" if name.endswith("moe")
                                           else "Qwen3ForCausalLM")
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}],
                                       add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
               for q in ("hi", "What is 12 + 30? Answer with a number only.", "ok")]
    diff, backend, mb, ref_diff = _c12(name, engine, prompts)
    assert diff <= 1e-5 and ref_diff <= 1e-5, (diff, ref_diff)
    experts = {n: p.detach().clone() for n, p in backend.model.named_parameters()
               if "mlp" in n}
    stats = backend.train_step([mb])
    moved = max(float((p.detach() - experts[n]).abs().max())
                for n, p in backend.model.named_parameters() if n in experts)
    assert stats["grad_norm"] > 0 and moved > 1e-5, (stats, moved)


# ------------------------------------------------------------------ Qwen2.5-VL, Qwen3-VL


@pytest.fixture(scope="module", params=["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def qwen_vl(request):
    """``(engine, processor)`` of a tiny Qwen VL model (both: 16 image tokens per
    easy-vqa image, an 8 x 8 patch grid merged 2 x 2)."""
    from relax.trainer.models import load_processor

    return (HFEngine(request.param, engine_id=f"{request.param}-0", device="cpu"),
            load_processor(request.param))


def _vqa(n: int) -> list[tuple[str, bytes]]:
    from relax.producers.sources import read_source

    return [(r.record["question"], Path(r.record["image"]).read_bytes())
            for r in read_source(f"easy_vqa:test?size={n}&seed=4")]


def test_qwen_vl_each_image_is_expanded_once_in_its_own_message(qwen_vl):
    """Two images over three turns: each image's ``<|vision_start|><|image_pad|> x16
    <|vision_end|>`` appears once, in the message it came in; the trainer's rebuilt
    grids ask for exactly the placeholders the rollout holds (no double expansion), and
    the SGLang-style unexpanded ids hold one placeholder per image."""
    engine, proc = qwen_vl
    (q0, png0), (q1, png1) = _vqa(2)
    image = MEDIA_MARK.format(kind="image")
    items = [media_item("image", png0, "image", MediaOptions()),
             media_item("image", png1, "image", MediaOptions())]
    messages = [{"role": "user", "content": f"{image}{q0}"},
                {"role": "assistant", "content": "circle"},
                {"role": "user", "content": f"and this? {image}{q1}"}]
    ids, inputs = encode_prompt(proc, messages, items)
    tok = proc.tokenizer
    pad, start, end = (tok.convert_tokens_to_ids(t) for t in
                       ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 8]]
    assert ids.count(start) == ids.count(end) == 2 and ids.count(pad) == 32
    starts = [i for i, t in enumerate(ids) if t == start]
    for s in starts:
        assert ids[s + 1:s + 17] == [pad] * 16 and ids[s + 17] == end
    text = tok.decode(ids)
    assert text.index(q0) > text.index("<|vision_start|>") and \
        text.index("circle") < text.rindex("<|vision_start|>") < text.index(q1)
    again = media_inputs(proc, items)  # what the trainer rebuilds from the row
    assert again.keys() == inputs.keys()
    assert all(torch.equal(again[k], inputs[k]) for k in inputs)
    merge = engine.model.config.vision_config.spatial_merge_size
    assert int((again["image_grid_thw"].prod(-1) // merge ** 2).sum()) == ids.count(pad)
    short = unexpanded_ids(proc, messages, items)
    assert short.count(pad) == 2 and len(ids) - len(short) == 30


def test_qwen_vl_positions_are_the_models_own_rope_index(qwen_vl):
    """The batch's multimodal RoPE positions (left-padded prompts, one without an image)
    equal ``get_rope_index`` of each prompt alone with the processor's own token types,
    and differ from 1-D positions (delta < 0: 16 image tokens span 4 positions)."""
    engine, proc = qwen_vl
    (q0, png0), (q1, png1) = _vqa(2)
    encs, per = [], []
    for msgs, items in (([{"role": "user", "content": q0}],
                         [media_item("image", png0, "image", MediaOptions())]),
                        ([{"role": "user", "content": "no image here, just words"}], None),
                        ([{"role": "user", "content": q1 + " please"}],
                         [media_item("image", png1, "image", MediaOptions())])):
        ids, inputs = encode_prompt(proc, msgs, items)
        per.append(inputs)
        text = proc.apply_chat_template(
            [{"role": "user", "content": ([{"type": "image"}] if items else [])
              + [{"type": "text", "text": msgs[0]["content"]}]}],
            add_generation_prompt=True, tokenize=False)
        enc = proc(text=[text], images=[[img for img in _images(items)]] if items else None,
                   return_tensors="pt")
        assert enc["input_ids"][0].tolist() == ids
        encs.append(enc)
    width = max(e["input_ids"].shape[1] for e in encs)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, e in enumerate(encs):
        n = e["input_ids"].shape[1]
        ids[i, width - n:], mask[i, width - n:] = e["input_ids"][0], 1
    inputs = stack_media(per, FAMILIES["qwen2.5-vl"])
    pos, delta = mrope_positions(engine.model, ids, mask, inputs)
    assert pos.shape == (3, 3, width)
    for i, e in enumerate(encs):
        own, own_delta = engine.model.model.get_rope_index(
            e["input_ids"], mm_token_type_ids=e["mm_token_type_ids"],
            image_grid_thw=e.get("image_grid_thw"))
        n = e["input_ids"].shape[1]
        assert torch.equal(pos[:, i, width - n:], own[:, 0]), i
        assert int(delta[i]) == int(own_delta[0])
    assert delta[:, 0].tolist() == [-12, 0, -12]


def _images(items):
    from relax.trainer.multimodal import images_of

    return images_of(items)


def test_qwen_vl_engine_logprobs_equal_the_trainers_on_image_prompts(qwen_vl):
    """Three easy-vqa prompts (one with the image marked mid-message), G=3 samples each:
    max |rollout - trainer| <= 1e-5 (fp32) with the grids and multimodal RoPE on both
    sides; the engine without the image samples another distribution; one AdamW step
    moves the vision encoder."""
    engine, proc = qwen_vl
    prompts, media, inputs = [], [], []
    for i, (q, png) in enumerate(_vqa(3)):
        items = [media_item("image", png, "image", MediaOptions())]
        content = q if i != 1 else f"Look: {MEDIA_MARK.format(kind='image')}\n{q}"
        ids, inp = encode_prompt(proc, [{"role": "user", "content": content}], items)
        prompts.append(ids)
        media.append(items)
        inputs.append(inp)
    name = engine.engine_id.removesuffix("-0")
    diff, backend, mb, ref_diff = _c12(name, engine, prompts, inputs, media)
    assert diff <= 1e-5 and ref_diff <= 1e-5, (diff, ref_diff)
    assert mb.prompt_mask.sum(-1).tolist() == [len(p) for p in prompts]

    # an image a later turn added (it stands in the response): refused, not mis-positioned
    later = dataclasses.replace(mb, media=[m + [{**m[0], "turn": 1}] for m in mb.media])
    with pytest.raises(ValueError, match=f"{family_of(engine.model.config).name}: the "
                                         "response pass does not take media a later turn"):
        backend.logprobs(later)

    params = SamplingParams(max_new_tokens=1, temperature=1.0, seed=1)
    blind = engine.generate([prompts[0]], params)
    seen = engine.generate([prompts[0]], params, media=[inputs[0]])
    assert blind[0].token_ids != seen[0].token_ids or \
        abs(blind[0].logprobs[0] - seen[0].logprobs[0]) > 1e-4

    visual = {n: p.detach().clone() for n, p in backend.model.named_parameters()
              if ".visual." in n or n.startswith("visual.")}
    assert visual
    stats = backend.train_step([mb])
    moved = max(float((p.detach() - visual[n]).abs().max())
                for n, p in backend.model.named_parameters() if n in visual)
    assert stats["grad_norm"] > 0 and moved > 1e-5, (stats, moved)


# ------------------------------------------------------------------ Qwen2.5-VL, Qwen3-VL video


def _clips(n: int, fps: float = 8.0) -> list[tuple[str, str, dict]]:
    """``n`` moving-square clips (8 frames of 64 x 64 at 8 fps) as published video items,
    frames sampled at ``fps``: ``(question, answer, item)``."""
    from relax.producers.sources import read_source

    opts = MediaOptions(video_fps=fps, video_max_frames=8)
    return [(r.record["question"], r.record["answer"],
             media_item("video", r.record["video"], "video", opts))
            for r in read_source(f"moving_square:test?size={n}&seed=4")]


def _video_spans(ids: list[int], tok) -> list[list[int]]:
    """Per ``<|vision_start|>`` that opens video tokens, how many ``<|video_pad|>`` follow
    it before its ``<|vision_end|>``."""
    pad, start, end = (tok.convert_tokens_to_ids(t) for t in
                       ("<|video_pad|>", "<|vision_start|>", "<|vision_end|>"))
    spans = []
    for s in (i for i, t in enumerate(ids) if t == start and ids[i + 1] == pad):
        n = next(j for j in range(s + 1, len(ids)) if ids[j] != pad) - s - 1
        assert ids[s + 1 + n] == end
        spans.append(n)
    return spans


def test_qwen_vl_each_video_is_expanded_once_in_its_own_message(qwen_vl):
    """Two clips (8 and 4 frames) over three turns: each clip's video tokens appear once,
    in the message it came in (Qwen2.5-VL: one ``<|vision_start|><|video_pad|> x 4T
    <|vision_end|>`` per clip; Qwen3-VL: one such group of 4 per two frames, each after
    its timestamp ``<t seconds>``); the trainer's rebuilt grids ask for exactly the
    placeholders the rollout holds; the SGLang-style unexpanded ids hold one placeholder
    per clip."""
    engine, proc = qwen_vl
    (q0, _, v0), = _clips(1)
    (_, _, v1), = _clips(1, fps=4.0)  # the same clip, every second frame: 4 frames
    video = MEDIA_MARK.format(kind="video")
    messages = [{"role": "user", "content": f"{video}{q0}"},
                {"role": "assistant", "content": "left"},
                {"role": "user", "content": f"and slower? {video}"}]
    ids, inputs = encode_prompt(proc, messages, [v0, v1])
    tok = proc.tokenizer
    assert inputs["video_grid_thw"].tolist() == [[4, 4, 4], [2, 4, 4]]
    assert inputs["pixel_values_videos"].shape[0] == 64 + 32
    qwen3 = "second_per_grid_ts" not in inputs
    pad = tok.convert_tokens_to_ids("<|video_pad|>")
    assert ids.count(pad) == 24 and ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == 0
    assert _video_spans(ids, tok) == ([4] * 6 if qwen3 else [16, 8])
    text = tok.decode(ids)
    head, tail = text.split("and slower?")
    assert head.count("<|video_pad|>") == 16 and tail.count("<|video_pad|>") == 8
    assert head.rindex("<|video_pad|>") < head.index(q0) < head.index("left")
    if qwen3:  # the mean timestamp of each two frames: 8 fps, then 4 fps
        stamps = [float(x) for x in re.findall(r"<([0-9.]+) seconds>", text)]
        assert stamps == [0.1, 0.3, 0.6, 0.8, 0.1, 0.6], stamps
    else:  # two frames a temporal patch: 0.25 s at 8 fps, 0.5 s at 4 fps
        assert inputs["second_per_grid_ts"].tolist() == [0.25, 0.5]
    again = media_inputs(proc, [v0, v1])  # what the trainer rebuilds from the row
    assert again.keys() == inputs.keys()
    assert all(torch.equal(again[k], inputs[k]) for k in inputs)
    merge = engine.model.config.vision_config.spatial_merge_size
    assert int((again["video_grid_thw"].prod(-1) // merge ** 2).sum()) == ids.count(pad)
    short = unexpanded_ids(proc, messages, [v0, v1])
    assert short.count(pad) == 2


def _own_encoding(proc, messages, items):
    """The processor's own output for a chat with media (``mm_token_type_ids`` too)."""
    text = proc.apply_chat_template(chat_with_media(messages, items),
                                    add_generation_prompt=True, tokenize=False)
    kwargs = {}
    if images := images_of(items):
        kwargs["images"] = [images]
    if videos := videos_of(items):
        kwargs.update(videos=[f for f, _ in videos], video_metadata=[m for _, m in videos],
                      do_sample_frames=False)
    return proc(text=[text], return_tensors="pt", **kwargs)


def test_qwen_vl_video_positions_are_the_models_own_rope_index(qwen_vl):
    """A batch of left-padded prompts (a clip, text only, an image and a clip): the
    multimodal RoPE positions equal ``get_rope_index`` of each prompt alone with the
    processor's own token types (and Qwen2.5-VL's ``second_per_grid_ts``); a clip's
    tokens span 4 temporal positions (Qwen2.5-VL: ``tokens_per_second`` x 0.25 s apart;
    Qwen3-VL: one frame group each, with its timestamp text between)."""
    engine, proc = qwen_vl
    (q0, _, v0), (q1, _, v1) = _clips(2)
    (_, png), = _vqa(1)
    img = media_item("image", png, "image", MediaOptions())
    video, image = MEDIA_MARK.format(kind="video"), MEDIA_MARK.format(kind="image")
    encs, per = [], []
    for content, items in ((f"{video}{q0}", [v0]), ("no video here", None),
                           (f"{image} then {video}{q1}", [img, v1])):
        ids, inputs = encode_prompt(proc, [{"role": "user", "content": content}], items)
        per.append(inputs)
        enc = _own_encoding(proc, [{"role": "user", "content": content}], items)
        assert enc["input_ids"][0].tolist() == ids
        encs.append(enc)
    width = max(e["input_ids"].shape[1] for e in encs)
    ids = torch.full((3, width), 2, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, e in enumerate(encs):
        n = e["input_ids"].shape[1]
        ids[i, width - n:], mask[i, width - n:] = e["input_ids"][0], 1
    inputs = stack_media(per, family_of(engine.model.config))
    pos, delta = mrope_positions(engine.model, ids, mask, inputs)
    for i, e in enumerate(encs):
        own, own_delta = engine.model.model.get_rope_index(
            e["input_ids"], mm_token_type_ids=e["mm_token_type_ids"],
            image_grid_thw=e.get("image_grid_thw"), video_grid_thw=e.get("video_grid_thw"),
            second_per_grid_ts=e.get("second_per_grid_ts"))
        n = e["input_ids"].shape[1]
        assert torch.equal(pos[:, i, width - n:], own[:, 0]), i
        assert int(delta[i]) == int(own_delta[0])
    pad = proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    first = pos[:, 0, (ids[0] == pad)]  # [3, 16]: the first prompt's clip
    assert int(delta[1]) == 0 and int(delta[0]) < 0
    temporal = sorted(set(first[0].tolist()))
    assert len(temporal) == 4
    if "second_per_grid_ts" in inputs:  # one grid: 4 x (2 x 2), 0.25 s a temporal patch
        assert len(set(first[1].tolist())) == len(set(first[2].tolist())) == 2
        tps = engine.model.config.vision_config.tokens_per_second
        assert [b - a for a, b in itertools.pairwise(temporal)] == [int(tps * 0.25)] * 3
    else:  # a 2 x 2 grid per frame group, each after its timestamp text
        for g in first.reshape(3, 4, 4).unbind(1):
            assert len(set(g[0].tolist())) == 1
            assert len(set(g[1].tolist())) == len(set(g[2].tolist())) == 2
        assert min(b - a for a, b in itertools.pairwise(temporal)) > 2


def test_qwen_vl_engine_logprobs_equal_the_trainers_on_video_prompts(qwen_vl):
    """Three moving-square prompts (one marked mid-message, one with an easy-vqa image
    before its clip sampled at 4 fps), G=3 samples each: max |rollout - trainer| and
    |rollout - reference stage| <= 1e-5 (fp32), the image and video grids, Qwen2.5-VL's
    ``second_per_grid_ts`` and multimodal RoPE on every side; the engine without the clip
    samples another distribution; one AdamW step moves the vision encoder."""
    engine, proc = qwen_vl
    prompts, media, inputs = [], [], []
    clips = _clips(3)
    (_, png), = _vqa(1)
    image = media_item("image", png, "image", MediaOptions())
    for i, (q, _, item) in enumerate(clips):
        content = q if i != 1 else f"Watch: {MEDIA_MARK.format(kind='video')}\n{q}"
        items = [item] if i != 2 else [image, _clips(3, fps=4.0)[2][2]]
        ids, inp = encode_prompt(proc, [{"role": "user", "content": content}], items)
        prompts.append(ids)
        media.append(items)
        inputs.append(inp)
    assert "video_grid_thw" in inputs[0] and "pixel_values" not in inputs[0]
    assert inputs[2]["image_grid_thw"].tolist() == [[1, 8, 8]]
    name = engine.engine_id.removesuffix("-0")
    diff, backend, mb, ref_diff = _c12(name, engine, prompts, inputs, media)
    assert diff <= 1e-5 and ref_diff <= 1e-5, (diff, ref_diff)
    assert mb.prompt_mask.sum(-1).tolist() == [len(p) for p in prompts]

    params = SamplingParams(max_new_tokens=1, temperature=1.0, seed=1)
    blind = engine.generate([prompts[0]], params)
    seen = engine.generate([prompts[0]], params, media=[inputs[0]])
    assert blind[0].token_ids != seen[0].token_ids or \
        abs(blind[0].logprobs[0] - seen[0].logprobs[0]) > 1e-4

    visual = {n: p.detach().clone() for n, p in backend.model.named_parameters()
              if ".visual." in n or n.startswith("visual.")}
    stats = backend.train_step([mb])
    moved = max(float((p.detach() - visual[n]).abs().max())
                for n, p in backend.model.named_parameters() if n in visual)
    assert stats["grad_norm"] > 0 and moved > 1e-5, (stats, moved)


def test_video_is_refused_where_it_is_not_taken():
    """A video row fails with a reason, never as its text alone: for a model whose
    processor has no video processor (tiny-vlm, Idefics3) at rendering and when the
    trainer rebuilds its inputs; for the SGLang engine (not sent: its server samples a clip
    itself) at the rollout's rendering and in the request."""
    from relax.consumers.engines.sglang import media_fields
    from relax.consumers.rollout.config import RolloutConfig
    from relax.consumers.rollout.prompts import PromptItem
    from relax.consumers.rollout.stage import RolloutStage
    from relax.trainer.models import load_processor

    (q, _, item), = _clips(1)
    msgs = [{"role": "user", "content": f"{MEDIA_MARK.format(kind='video')}{q}"}]
    assert chat_with_media(msgs, [item])[0]["content"][0] == {"type": "video"}
    vlm = load_processor("tiny-vlm")
    for call in (lambda: encode_prompt(vlm, msgs, [item]), lambda: media_inputs(vlm, [item])):
        with pytest.raises(ValueError, match=r"the row has 1 video items; the model's processor "
                                             r"\(Idefics3Processor\) takes no video"):
            call()
    with pytest.raises(ValueError, match="video items are not sent to SGLang"):
        media_fields([None, [item]])
    cfg = RolloutConfig(run="r", dataset="d",
                        model="tiny-qwen2.5-vl", engine="sglang", sglang_url="http://unused:1")
    engine = HFEngine("tiny-qwen2.5-vl", engine_id="e-0", device="cpu")
    stage = RolloutStage(cfg, engine=engine)
    row = {"prompt_id": "p", "prompt": q, "messages": None, "media": [item]}
    with pytest.raises(ValueError, match="the SGLang engine is sent no video"):
        stage._render(PromptItem(None, row, 0))
    hf = RolloutStage(cfg.model_copy(update={"engine": "hf"}), engine=engine)
    assert hf._render(PromptItem(None, row, 0)).count(
        engine.tokenizer.convert_tokens_to_ids("<|video_pad|>")) == 16


# ------------------------------------------------------ Qwen2.5-Omni and Qwen3-Omni thinkers


def _whisper_tokens(frames: int) -> int:
    """Qwen2.5-Omni's audio tokens of a clip of ``frames`` mel frames: the encoder's two
    stride-2 steps."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def _chunked_tokens(frames: int) -> int:
    """Qwen3-Omni's audio tokens of a clip of ``frames`` mel frames: three stride-2
    convolutions over each 100-frame chunk (13 tokens a whole chunk)."""
    rest = frames % 100
    for _ in range(3):
        rest = (rest - 1) // 2 + 1 if rest else 0
    return frames // 100 * 13 + rest


OMNI = {"qwen2.5-omni": ("tiny-qwen2.5-omni", _whisper_tokens, int),
        "qwen3-omni": ("tiny-qwen3-omni", _chunked_tokens, float)}
"""Per omni family: its tiny model, its audio tokens per clip, and the type of a video's
temporal position step (Qwen2.5-Omni truncates seconds x position_id_per_seconds to an
int; Qwen3-Omni keeps the fraction)."""


@pytest.fixture(scope="module", params=list(OMNI))
def omni(request):
    """``(engine, processor)`` of each tiny omni thinker."""
    from relax.trainer.models import load_processor

    name = OMNI[request.param][0]
    return HFEngine(name, engine_id=f"{name}-0", device="cpu"), load_processor(name)


def _speech(n: int) -> list[tuple[str, dict]]:
    from relax.producers.sources import read_source

    return [(r.record["question"], media_item("audio", r.record["audio"], "audio",
                                              MediaOptions()))
            for r in read_source(f"speech_arith:?size={n}&seed=4")]


def _omni_prompt(i: int):
    """Prompt ``i`` of three kinds: ``(messages, items)``: 0 all four kinds in one user
    message, 1 an image then (a turn later) a clip and speech, 2 speech alone (another,
    longer clip)."""
    (q, png), = _vqa(1) if i != 1 else _vqa(2)[1:]
    (_, _, clip), = _clips(1)
    (spoken, wav), = _speech(1) if i != 2 else _speech(2)[1:]
    img = media_item("image", png, "image", MediaOptions())
    image, video, audio = (MEDIA_MARK.format(kind=k) for k in ("image", "video", "audio"))
    if i == 0:
        return [{"role": "user", "content": f"{image}{video}{audio} {q}"}], [img, clip, wav]
    if i == 1:
        return [{"role": "user", "content": f"{image}{q}"},
                {"role": "assistant", "content": "circle"},
                {"role": "user", "content": f"now {video} and {audio}?"}], [img, clip, wav]
    return [{"role": "user", "content": f"{audio}{spoken}"}], [wav]


def test_omni_takes_text_image_audio_and_video_in_one_prompt_each_expanded_once(omni):
    """All four kinds across turns: each item's placeholders appear once, in the message
    it came in (16 image tokens, 16 video tokens, the clip's audio tokens by its
    length); the trainer rebuilds the same inputs; the unexpanded ids hold one
    placeholder each."""
    engine, proc = omni
    _, audio_tokens, _ = OMNI[engine.family.name]
    tok = proc.tokenizer
    messages, items = _omni_prompt(1)
    ids, inputs = encode_prompt(proc, messages, items)
    assert set(inputs) == set(engine.family.media_keys)
    img, vid, aud = (tok.convert_tokens_to_ids(t)
                     for t in (proc.image_token, proc.video_token, proc.audio_token))
    n_audio = audio_tokens(int(inputs["feature_attention_mask"].sum()))
    assert (ids.count(img), ids.count(vid), ids.count(aud)) == (16, 16, n_audio) and n_audio >= 20
    assert inputs["video_second_per_grid"].tolist() == [0.25]
    text = tok.decode(ids)
    head, tail = text.split("circle")
    assert head.count(proc.image_token) == 16 and proc.video_token not in head \
        and proc.audio_token not in head
    assert tail.index(proc.video_token) < tail.index(proc.audio_token)
    again = media_inputs(proc, items)
    assert again.keys() == inputs.keys()
    assert all(torch.equal(again[k], inputs[k]) and again[k].dtype == inputs[k].dtype
               for k in inputs)
    short = unexpanded_ids(proc, messages, items)
    assert (short.count(img), short.count(vid), short.count(aud)) == (1, 1, 1)


def test_omni_positions_are_the_models_own_rope_index(omni):
    """Three left-padded prompts (all four kinds, image then clip and speech over turns,
    speech alone): the batch's positions equal the thinker's ``get_rope_index`` of each
    prompt alone with the processor's own inputs; a clip's 4 temporal patches sit
    0.25 s x ``position_id_per_seconds`` apart (3.25 for Qwen3-Omni's 13 a second)."""
    engine, proc = omni
    step_type = OMNI[engine.family.name][2]
    encs, per = [], []
    for i in range(3):
        messages, items = _omni_prompt(i)
        ids, inputs = encode_prompt(proc, messages, items)
        per.append(inputs)
        text = proc.apply_chat_template(chat_with_media(messages, items),
                                        add_generation_prompt=True, tokenize=False)
        own = {}
        if images := images_of(items):
            own["images"] = [images]
        if videos := videos_of(items):
            own.update(videos=[f for f, _ in videos], video_metadata=[m for _, m in videos],
                       do_sample_frames=False,
                       videos_kwargs={"size": dict(proc.video_processor.size), "fps": 8.0})
        own["audio"] = [a for a in _waves(items)]
        enc = proc(text=[text], return_tensors="pt", **own)
        assert enc["input_ids"][0].tolist() == ids
        encs.append(enc)
    width = max(e["input_ids"].shape[1] for e in encs)
    ids = torch.full((3, width), 2, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, e in enumerate(encs):
        n = e["input_ids"].shape[1]
        ids[i, width - n:], mask[i, width - n:] = e["input_ids"][0], 1
    inputs = stack_media(per, engine.family)
    pos, delta = engine.family.positions(engine.model, ids, mask, inputs)
    for i, e in enumerate(encs[:2]):  # prompts with a grid
        own, own_delta = engine.model.get_rope_index(
            e["input_ids"], e.get("image_grid_thw"), e.get("video_grid_thw"),
            e["attention_mask"], False, e["feature_attention_mask"].sum(-1),
            e.get("video_second_per_grid"))
        n = e["input_ids"].shape[1]
        assert torch.equal(pos[:, i, width - n:], own[:, 0]), i
        assert float(delta[i]) == float(own_delta[0])
    n = encs[2]["input_ids"].shape[1]
    assert pos[:, 2, width - n:].tolist() == [list(range(n))] * 3 and int(delta[2]) == 0
    vid = proc.tokenizer.convert_tokens_to_ids(proc.video_token)
    temporal = sorted(set(pos[0, 0, ids[0] == vid].tolist()))
    step = step_type(0.25 * engine.model.config.position_id_per_seconds)
    assert [b - a for a, b in itertools.pairwise(temporal)] == [step] * 3


def _waves(items):
    from relax.trainer.multimodal import audio_of

    return audio_of(items, 16_000, 5)


def test_omni_engine_logprobs_equal_the_trainers_with_all_four_kinds(omni):
    """The three prompts, G=3 samples each: max |rollout - trainer| and |rollout -
    reference stage| <= 1e-5 (fp32) with images, video and audio in one batch; without
    its media the engine samples another distribution; one AdamW step moves the vision
    and the audio encoders."""
    engine, proc = omni
    prompts, media, inputs = [], [], []
    for i in range(3):
        messages, items = _omni_prompt(i)
        ids, inp = encode_prompt(proc, messages, items)
        prompts.append(ids)
        media.append(items)
        inputs.append(inp)
    diff, backend, mb, ref_diff = _c12(OMNI[engine.family.name][0], engine, prompts, inputs,
                                       media)
    assert diff <= 1e-5 and ref_diff <= 1e-5, (diff, ref_diff)
    assert mb.prompt_mask.sum(-1).tolist() == [len(p) for p in prompts]

    params = SamplingParams(max_new_tokens=1, temperature=1.0, seed=1)
    blind = engine.generate([prompts[0]], params)
    seen = engine.generate([prompts[0]], params, media=[inputs[0]])
    assert blind[0].token_ids != seen[0].token_ids or \
        abs(blind[0].logprobs[0] - seen[0].logprobs[0]) > 1e-4

    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()
              if ".visual." in n or ".audio_tower." in n}
    stats = backend.train_step([mb])
    for part in (".visual.", ".audio_tower."):
        moved = max(float((p.detach() - before[n]).abs().max())
                    for n, p in backend.model.named_parameters() if n in before and part in n)
        assert stats["grad_norm"] > 0 and moved > 1e-5, (part, stats, moved)
