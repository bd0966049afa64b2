"""megatron-core's GPTModel for a Hugging Face Llama/Qwen2-family model, and the response
log-probs of a micro-batch computed with vocab-parallel cross entropy.

The model is megatron-core's own ``GPTModel`` with its local layer spec (plain torch
modules; Transformer Engine is not needed and not on the CPU), built from the HF config
(:func:`transformer_config`) and loaded with the TP shard of the HF weights
(:mod:`relax.trainer.backends.megatron_convert`); with pipeline parallelism each rank's
model holds one stage (:func:`build_gpt`), and a micro-batch goes through
:func:`stage_hidden` on every stage, then :func:`head_logits` on the last.

Sequences: every row is its prompt followed by its response, **right-padded**
(:func:`row_sequences`), so that token j sits at position j: megatron-core applies RoPE
by index (``rotary_pos_emb(seq_len)``, not by ``position_ids``), so the left padding the
torch back end uses for its shared-prefix pass would shift positions. The causal mask is
explicit (megatron's default mask is built on ``"cuda"``); padding at the end of a row is
never attended to by a real token of that row. Each row is computed in full (no
shared-prompt key/value cache as in the torch back end): ``B x (P + R)`` tokens.

Log-probs: the hidden states of the positions that predict response tokens (position
``p_len - 1 + t`` predicts response token t) go through the vocab-parallel output layer
(``[B, R, V / tp]`` logits per rank; the columns of the vocabulary padding are masked
out, so the softmax is over the tokenizer's vocabulary exactly as in the HF model), then
``log pi = -vocab_parallel_cross_entropy(logits / T, targets)`` (megatron-core; the
same temperature-scaled full-vocabulary log-probs as
:func:`relax.trainer.logprobs.token_logprobs`, public case C12).
"""

from __future__ import annotations

import torch

from relax.trainer.backends.megatron_convert import Layout
from relax.trainer.batching import MicroBatch

FAMILIES = ("llama", "qwen2")
"""HF ``model_type`` values the back end builds (SmolLM2 is Llama)."""


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) \
        or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"{config.model_type}: RoPE type {kind!r} ({params}) is not supported "
                         f"by the megatron back end (plain RoPE only)")
    return float(params.get("rope_theta") or getattr(config, "rope_theta", 10000.0))


def transformer_config(hf_config, tp: int, dtype: torch.dtype = torch.float32, pp: int = 1,
                       recompute: bool = False):
    """megatron-core ``TransformerConfig`` of an HF Llama/Qwen2 config at tensor-parallel
    size ``tp`` and pipeline-parallel size ``pp``: RMSNorm, SiLU-gated MLP, grouped-query
    attention, QKV bias for Qwen2, no dropout, no fusion (the CPU has none), CPU
    initialisation; with ``recompute`` (``trainer.gradient_checkpointing``) megatron-core's
    full activation recompute, each layer on its own (``uniform``, 1 layer).

    Raises:
        ValueError: another model family, an activation other than SiLU, MLP or output
            biases, attention dropout, RoPE scaling (names the field).
    """
    c = hf_config
    if c.model_type not in FAMILIES:
        raise ValueError(f"model_type {c.model_type!r}: the megatron back end builds "
                         f"{', '.join(FAMILIES)}")
    if c.hidden_act != "silu":
        raise ValueError(f"hidden_act {c.hidden_act!r}: expected 'silu'")
    if getattr(c, "mlp_bias", False):
        raise ValueError("mlp_bias: not supported by the megatron back end")
    if getattr(c, "attention_dropout", 0.0):
        raise ValueError(f"attention_dropout {c.attention_dropout}: expected 0")
    _rope_theta(c)
    qkv_bias = c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False))
    lay = Layout.from_hf_config(c)
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads, num_query_groups=lay.groups,
        kv_channels=lay.head_dim, ffn_hidden_size=c.intermediate_size,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps,
        add_bias_linear=False, add_qkv_bias=qkv_bias,
        attention_dropout=0.0, hidden_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        use_cpu_initialization=True, perform_initialization=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype if pp > 1 else None, params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        **({"recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": 1} if recompute else {}))


def build_gpt(hf_config, tp: int, dtype: torch.dtype = torch.float32, pp: int = 1,
              stage: int = 0, recompute: bool = False):
    """An (uninitialised) megatron-core ``GPTModel`` for ``hf_config``: this rank's TP
    shard of pipeline stage ``stage`` of ``pp``, every parameter in ``dtype``; model
    parallelism must be initialised (``parallel_state``).

    With ``pp > 1`` a tied model is built untied: the last stage gets its own output layer,
    which the back end keeps equal to the first stage's embedding
    (:mod:`.megatron_convert`); megatron-core's own tie moves the copy with ``.cuda()``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    lay = Layout.from_hf_config(hf_config)
    gpt = GPTModel(transformer_config(hf_config, tp, dtype, pp, recompute),
                   get_gpt_layer_local_spec(normalization="RMSNorm"),
                   vocab_size=lay.padded_vocab(tp),
                   max_sequence_length=hf_config.max_position_embeddings,
                   share_embeddings_and_output_weights=lay.tied and pp == 1,
                   position_embedding_type="rope", rotary_base=_rope_theta(hf_config),
                   parallel_output=True, pre_process=stage == 0, post_process=stage == pp - 1)
    for p in gpt.parameters():  # the local spec's torch RMSNorm is made in float32 always
        p.data = p.data.to(dtype)
    return gpt


def row_sequences(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's prompt then response, right-padded with 0.

    Returns:
        ``(ids [B, P + R] int64, p_len [B] int64)``: row b's prompt is ``ids[b, :p_len[b]]``
        and its response token t is at ``p_len[b] + t`` (so it is predicted at
        ``p_len[b] - 1 + t``).
    """
    rows = mb.prompt_of_row
    full = torch.cat([mb.prompt_ids[rows], mb.response_ids], dim=1)      # [B, P + R]
    p_len = mb.prompt_mask.sum(-1)[rows]                                 # [B]
    width = full.shape[1]
    shift = mb.prompt_ids.shape[1] - p_len                               # left padding
    idx = torch.arange(width, device=full.device)[None, :] + shift[:, None]
    ids = torch.where(idx < width, full.gather(1, idx.clamp(max=width - 1)), 0)
    return ids, p_len


def stage_hidden(gpt, ids: torch.Tensor, x: torch.Tensor | None = None,
                 pad_id: int | None = None) -> torch.Tensor:
    """``[S, B, H]`` hidden states after this pipeline stage's decoder layers (the last
    stage's include the final norm), under an explicit causal mask.

    Args:
        ids: ``[B, S]`` int64 right-padded rows (:func:`row_sequences`).
        x: ``[S, B, H]`` the previous stage's output; None on the first stage, which
            embeds ``ids`` (megatron-core's embedding; RoPE is applied in every layer).
        pad_id: the HF model's ``pad_token_id`` (its ``nn.Embedding(padding_idx=...)``):
            the embeddings looked up for this id are detached, so that row of the word
            embeddings gets no gradient from its lookups, as in the HF model (a tied
            output layer still trains it). SmolLM2 pads with ``<|im_end|>`` (id 2),
            which ends every turn of a chat prompt.
    """
    b, s = ids.shape
    emb = None
    if x is None:
        pos = torch.arange(s, device=ids.device)
        emb = gpt.embedding(input_ids=ids, position_ids=pos[None, :].expand(b, s))  # [S, B, H]
        if pad_id is not None:
            emb = torch.where((ids == pad_id).T[..., None], emb.detach(), emb)
    else:
        gpt.decoder.set_input_tensor(x)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=ids.device), 1)[None, None]
    return gpt.decoder(hidden_states=emb, attention_mask=causal,
                       rotary_pos_emb=gpt.rotary_pos_emb(s))


def head_logits(gpt, hidden: torch.Tensor, p_len: torch.Tensor, r: int, vocab: int
                ) -> torch.Tensor:
    """``[B, R, V / tp]`` vocab-parallel logits (float32) of this TP rank that predict each
    of ``r`` response tokens, from the last stage's ``[S, B, H]`` ``hidden``; columns of
    the vocabulary padding (ids >= ``vocab``) are -inf. ``p_len``: ``[B]`` prompt lengths
    (:func:`row_sequences`)."""
    from megatron.core import parallel_state

    b = hidden.shape[1]
    at = p_len[:, None] - 1 + torch.arange(r, device=hidden.device)[None, :]     # [B, R]
    h = hidden[at.T, torch.arange(b, device=hidden.device)[None, :]]             # [R, B, H]
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
        else None
    logits, _ = gpt.output_layer(h, weight=weight)                               # [R, B, V/tp]
    logits = logits.transpose(0, 1).contiguous().float()
    part = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * part
    if start + part > vocab:
        pad = torch.arange(start, start + part, device=logits.device) >= vocab
        logits = logits.masked_fill(pad, float("-inf"))
    return logits


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float
                            ) -> torch.Tensor:
    """``[B, R]`` float32 ``log softmax(logits / T)[targets]`` over the whole (TP-split)
    vocabulary: megatron-core's ``vocab_parallel_cross_entropy``, negated. Differentiable.

    Args:
        logits: ``[B, R, V / tp]`` this rank's float32 logits (:func:`head_logits`).
        targets: ``[B, R]`` int64 token ids in the full vocabulary.
        temperature: sampling temperature (> 0).
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    x = logits / temperature if temperature != 1.0 else logits.clone()  # CE works in place
    return -vocab_parallel_cross_entropy(x, targets)


def vocab_parallel_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[B, R]`` float32 entropy (nats) of ``softmax(logits / T)`` over the TP-split
    vocabulary: ``H = log s - w / s`` with ``m`` the global max, ``s = sum exp(x - m)``
    and ``w = sum exp(x - m) (x - m)`` (centred: float32 loses nothing to a cancellation
    of ~``m``), the sums all-reduced over the tensor-parallel group (megatron-core's
    ``reduce_from_tensor_model_parallel_region``: backward is the identity, right because
    every TP rank computes the same loss). Differentiable.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    x = logits / temperature
    m = x.detach().amax(-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    xc = x - m[..., None]
    e = torch.exp(xc)  # 0 on the vocabulary padding (-inf)
    finite = torch.where(torch.isfinite(xc), xc, 0.0)  # 0 * x is 0, not nan, both ways
    s = reduce_from_tensor_model_parallel_region(e.sum(-1))
    w = reduce_from_tensor_model_parallel_region((e * finite).sum(-1))
    return torch.log(s) - w / s
