"""glibc malloc settings for the stage processes: keep freed memory in the process.

A training step allocates and frees the same large buffers every step (logits, hidden
states, gradients, the AdamW update's temporaries; ~100 MB each for SmolLM2-135M). With
glibc's defaults every buffer over the mmap threshold (32 MB at most) is a fresh
``mmap`` that is ``munmap``-ed on free, and a stage's step runs in a Ray actor's worker
thread, whose malloc arena serves anything over its 64 MB heaps the same way: each step
page-faults its whole working set back in. Measured on the 2-vCPU machine
(``benchmarks/JOURNAL.md``): 350k-420k minor page faults and 2.6-3.3 s of kernel time in
a steady 40-48-row train step of the trainer stage, 1M faults and ~14 s in each of the
first two steps.

:data:`RETAIN` makes every thread use the main arena (``MALLOC_ARENA_MAX=1``), serves
large blocks from the heap instead of ``mmap`` (``MALLOC_MMAP_MAX_=0``) and never gives
the heap's top back to the kernel (``MALLOC_TRIM_THRESHOLD_`` 64 GiB): after the first
steps a process reuses its memory with no page faults (the trainer stage: 0-17 faults and
0.4 s of kernel time a step). The price: a process's RSS stays at its peak plus the
heap's fragmentation (``tests/infra/test_allocator.py``: a 237 MB working set settles
after 2-4 rounds, 240-440 MB above the default's RSS; the fragmentation now and then
grows the heap by one buffer again in a later round). glibc reads these when a process starts,
so :func:`retain_freed_memory` sets them in the environment a local Ray cluster and its
workers inherit when it starts; a value already set wins (``MALLOC_ARENA_MAX=8`` restores several
arenas, say). On a cluster started with ``ray start``, set them where the nodes start.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import MutableMapping

RETAIN = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0",
          "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}
"""glibc tunables (environment variables read at process start) of the module docstring."""


@contextlib.contextmanager
def retain_freed_memory(environ: MutableMapping[str, str] = os.environ):
    """Within the block, ``environ`` has :data:`RETAIN` where a key was not set: the
    processes started meanwhile (a local Ray's raylet, hence every worker it forks) get
    them; the keys it added are removed afterwards, so the caller's own later children do
    not. Yields the values in effect for those keys."""
    added = {k: v for k, v in RETAIN.items() if k not in environ}
    environ.update(added)
    try:
        yield {k: environ[k] for k in RETAIN}
    finally:
        for k in added:
            environ.pop(k, None)
