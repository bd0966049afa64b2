"""Pipeline parallelism for the megatron back end: relax's own non-interleaved 1F1B
schedule over point-to-point sends in the pipeline group (gloo on the CPU, nccl on GPUs).

megatron-core 0.16.1's schedules (``forward_backward_pipelining_without_interleaving``)
allocate on ``"cuda"`` inside the schedule and expect its DDP wrapper's gradient
buffers, so they do not run on the CPU; the back end drives megatron-core's model
pieces itself (:mod:`.megatron_model`), and this module orders them across stages.

The order is 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", section 2.2; :func:`one_f_one_b`): stage ``s`` of
``p`` runs ``min(p - s - 1, n)`` warm-up forwards, then alternates one forward and one
backward, then the remaining backwards, so at most ``p - s`` micro-batches' activations
are alive on it. Sends are asynchronous (waited at the end of the schedule), receives
block; each stage's receives are matched in order by its neighbour's sends, and the
1F1B order has no cycle between neighbours, so the schedule cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def one_f_one_b(n: int, stage: int, stages: int) -> list[tuple[str, int]]:
    """The 1F1B order of stage ``stage`` of ``stages`` over ``n`` micro-batches:
    ``[("F", i) | ("B", i), ...]`` (module docstring). One stage: F0 B0 F1 B1 ..."""
    warm = min(stages - stage - 1, n)
    order = [("F", i) for i in range(warm)]
    for i in range(n - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(n - warm, n)]


class Link:
    """This rank's place in its pipeline group and its sends to and receives from the
    neighbouring stages (ranks of the same tensor-parallel rank).

    Args:
        group: the pipeline-parallel process group (``None``: a pipeline of one stage).
        device: where received tensors are allocated.
    """

    def __init__(self, group, device: torch.device):
        ranks = dist.get_process_group_ranks(group) if group is not None else [0]
        self.stage = ranks.index(dist.get_rank()) if group is not None else 0
        self.stages, self.ranks, self.group, self.device = len(ranks), ranks, group, device
        self._sends: list = []

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def send(self, t: torch.Tensor, step: int) -> None:
        """Send ``t`` (detached) to the stage ``step`` (+1 or -1) away; not waited here
        (sends already done are waited, raising a failed one's error, and dropped with
        their tensors)."""
        pending = []
        for work, kept in self._sends:
            if work.is_completed():
                work.wait()
            else:
                pending.append((work, kept))
        self._sends = pending
        t = t.detach().contiguous()
        self._sends.append((dist.isend(t, self.ranks[self.stage + step], group=self.group), t))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, step: int) -> torch.Tensor:
        """Receive a ``shape`` tensor from the stage ``step`` (+1 or -1) away (blocks)."""
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, self.ranks[self.stage + step], group=self.group)
        return buf

    def wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()


def train_schedule(link: Link, shapes: list[tuple[int, ...]], dtype: torch.dtype,
                   forward: Callable[[int, torch.Tensor | None], torch.Tensor]) -> None:
    """Forward and backward of ``len(shapes)`` micro-batches through the pipeline in 1F1B
    order; gradients accumulate in this stage's parameters.

    Args:
        link: this rank's stage (:class:`Link`).
        shapes: ``[S, B, H]`` of the activations each micro-batch passes between stages.
        dtype: their dtype (the model's).
        forward: ``forward(i, x)``: micro-batch ``i`` through this stage given the
            previous stage's output ``x`` (None on the first stage); returns the
            activations to send on, or on the last stage the scalar loss to backpropagate.
    """
    kept: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    for kind, i in one_f_one_b(len(shapes), link.stage, link.stages):
        if kind == "F":
            x = None if link.first else link.recv(shapes[i], dtype, -1).requires_grad_()
            out = forward(i, x)
            if not link.last:
                link.send(out, +1)
            kept[i] = (x, out)
            continue
        x, out = kept.pop(i)
        if link.last:
            out.backward()
        else:
            torch.autograd.backward(out, link.recv(shapes[i], dtype, +1))
        if not link.first:
            link.send(x.grad, -1)
    link.wait_sends()


def forward_schedule(link: Link, shapes: list[tuple[int, ...]], dtype: torch.dtype,
                     forward: Callable[[int, torch.Tensor | None], object]) -> list:
    """Forward only (no gradients), micro-batch by micro-batch: the last stage's
    ``forward`` results in order (``[]`` on the other stages); arguments as
    :func:`train_schedule`."""
    results = []
    with torch.no_grad():
        for i, shape in enumerate(shapes):
            x = None if link.first else link.recv(shape, dtype, -1)
            out = forward(i, x)
            if link.last:
                results.append(out)
            else:
                link.send(out, +1)
    link.wait_sends()
    return results
