"""Hand one verified weight version to whatever consumes it: :func:`install_weights`."""

from __future__ import annotations

import torch


def install_weights(target, named: dict[str, torch.Tensor], version: int) -> None:
    """Give ``named`` (name -> tensor, any shape/dtype, views of a receive buffer) to
    ``target``.

    An engine (has ``update_weights(named, policy_version)``) stages them itself and swaps
    at its own safe point. A ``torch.nn.Module`` has them copied into its parameters and
    buffers in place, once every name and shape is checked, so a bad update changes
    nothing.

    Raises:
        KeyError: a name the module does not have.
        ValueError: a shape that differs from the module's.
    """
    if hasattr(target, "update_weights"):
        target.update_weights(named, version)
        return
    own = dict(target.named_parameters(remove_duplicate=False))
    own.update(dict(target.named_buffers(remove_duplicate=False)))
    for name, t in named.items():
        if name not in own:
            raise KeyError(f"{name!r} is not a parameter or buffer of the model")
        if t.shape != own[name].shape:
            raise ValueError(f"{name}: received shape {tuple(t.shape)}, "
                             f"the model's is {tuple(own[name].shape)}")
    with torch.no_grad():
        for name, t in named.items():
            own[name].copy_(t)
