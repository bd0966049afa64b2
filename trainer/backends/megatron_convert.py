"""Weights between a Hugging Face Llama/Qwen2-family model and megatron-core's GPTModel
with tensor parallelism: the first piece of the megatron back end (issue 18).

Pure functions over ``{name: tensor}`` dicts; nothing here imports megatron-core. The
layout is megatron-core's (``GPTModel`` with the local or Transformer Engine layer
spec), as Megatron-Bridge converts it (``merge_qkv_weights``/``split_qkv_weights``):

* ``linear_qkv`` is column parallel and *interleaved by query group*: for each of the
  ``G`` groups, its ``H / G`` query heads, then its key head, then its value head, each
  ``head_dim`` rows (``[G * (H / G + 2) * head_dim, hidden]``). TP rank r holds the
  contiguous groups ``r * G / tp .. (r + 1) * G / tp - 1`` (so ``G % tp == 0``).
  A bias (Qwen2) is laid out the same way.
* ``linear_fc1`` is column parallel and fuses the gated MLP: rank r holds
  ``[gate_r; up_r]``, the r-th row chunks of ``gate_proj`` and ``up_proj``.
* ``linear_proj`` and ``linear_fc2`` are row parallel: split along the input dim.
* ``word_embeddings`` and ``output_layer`` are vocab parallel: the vocabulary is padded
  with zero rows to a multiple of ``divisible_by * tp`` (Megatron's
  ``make_vocab_size_divisible_by``), then split along dim 0; the way back drops the
  padding. A tied model has no ``output_layer``.
* Norms are replicated. Names: ``decoder.layers.<i>.input_layernorm.weight`` and
  ``pre_mlp_layernorm.weight`` with the local spec; with Transformer Engine they are
  fused into ``linear_qkv.layer_norm_weight`` and ``linear_fc1.layer_norm_weight``.

Pipeline parallelism (:func:`to_stage`, :func:`from_stages`): stage s of ``pp`` holds
layers ``s * L / pp .. (s + 1) * L / pp - 1`` numbered from 0 in its own state dict (as
megatron-core's ``TransformerBlock`` names them), the first stage the embedding, the last
the final norm and the output layer. With ``pp > 1`` a tied model's last stage holds a
copy of the embedding as its ``output_layer.weight`` (megatron-core's shared embedding:
the two copies get the same summed gradient and so stay equal).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Layout:
    """The shapes a conversion needs (from the HF config; :meth:`from_hf_config`).

    Attributes:
        layers: decoder layers.
        heads: query heads (H).
        groups: key/value heads, the query groups (G; H % G == 0).
        head_dim: channels per head.
        vocab: the tokenizer's vocabulary (rows of the HF embedding).
        tied: input embedding and LM head share one tensor.
        te: Transformer Engine names (layer norms fused into the linear layers).
        divisible_by: Megatron's ``make_vocab_size_divisible_by`` (per TP rank).
    """

    layers: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    tied: bool
    te: bool = False
    divisible_by: int = 128

    @classmethod
    def from_hf_config(cls, config, te: bool = False, divisible_by: int = 128) -> Layout:
        """The layout of a ``transformers`` Llama/Qwen2-style config."""
        heads = config.num_attention_heads
        return cls(layers=config.num_hidden_layers, heads=heads,
                   groups=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   vocab=config.vocab_size, tied=bool(config.tie_word_embeddings), te=te,
                   divisible_by=divisible_by)

    def check(self, tp: int) -> None:
        """Raises ValueError unless H % G == 0 and G % tp == 0 (Megatron's own rules)."""
        if tp < 1 or self.heads % self.groups or self.groups % tp:
            raise ValueError(f"tensor parallel size {tp}: need heads ({self.heads}) % groups "
                             f"({self.groups}) == 0 and groups % tp == 0")

    def padded_vocab(self, tp: int) -> int:
        """Rows of Megatron's embedding: the vocabulary rounded up to a multiple of
        ``divisible_by * tp``."""
        m = self.divisible_by * tp
        return -(-self.vocab // m) * m


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: Layout) -> torch.Tensor:
    """``[H*d, ...]``, ``[G*d, ...]``, ``[G*d, ...]`` (weights or biases) -> Megatron's
    ``[G * (H/G + 2) * d, ...]``, group by group: its query heads, key head, value head."""
    d, per = lay.head_dim, lay.heads // lay.groups
    rest = q.shape[1:]
    qg = q.reshape(lay.groups, per * d, *rest)
    kg = k.reshape(lay.groups, d, *rest)
    vg = v.reshape(lay.groups, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(lay.groups * (per + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, lay: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`interleave_qkv`: ``(q, k, v)``."""
    d, per = lay.head_dim, lay.heads // lay.groups
    rest = qkv.shape[1:]
    g = qkv.reshape(lay.groups, (per + 2) * d, *rest)
    q, k, v = g.split([per * d, d, d], dim=1)
    return (q.reshape(lay.heads * d, *rest), k.reshape(lay.groups * d, *rest),
            v.reshape(lay.groups * d, *rest))


def replicated(name: str) -> bool:
    """Whether the Megatron tensor ``name`` is the same on every TP rank (the norms); all
    the others are split (module docstring)."""
    return "layernorm" in name or "layer_norm" in name


def _names(i: int, te: bool) -> dict[str, str]:
    """Megatron names of layer ``i``'s tensors, by role."""
    p = f"decoder.layers.{i}."
    return {
        "qkv": p + "self_attention.linear_qkv.weight",
        "qkv_bias": p + "self_attention.linear_qkv.bias",
        "proj": p + "self_attention.linear_proj.weight",
        "fc1": p + "mlp.linear_fc1.weight",
        "fc2": p + "mlp.linear_fc2.weight",
        "ln1": p + ("self_attention.linear_qkv.layer_norm_weight" if te else
                    "input_layernorm.weight"),
        "ln2": p + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"),
    }


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def hf_to_megatron(hf: dict[str, torch.Tensor], lay: Layout, tp: int = 1
                   ) -> list[dict[str, torch.Tensor]]:
    """Split an HF state dict (``model.layers.<i>.self_attn.q_proj.weight``, ...) into the
    state dicts of ``tp`` Megatron tensor-parallel ranks (see the module docstring).

    Raises:
        ValueError: a TP size the heads do not allow (:meth:`Layout.check`).
        KeyError: an HF tensor the layout needs is missing (names it).
    """
    lay.check(tp)
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    vocab = lay.padded_vocab(tp)
    emb = _pad_rows(hf["model.embed_tokens.weight"], vocab).chunk(tp)
    head = None if lay.tied else _pad_rows(hf["lm_head.weight"], vocab).chunk(tp)
    for r in range(tp):
        out[r]["embedding.word_embeddings.weight"] = emb[r].clone()
        out[r]["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if head is not None:
            out[r]["output_layer.weight"] = head[r].clone()
    for i in range(lay.layers):
        p, n = f"model.layers.{i}.", _names(i, lay.te)
        a = p + "self_attn."
        qkv = interleave_qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"],
                             hf[a + "v_proj.weight"], lay).chunk(tp)
        bias = None
        if a + "q_proj.bias" in hf:
            bias = interleave_qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"],
                                  hf[a + "v_proj.bias"], lay).chunk(tp)
        proj = hf[a + "o_proj.weight"].chunk(tp, dim=1)
        gate = hf[p + "mlp.gate_proj.weight"].chunk(tp)
        up = hf[p + "mlp.up_proj.weight"].chunk(tp)
        down = hf[p + "mlp.down_proj.weight"].chunk(tp, dim=1)
        for r in range(tp):
            o = out[r]
            o[n["qkv"]] = qkv[r].clone()
            if bias is not None:
                o[n["qkv_bias"]] = bias[r].clone()
            o[n["proj"]] = proj[r].clone()
            o[n["fc1"]] = torch.cat([gate[r], up[r]])
            o[n["fc2"]] = down[r].clone()
            o[n["ln1"]] = hf[p + "input_layernorm.weight"].clone()
            o[n["ln2"]] = hf[p + "post_attention_layernorm.weight"].clone()
    return out


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], lay: Layout) -> dict[str, torch.Tensor]:
    """Gather ``tp = len(shards)`` Megatron TP state dicts into HF names and shapes
    (vocabulary padding dropped; a tied model gets ``lm_head.weight`` = the embedding,
    as ``state_dict()`` of a tied HF model has it): what the weight channel publishes.

    Raises:
        KeyError: a Megatron tensor the layout needs is missing (names it).
    """
    tp = len(shards)
    lay.check(tp)
    hf: dict[str, torch.Tensor] = {}
    emb = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])[: lay.vocab]
    hf["model.embed_tokens.weight"] = emb
    hf["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"].clone()
    hf["lm_head.weight"] = emb if lay.tied else \
        torch.cat([s["output_layer.weight"] for s in shards])[: lay.vocab]
    for i in range(lay.layers):
        p, n = f"model.layers.{i}.", _names(i, lay.te)
        a = p + "self_attn."
        q, k, v = split_qkv(torch.cat([s[n["qkv"]] for s in shards]), lay)
        hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"] = q, k, v
        if n["qkv_bias"] in shards[0]:
            qb, kb, vb = split_qkv(torch.cat([s[n["qkv_bias"]] for s in shards]), lay)
            hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"] = qb, kb, vb
        hf[a + "o_proj.weight"] = torch.cat([s[n["proj"]] for s in shards], dim=1)
        halves = [s[n["fc1"]].chunk(2) for s in shards]
        hf[p + "mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves])
        hf[p + "mlp.up_proj.weight"] = torch.cat([h[1] for h in halves])
        hf[p + "mlp.down_proj.weight"] = torch.cat([s[n["fc2"]] for s in shards], dim=1)
        hf[p + "input_layernorm.weight"] = shards[0][n["ln1"]].clone()
        hf[p + "post_attention_layernorm.weight"] = shards[0][n["ln2"]].clone()
    return hf


def stage_layers(lay: Layout, pp: int, stage: int) -> range:
    """The (global) decoder layers of pipeline stage ``stage`` of ``pp``.

    Raises:
        ValueError: the layers do not divide by ``pp`` (megatron-core's even split).
    """
    if lay.layers % pp:
        raise ValueError(f"pipeline parallel size {pp}: the model's {lay.layers} layers "
                         f"must divide by it")
    n = lay.layers // pp
    return range(stage * n, (stage + 1) * n)


def to_stage(shard: dict[str, torch.Tensor], lay: Layout, pp: int, stage: int
             ) -> dict[str, torch.Tensor]:
    """One TP rank's state dict (global layer numbers; :func:`hf_to_megatron`) -> the part
    pipeline stage ``stage`` of ``pp`` holds, its layers numbered from 0 (module docstring).

    Raises:
        ValueError: the layers do not divide by ``pp``.
    """
    keep, last = stage_layers(lay, pp, stage), stage == pp - 1
    out: dict[str, torch.Tensor] = {}
    for name, t in shard.items():
        m = _LAYER.match(name)
        if m:
            if int(m.group(1)) in keep:
                out[f"decoder.layers.{int(m.group(1)) - keep.start}.{name[m.end():]}"] = t
        elif name.startswith("embedding."):
            if stage == 0:
                out[name] = t
        elif last:
            out[name] = t
    if last and pp > 1 and lay.tied:
        out["output_layer.weight"] = shard["embedding.word_embeddings.weight"].clone()
    return out


def from_stages(parts: list[dict[str, torch.Tensor]], lay: Layout) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_stage` over all ``pp = len(parts)`` stages of one TP rank:
    global layer numbers, a tied model's output layer copy dropped."""
    out: dict[str, torch.Tensor] = {}
    for stage, part in enumerate(parts):
        start = stage_layers(lay, len(parts), stage).start
        for name, t in part.items():
            m = _LAYER.match(name)
            if m:
                out[f"decoder.layers.{int(m.group(1)) + start}.{name[m.end():]}"] = t
            elif not (lay.tied and name == "output_layer.weight"):
                out[name] = t
    return out
