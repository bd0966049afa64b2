"""megatron-core back end (TP/PP/CP/EP): not implemented in this release.

The weight conversion it needs is built and checked against megatron-core's own
GPTModel (:mod:`relax.trainer.backends.megatron_convert`, ``tests/trainer/test_megatron.py``).
The training step is not: the recipe value ``trainer.backend: megatron`` reaches here
and fails with a clear error instead of silently running something else.
"""

from __future__ import annotations


class MegatronBackend:
    """Placeholder that refuses to start (see the module docstring)."""

    def __init__(self, cfg, **kwargs):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("trainer.backend=megatron needs CUDA GPUs; use backend=torch on CPU")
        raise NotImplementedError("the megatron back end is not implemented yet; use backend=torch")
