"""Token log-probs from temperature-scaled logits: ONE function for rollout and trainer.

``log pi(y_t) = log_softmax(logits_t / temperature)[y_t]``, over the full
vocabulary, on both sides (public case C12: huggingface/trl #4159, NVIDIA-NeMo/RL
PR #316, prime-rl PR #697). Raw (T = 1) log-probs on one side, or raw log-probs
divided by T, give an IS / PPO ratio != 1 for identical weights.

Top-p / top-k convention: relax stores full-vocabulary log-probs (of the scaled
logits, before any truncation) on the rollout side too, so no correction is
needed. An engine that reports log-probs renormalised over the kept top-p set
reports ``log p - log S`` where ``S`` is the kept mass; :func:`top_p_log_mass`
returns ``log S`` so such values can be converted back
(``full = truncated + log S``), and the ratio between the two conventions is
exactly ``S`` for every token.

:func:`head_logprobs` goes one step earlier: it takes the hidden states and the LM head
and builds the logits a chunk of tokens at a time (each chunk under
``torch.utils.checkpoint``), so the ``[tokens, V]`` logits are never whole in memory,
in the forward or the backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from relax.trainer.losses.entropy import token_entropy

CHUNK_TOKENS = 1024
"""Default tokens per LM-head chunk of :func:`head_logprobs` (``trainer.logits_chunk_tokens``):
``CHUNK_TOKENS * V * 4`` bytes of float32 logits at once (0.2 GB at SmolLM2's V = 49k)."""

CHUNK_ROWS = 1024
"""``[V]`` rows (batch x positions) processed at once: bounds the float32 copy of the
logits to ``CHUNK_ROWS * V * 4`` bytes (0.6 GB at V = 152k)."""


def _check(logits: torch.Tensor, temperature: float) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape [B, T, V], got {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float, *,
                   chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """Log-probs of ``token_ids`` under ``softmax(logits / temperature)``.

    Computed as ``x[y] - logsumexp(x)`` with ``x = logits / temperature`` in float32,
    over slices of ``max(1, chunk_rows // B)`` positions (views: non-contiguous logits
    are not copied whole), so no ``[B, T, V]`` log-softmax output is materialised and,
    without autograd, at most ``chunk_rows`` float32 rows of the logits exist at once
    (with autograd the scaled slices are kept for backward: one float32 copy in all).
    Differentiable.

    Args:
        logits: ``[B, T, V]`` float (any float dtype), the logits that predict
            ``token_ids`` (already shifted: position t predicts ``token_ids[:, t]``).
        token_ids: ``[B, T]`` int64 sampled tokens.
        temperature: the sampling temperature (> 0); 1.0 means raw logits.
        chunk_rows: ``[V]`` rows per slice (memory bound, see ``CHUNK_ROWS``).

    Returns:
        ``[B, T]`` float32 log-probs.
    """
    _check(logits, temperature)
    if token_ids.shape != logits.shape[:2]:
        raise ValueError(f"token_ids shape {tuple(token_ids.shape)} != logits [B, T] "
                         f"{tuple(logits.shape[:2])}")
    step = max(1, chunk_rows // max(1, logits.shape[0]))
    out = []
    for start in range(0, logits.shape[1], step):
        x = logits[:, start:start + step].float()
        if temperature != 1.0:
            x = x / temperature
        ids = token_ids[:, start:start + step].long().unsqueeze(-1)
        out.append(x.gather(-1, ids).squeeze(-1) - torch.logsumexp(x, dim=-1))
    if not out:
        return logits.new_zeros(logits.shape[:2], dtype=torch.float32)
    return torch.cat(out, dim=1)


def top_p_log_mass(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """``log S``: log of the probability mass kept by nucleus (top-p) sampling.

    The kept set is the smallest set of most probable tokens whose mass reaches
    ``top_p`` (a token is kept iff the mass of the tokens ranked before it is
    ``< top_p``), the rule of HF ``TopPLogitsWarper``, vLLM and SGLang (ties aside).
    A log-prob renormalised over the kept set equals the full-vocabulary log-prob
    minus ``log S`` (public case C12 sub-check: logits [2, 1, 0], T = 0.5,
    top_p = 0.95 -> S = 0.984124).

    Args:
        logits: ``[B, T, V]`` float logits.
        temperature: sampling temperature (> 0).
        top_p: nucleus mass in ``(0, 1]``; 1.0 gives ``log S = 0``.

    Returns:
        ``[B, T]`` float32 ``log S`` (<= 0). No gradient. Sorts the full ``[B, T, V]``
        probabilities at once: a diagnostic/correction helper, not a hot path.
    """
    _check(logits, temperature)
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if top_p == 1:
        return torch.zeros(logits.shape[:2], dtype=torch.float32, device=logits.device)
    with torch.no_grad():
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        sorted_probs, _ = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        kept = torch.where(mass_before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
        return kept.sum(dim=-1).log()


def head_logprobs(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                  token_ids: torch.Tensor, temperature: float, *,
                  chunk_tokens: int = CHUNK_TOKENS, with_entropy: bool = False,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of ``token_ids`` from hidden states, the LM head applied
    ``chunk_tokens`` tokens at a time.

    Each chunk's logits ``head(hidden[i:i + chunk_tokens])`` give its log-probs by
    :func:`token_logprobs` and entropy by
    :func:`relax.trainer.losses.entropy.token_entropy`, then are dropped. With autograd,
    each chunk runs under ``torch.utils.checkpoint`` (non-reentrant): the backward
    recomputes one chunk's logits at a time instead of keeping all of them, so at most
    one chunk's ``[chunk_tokens, V]`` logits (and their float32 softmax temporaries)
    exist at once, for one extra LM-head matmul per token. Same values and gradients as
    the whole logits at once (float rounding of the matmul aside: ~1e-7 in float32).

    Args:
        hidden: ``[N, H]`` float hidden states, row i the state that predicts
            ``token_ids[i]`` (already shifted).
        head: the LM head (``model.get_output_embeddings()``), ``[n, H] -> [n, V]``.
        token_ids: ``[N]`` int64 tokens.
        temperature: the sampling temperature (> 0).
        chunk_tokens: tokens per chunk; ``0`` builds the whole ``[N, V]`` logits at once
            (the unchunked path).
        with_entropy: also return the entropy of ``softmax(logits / temperature)``. Ask
            for it only when the loss differentiates it (or without autograd): the
            backward recomputes a chunk whole, and the entropy's share of a chunk whose
            gradient never comes stays held until the backward ends.

    Returns:
        ``([N] float32 log-probs, [N] float32 entropies in nats or None)``,
        differentiable.

    Raises:
        ValueError: ``hidden`` not 2-D, ``token_ids`` not ``[N]``, a negative
            ``chunk_tokens`` or a temperature <= 0.
    """
    if hidden.dim() != 2 or token_ids.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, H] and token_ids [N], got "
                         f"{tuple(hidden.shape)} and {tuple(token_ids.shape)}")
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0, got {chunk_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    def chunk(h: torch.Tensor, ids: torch.Tensor):
        logits = head(h)[None]                               # [1, n, V]
        lp = token_logprobs(logits, ids[None], temperature)[0]
        if not with_entropy:
            return lp, None
        return lp, token_entropy(logits, temperature=temperature)[0]

    n = hidden.shape[0]
    step = chunk_tokens or max(n, 1)
    if n <= step:
        return chunk(hidden, token_ids)
    recompute = torch.is_grad_enabled()
    parts = [checkpoint(chunk, hidden[i:i + step], token_ids[i:i + step], use_reentrant=False)
             if recompute else chunk(hidden[i:i + step], token_ids[i:i + step])
             for i in range(0, n, step)]
    lp = torch.cat([p[0] for p in parts])
    return lp, torch.cat([p[1] for p in parts]) if with_entropy else None
