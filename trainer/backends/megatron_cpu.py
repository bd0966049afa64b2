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
  ``model_parallel_cuda_manual_seed``, which calls ``torch.cuda.manual_seed``.

The redirect makes ``torch.cuda.current_device()`` answer ``"cpu"`` and hands
megatron-core a tracker whose ``fork()`` does nothing (relax trains with dropout 0, so
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

    torch.cuda.current_device = lambda: "cpu"
    tracker = _NoRngTracker()
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: tracker
    return True
