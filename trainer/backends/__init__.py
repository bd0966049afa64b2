"""Trainer back ends, chosen when the trainer is built: ``torch`` (HF model; CPU or
GPU; DDP or FSDP2 over gloo/nccl) and ``megatron`` (megatron-core, tensor parallel; CPU
or GPU; imported lazily: the ``megatron`` install extra).
"""

from __future__ import annotations


def build_backend(cfg, **kwargs):
    """The back end named by ``cfg.backend``.

    Raises:
        ValueError: for an unknown name (lists the valid ones).
        ImportError: ``megatron`` without megatron-core installed.
    """
    if cfg.backend == "torch":
        from relax.trainer.backends.torch_backend import TorchBackend

        return TorchBackend(cfg, **kwargs)
    if cfg.backend == "megatron":
        from relax.trainer.backends.megatron_backend import MegatronBackend

        return MegatronBackend(cfg, **kwargs)
    raise ValueError(f"unknown trainer backend {cfg.backend!r}; valid: torch, megatron")
