"""Cores shared by co-located stages: the trainer takes a second core while the rollout
engine on the same host is not generating.

On a small host the two busy stages of an async run are the rollout (generation) and
the trainer (forward/backward), one core each. When the trainer's step costs more
than the rollout's generation (SmolLM2-135M on 2 CPU cores: ~21 s against ~7 s per
64 samples), the rollout finishes its batch and idles for the rest of the step while
the trainer goes on with one core. Two fixed threads for the trainer do not help:
three threads on two cores make its OpenMP regions wait for the preempted thread
(measured: 26.7 s per step, against 21.7 s with one thread).

So the rollout marks its engine calls with a :class:`BusyFlag` (a file that exists
while it generates) and the trainer's :class:`ElasticThreads` sets torch's intra-op
threads to ``low`` while any flag of the folder exists and to ``high`` otherwise,
checked between the model's layers in forward and backward (at most every
``interval_s``). Only stages on the same host share flags: each host has its own
sub-folder (:func:`host_folder`, named by :func:`node_address`), so a rollout on
another host that writes into a shared run folder never slows this host's trainer.
A flag left by a killed process only costs speed until its stage restarts (the new
BusyFlag removes it).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path


def node_address() -> str:
    """The address other hosts reach this process at: the Ray node's IP when this process
    is a Ray worker (the address the cluster's nodes registered with), else 127.0.0.1."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def host_folder(folder: str | Path, host: str | None = None) -> Path:
    """The flag folder of ``host`` (default :func:`node_address`) under the run's flag
    folder ``folder``: ``<folder>/<host>`` (``:`` of an IPv6 address as ``_``)."""
    return Path(folder) / (host or node_address()).replace(":", "_")


class BusyFlag:
    """A file ``<folder>/<name>.busy`` that exists while ``with flag.busy():`` runs.

    Args:
        folder: the folder shared with the trainer (created).
        name: unique per process on the host (e.g. the engine_id).
    """

    def __init__(self, folder: str | Path, name: str):
        self.path = Path(folder) / f"{name}.busy"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # left by a killed predecessor

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Mark the enclosed block as busy (creates, then removes the file)."""
        self.path.touch()
        try:
            yield
        finally:
            self.path.unlink(missing_ok=True)


class ElasticThreads:
    """torch intra-op threads: ``low`` while any ``*.busy`` file of ``folder`` exists,
    ``high`` otherwise.

    Args:
        folder: the flag folder (need not exist yet).
        low: threads while another stage is busy (>= 1).
        high: threads while none is (>= low).
        interval_s: at most one folder check per this many seconds.

    Raises:
        ValueError: ``low < 1`` or ``high < low``.
    """

    def __init__(self, folder: str | Path, low: int, high: int, interval_s: float = 0.01):
        if low < 1 or high < low:
            raise ValueError(f"need 1 <= low <= high, got low={low} high={high}")
        self.folder = str(folder)
        self.low, self.high, self.interval_s = low, high, interval_s
        self._next = 0.0
        self.current: int | None = None
        self.switches = 0
        self.seconds = {low: 0.0, high: 0.0}  # time spent at each setting (seconds)
        self._since = time.monotonic()

    def _other_busy(self) -> bool:
        try:
            with os.scandir(self.folder) as it:
                return any(e.name.endswith(".busy") for e in it)
        except FileNotFoundError:
            return False

    def update(self) -> int:
        """Check the flags (throttled) and set torch's threads; returns the setting."""
        now = time.monotonic()
        if now < self._next and self.current is not None:
            return self.current
        self._next = now + self.interval_s
        want = self.low if self._other_busy() else self.high
        if want != self.current:
            import torch

            if self.current is not None:
                self.seconds[self.current] += now - self._since
                self.switches += 1
            self._since = now
            torch.set_num_threads(want)
            self.current = want
        return want

    def seconds_at(self, threads: int) -> float:
        """Seconds spent at setting ``threads`` so far (since the first :meth:`update`)."""
        extra = time.monotonic() - self._since if self.current == threads else 0.0
        return self.seconds.get(threads, 0.0) + extra

    def install(self, model) -> list:
        """Call :meth:`update` before every leaf module's forward and after each
        parameter's gradient is accumulated in backward. Returns the hook handles."""
        def hook(*_) -> None:  # a forward pre-hook's return value would replace the input
            self.update()

        handles = []
        for m in model.modules():
            if next(m.children(), None) is None:
                handles.append(m.register_forward_pre_hook(hook))
        for p in model.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(hook))
        return handles


__all__ = ["BusyFlag", "ElasticThreads", "host_folder", "node_address"]
