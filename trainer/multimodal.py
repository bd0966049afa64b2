"""A row's images, video and audio as model inputs, the same way in the rollout engine and
the trainer.

A prompt row carries its media by reference (``media`` items: inline bytes or a blob URI,
:mod:`relax.producers.media`) and its text with ``<relax:image>`` / ``<relax:audio>``
marks where a chat message had a media part. :func:`chat_with_media` turns that back into
content parts (items with no mark, from an ``--image-field`` / ``--video-field`` /
``--audio-field`` column, open the last user message, as SmolVLM, Qwen2-VL and Qwen2-Audio
prompts put them), and
the model's own transformers processor renders the chat template and expands each item
into its placeholder tokens (:func:`encode_prompt`). The trainer never re-renders the
text: it takes the rollout's ``prompt_ids`` and recomputes only the media inputs from the
same items with the same image processor / feature extractor (:func:`media_inputs`), so
the forward it runs is the rollout's (public case C12: log-probs equal for equal weights).

Media inputs, per prompt (what the processor returns besides the token ids):

* images (Idefics3): ``pixel_values`` ``[1, N, 3, H, W]`` float32 and
  ``pixel_attention_mask`` ``[1, N, H, W]`` bool, N images of the prompt;
* images (Qwen2.5-VL): ``pixel_values`` ``[patches, C * 2 * 14 * 14]`` float32 (the
  flattened patches of the N images) and ``image_grid_thw`` ``[N, 3]`` int64 (each
  image's temporal, height and width patch counts; the trainer's and the engine's
  multimodal RoPE positions come from them);
* video (Qwen2.5-VL, Qwen3-VL): ``pixel_values_videos`` ``[patches, C * 2 * P * P]``
  float32 and ``video_grid_thw`` ``[N, 3]`` int64 of the N clips' frames (two frames a
  temporal patch), and for Qwen2.5-VL ``second_per_grid_ts`` ``[N]`` float32 (seconds a
  temporal patch spans); Qwen3-VL writes each temporal patch's timestamp into the prompt
  text instead (``<0.1 seconds>``). A video item holds the frames ``relax publish``
  sampled, with their timestamps (:func:`relax.schemas.media.video_frames`); the
  processor takes them as they are (no re-sampling) with the timestamps as their
  metadata (:func:`videos_of`);
* audio (Qwen2-Audio, Whisper features): ``input_features`` ``[N, mel, frames]`` float32
  (log-mel, padded to the feature extractor's ``chunk_length`` seconds) and
  ``feature_attention_mask`` ``[N, frames]`` int, N clips of the prompt.

Which keys a model takes and how they are batched is its family's
(:mod:`relax.trainer.families`).
"""

from __future__ import annotations

import io
import wave

import numpy as np
import torch

from relax.schemas.media import MEDIA_MARK, split_marked
from relax.trainer.families import FAMILIES, Family, cat_keys_of

MEDIA_KEYS = frozenset(k for f in FAMILIES.values() for k in f.media_keys)
"""Processor outputs that are media inputs, of any family."""


def item_bytes(item: dict) -> bytes:
    """A media item's bytes (inline, or read from its blob URI).

    Raises:
        FileNotFoundError: a blob URI that does not exist.
    """
    from relax.streams.blobs import BlobStore

    return item["data"] if item["data"] is not None else BlobStore.get(item["uri"])


def images_of(items: list[dict] | None) -> list:
    """PIL RGB images of the ``image`` items, in order (inline bytes or blob URIs).

    Raises:
        FileNotFoundError: a blob URI that does not exist.
    """
    from PIL import Image

    return [Image.open(io.BytesIO(item_bytes(it))).convert("RGB")
            for it in items or [] if it["kind"] == "image"]


def audio_of(items: list[dict] | None, rate: int, seconds: float) -> list[np.ndarray]:
    """``[samples]`` float32 waveforms in [-1, 1] of the ``audio`` items (PCM WAV, mono or
    the mean of its channels), in order.

    Args:
        rate: the sample rate the model's feature extractor takes (Hz).
        seconds: the longest clip it takes (its ``chunk_length``).

    Raises:
        ValueError: a clip at another rate or longer than ``seconds``.
        FileNotFoundError: a blob URI that does not exist.
    """
    out = []
    for i, it in enumerate(it for it in items or [] if it["kind"] == "audio"):
        with wave.open(io.BytesIO(item_bytes(it))) as w:
            channels, width, got = w.getnchannels(), w.getsampwidth(), w.getframerate()
            frames = w.readframes(w.getnframes())
        if got != rate:
            raise ValueError(f"audio {i}: {got} Hz, the model takes {rate} Hz")
        scale = float(2 ** (8 * width - 1))
        dtype = {1: np.uint8, 2: "<i2", 4: "<i4"}[width]
        y = np.frombuffer(frames, dtype=dtype).astype(np.float32)
        y = (y - 128.0) / 128.0 if width == 1 else y / scale
        y = y.reshape(-1, channels).mean(axis=1)
        if len(y) > seconds * rate:
            raise ValueError(f"audio {i}: {len(y) / rate:.2f} s, the model takes at most "
                             f"{seconds} s")
        out.append(y)
    return out


def videos_of(items: list[dict] | None) -> list[tuple[list, object]]:
    """The ``video`` items' frames and their ``transformers.video_utils.VideoMetadata``, in
    order: ``(F PIL RGB frames, metadata)`` per clip.

    The metadata puts the stored timestamps ``t_i`` (seconds) where a transformers video
    processor reads them: ``fps = 1 / s`` with ``s`` the mean spacing of the frames
    (``(t_last - t_0) / (F - 1)``; one frame: the clip's frame time) and
    ``frames_indices = t_i / s``, so ``frames_indices / fps`` (the timestamps Qwen3-VL
    writes) are the ``t_i`` and the sampled rate (``F / total_num_frames * fps``, of which
    Qwen2.5-VL's ``second_per_grid_ts`` is ``temporal_patch_size / rate``) is ``1 / s``.

    Raises:
        ValueError: an item that is not a frame strip (:func:`relax.schemas.media.video_frames`).
        FileNotFoundError: a blob URI that does not exist.
    """
    from transformers.video_utils import VideoMetadata

    from relax.schemas.media import video_frames

    out = []
    for it in items or []:
        if it["kind"] != "video":
            continue
        frames, times, info = video_frames(item_bytes(it))
        step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        step = step if step > 0 else 1.0 / info["fps"]
        out.append((frames, VideoMetadata(
            total_num_frames=len(frames), fps=1.0 / step, width=info["width"],
            height=info["height"], duration=times[-1] + step,
            frames_indices=[t / step for t in times])))
    return out


def mark_media(messages: list[dict], items: list[dict] | None) -> list[dict]:
    """``messages`` (``{role, content: str}``) with a mark for every item beyond the
    marks already there, at the start of the last user message (images, video, then audio):
    afterwards the marks alone say where every item is, so that messages added later
    (multi-turn) do not move them.

    Raises:
        ValueError: more marks of a kind than items of that kind.
    """
    extra = ""
    for kind in ("image", "video", "audio"):
        have = sum(1 for it in items or [] if it["kind"] == kind)
        marks = sum(1 for m in messages for k, _ in split_marked(m["content"]) if k == kind)
        if marks > have:
            raise ValueError(f"the messages mark {marks} {kind} items, the row has {have}")
        extra += MEDIA_MARK.format(kind=kind) * (have - marks)
    if not extra:
        return messages
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    return [{**m, "content": extra + m["content"]} if i == last_user else m
            for i, m in enumerate(messages)]


def refuse_video(processor, items: list[dict] | None) -> None:
    """Raise ValueError if ``items`` hold a ``video`` item and ``processor`` (the model's)
    has no video processor: the model's family takes no video (Qwen2.5-VL and Qwen3-VL
    do), and dropping the clip would train on the text alone without a word."""
    n = sum(1 for it in items or [] if it["kind"] == "video")
    if n and getattr(processor, "video_processor", None) is None:
        raise ValueError(f"the row has {n} video items; the model's processor "
                         f"({type(processor).__name__}) takes no video (families with video: "
                         "qwen2.5-vl, qwen3-vl): publish it without --video-field or train a "
                         "model of those")


def chat_with_media(messages: list[dict], items: list[dict] | None) -> list[dict]:
    """``messages`` (``{role, content: str}``) with content parts for the media: each
    ``<relax:image>`` / ``<relax:video>`` / ``<relax:audio>`` mark becomes an
    ``{"type": kind}`` part in place; the items beyond the marks open the last user
    message (:func:`mark_media`). Text-only input comes back unchanged.

    Raises:
        ValueError: more marks of a kind than items of that kind.
    """
    marked = mark_media(messages, items)
    if not items:
        return messages
    return [{"role": m["role"], "content": [
        {"type": "text", "text": text} if kind == "text" else {"type": kind}
        for kind, text in split_marked(m["content"])]} for m in marked]


def observation_media(message: dict, turn: int) -> tuple[dict, list[dict]]:
    """An environment's chat message whose content may be a list of parts
    (``{"type": "text", "text": ...}``, ``{"type": "image", "image": PNG/JPEG bytes or a
    PIL image}``, ``{"type": "audio", "audio": WAV bytes}``) as a message with string
    content holding marks, and its media items (inline, ``turn``: the turn they came
    in). A string content comes back as it is, with no items.

    Raises:
        TypeError: a part that is not one of those.
    """
    content = message["content"]
    if isinstance(content, str):
        return message, []
    text, items = "", []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text += part["text"]
            continue
        value = part.get(kind) if kind in ("image", "audio") else None
        if kind == "image" and hasattr(value, "save"):  # a PIL image
            buf = io.BytesIO()
            value.save(buf, format="PNG")
            value = buf.getvalue()
        if not isinstance(value, bytes):
            raise TypeError(f"observation part {i}: expected {{type: text, text}}, {{type: "
                            f"image, image: bytes or PIL image}} or {{type: audio, audio: WAV "
                            f"bytes}}, got {part!r:.200}")
        mime = "audio/wav" if kind == "audio" else f"image/{_image_format(value)}"
        items.append({"kind": kind, "uri": None, "data": value, "mime": mime, "turn": turn})
        text += MEDIA_MARK.format(kind=kind)
    return {**message, "content": text}, items


def _image_format(data: bytes) -> str:
    from PIL import Image

    return (Image.open(io.BytesIO(data)).format or "png").lower()


def _audio(processor, items) -> list[np.ndarray]:
    fe = getattr(processor, "feature_extractor", None)
    if fe is None:
        if any(it["kind"] == "audio" for it in items or []):
            raise ValueError(f"{type(processor).__name__} takes no audio")
        return []
    return audio_of(items, fe.sampling_rate, fe.chunk_length)


def encode_prompt(processor, messages: list[dict], items: list[dict] | None
                  ) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The prompt token ids (placeholders expanded by the processor) and the media
    inputs (see the module docstring; empty dict without media) of one prompt.

    Raises:
        ValueError: see :func:`chat_with_media`, :func:`audio_of` and :func:`videos_of`;
            audio for a processor without a feature extractor, video for one without a
            video processor (:func:`refuse_video`).
    """
    refuse_video(processor, items)
    chat = chat_with_media(messages, items)
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], return_tensors="pt", **_media_kwargs(processor, items))
    return [int(t) for t in enc["input_ids"][0]], _inputs(enc)


def _media_kwargs(processor, items: list[dict] | None) -> dict:
    """The processor's keyword arguments for the items' images, video and audio (decoded;
    video frames as they are, not re-sampled; audio padded to ``chunk_length``)."""
    kwargs = {}
    if images := images_of(items):
        kwargs["images"] = [images]
    if videos := videos_of(items):
        kwargs.update(_video_kwargs(processor, videos))
    if audio := _audio(processor, items):
        kwargs["audio"] = audio
        kwargs["sampling_rate"] = processor.feature_extractor.sampling_rate
        # padded to the extractor's chunk_length as media_inputs does: prompts' clips of
        # other lengths concatenate (Qwen3-Omni's processor pads to the longest clip)
        kwargs["audio_kwargs"] = {"padding": "max_length"}
    return kwargs


def _video_kwargs(processor, videos: list[tuple[list, object]]) -> dict:
    """The processor's keyword arguments for decoded clips (:func:`videos_of`): the frames
    as they are (``do_sample_frames`` off), their metadata, and as ``videos_kwargs`` the
    video processor's own ``size`` (the Qwen2.5-Omni processor's class default would win
    otherwise) and the clips' sampled rate as ``fps`` (what Qwen2.5-Omni derives
    ``video_second_per_grid`` from; the others read the metadata).

    Raises:
        ValueError: clips sampled at different rates in one prompt for a processor that
            takes one ``fps`` per call (its ``video_second_per_grid`` would be wrong).
    """
    rates = sorted({round(meta.fps, 6) for _, meta in videos})
    if len(rates) > 1 and "video_second_per_grid" in processor.model_input_names:
        raise ValueError(f"the prompt's clips are sampled at {rates} frames/s; "
                         f"{type(processor).__name__} takes one rate per prompt: publish them "
                         "with one video_fps")
    return {"videos": [frames for frames, _ in videos],
            "video_metadata": [meta for _, meta in videos], "do_sample_frames": False,
            "videos_kwargs": {"size": dict(processor.video_processor.size), "fps": rates[0]}}


def unexpanded_ids(processor, messages: list[dict], items: list[dict] | None) -> list[int]:
    """The prompt token ids with one placeholder per item, as the chat template writes
    it (what an engine that runs the processor itself takes, such as SGLang).

    Raises:
        ValueError: see :func:`chat_with_media` and :func:`refuse_video`.
    """
    refuse_video(processor, items)
    text = processor.apply_chat_template(chat_with_media(messages, items),
                                         add_generation_prompt=True, tokenize=False)
    return list(processor.tokenizer.encode(text, add_special_tokens=False))


def tokens_of(processor, text: str, items: list[dict]) -> list[int]:
    """Token ids of ``text`` (a piece of a rendered chat holding the placeholders of
    ``items``), each placeholder expanded by the processor; no special tokens added.

    Raises:
        ValueError: see :func:`audio_of`, :func:`videos_of` and :func:`refuse_video`.
    """
    refuse_video(processor, items)
    enc = processor(text=[text], add_special_tokens=False, **_media_kwargs(processor, items))
    return [int(t) for t in enc["input_ids"][0]]


def _inputs(enc) -> dict[str, torch.Tensor]:
    return {k: v for k, v in enc.items() if k in MEDIA_KEYS}


def media_inputs(processor, items: list[dict] | None) -> dict[str, torch.Tensor]:
    """The media inputs :func:`encode_prompt` gives for ``items`` (the image processor,
    the processor over the clips with a text of one video token each, and the feature
    extractor; empty dict without media).

    Raises:
        ValueError: see :func:`refuse_video`, :func:`videos_of` and :func:`_video_kwargs`."""
    refuse_video(processor, items)
    out = {}
    if images := images_of(items):
        out.update(_inputs(processor.image_processor(images=[images], return_tensors="pt")))
    if videos := videos_of(items):
        out.update(_inputs(processor(text=[processor.video_token * len(videos)],
                                     return_tensors="pt", **_video_kwargs(processor, videos))))
    if audio := _audio(processor, items):
        fe = processor.feature_extractor
        enc = fe(audio, sampling_rate=fe.sampling_rate, padding="max_length",
                 return_attention_mask=True, return_tensors="pt")
        out["input_features"] = enc["input_features"]
        out["feature_attention_mask"] = enc["attention_mask"]
    return out


def stack_media(per_prompt: list[dict[str, torch.Tensor]],
                family: Family | None = None) -> dict[str, torch.Tensor]:
    """One batch of media inputs from U prompts', as the family batches them
    (:class:`relax.trainer.families.Family`): its ``cat_keys`` (each ``[n_u, ...]``)
    concatenated to ``[sum n_u, ...]`` in prompt order (Qwen2-Audio and Qwen2.5-VL fill
    their placeholders in that order); its other keys (each ``[1, N_u, ...]``) to
    ``[U, max N, ...]``, the missing images all zeros (Idefics3 drops all-zero images).
    A prompt without media adds nothing to the first kind and zero items to the second.
    Empty dict when no prompt has media.

    Args:
        family: the model's family; default: the batching of the families whose media
            keys these are (:func:`relax.trainer.families.cat_keys_of`).
    """
    keys = {k: p[k] for p in per_prompt for k in p}  # one example tensor per key
    cat = family.cat_keys if family is not None else cat_keys_of(keys)
    out = {}
    for key, example in keys.items():
        if key in cat:
            out[key] = torch.cat([p[key] for p in per_prompt if key in p], dim=0)
            continue
        n = max(p[key].shape[1] for p in per_prompt if key in p)
        padded = []
        for p in per_prompt:
            t = p.get(key, example[:, :0])
            pad = torch.zeros((1, n - t.shape[1], *t.shape[2:]), dtype=t.dtype)
            padded.append(torch.cat([t, pad], dim=1))
        out[key] = torch.cat(padded, dim=0)
    return out


def media_inputs_of(processor, media: list[list[dict] | None], model: str,
                    prompt_of_row: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The media inputs of a micro-batch: with ``prompt_of_row`` None, of the prompt
    pass (:func:`stack_media` of the U prompts' turn-0 items); else of the response pass,
    row by row (``[B]`` prompt of each row; the items later turns of a multi-turn
    episode added, which stand in the response). Empty dict when there are none.

    Raises:
        ValueError: rows with media for a model without a processor (text-only).
    """
    if processor is None:
        raise ValueError(f"rows carry media but {model} takes no images or audio "
                         "(no processor)")
    if prompt_of_row is None:
        return stack_media([media_inputs(processor, [it for it in items or []
                                                     if not it.get("turn")]) for items in media])
    later = [[it for it in items or [] if it.get("turn")] for items in media]
    if not any(later):
        return {}
    rows = prompt_of_row.tolist()
    per_prompt = {u: media_inputs(processor, later[u]) for u in set(rows)}  # decoded once
    return stack_media([per_prompt[u] for u in rows])


def kv_cache(out):
    """The key/value cache of a transformers model output (``past_key_values``, or
    ``cache`` for the models that renamed it, such as Qwen2-Audio)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def cache_arg(module) -> str:
    """The keyword ``module.forward`` takes a key/value cache by: ``cache`` where
    transformers renamed it (Qwen2-Audio, 5.x), else ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(module.forward).parameters \
        else "past_key_values"


__all__ = ["MEDIA_KEYS", "audio_of", "cache_arg", "chat_with_media", "encode_prompt", "images_of",
           "item_bytes", "kv_cache", "mark_media", "media_inputs", "media_inputs_of",
           "observation_media", "refuse_video", "stack_media", "tokens_of", "unexpanded_ids",
           "videos_of"]
