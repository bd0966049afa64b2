"""Tiny random-weight models of the Qwen families, built offline from transformers' own
config and model classes, for tests and CPU recipes.

* ``tiny-qwen3``: ``Qwen3ForCausalLM`` (2 layers, hidden 64, head_dim 16, q/k norms),
  the text trunk of :data:`relax.trainer.model_store.TINY_CONFIG`;
* ``tiny-qwen3-moe``: ``Qwen3MoeForCausalLM``, the same trunk with 4 experts of width 32
  in every layer, 2 routed per token;
* ``tiny-qwen2.5-vl``: ``Qwen2_5_VLForConditionalGeneration``: a 2-block vision encoder
  (patch 14, temporal patch 2, spatial merge 2, window attention then one full-attention
  block) over images resized to 112 x 112 (an 8 x 8 patch grid: 16 image tokens per
  image), the same text trunk with multimodal RoPE (``mrope_section`` [2, 3, 3] of its
  8 rotary frequencies), its processor ``Qwen2_5_VLProcessor`` with
  ``Qwen2VLImageProcessor`` and ``Qwen2VLVideoProcessor`` (video frames resized to 56 x
  56, two frames a temporal patch: 4 video tokens per 2 frames, and ``second_per_grid_ts``
  from the frames' timestamps; both need torchvision);
* ``tiny-qwen3-vl``: ``Qwen3VLForConditionalGeneration``: a 2-block vision encoder (patch
  16, merge 2, learned 8 x 8 position grid, its block-0 features also added to text layer
  0: DeepStack) over images resized to 128 x 128 (16 image tokens per image), the same
  text trunk with interleaved multimodal RoPE (``mrope_section`` [4, 2, 2]),
  ``Qwen3VLProcessor`` with ``Qwen2VLImageProcessor`` and ``Qwen3VLVideoProcessor`` (64 x
  64 frames kept, 4 video tokens per 2 frames, each pair of frames written as
  ``<T seconds><|vision_start|>...<|vision_end|>`` with its mean timestamp).

* ``tiny-qwen2.5-omni``: ``Qwen2_5OmniThinkerForConditionalGeneration`` (the thinker:
  no talker, text out): ``tiny-qwen2.5-vl``'s vision encoder and text trunk (images 112 x
  112, video frames 56 x 56) and a 2-layer Whisper-style audio encoder (80 log-mel bins,
  25 audio tokens a second, clips of at most :data:`OMNI_CLIP_SECONDS` s), its processor
  ``Qwen2_5OmniProcessor`` (``Qwen2VLImageProcessor``, ``Qwen2VLVideoProcessor``,
  ``WhisperFeatureExtractor`` at 16 kHz) with Qwen2.5-Omni's seven media tokens
  (:data:`OMNI_TOKENS`, ids 49152-49158) and template parts (:data:`OMNI_PLACEHOLDERS`).
* ``tiny-qwen3-omni``: ``Qwen3OmniMoeThinkerForConditionalGeneration`` (the thinker):
  ``tiny-qwen3-moe``'s trunk with ``tiny-qwen3-vl``'s interleaved multimodal RoPE and
  vision encoder (images 128 x 128, frames 64 x 64: 16 tokens each), a 2-layer audio encoder
  (128 log-mel bins, three stride-2 convolutions per 1 s chunk: 13 audio tokens a second),
  ``position_id_per_seconds`` 13 (fractional video temporal positions, as the model's own),
  ``Qwen3OmniMoeProcessor`` (``Qwen2VLImageProcessor``, ``Qwen2VLVideoProcessor``,
  ``WhisperFeatureExtractor``) with Qwen3-Omni's media tokens (:data:`OMNI3_TOKENS`, ids
  49152-49158) and template parts (:data:`OMNI3_PLACEHOLDERS`).

All use the SmolLM2 tokenizer and chat template (ids as ``tiny-llama``'s); the VL model
adds Qwen2-VL's four vision tokens (ids 49152-49155), and its template renders an
``{"type": "image"}`` part as ``<|vision_start|><|image_pad|><|vision_end|>`` and a
``{"type": "video"}`` part as ``<|vision_start|><|video_pad|><|vision_end|>``
(:data:`VL_PLACEHOLDERS`, as the real models' templates do), which the processor expands
to one pad token per merged patch. The video processors take the frames ``relax
publish`` sampled as they are (``do_sample_frames`` off). Seeds fixed
(:data:`QWEN_SEED`), so the weights are bit-identical everywhere.
"""

from __future__ import annotations

from pathlib import Path

import torch

QWEN_SEED = 2468
QWEN25_VL_IMAGE_SIZE = 112
QWEN3_VL_IMAGE_SIZE = 128
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VL_PLACEHOLDERS = {"image": "<|vision_start|><|image_pad|><|vision_end|>",
                   "video": "<|vision_start|><|video_pad|><|vision_end|>"}
"""What the VL models' chat template writes for an image / a video part (as the real
Qwen2.5-VL and Qwen3-VL templates do); the processor expands each."""
QWEN25_VL_VIDEO_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 56 * 56}
"""Qwen2.5-VL video frames: resized to 56 x 56 pixels each (a 4 x 4 patch grid)."""
QWEN3_VL_VIDEO_SIZE = {"shortest_edge": 2 * 64 * 64, "longest_edge": 32 * 64 * 64}
"""Qwen3-VL video: its pixel budget over all frames (64 x 64 frames kept as they are up to
32 frames: a 4 x 4 patch grid)."""
OMNI_TOKENS = {"image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>",
               "audio_token": "<|AUDIO|>", "vision_bos_token": "<|vision_bos|>",
               "vision_eos_token": "<|vision_eos|>", "audio_bos_token": "<|audio_bos|>",
               "audio_eos_token": "<|audio_eos|>"}
"""Qwen2.5-Omni's seven media tokens, by the tokenizer attribute its processor reads."""
OMNI_PLACEHOLDERS = {"image": "<|vision_bos|><|IMAGE|><|vision_eos|>",
                     "video": "<|vision_bos|><|VIDEO|><|vision_eos|>",
                     "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>"}
"""What the Omni thinker's chat template writes for an image / video / audio part."""
OMNI_CLIP_SECONDS = 5
"""Longest audio clip of ``tiny-qwen2.5-omni`` and ``tiny-qwen3-omni`` (seconds): the feature
extractor pads to it."""
OMNI3_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                "audio_token": "<|audio_pad|>", "vision_bos_token": "<|vision_start|>",
                "vision_eos_token": "<|vision_end|>", "audio_bos_token": "<|audio_start|>",
                "audio_eos_token": "<|audio_end|>"}
"""Qwen3-Omni's seven media tokens, by the tokenizer attribute its processor reads."""
OMNI3_PLACEHOLDERS = {**VL_PLACEHOLDERS, "audio": "<|audio_start|><|audio_pad|><|audio_end|>"}
"""What the Qwen3-Omni thinker's chat template writes for an image / video / audio part."""
VL_REVISION = 2
"""Revision of the VL folders' files (revision 2: video parts in the template, the video
processors' sizes); a cached folder of another revision is not used."""
QWEN3_OMNI_VIDEO_SIZE = {"shortest_edge": 64 * 64, "longest_edge": 64 * 64}
"""Qwen3-Omni video frames: resized to 64 x 64 pixels each (a 4 x 4 patch grid)."""
OMNI3_POSITIONS_PER_SECOND = 13
"""Qwen3-Omni's ``position_id_per_seconds`` (its processor's default; the config's is 25)."""
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           decoder_sparse_step=1, norm_topk_prob=True)


def _text(vocab_size: int) -> dict:
    from relax.trainer.model_store import TINY_CONFIG

    cfg = {k: v for k, v in TINY_CONFIG.items() if k != "rope_theta"}
    return dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                **cfg)


def tiny_qwen3_config(moe: bool = False):
    """``Qwen3Config`` (or ``Qwen3MoeConfig`` with ``moe``) of ``tiny-qwen3`` /
    ``tiny-qwen3-moe`` (see the module docstring)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    return Qwen3MoeConfig(**_text(49152), **MOE) if moe else Qwen3Config(**_text(49152))


def tiny_qwen3_dir(moe: bool = False) -> Path:
    """The ``tiny-qwen3`` (``tiny-qwen3-moe``) folder, built into the model cache once."""
    from transformers import AutoTokenizer

    from relax.trainer.model_store import cache_dir, publish_folder, smollm2_tokenizer_dir

    def build(tmp: Path) -> None:
        from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(QWEN_SEED)
            cls = Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM
            model = cls(tiny_qwen3_config(moe)).float()
        model.generation_config.eos_token_id = 2
        model.generation_config.pad_token_id = 2
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(smollm2_tokenizer_dir()).save_pretrained(tmp)

    name = "tiny-qwen3-moe" if moe else "tiny-qwen3"
    return publish_folder(build, cache_dir() / "models" / name)


def tiny_qwen25_vl_config(vocab_size: int, token_ids: dict[str, int]):
    """``Qwen2_5_VLConfig`` of ``tiny-qwen2.5-vl`` (see the module docstring);
    ``token_ids``: the ids of :data:`VISION_TOKENS`."""
    from transformers import Qwen2_5_VLConfig

    text = _text(vocab_size)
    text["tie_word_embeddings"] = False
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [2, 3, 3]}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=text["hidden_size"], patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"])


def tiny_qwen3_vl_config(vocab_size: int, token_ids: dict[str, int]):
    """``Qwen3VLConfig`` of ``tiny-qwen3-vl`` (see the module docstring);
    ``token_ids``: the ids of :data:`VISION_TOKENS`."""
    from transformers import Qwen3VLConfig

    text = _text(vocab_size)
    text["tie_word_embeddings"] = False
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [4, 2, 2]}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=text["hidden_size"], patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0])
    return Qwen3VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"])


def _vl_dir(name: str, patch: int, size: int, processor: str, videos: str, video_size: dict,
            model: str, config) -> Path:
    """A tiny Qwen VL folder: the SmolLM2 tokenizer with :data:`VISION_TOKENS`, the
    transformers ``processor`` class over ``Qwen2VLImageProcessor`` (images resized to
    ``size`` x ``size``, ``patch`` pixels a patch, merge 2) and the ``videos`` processor
    class (``video_size`` its pixel budget; frames taken as given, not re-sampled), and
    the ``model`` class built from ``config(vocab_size, token_ids)``."""
    import transformers

    from relax.trainer.model_store import cache_dir, publish_folder, smollm2_tokenizer_dir
    from relax.trainer.vlm import smollm2_template

    def build(tmp: Path) -> None:
        template = smollm2_template(VL_PLACEHOLDERS)
        tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
        tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
        tok.chat_template = template
        grid = dict(patch_size=patch, merge_size=2, temporal_patch_size=2)
        images = transformers.Qwen2VLImageProcessor(min_pixels=size * size,
                                                    max_pixels=size * size, **grid)
        clips = getattr(transformers, videos)(do_sample_frames=False, cap_pixels_per_frame=False,
                                              size=video_size, **grid)
        proc = getattr(transformers, processor)(
            image_processor=images, tokenizer=tok, chat_template=template,
            video_processor=clips)
        ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(QWEN_SEED)
            net = getattr(transformers, model)(config(len(tok), ids)).float()
        net.generation_config.eos_token_id = 2
        net.generation_config.pad_token_id = 2
        net.save_pretrained(tmp, safe_serialization=True)
        proc.save_pretrained(tmp)

    return publish_folder(build, cache_dir() / "models" / f"{name}-r{VL_REVISION}")


def tiny_qwen25_omni_config(vocab_size: int, token_ids: dict[str, int]):
    """``Qwen2_5OmniThinkerConfig`` of ``tiny-qwen2.5-omni`` (see the module docstring);
    ``token_ids``: the ids of :data:`OMNI_TOKENS`' tokens, by their names."""
    from transformers import Qwen2_5OmniThinkerConfig

    text = _text(vocab_size)
    text["tie_word_embeddings"] = False
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [2, 3, 3]}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=text["hidden_size"], patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    audio = dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                 num_mel_bins=80, max_source_positions=OMNI_CLIP_SECONDS * 50, n_window=50,
                 output_dim=text["hidden_size"])
    return Qwen2_5OmniThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio, tie_word_embeddings=False,
        image_token_index=token_ids["image_token"], video_token_index=token_ids["video_token"],
        audio_token_index=token_ids["audio_token"],
        vision_start_token_id=token_ids["vision_bos_token"],
        vision_end_token_id=token_ids["vision_eos_token"],
        audio_start_token_id=token_ids["audio_bos_token"],
        audio_end_token_id=token_ids["audio_eos_token"])


def _omni_dir(name: str, placeholders: dict, tokens: dict, patch: int, image_size: int,
              video_size: dict, mel_bins: int, processor: str, model: str, config) -> Path:
    """The folder of an Omni thinker ``name`` (thinker, tokenizer, processor), built into
    the model cache once: the SmolLM2 tokenizer with ``tokens`` and a template writing
    ``placeholders``, the ``processor`` class over Qwen2-VL image and video processors
    (``patch`` px patches, images ``image_size`` px square, ``video_size`` frames) and a
    Whisper feature extractor of ``mel_bins`` bins, and the ``model`` class made from
    ``config(vocab_size, token_ids)``."""
    import transformers

    from relax.trainer.model_store import cache_dir, publish_folder, smollm2_tokenizer_dir
    from relax.trainer.vlm import smollm2_template

    def build(tmp: Path) -> None:
        template = smollm2_template(placeholders)
        tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir(),
                                                         extra_special_tokens=tokens)
        tok.chat_template = template
        grid = dict(patch_size=patch, merge_size=2, temporal_patch_size=2)
        proc = getattr(transformers, processor)(
            image_processor=transformers.Qwen2VLImageProcessor(
                min_pixels=image_size * image_size, max_pixels=image_size * image_size, **grid),
            video_processor=transformers.Qwen2VLVideoProcessor(
                do_sample_frames=False, cap_pixels_per_frame=False, size=video_size, **grid),
            feature_extractor=transformers.WhisperFeatureExtractor(
                feature_size=mel_bins, sampling_rate=16_000, chunk_length=OMNI_CLIP_SECONDS),
            tokenizer=tok, chat_template=template)
        ids = {key: tok.convert_tokens_to_ids(t) for key, t in tokens.items()}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(QWEN_SEED)
            net = getattr(transformers, model)(config(len(tok), ids)).float()
        net.generation_config.eos_token_id = 2
        net.generation_config.pad_token_id = 2
        net.save_pretrained(tmp, safe_serialization=True)
        proc.save_pretrained(tmp)

    return publish_folder(build, cache_dir() / "models" / name)


def tiny_qwen25_omni_dir() -> Path:
    """The ``tiny-qwen2.5-omni`` folder (thinker, tokenizer, processor), built into the
    model cache once."""
    return _omni_dir("tiny-qwen2.5-omni", OMNI_PLACEHOLDERS, OMNI_TOKENS, 14,
                     QWEN25_VL_IMAGE_SIZE, QWEN25_VL_VIDEO_SIZE, 80, "Qwen2_5OmniProcessor",
                     "Qwen2_5OmniThinkerForConditionalGeneration", tiny_qwen25_omni_config)


def tiny_qwen3_omni_config(vocab_size: int, token_ids: dict[str, int]):
    """``Qwen3OmniMoeThinkerConfig`` of ``tiny-qwen3-omni`` (see the module docstring);
    ``token_ids``: the ids of :data:`OMNI3_TOKENS`' tokens, by their names."""
    from transformers import Qwen3OmniMoeThinkerConfig

    text = {**_text(vocab_size), **MOE}
    text["tie_word_embeddings"] = False
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [4, 2, 2],
                               "interleaved": True}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=text["hidden_size"], patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0])
    audio = dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                 num_mel_bins=128, n_window=50, downsample_hidden_size=16,
                 max_source_positions=13, output_dim=text["hidden_size"])
    return Qwen3OmniMoeThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio, tie_word_embeddings=False,
        position_id_per_seconds=OMNI3_POSITIONS_PER_SECOND,
        image_token_id=token_ids["image_token"], video_token_id=token_ids["video_token"],
        audio_token_id=token_ids["audio_token"],
        vision_start_token_id=token_ids["vision_bos_token"],
        vision_end_token_id=token_ids["vision_eos_token"],
        audio_start_token_id=token_ids["audio_bos_token"],
        audio_end_token_id=token_ids["audio_eos_token"])


def tiny_qwen3_omni_dir() -> Path:
    """The ``tiny-qwen3-omni`` folder (thinker, tokenizer, processor), built into the
    model cache once."""
    return _omni_dir("tiny-qwen3-omni", OMNI3_PLACEHOLDERS, OMNI3_TOKENS, 16,
                     QWEN3_VL_IMAGE_SIZE, QWEN3_OMNI_VIDEO_SIZE, 128, "Qwen3OmniMoeProcessor",
                     "Qwen3OmniMoeThinkerForConditionalGeneration", tiny_qwen3_omni_config)


def tiny_qwen25_vl_dir() -> Path:
    """The ``tiny-qwen2.5-vl`` folder (model, tokenizer, processor), built into the model
    cache once."""
    return _vl_dir("tiny-qwen2.5-vl", 14, QWEN25_VL_IMAGE_SIZE, "Qwen2_5_VLProcessor",
                   "Qwen2VLVideoProcessor", QWEN25_VL_VIDEO_SIZE,
                   "Qwen2_5_VLForConditionalGeneration",
                   tiny_qwen25_vl_config)


def tiny_qwen3_vl_dir() -> Path:
    """The ``tiny-qwen3-vl`` folder (model, tokenizer, processor), built into the model
    cache once."""
    return _vl_dir("tiny-qwen3-vl", 16, QWEN3_VL_IMAGE_SIZE, "Qwen3VLProcessor",
                   "Qwen3VLVideoProcessor", QWEN3_VL_VIDEO_SIZE, "Qwen3VLForConditionalGeneration",
                   tiny_qwen3_vl_config)


__all__ = [
    "MOE",
    "OMNI3_PLACEHOLDERS",
    "OMNI3_POSITIONS_PER_SECOND",
    "OMNI3_TOKENS",
    "OMNI_CLIP_SECONDS",
    "OMNI_PLACEHOLDERS",
    "OMNI_TOKENS",
    "QWEN3_OMNI_VIDEO_SIZE",
    "QWEN3_VL_IMAGE_SIZE",
    "QWEN3_VL_VIDEO_SIZE",
    "QWEN25_VL_IMAGE_SIZE",
    "QWEN25_VL_VIDEO_SIZE",
    "QWEN_SEED",
    "VISION_TOKENS",
    "VL_PLACEHOLDERS",
    "VL_REVISION",
    "tiny_qwen3_config",
    "tiny_qwen3_dir",
    "tiny_qwen3_omni_config",
    "tiny_qwen3_omni_dir",
    "tiny_qwen3_vl_config",
    "tiny_qwen3_vl_dir",
    "tiny_qwen25_omni_config",
    "tiny_qwen25_omni_dir",
    "tiny_qwen25_vl_config",
    "tiny_qwen25_vl_dir",
]
