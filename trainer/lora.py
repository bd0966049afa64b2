"""LoRA on the torch back end (``trainer.lora``), with ``peft``.

:func:`apply` puts low-rank adapters (Hu et al., arXiv 2106.09685) into the Hugging Face
model in place and freezes every base weight, so the optimizer holds only the adapters
(``A: [r, in]``, ``B: [out, r]`` per target layer; ``B`` starts at zero: the adapted model
starts equal to the base). What leaves the trainer:

* the weight channel: merged weights under the model's own names (:func:`merged`:
  ``W + (alpha / r) * B @ A`` for each adapted layer, the other tensors as they are), so an
  engine loads them like a full fine-tune's, under the same policy_version rules;
* checkpoints: only the adapters (peft's ``adapter_model.safetensors`` and
  ``adapter_config.json`` in ``adapter/``) and their optimizer state; a resumed trainer
  loads the base model by name and the adapters over it;
* ``final_model/``: the merged model (transformers folder) and ``final_model/adapter/``
  (``PeftModel.from_pretrained(base, "final_model/adapter")``).

Names: in the adapted model a target layer ``P`` holds ``P.base_layer.weight`` and
``P.lora_A.default.weight`` / ``P.lora_B.default.weight``; peft's saved files drop the
adapter name and prefix ``base_model.model.`` (:func:`to_peft_names`,
:func:`from_peft_names`).
"""

from __future__ import annotations

import torch

from relax.trainer.config import LoraConfig

ADAPTER = "default"
"""peft's name of the one adapter."""
ADAPTER_DIR = "adapter"
"""The adapter's folder inside a checkpoint and inside ``final_model/``."""
PEFT_PREFIX = "base_model.model."


def apply(model: torch.nn.Module, cfg: LoraConfig):
    """Add adapters to ``model``'s ``cfg.target_modules`` linear layers in place and
    freeze everything else; returns the ``peft.PeftModel`` that wraps it (what saves the
    adapter folder). ``model`` itself stays usable as before (same forward, same
    methods), now computing ``x @ (W + (alpha / r) B A)^T``.

    Raises:
        ValueError: a target name that is no linear layer of the model (lists some that
            are).
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear)})
    if cfg.target_modules == ("all-linear",):
        targets = "all-linear"
    else:
        unknown = [t for t in cfg.target_modules if t not in linear]
        if unknown:
            raise ValueError(f"trainer.lora.target_modules {unknown}: no linear layer of the "
                             f"model has that name; its linear layers are "
                             f"{', '.join(linear)} (or use ['all-linear'])")
        targets = list(cfg.target_modules)
    return get_peft_model(model, PeftLoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
        bias="none"))


def scales(model: torch.nn.Module) -> dict[str, float]:
    """``{layer name: alpha / r}`` of every adapted layer of ``model`` (names as in
    ``model.named_modules()``)."""
    from peft.tuners.lora import LoraLayer

    return {n: float(m.scaling[ADAPTER]) for n, m in model.named_modules()
            if isinstance(m, LoraLayer)}


def is_adapter(name: str) -> bool:
    """Whether a state-dict name is an adapter tensor (``...lora_A.default.weight``)."""
    return ".lora_" in name


@torch.no_grad()
def merged(state: dict[str, torch.Tensor], layer_scales: dict[str, float]) -> dict[str, torch.Tensor]:
    """The base model's state dict with the adapters folded in.

    Args:
        state: the adapted model's state dict (``P.base_layer.weight``,
            ``P.lora_A.default.weight`` ``[r, in]``, ``P.lora_B.default.weight``
            ``[out, r]``, and every other tensor under its own name).
        layer_scales: :func:`scales` of the model.

    Returns:
        ``{name: tensor}`` under the plain model's names: ``P.weight = W + s * (B @ A)``
        (a new tensor, in W's dtype), every other tensor the same object as in
        ``state`` (tied aliases stay aliases).
    """
    out = {k.replace(".base_layer.", "."): v for k, v in state.items() if not is_adapter(k)}
    for p, s in layer_scales.items():
        out[f"{p}.weight"] = _merge_layer(state, p, s)
    return out


def _merge_layer(state: dict[str, torch.Tensor], p: str, s: float) -> torch.Tensor:
    """``W + s * (B @ A)`` of target layer ``p`` (a new tensor in W's dtype)."""
    a = state[f"{p}.lora_A.{ADAPTER}.weight"]
    b = state[f"{p}.lora_B.{ADAPTER}.weight"]
    base = state[f"{p}.base_layer.weight"]
    return base + (b @ a).to(base.dtype) * s


def _sync(path) -> None:
    """Write ``path``'s dirty pages to disk now: a shard's bytes would otherwise wait in
    memory (up to the kernel's dirty ratio, gigabytes), where the memory they take counts
    against a run near its limit (Ray's memory monitor killed a 7B colocated trainer
    during its final save so)."""
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_merged(state: dict[str, torch.Tensor], layer_scales: dict[str, float],
                folder, max_shard_bytes: int = 1 << 28) -> list[str]:
    """Write :func:`merged` of ``state`` into ``folder`` as safetensors in Hugging Face's
    layout (``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` of at
    most ``max_shard_bytes`` bytes with ``model.safetensors.index.json``), merging each
    adapted layer only when its shard is written: the merged model is never whole in
    memory (with :func:`merged` it was a second copy of every adapted weight, 2.6 GB for
    a 1.5B model in bf16, at the end of each LoRA run), and each shard is synced to disk
    before the next is merged. Tied aliases (one storage under
    two names: a tied LM head) are written once, under the first name, as transformers
    saves them. Returns the file names written.

    Raises:
        OSError: ``folder`` cannot be written.
    """
    import json
    from pathlib import Path

    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shapes: dict[str, torch.Tensor] = {}  # merged name -> a tensor of its shape and dtype
    stored: set[tuple[int, int]] = set()
    for k, v in state.items():
        where = (v.untyped_storage().data_ptr(), v.storage_offset())
        if is_adapter(k) or where in stored:
            continue
        stored.add(where)
        shapes[k.replace(".base_layer.", ".")] = v
    adapted = {f"{p}.weight": (p, s) for p, s in layer_scales.items()}
    split = split_torch_state_dict_into_shards(shapes, max_shard_size=max_shard_bytes)
    for name, tensors in split.filename_to_tensors.items():
        shard = {t: _merge_layer(state, *adapted[t]) if t in adapted
                 else shapes[t].contiguous() for t in tensors}
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        del shard
        _sync(folder / name)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return list(split.filename_to_tensors)


def to_peft_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of an adapted model's state dict under the names peft's
    ``PeftModel.state_dict()`` uses (what ``save_pretrained(state_dict=...)`` takes)."""
    return {PEFT_PREFIX + k: v for k, v in state.items() if is_adapter(k)}


def from_peft_names(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors of a saved ``adapter_model.safetensors`` under the adapted model's
    state-dict names (prefix removed, adapter name put back)."""
    out = {}
    for k, v in saved.items():
        k = k.removeprefix(PEFT_PREFIX)
        head, _, leaf = k.rpartition(".")  # ...lora_A + weight
        out[f"{head}.{ADAPTER}.{leaf}"] = v
    return out
