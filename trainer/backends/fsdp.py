"""FSDP2 for the torch back end's data-parallel ranks (``trainer.data_parallel: fsdp2``).

``torch.distributed.fsdp.fully_shard`` shards every parameter (and so its gradient and
its AdamW moments) over the ranks along dim 0: each decoder layer is its own group
(gathered for its forward and backward, resharded after) and the root
(:class:`~relax.trainer.backends.torch_backend.ResponseLogprobs`) holds the rest
(embeddings, final norm, LM head). Gradients are reduce-scattered (averaged, as DDP
all-reduces), so the same loss scaling serves both. Works over gloo on the CPU and
nccl on GPUs (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html).

What the rest of relax sees stays the same: rank 0 publishes and checkpoints full,
unsharded HF tensors. Those come from collectives every rank takes part in
(``torch.distributed.checkpoint.state_dict``, ``full_state_dict`` + ``cpu_offload``:
rank 0 receives everything, the others nothing), run by the back end at points where
every rank is anyway: after each optimizer step, and in ``broadcast_state``.
Checkpoints keep the single-process format (HF safetensors + a torch optimizer
``state_dict`` keyed by parameter index), so a run may switch between 1 process, DDP
and FSDP2 across a restart: :func:`to_fqn_optimizer_state` and
:func:`to_index_optimizer_state` convert between that format and the name-keyed one
the state-dict API speaks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def shard(module: torch.nn.Module, layers: list[torch.nn.Module], device: torch.device) -> None:
    """``fully_shard`` each of ``layers`` then ``module`` (the root) over every rank of
    the default process group (a 1-D device mesh on ``device``'s type), in place.
    Every rank must hold the same weights before (FSDP2 shards what each rank has)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (``model.model.layers`` for the
    Llama/Qwen2 families), [] when it has none there (then only the root is sharded)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    return list(getattr(base, "layers", []) or [])


def set_gradient_sync(module: torch.nn.Module, sync: bool) -> None:
    """Whether the next backward reduce-scatters gradients (FSDP2's counterpart of DDP's
    ``no_sync``: off for every micro-batch but the last of a step)."""
    module.set_requires_gradient_sync(sync)


def full_model_state(module: torch.nn.Module, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The unsharded weights on rank 0 (CPU tensors named as in the HF model: ``prefix``
    stripped), ``{}`` on the others. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True,
                                                               cpu_offload=True))
    return {k.removeprefix(prefix): v for k, v in sd.items()}


def full_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The unsharded optimizer state on rank 0 in ``Optimizer.state_dict()``'s own
    format (keyed by parameter index, :func:`to_index_optimizer_state`), ``{}`` on the
    others. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    sd = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return {}
    return to_index_optimizer_state(sd, trained_names(module))


def load_full_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    model_state: dict[str, torch.Tensor] | None, optimizer_state: dict | None,
                    prefix: str = "model.") -> None:
    """Give every rank its shards of rank 0's full ``model_state`` (HF names) and
    ``optimizer_state`` (index-keyed, as saved); the other ranks pass None. A
    collective: every rank calls it. ``model_state`` may lack tied weights (a tied LM
    head): they stay tied to what is loaded."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    names = trained_names(module)
    msd = {} if model_state is None else {prefix + k: v for k, v in model_state.items()}
    # not strict: a tied LM head is not in a checkpoint (its names were checked on load)
    set_model_state_dict(module, msd, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=False))
    osd = {} if optimizer_state is None else to_fqn_optimizer_state(optimizer_state, names)
    set_optimizer_state_dict(module, optimizer, osd, options=opts)


def trained_names(module: torch.nn.Module) -> list[str]:
    """Names of ``module``'s parameters that require a gradient, in ``named_parameters()``
    order: the optimizer's parameters and their order (frozen ones, ``trainer.freeze`` or
    a LoRA base model, are not in it)."""
    return [n for n, p in module.named_parameters() if p.requires_grad]


def to_index_optimizer_state(state: dict, names: list[str]) -> dict:
    """A name-keyed optimizer state (``{"state": {name: {...}}, "param_groups":
    [{"params": [name, ...], ...}]}``) keyed by parameter index instead, the index of a
    name being its place in ``names`` (:func:`trained_names`: the optimizer's
    parameter order).

    Raises:
        KeyError: a name not in ``names``.
    """
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: s for n, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                             for g in state["param_groups"]]}


def to_fqn_optimizer_state(state: dict, names: list[str]) -> dict:
    """The inverse of :func:`to_index_optimizer_state`.

    Raises:
        IndexError: an index beyond ``names``.
    """
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                             for g in state["param_groups"]]}
