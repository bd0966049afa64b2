"""Images and audio through the rollout engine and the trainer (issue 17): the tiny
SmolVLM-family model on real easy-vqa PNGs, the tiny Qwen2-Audio-family model on
espeak-ng speech, each with its own transformers processor.

C12 family on multimodal rows: the HF engine samples from text+image and text+audio
prompts (the processor's expanded placeholders, media inputs at every prefill); the torch
back end recomputes the log-probs from the rows alone (prompt_ids, response_ids and the
media items by reference, inputs rebuilt by the image processor / feature extractor) and
gets the engine's values in fp32. A train step moves the vision / audio encoder's
weights."""

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
from relax.trainer.multimodal import chat_with_media, encode_prompt, media_inputs

G, TEMPERATURE = 3, 0.7


def _vqa(n: int) -> list[tuple[str, str, bytes]]:
    from relax.producers.sources import read_source

    return [(r.record["question"], r.record["answer"], Path(r.record["image"]).read_bytes())
            for r in read_source(f"easy_vqa:test?size={n}&seed=4")]


def _speech(n: int) -> list[tuple[str, str, bytes]]:
    from relax.producers.sources import read_source

    return [(r.record["question"], r.record["answer"], r.record["audio"])
            for r in read_source(f"speech_arith:?size={n}&seed=4")]


def _wav(seconds: float, rate: int) -> bytes:
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x10\x00" * int(seconds * rate))
    return buf.getvalue()


def _model(name: str):
    from relax.consumers.engines.hf import HFEngine
    from relax.trainer.models import load_processor

    return HFEngine(name, engine_id=f"{name}-0", device="cpu"), load_processor(name)


@pytest.fixture(scope="module")
def vlm():
    return _model("tiny-vlm")


@pytest.fixture(scope="module")
def alm():
    return _model("tiny-audio")


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
    with pytest.raises(ValueError, match="the messages mark 1 image items, the row has 0"):
        chat_with_media(marked, [])
    clip = {**img, "kind": "audio", "mime": "audio/wav"}
    said = [{"role": "user", "content": f"{MEDIA_MARK.format(kind='audio')} and this?"}]
    assert chat_with_media(said, [clip, clip, img])[0]["content"] == [
        {"type": "image"}, {"type": "audio"}, {"type": "audio"},
        {"type": "text", "text": " and this?"}]


def test_the_processor_expands_each_image_and_the_trainer_rebuilds_the_same_pixels(vlm):
    _, proc = vlm
    (q, _, png), = _vqa(1)
    items = [media_item("image", png, "image", MediaOptions())]
    ids, pixels = encode_prompt(proc, [{"role": "user", "content": q}], items)
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image_id) == proc.image_seq_len == 16
    assert tuple(pixels["pixel_values"].shape) == (1, 1, 3, 64, 64)
    again = media_inputs(proc, items)
    assert pixels.keys() == again.keys()
    assert all(torch.equal(pixels[k], again[k]) for k in pixels)


def test_the_processor_expands_each_clip_and_the_trainer_rebuilds_the_same_features(alm):
    """Whisper features of a 16 kHz clip padded to 5 s (500 frames); one <|AUDIO|> token
    per 40 ms of speech (the encoder's conv stride 2 and pool 2); a clip at another rate or
    over 5 s is refused, naming it."""
    _, proc = alm
    (q, _, wav), = _speech(1)
    items = [media_item("audio", wav, "audio", MediaOptions())]
    ids, inputs = encode_prompt(proc, [{"role": "user", "content": q}], items)
    frames = int(inputs["feature_attention_mask"].sum())
    assert tuple(inputs["input_features"].shape) == (1, 80, 500) and 50 <= frames <= 400
    assert ids.count(proc.audio_token_id) == ((frames - 1) // 2 + 1 - 2) // 2 + 1
    again = media_inputs(proc, items)
    assert inputs.keys() == again.keys()
    assert all(torch.equal(inputs[k], again[k].to(inputs[k].dtype)) for k in inputs)
    slow = [media_item("audio", _wav(1.0, 8000), "audio", MediaOptions(audio_rate=8000))]
    with pytest.raises(ValueError, match="audio 0: 8000 Hz, the model takes 16000 Hz"):
        media_inputs(proc, slow)
    long = [media_item("audio", _wav(6.0, 16000), "audio", MediaOptions())]
    with pytest.raises(ValueError, match=r"audio 0: 6.00 s, the model takes at most 5 s"):
        encode_prompt(proc, [{"role": "user", "content": q}], long)


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


@pytest.mark.parametrize("kind", ["image", "audio"])
def test_trainer_logprobs_equal_the_engines_on_media_rows_and_a_step_moves_the_encoder(
        kind, request):
    """Three prompts (easy-vqa images or spoken sums; one with its item marked inside
    the message), G=3 samples each at temperature 0.7: max |rollout - trainer| log-prob
    <= 1e-5 (fp32, public case C12); the engine without the media samples another
    distribution; one AdamW step changes the vision / audio encoder."""
    from relax.trainer.backends.torch_backend import TorchBackend
    from relax.trainer.config import TrainerConfig

    name, data, tower = {"image": ("tiny-vlm", _vqa, "vision_model"),
                         "audio": ("tiny-audio", _speech, "audio_tower")}[kind]
    engine, proc = request.getfixturevalue("vlm" if kind == "image" else "alm")
    prompts, media, inputs = [], [], []
    for i, (q, _, data_bytes) in enumerate(data(3)):
        items = [media_item(kind, data_bytes, kind, MediaOptions())]
        content = q if i else f"{MEDIA_MARK.format(kind=kind)}\n{q}"
        ids, inp = encode_prompt(proc, [{"role": "user", "content": content}], items)
        prompts.append(ids)
        media.append(items)
        inputs.append(inp)
    gens = engine.generate([p for p in prompts for _ in range(G)],
                           SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, seed=7),
                           media=[m for m in inputs for _ in range(G)])
    assert all(g.token_ids for g in gens)
    table = _train_rows(prompts, gens, media)
    mb = collate(table)
    assert mb.prompt_ids.shape[0] == 3 and len(mb.media) == 3

    backend = TorchBackend(TrainerConfig(model=name, optim={"lr": 1e-3}), device="cpu")
    with torch.no_grad():
        lp, _ = backend.logprobs(mb)
    mask = mb.response_mask.bool()
    diff = float((lp[mask] - mb.rollout_logprobs[mask]).abs().max())
    print(f"multimodal C12 ({kind}): {int(mask.sum())} tokens, max |rollout - trainer| = "
          f"{diff:.2e}")
    assert diff <= 1e-5, diff
    assert _ref_diff(engine.model, proc, table.to_pylist()) <= 1e-5  # reference stage

    # the engine without the media: another distribution (the media really are used)
    params = SamplingParams(max_new_tokens=1, temperature=1.0, seed=1)
    blind = engine.generate([prompts[0]], params)
    seen = engine.generate([prompts[0]], params, media=[inputs[0]])
    assert blind[0].token_ids != seen[0].token_ids or \
        abs(blind[0].logprobs[0] - seen[0].logprobs[0]) > 1e-4

    encoder = {n: p.detach().clone() for n, p in backend.model.named_parameters()
               if tower in n}
    assert encoder
    stats = backend.train_step([mb])
    moved = max(float((p.detach() - encoder[n]).abs().max())
                for n, p in backend.model.named_parameters() if n in encoder)
    assert stats["grad_norm"] > 0 and moved > 1e-5, (stats, moved)


@pytest.mark.e2e
def test_vqa_recipe_through_the_broker_trains_the_tiny_vlm(broker, local_ray, tmp_path):
    """recipes/vqa_grpo.yaml, 3 steps, every stage its own process on the real broker:
    every rollout accounted; rollouts and train samples carry the prompt's PNG bytes;
    the engine sampled with published weights; the final model's vision encoder moved
    (scored by the parity test reward: the random model never answers right, and all-zero
    rewards give all-zero advantages, so no gradient at all)."""
    import uuid

    from testdata import PARITY_REWARD, RECIPES

    from relax.infra.control.launch import train
    from relax.infra.recipe.recipe import load_recipe
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table
    from relax.trainer.models import load_model

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


@pytest.mark.e2e
def test_speech_recipe_through_the_broker_trains_the_tiny_audio_model(broker, local_ray,
                                                                      tmp_path):
    """recipes/speech_arith_grpo.yaml, 3 steps, every stage its own process on the real
    broker: every rollout accounted; rollouts and train samples carry the prompt's WAV
    bytes; the rollout's prompt holds the processor's <|AUDIO|> tokens; the final model's
    audio encoder moved (scored by the parity test reward, as above)."""
    import uuid

    from testdata import PARITY_REWARD, RECIPES

    from relax.infra.control.launch import train
    from relax.infra.recipe.recipe import load_recipe
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table
    from relax.trainer.models import load_model

    run = "speech" + uuid.uuid4().hex[:6]
    recipe = load_recipe(RECIPES / "speech_arith_grpo.yaml", [
        f"bootstrap_servers={broker}", f"run_root={tmp_path}", f"run={run}",
        "trainer.steps=3", "data.source=speech_arith:?size=32&seed=2", PARITY_REWARD])
    s = train(recipe, say=lambda _: None, timeout_s=500)
    assert s["steps"] == 3 and s["balanced"], s
    assert s["trained"] + s["stale"] + s["filtered"] + s["errors"] == s["sampled"] > 0, s
    bus = BusConfig(bootstrap_servers=broker)
    prompts = {r["prompt_id"]: r for r in read_table(bus, "prompts.speech-arith").to_pylist()}
    rollouts = read_table(bus, f"{run}.rollouts").to_pylist()
    for r in rollouts:
        (item,) = r["media"]
        assert item == prompts[r["prompt_id"]]["media"][0] and item["mime"] == "audio/wav"
        assert r["prompt_ids"].count(49152) >= 10  # the processor's <|AUDIO|> tokens
    samples = read_table(bus, f"{run}.train_samples").to_pylist()
    assert samples and all(x["media"] for x in samples)
    final = load_model(str(Path(s["run_dir"]) / "final_model")).state_dict()
    start = load_model("tiny-audio").state_dict()
    moved = max(float((final[k] - start[k]).abs().max()) for k in final if "audio_tower" in k)
    assert moved > 1e-5, moved
    # the run's CPU timeline (infra/observe/cpu_timeline.py): every stage sampled, drawn
    from relax.infra.observe.cpu_timeline import read_timeline

    cpu = read_timeline(Path(s["run_dir"]) / "cpu_timeline.jsonl")
    assert {"trainer", "rollout-0", "aggregate"} <= {r["name"] for r in cpu}
    assert max(r["cores"] for r in cpu if r["name"] == "trainer") > 0.3
    assert (Path(s["run_dir"]) / "timeline.png").stat().st_size > 1000


class _PictureEnv:
    """Answers the model's first turn with a picture (one of easy-vqa's PNGs) and a
    question about it; scores the second turn 1.0 and ends."""

    def __init__(self, png: bytes):
        self.png, self.turns = png, 0

    def reset(self, prompt_row):
        return None

    def step(self, text):
        self.turns += 1
        if self.turns == 1:
            return {"role": "user", "content": [{"type": "text", "text": "And this one? "},
                                                {"type": "image", "image": self.png}]}, False, None
        return None, True, 1.0


def _picture_row(q: str, png: bytes) -> dict:
    return {"prompt_id": "p0", "dataset": "vqa", "prompt": q, "messages": None,
            "media": [media_item("image", png, "image", MediaOptions())]}


def test_c22_an_image_from_the_environment_joins_the_conversation(vlm):
    """Two turns, the environment returning an image after the first: the second turn is
    sampled with both images; prompt + response ids equal the processor's full render of
    the whole conversation with both images (C22 family; length difference 0); the 16
    image tokens of the returned image have loss_mask 0; the episode's media hold both
    items, the second with turn 1."""
    from testdata import ScriptedEngine

    from relax.consumers.multiturn import run_episodes
    from relax.trainer.multimodal import tokens_of

    _, proc = vlm
    (q, _, png0), (_, _, png1) = _vqa(2)
    engine = ScriptedEngine(proc.tokenizer, ["A circle.", "A square."])
    row = _picture_row(q, png0)
    (ep,) = run_episodes(engine, proc.tokenizer, [_PictureEnv(png1)], row,
                         SamplingParams(max_new_tokens=20), max_turns=2, processor=proc)
    assert ep.finish_reason == "stop" and ep.rewards == [None, 1.0]
    assert [it["turn"] for it in ep.media] == [0, 1] and ep.media[1]["data"] == png1
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    first, second = (prompts[0] for prompts, _ in engine.calls)
    assert first.count(image_id) == 16 and second.count(image_id) == 32
    assert engine.media[0][0]["pixel_values"].shape[:2] == (1, 1)
    assert engine.media[1][0]["pixel_values"].shape[:2] == (1, 2)

    mark = MEDIA_MARK.format(kind="image")
    conv = [{"role": "user", "content": mark + q}, {"role": "assistant", "content": "A circle."},
            {"role": "user", "content": "And this one? " + mark},
            {"role": "assistant", "content": "A square."}]
    text = proc.apply_chat_template(chat_with_media(conv, ep.media), tokenize=False)
    full = tokens_of(proc, text, ep.media)
    ours = ep.prompt_ids + ep.response_ids
    assert ours == full[:-1]  # token for token; the template's last newline aside
    returned = [i for i, t in enumerate(ep.response_ids) if t == image_id]
    assert len(returned) == 16 and all(ep.loss_mask[i] == 0 for i in returned)
    assert sum(ep.loss_mask) == sum(t["end"] - t["start"] for t in ep.turns
                                    if t["role"] == "assistant")


def _ref_diff(model, proc, rows: list[dict]) -> float:
    """max |reference stage - rollout| log-prob over the rows' model tokens (the
    reference stage's full forward with every row's media)."""
    from relax.consumers.reference import ref_batch

    ref = ref_batch(model, rows, 0, processor=proc).column("ref_logprobs").to_pylist()
    return max(abs(a - b) for r, lp in zip(rows, ref)
               for a, b, m in zip(lp, r["logprobs"], r["loss_mask"]) if m)


def test_trainer_logprobs_equal_the_engines_when_the_environment_returns_images(vlm):
    """The real tiny VLM, two episodes whose environments return different images after
    the first turn (turns end at a stop string): the trainer, given the rows alone (turn-1
    images in the response pass), and the reference stage (one full forward with both
    images) recompute the engine's log-probs of every model token (max |diff| <= 1e-5,
    fp32, C12 family)."""
    from relax.consumers.multiturn import run_episodes
    from relax.trainer.backends.torch_backend import TorchBackend
    from relax.trainer.config import TrainerConfig

    engine, proc = vlm
    (q, _, png0), (_, _, png1), (_, _, png2) = _vqa(3)
    params = SamplingParams(max_new_tokens=12, temperature=TEMPERATURE, seed=3, stop=("e",))
    eps = run_episodes(engine, proc.tokenizer, [_PictureEnv(png1), _PictureEnv(png2)],
                       _picture_row(q, png0), params, max_turns=2, processor=proc)
    assert all(len(e.media) == 2 for e in eps), [e.finish_reason for e in eps]
    assert all([t["role"] for t in e.turns] == ["assistant", "user", "assistant"] for e in eps)
    rows = [dict(
        rollout_id=f"g0/{k}", group_id="g0", prompt_id="p0", dataset="vqa", sample_index=k,
        group_size=2, prompt_ids=e.prompt_ids, response_ids=e.response_ids,
        loss_mask=e.loss_mask, logprobs=e.logprobs, ref_logprobs=None,
        advantages=[1.0] * len(e.response_ids), reward=1.0, reward_components=[("env", 1.0)],
        token_policy_versions=None, policy_version_start=0, policy_version_end=0,
        finish_reason=e.finish_reason, temperature=TEMPERATURE, top_p=1.0, top_k=0,
        drop_reason=None, finished_at=0, media=e.media) for k, e in enumerate(eps)]
    mb = collate(pa.Table.from_pylist(rows, schema=TRAIN_SAMPLES))
    backend = TorchBackend(TrainerConfig(model="tiny-vlm"), device="cpu")
    with torch.no_grad():
        lp, _ = backend.logprobs(mb)
    mask = mb.loss_mask.bool()
    diff = float((lp[mask] - mb.rollout_logprobs[mask]).abs().max())
    print(f"multi-turn images C12: {int(mask.sum())} model tokens, max |diff| = {diff:.2e}")
    assert int(mask.sum()) > 4 and diff <= 1e-5, diff
    assert _ref_diff(engine.model, proc, rows) <= 1e-5


@pytest.mark.parametrize("kind", ["image", "audio"])
def test_sglang_requests_carry_the_media_and_their_expansion_is_the_rows(kind, request):
    """The SGLang request (unverified against a server here): ``image_data`` /
    ``audio_data`` data URLs that decode to the items' bytes, and ``input_ids`` with one
    placeholder per item; decoding those ids and running the model's processor (what
    SGLang's multimodal processors do) gives exactly the expanded ids the rows record."""
    import base64

    from relax.consumers.engines.sglang import generate_request
    from relax.trainer.multimodal import audio_of, images_of, unexpanded_ids

    _, proc = request.getfixturevalue("vlm" if kind == "image" else "alm")
    (q, _, data), = (_vqa if kind == "image" else _speech)(1)
    items = [media_item(kind, data, kind, MediaOptions())]
    msgs = [{"role": "user", "content": q}]
    sent = unexpanded_ids(proc, msgs, items)
    expanded, _ = encode_prompt(proc, msgs, items)
    body = generate_request([sent, sent[:3]], SamplingParams(), [items, None])
    field = "image_data" if kind == "image" else "audio_data"
    (url,), none = body[field]
    assert none is None and body["input_ids"][0] == sent and len(sent) < len(expanded)
    head, b64 = url.split(",", 1)
    assert head == f"data:{items[0]['mime']};base64" and base64.b64decode(b64) == data
    text = proc.tokenizer.decode(sent)
    if kind == "image":
        again = proc(text=[text], images=[images_of(items)])
    else:
        fe = proc.feature_extractor
        again = proc(text=[text], audio=audio_of(items, fe.sampling_rate, fe.chunk_length),
                     sampling_rate=fe.sampling_rate)
    assert [int(t) for t in again["input_ids"][0]] == expanded


@pytest.mark.e2e
def test_environment_images_go_through_the_broker_into_training(broker, local_ray, tmp_path):
    """The vqa recipe as a 2-turn episode whose environment answers with a picture
    (testdata:PictureEnv; turns end at the stop string "e"), 2 steps on the real broker:
    every rollout accounted; the rollouts that reached turn 2 carry both images (turn 0
    and the environment's PNG as turn 1) and 32 image tokens; train samples keep them,
    so the trainer runs the returned images through its response pass."""
    import uuid

    from relax.infra.control.launch import train
    from relax.infra.recipe.recipe import load_recipe
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table
    from testdata import PARITY_REWARD, RECIPES

    run = "vqaenv" + uuid.uuid4().hex[:6]
    recipe = load_recipe(RECIPES / "vqa_grpo.yaml", [
        f"bootstrap_servers={broker}", f"run_root={tmp_path}", f"run={run}",
        "trainer.steps=2", "data.source=easy_vqa:train?size=32&seed=3", PARITY_REWARD,
        "rollout.environment=testdata:PictureEnv", "rollout.max_turns=2",
        'rollout.stop=["e"]', "rollout.max_new_tokens=8"])
    s = train(recipe, say=lambda _: None, timeout_s=500)
    assert s["steps"] == 2 and s["balanced"], s
    assert s["trained"] + s["stale"] + s["filtered"] + s["errors"] == s["sampled"] > 0, s
    bus = BusConfig(bootstrap_servers=broker)
    rollouts = read_table(bus, f"{run}.rollouts").to_pylist()
    two = [r for r in rollouts if len(r["turns"]) == 3]
    assert len(two) >= len(rollouts) // 2, [r["finish_reason"] for r in rollouts]
    for r in two:
        assert [it["turn"] for it in r["media"]] == [0, 1]
        assert r["media"][1]["mime"] == "image/png"
        assert (r["prompt_ids"] + r["response_ids"]).count(49152) == 32
    samples = read_table(bus, f"{run}.train_samples").to_pylist()
    assert any(len(x["media"]) == 2 for x in samples)
