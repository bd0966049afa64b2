"""Gradient (activation) checkpointing of the torch back end's Hugging Face model
(``trainer.gradient_checkpointing: true``).

Each decoder layer keeps only its input in the forward and recomputes its activations in
the backward (transformers' ``gradient_checkpointing_enable`` with
``use_reentrant=False``, i.e. ``torch.utils.checkpoint``'s saved-tensor hooks): activation
memory drops from every intermediate of every layer to one ``[rows, tokens, hidden]``
tensor per layer, for about one more forward of compute. Gradients are those of the run
without it (the recompute is the same arithmetic).

The back end's forward (:func:`relax.trainer.backends.torch_backend.response_logits`) runs
each group's prompt once and the responses on a key/value cache of it. transformers drops
a cache that reaches a checkpointed layer, because a cache that appends would be appended
twice when the layer is recomputed. :class:`PrefixCache` does not append in place: layer
``i``'s keys are always ``cat(prefix_i, new)``, a pure function of what the layer is given,
so the recompute sees the keys the forward saw and the cache may stay
(:func:`enable` marks the layers so).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


def enable(model: torch.nn.Module) -> None:
    """Turn on gradient checkpointing of every decoder layer of the transformers
    ``model`` (non-reentrant), keeping the key/value cache they are given (it must be a
    :class:`PrefixCache`). Takes effect in train mode with gradients enabled; a no-grad
    forward (``old_logprobs: recompute``) runs as before.

    Raises:
        ValueError: the model does not support gradient checkpointing (transformers'
            error), or this transformers version cannot keep a cache in a checkpointed
            layer (``GradientCheckpointingLayer._can_checkpoint_with_cache``, 5.x).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache"):
        import transformers

        raise ValueError(f"trainer.gradient_checkpointing: transformers "
                         f"{transformers.__version__} drops the key/value cache in a "
                         f"checkpointed layer, which the shared-prompt forward needs; "
                         f"install a transformers 5.x that keeps it")
    enable_hf = getattr(model, "activation_checkpointing_enable", None) \
        or model.gradient_checkpointing_enable  # renamed in transformers 5.x
    enable_hf({"use_reentrant": False})
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer):
            m._can_checkpoint_with_cache = True  # PrefixCache replays: see the module doc


class PrefixCache(DynamicCache):
    """A ``DynamicCache`` whose ``update(keys, values, i)`` returns ``cat(prefix_i, keys)``
    (``[B, kv_heads, P + T, head_dim]``) without appending to what an earlier call stored,
    so calling it again (a checkpointed layer's recompute) gives the same result.

    Args:
        config: the transformers config of the model the cache is passed to (its text
            config sizes the layers).
        prefix: per layer ``(keys, values)`` ``[B, kv_heads, P, head_dim]`` the new
            tokens attend to (the prompt pass's cache, rows selected); None: empty (the
            prompt pass itself).

    Raises:
        ValueError: (at ``update``) a layer that is not plain full attention (a
            sliding-window or linear-attention layer keeps other state).
    """

    def __init__(self, config, prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        super().__init__(ddp_cache_data=prefix, config=config)
        self.model_config, self.prefix = config, prefix

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        if type(layer) is not DynamicLayer:
            raise ValueError(f"layer {layer_idx}: {type(layer).__name__} is not supported by "
                             f"the shared-prompt forward (full attention only)")
        if self.prefix is None:
            layer.reset()
        else:
            layer.keys, layer.values = self.prefix[layer_idx]
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def selected(self, rows: torch.Tensor) -> PrefixCache:
        """A new cache whose prefix is this one's keys and values at batch ``rows``
        (``[B]`` int64 indices): each response row attends to its prompt."""
        return PrefixCache(self.model_config, [(l.keys[rows], l.values[rows]) for l in self.layers])
