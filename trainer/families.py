"""Model families: what the rollout engine and the trainer need to know of a model's
media, as data (one :class:`Family` per entry of :data:`FAMILIES`), not as branches.

A family says three things:

* which of its processor's outputs are **media inputs** (``media_keys``: what the engine
  passes at every prefill and the trainer at its prompt pass, rebuilt from the row's
  media items by :func:`relax.trainer.multimodal.media_inputs`), and how the inputs of
  several prompts are batched (``cat_keys``: item by item, ``[sum n, ...]`` in prompt
  order; the other keys prompt by prompt, ``[1, N, ...]`` padded to ``[U, max N, ...]``);
* its **position ids** (``positions``): plain 1-D positions from the attention mask, or
  multimodal RoPE (Qwen2.5-VL, Qwen3-VL, the Qwen2.5-Omni and Qwen3-Omni thinkers: ``[3, B, T]``
  temporal/height/width positions from the model's own ``get_rope_index`` over the image
  and video grids), with the offset
  (``delta``) that the tokens after the prompt add to their 1-D position;
* the config ``model_type`` values it covers (``model_types``).

How a processor renders a prompt (its chat template's placeholder, which the processor
expands per item) lives in the model folder; the tiny models' builders write it
(:mod:`relax.trainer.vlm`, :mod:`relax.trainer.audio_lm`, :mod:`relax.trainer.qwen`).
A new family is one more entry here (and a builder for its tiny model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def text_positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D positions of left-padded rows: ``([B, T] int64 0.. on the real tokens, 0 on
    padding, [B, 1] int64 zeros)``; ``model`` and ``inputs`` are not used."""
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return pos, torch.zeros_like(pos[:, :1])


def _rope_index_owner(model):
    """The module with ``get_rope_index`` (the multimodal trunk, under a causal-LM head
    or an adapter wrapper)."""
    m = model
    for _ in range(4):
        if hasattr(m, "get_rope_index"):
            return m
        m = getattr(m, "model", None)
    raise ValueError(f"{type(model).__name__} has no get_rope_index (not a multimodal-RoPE "
                     "model)")


def mrope_positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal RoPE positions (Qwen2.5-VL, Qwen3-VL) of left-padded rows from the model's own
    ``get_rope_index``: ``([3, B, T] int64, [B, 1] int64 delta)``; an image's (a video's)
    tokens get (temporal, height, width) positions of its merged patch grid, text tokens one
    position on all three, and a token after the prompt at 1-D position ``p`` sits at
    ``p + delta`` on all three.

    Args:
        input_ids: ``[B, T]`` int64, the image placeholders expanded.
        attention_mask: ``[B, T]``, 1 on real tokens.
        inputs: the rows' media inputs (``image_grid_thw`` ``[images, 3]`` and
            ``video_grid_thw`` ``[videos, 3]`` int64 in row order; Qwen2.5-VL's
            ``second_per_grid_ts`` ``[videos]`` float32, the seconds one temporal patch
            spans, which space the video tokens' temporal positions); without any grid,
            the 1-D positions (:func:`text_positions`).
    """
    if inputs.get("image_grid_thw") is None and inputs.get("video_grid_thw") is None:
        return text_positions(model, input_ids, attention_mask, inputs)
    owner = _rope_index_owner(model)
    cfg = owner.config
    types = (input_ids == cfg.image_token_id).int() + 2 * (input_ids == cfg.video_token_id).int()
    return owner.get_rope_index(input_ids, mm_token_type_ids=types,
                                image_grid_thw=inputs.get("image_grid_thw"),
                                video_grid_thw=inputs.get("video_grid_thw"),
                                second_per_grid_ts=inputs.get("second_per_grid_ts"),
                                attention_mask=attention_mask)


def omni_positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal RoPE positions of the Qwen2.5-Omni and Qwen3-Omni thinkers from their own
    ``get_rope_index``: ``([3, B, T] int64, [B, 1] int64 delta)`` as
    :func:`mrope_positions` (Qwen3-Omni: float32 both, its video temporal positions may be
    fractional), with audio tokens on one position each (their count from
    ``feature_attention_mask``) and a video's temporal positions
    ``video_second_per_grid`` x ``position_id_per_seconds`` apart; audio and video
    separate (no audio taken from the video).

    Args:
        input_ids: ``[B, T]`` int64, the placeholders expanded.
        attention_mask: ``[B, T]``, 1 on real tokens.
        inputs: the rows' media inputs (grids ``[n, 3]`` int64, ``feature_attention_mask``
            ``[clips, frames]``, ``video_second_per_grid`` ``[videos]`` float32, in row
            order); without any image or video grid, the 1-D positions
            (:func:`text_positions`, which the model's own are there).
    """
    if inputs.get("image_grid_thw") is None and inputs.get("video_grid_thw") is None:
        return text_positions(model, input_ids, attention_mask, inputs)
    owner = _rope_index_owner(model)
    features = inputs.get("feature_attention_mask")
    return owner.get_rope_index(input_ids, inputs.get("image_grid_thw"),
                                inputs.get("video_grid_thw"), attention_mask, False,
                                None if features is None else features.sum(-1),
                                inputs.get("video_second_per_grid"))


@dataclass(frozen=True)
class Family:
    """One model family (see the module docstring).

    Attributes:
        name: the family's name (a key of :data:`FAMILIES`).
        model_types: config ``model_type`` values of its models.
        media_keys: processor outputs that are media inputs.
        cat_keys: media keys batched item by item (``[sum n, ...]``); the others are
            batched prompt by prompt (``[U, max N, ...]``, missing items all zeros).
        positions: ``(model, input_ids [B, T], attention_mask [B, T], media inputs) ->
            (position_ids [B, T] or [3, B, T], delta [B, 1])``.
        later_media: whether the trainer's response pass takes media a later turn of a
            multi-turn episode added (positions 1-D there: not for multimodal RoPE,
            whose response positions would have to come from the whole row).
    """

    name: str
    model_types: tuple[str, ...]
    media_keys: tuple[str, ...] = ()
    cat_keys: tuple[str, ...] = ()
    positions: Callable = text_positions
    later_media: bool = True


QWEN_VL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
"""The media inputs of Qwen2.5-VL and Qwen3-VL images and video (Qwen2.5-VL adds
``second_per_grid_ts``)."""

OMNI_KEYS = QWEN_VL_KEYS + ("video_second_per_grid", "input_features", "feature_attention_mask")
"""The media inputs of the Qwen2.5-Omni and Qwen3-Omni thinkers: images, video and audio in
one prompt."""

FAMILIES = {
    "text": Family("text", ()),
    "idefics3": Family("idefics3", ("idefics3",),
                       media_keys=("pixel_values", "pixel_attention_mask")),
    "qwen2-audio": Family("qwen2-audio", ("qwen2_audio",),
                          media_keys=("input_features", "feature_attention_mask"),
                          cat_keys=("input_features", "feature_attention_mask")),
    "qwen2.5-vl": Family("qwen2.5-vl", ("qwen2_5_vl",),
                         media_keys=QWEN_VL_KEYS + ("second_per_grid_ts",),
                         cat_keys=QWEN_VL_KEYS + ("second_per_grid_ts",),
                         positions=mrope_positions, later_media=False),
    "qwen3-vl": Family("qwen3-vl", ("qwen3_vl",),
                       media_keys=QWEN_VL_KEYS, cat_keys=QWEN_VL_KEYS,
                       positions=mrope_positions, later_media=False),
    "qwen2.5-omni": Family("qwen2.5-omni", ("qwen2_5_omni_thinker",), media_keys=OMNI_KEYS,
                           cat_keys=OMNI_KEYS, positions=omni_positions, later_media=False),
    "qwen3-omni": Family("qwen3-omni", ("qwen3_omni_moe_thinker",), media_keys=OMNI_KEYS,
                         cat_keys=OMNI_KEYS, positions=omni_positions, later_media=False),
}
"""The families relax knows, by name."""


def family_of(config) -> Family:
    """The family of a transformers config (``model_type``); a model with neither
    ``vision_config`` nor ``audio_config`` (or no config: None) is ``text``.

    Raises:
        ValueError: a multimodal model of no known family (names the known ones).
    """
    kind = getattr(config, "model_type", None)
    for fam in FAMILIES.values():
        if kind in fam.model_types:
            return fam
    if getattr(config, "vision_config", None) is None and \
            getattr(config, "audio_config", None) is None:
        return FAMILIES["text"]
    known = ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES.values()
                      if f.model_types)
    raise ValueError(f"model_type {kind!r} takes media but is of no known family; known: "
                     f"{known}")


def cat_keys_of(keys) -> frozenset[str]:
    """Which of ``keys`` (media-input names, without the model at hand: the reference
    stage's and the trainer's batches) are batched item by item: the ``cat_keys`` of the
    families that take all of ``keys`` (empty for no keys).

    Raises:
        ValueError: no family takes all of ``keys``, or those that do batch them
            differently.
    """
    keys = set(keys)
    if not keys:
        return frozenset()
    found = [f for f in FAMILIES.values() if f.media_keys and keys <= set(f.media_keys)]
    rules = {frozenset(keys & set(f.cat_keys)) for f in found}
    if len(rules) != 1:
        raise ValueError(f"media inputs {sorted(keys)}: {len(found)} families take them "
                         f"({', '.join(f.name for f in found) or 'none'}) with "
                         f"{len(rules)} batching rules; expected one")
    return rules.pop()


__all__ = ["FAMILIES", "OMNI_KEYS", "QWEN_VL_KEYS", "Family", "cat_keys_of", "family_of",
           "mrope_positions", "omni_positions", "text_positions"]
