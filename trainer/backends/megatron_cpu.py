"""The CUDA redirect that lets megatron-core's GPTModel train on the CPU: the ONE place
relax patches megatron-core, applied only in a process that builds the megatron back end
and has no CUDA device (:func:`redirect_cuda_to_cpu`).

megatron-core 0.16.1 assumes CUDA in two places a CPU forward/backward reaches (with
``use_cpu_initialization=True``, the local layer spec, no fusions, an explicit attention
mask):

* ``RotaryEmbedding.get_emb`` moves its ``inv_freq`` to ``torch.cuda.current_device()``
  at the first forward (and ``torch.cuda.current_device()`` is a device argument in a
  few other tensor constructors on that path);
* ``DotProductAttention.forward`` forks the CUDA RNG tracker around attention dropout
  (``tensor_parallel.get_cuda_rng_tracker().fork()``), whose states exist only after
  ``model_parallel_cuda_manual_seed``, which calls ``torch.cuda.manual_seed``;
* activation recompute (``trainer.gradient_checkpointing``: megatron-core's
  ``CheckpointFunction``) saves and restores the CUDA RNG state around each recomputed
  block (``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``).

The redirect makes ``torch.cuda.current_device()`` answer ``"cpu"``, hands
megatron-core a tracker whose ``fork()`` does nothing and makes the CUDA RNG state
``None`` to save and nothing to restore (relax trains with dropout 0, so
there is no RNG stream to keep apart; a recipe with dropout is refused by
:func:`relax.trainer.backends.megatron_model.transformer_config`). Everything else of
the CPU path is megatron-core's own code. Its pipeline schedules and distributed
optimizer assume CUDA streams and buffers and are not redirected: pipeline parallelism
runs relax's own schedule (:mod:`.megatron_pipeline`), on the CPU and on GPUs.
"""

from __future__ import annotations

import contextlib

import torch


class _NoRngTracker:
    """``get_cuda_rng_tracker()``'s stand-in on the CPU: ``fork()`` is a no-op context."""

    def fork(self, name: str | None = None):
        return contextlib.nullcontext()


def redirect_cuda_to_cpu() -> bool:
    """Apply the redirect (module docstring) when no CUDA device is visible; idempotent.

    Returns:
        True when the redirect is in effect (CPU), False with CUDA (nothing changed).
    """
    if torch.cuda.is_available():
        return False
    from megatron.core import tensor_parallel

    from megatron.core.tensor_parallel import random as tp_random

    torch.cuda.current_device = lambda: "cpu"
    tracker = _NoRngTracker()
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: tracker
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: None
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    return True
