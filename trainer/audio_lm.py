"""``tiny-audio``: a small audio language model built offline, for tests and CPU recipes.

No pretrained audio LM can be downloaded on relax's machines, so the model is built from
transformers' own classes of the Qwen2-Audio family: a 2-layer Whisper-style audio
encoder (80 log-mel bins, two convolutions, the second with stride 2, then a stride-2
average pool: 25 audio tokens per second) over clips of at most :data:`CLIP_SECONDS`
seconds, a linear projector, and a 2-layer Llama text model (``tiny-llama``'s shape) with
random weights (seed :data:`AUDIO_SEED`, so bit-identical everywhere), and the real
SmolLM2 tokenizer with Qwen2-Audio's three audio tokens added (ids 49152-49154).

Its processor is transformers' ``Qwen2AudioProcessor`` (``WhisperFeatureExtractor`` at
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

    from relax.trainer.models import _TINY_CONFIG

    text = dict(model_type="llama", vocab_size=vocab_size, bos_token_id=1, eos_token_id=2,
                pad_token_id=2, **_TINY_CONFIG)
    text["tie_word_embeddings"] = False  # Qwen2-Audio keeps its own lm_head
    frames = CLIP_SECONDS * RATE // 160  # Whisper: a 10 ms hop
    audio = dict(model_type="qwen2_audio_encoder", d_model=32, encoder_layers=2,
                 encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=80,
                 max_source_positions=frames // 2)  # after the stride-2 convolution
    return Qwen2AudioConfig(audio_config=audio, text_config=text,
                            audio_token_id=audio_token_id)


def tiny_audio_dir() -> Path:
    """The ``tiny-audio`` folder (model, tokenizer, processor), built into the model cache
    once."""
    from relax.trainer.models import _publish, cache_dir, smollm2_tokenizer_dir
    from relax.trainer.vlm import smollm2_template

    def build(tmp: Path) -> None:
        from transformers import (
            AutoTokenizer,
            Qwen2AudioForConditionalGeneration,
            Qwen2AudioProcessor,
            WhisperFeatureExtractor,
        )

        tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
        tok.add_special_tokens({"additional_special_tokens": AUDIO_TOKENS})
        template = smollm2_template("audio", "<|audio_bos|><|AUDIO|><|audio_eos|>")
        tok.chat_template = template
        features = WhisperFeatureExtractor(feature_size=80, sampling_rate=RATE,
                                           chunk_length=CLIP_SECONDS)
        proc = Qwen2AudioProcessor(feature_extractor=features, tokenizer=tok,
                                   chat_template=template)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(AUDIO_SEED)
            model = Qwen2AudioForConditionalGeneration(
                tiny_audio_config(len(tok), tok.convert_tokens_to_ids("<|AUDIO|>"))).float()
        model.generation_config.eos_token_id = 2
        model.generation_config.pad_token_id = 2
        model.save_pretrained(tmp, safe_serialization=True)
        proc.save_pretrained(tmp)

    return _publish(build, cache_dir() / "models" / "tiny-audio")


__all__ = ["AUDIO_TOKENS", "CLIP_SECONDS", "tiny_audio_config", "tiny_audio_dir"]
