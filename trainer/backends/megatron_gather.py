"""The megatron back end's model-parallel shards gathered to rank 0: over each pipeline
stage's TP group to its TP rank 0 (:func:`gather_tp`), then over the pipeline group of TP
rank 0 to the first stage (:func:`gather_pp`). What rank 0 gets, ``[stage][tp rank]``
``{megatron name: tensor}``, :func:`.megatron_convert.from_stages` and
:func:`.megatron_convert.megatron_to_hf` turn into the HF dict the weight channel
publishes. Replicated tensors (the norms) come from TP rank 0 only, never sent."""

from __future__ import annotations

import torch
import torch.distributed as dist

from relax.trainer.backends.megatron_convert import Layout, replicated, to_stage
from relax.trainer.backends.megatron_pipeline import Link


def stage_shapes(shards: list[dict[str, torch.Tensor]], lay: Layout, pp: int
                 ) -> list[list[dict[str, torch.Size]]]:
    """``[stage][tp rank]{name: shape}`` of what :func:`gather_pp` receives from each
    stage, from the TP shards of the whole model (:func:`.megatron_convert.hf_to_megatron`):
    the names and shapes are fixed, so only tensors cross the pipeline group."""
    return [[{n: t.shape for n, t in to_stage(sh, lay, pp, st).items()
              if r == 0 or not replicated(n)} for r, sh in enumerate(shards)]
            for st in range(pp)]


def gather_tp(local: dict[str, torch.Tensor], group, tp: int
              ) -> list[dict[str, torch.Tensor]]:
    """This stage's TP shards ``[tp rank]{megatron name: tensor}`` on its TP rank 0 (``[]``
    on the others). A collective over the TP ``group`` (size ``tp``)."""
    if tp == 1:
        return [{k: v.detach().clone() for k, v in local.items()}]
    rank = dist.get_rank(group)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name in sorted(local):
        t = local[name].detach().contiguous()
        if replicated(name):
            shards[0][name] = t.clone()
            continue
        parts = [torch.empty_like(t) for _ in range(tp)] if rank == 0 else None
        dist.gather(t, parts, dst=dist.get_global_rank(group, 0), group=group)
        if rank == 0:
            for r, part in enumerate(parts):
                shards[r][name] = part
    return shards if rank == 0 else []


def gather_pp(shards: list[dict[str, torch.Tensor]], link: Link,
              shapes: list[list[dict[str, torch.Size]]], dtype: torch.dtype
              ) -> list[list[dict[str, torch.Tensor]]]:
    """Each stage's TP shards (:func:`gather_tp`, on its TP rank 0) -> the first stage gets
    ``[stage][tp rank]``; the others ``[]``. Point-to-point in ``link``'s pipeline group,
    the tensors in sorted name order; ``shapes``: :func:`stage_shapes`; ``dtype``: the
    tensors' (the model's; the AdamW moments share it)."""
    if link.stages == 1:
        return [shards]
    if not link.first:
        for part in shards:
            for name in sorted(part):
                dist.send(part[name].contiguous(), link.ranks[0], group=link.group)
        return []
    parts = [shards]
    for stage in range(1, link.stages):
        got: list[dict[str, torch.Tensor]] = []
        for expected in shapes[stage]:
            got.append({})
            for name in sorted(expected):
                got[-1][name] = torch.empty(expected[name], dtype=dtype, device=link.device)
                dist.recv(got[-1][name], link.ranks[stage], group=link.group)
        parts.append(got)
    return parts
