"""A row's images as model inputs, the same way in the rollout engine and the trainer.

A prompt row carries its images by reference (``media`` items: inline bytes or a blob
URI, :mod:`relax.producers.media`) and its text with ``<relax:image>`` marks where a chat
message had an image part. :func:`chat_with_media` turns that back into content parts
(images with no mark, from an ``--image-field`` column, go first in the last user
message, as SmolVLM and Qwen2-VL prompts put them), and the model's own transformers
processor renders the chat template and expands each image into its placeholder tokens
(:func:`encode_prompt`). The trainer never re-renders the text: it takes the rollout's
``prompt_ids`` and recomputes only the pixel inputs from the same items with the same
image processor (:func:`pixel_inputs`), so the forward it runs is the rollout's (public
case C12: log-probs equal for equal weights).
"""

from __future__ import annotations

import io

import torch

from relax.schemas.media import split_marked


def images_of(items: list[dict] | None) -> list:
    """PIL RGB images of the ``image`` items, in order (inline bytes or blob URIs).

    Raises:
        FileNotFoundError: a blob URI that does not exist.
    """
    from PIL import Image

    from relax.streams.blobs import BlobStore

    out = []
    for it in items or []:
        if it["kind"] != "image":
            continue
        data = it["data"] if it["data"] is not None else BlobStore.get(it["uri"])
        out.append(Image.open(io.BytesIO(data)).convert("RGB"))
    return out


def chat_with_media(messages: list[dict], items: list[dict] | None) -> list[dict]:
    """``messages`` (``{role, content: str}``) with content parts for the images: each
    ``<relax:image>`` mark becomes an ``{"type": "image"}`` part in place; the images
    beyond the marks open the last user message. Text-only input comes back unchanged.

    Raises:
        ValueError: more image marks than image items.
    """
    n_images = sum(1 for it in items or [] if it["kind"] == "image")
    marks = sum(1 for m in messages for kind, _ in split_marked(m["content"]) if kind == "image")
    if marks > n_images:
        raise ValueError(f"the messages mark {marks} images, the row has {n_images}")
    if not n_images:
        return messages
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = []
    for i, m in enumerate(messages):
        parts = [{"type": "image"}] * (n_images - marks) if i == last_user else []
        for kind, text in split_marked(m["content"]):
            parts.append({"type": "text", "text": text} if kind == "text" else {"type": kind})
        out.append({"role": m["role"], "content": parts})
    return out


def encode_prompt(processor, messages: list[dict], items: list[dict] | None
                  ) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The prompt token ids (placeholders expanded by the processor) and the pixel
    inputs (``pixel_values`` ``[1, N, 3, H, W]`` float32, ``pixel_attention_mask``
    ``[1, N, H, W]`` bool for N images; empty dict without images) of one prompt."""
    chat = chat_with_media(messages, items)
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    images = images_of(items)
    enc = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    pixels = {k: v for k, v in enc.items() if k.startswith("pixel_")}
    return [int(t) for t in enc["input_ids"][0]], pixels


def pixel_inputs(processor, items: list[dict] | None) -> dict[str, torch.Tensor]:
    """The pixel inputs :func:`encode_prompt` gives for ``items`` (the image processor
    alone; empty dict without images)."""
    images = images_of(items)
    if not images:
        return {}
    enc = processor.image_processor(images=[images], return_tensors="pt")
    return {k: v for k, v in enc.items() if k.startswith("pixel_")}


def stack_pixels(per_prompt: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One batch of pixel inputs from U prompts' (each ``[1, N_u, ...]``): ``[U, max N,
    ...]``, the missing images all zeros (Idefics3 drops all-zero images). Empty dict
    when no prompt has an image.

    Raises:
        ValueError: some prompts have images and others none (a batch mixes text-only
            and image prompts: batch them apart).
    """
    have = [bool(p) for p in per_prompt]
    if not any(have):
        return {}
    if not all(have):
        raise ValueError(f"{sum(have)} of {len(have)} prompts have images: batch them apart")
    out = {}
    for key in per_prompt[0]:
        n = max(p[key].shape[1] for p in per_prompt)
        padded = []
        for p in per_prompt:
            t = p[key]
            pad = torch.zeros((1, n - t.shape[1], *t.shape[2:]), dtype=t.dtype)
            padded.append(torch.cat([t, pad], dim=1))
        out[key] = torch.cat(padded, dim=0)
    return out


def pixels_of(processor, media: list[list[dict] | None], model: str) -> dict[str, torch.Tensor]:
    """:func:`stack_pixels` of the U prompts' ``media`` (a micro-batch's).

    Raises:
        ValueError: rows with media for a model without a processor (text-only).
    """
    if processor is None:
        raise ValueError(f"rows carry media but {model} takes no images (no processor)")
    return stack_pixels([pixel_inputs(processor, items) for items in media])


__all__ = ["chat_with_media", "encode_prompt", "images_of", "pixel_inputs", "pixels_of",
           "stack_pixels"]
