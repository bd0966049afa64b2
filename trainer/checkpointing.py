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
twice when the layer is recomputed. :class:`PrefixCache` starts each update from the
state it had before the pass (layer ``i``'s keys are ``cat(prefix_i, new)``), a pure
function of what the layer is given, so the recompute sees the keys the forward saw and
the cache may stay (:func:`enable` marks the layers so).
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicCache


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
    """A ``DynamicCache`` (for ``config``, a model config; its text config sizes the layers)
    whose ``update(keys, values, i)`` starts every time from layer ``i``'s state at the last
    :meth:`mark` (construction: empty), not from what an earlier update stored: calling it
    again with the same keys (a checkpointed layer's recompute) returns the same
    ``[B, kv_heads, P + T, head_dim]`` keys and values. Works for every layer type whose
    ``update`` rebinds its tensors (full attention, sliding window).

    The shared-prompt forward: the prompt pass updates a fresh cache; :meth:`selected`
    gives the response pass its rows, marked, so the responses attend to the prompt.
    """

    def __init__(self, config):
        super().__init__(config=config)
        self.mark()

    def mark(self) -> None:
        """Make the layers' current state the one every later update starts from."""
        self._start = [copy.copy(layer) for layer in self.layers]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.layers[layer_idx] = copy.copy(self._start[layer_idx])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def selected(self, rows: torch.Tensor) -> PrefixCache:
        """A new cache holding this one's layers at batch ``rows`` (``[B]`` int64
        indices), marked: each response row attends to its prompt."""
        out = copy.copy(self)
        out.layers = [copy.copy(layer) for layer in self.layers]
        for layer in out.layers:
            layer.batch_select_indices(rows)
        out.mark()
        return out
