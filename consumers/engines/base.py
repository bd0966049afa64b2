"""The rollout-engine interface every engine implements (``hf``, ``sglang``, ...).

An engine turns prompt token ids into sampled continuations with their
log-probs (computed from temperature-scaled logits, the same computation the
trainer uses: public case C12), reports the policy_version of its weights and
accepts new weights at a safe point between generation steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one generate call.

    Attributes:
        max_new_tokens: most tokens to sample per sequence (tokens).
        temperature: softmax temperature (> 0; log-probs are of logits / temperature).
        top_p: nucleus mass in (0, 1] (1.0 = off).
        top_k: keep the k most likely tokens (0 = off).
        stop: stop strings; generation of a sequence ends after one appears.
        seed: random seed for reproducible sampling (None = nondeterministic).
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (use a small value for near-greedy), "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass
class Generation:
    """One sampled continuation.

    Attributes:
        token_ids: ``[L]`` int sampled tokens (including the terminating EOS/end-of-turn
            token when finish_reason is ``stop``).
        logprobs: ``[L]`` float log-probs of ``token_ids`` under logits / temperature (nats).
        finish_reason: ``stop`` | ``length`` | ``abort`` (see ``relax.schemas.FINISH_REASONS``).
        policy_version_start / policy_version_end: weights version at the first / last token.
        token_policy_versions: ``[L]`` per-token versions when weights changed mid-sequence
            (partial rollout), else None.
        text: decoded ``token_ids`` (special tokens skipped).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version_start: int
    policy_version_end: int
    token_policy_versions: list[int] | None = None
    text: str = ""
    meta: dict = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """What the rollout and reference stages (and the GenRM judge) need from an engine.

    Beyond the protocol, the rollout stage uses (when present): ``tokenizer`` (the
    model's tokenizer with its chat template; required by the rollout stage),
    ``stop_token_ids`` (ids that end a turn with ``stop``), ``pending_version`` (weights
    staged and not yet swapped in), ``apply_pending()`` (a safe point) and ``hold()`` (a
    context manager deferring swaps, e.g. over the turns of a multi-turn group). See
    ``relax.consumers.engines.hf.HFEngine``.
    """

    engine_id: str

    @property
    def policy_version(self) -> int:
        """Version of the weights generation currently uses."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Sample one continuation per prompt (``prompts``: ``[N][prompt_len]`` token ids)."""

    def update_weights(self, named_tensors: dict, policy_version: int) -> None:
        """Install new weights (``{name: tensor}``) tagged ``policy_version``; takes effect
        at the next safe point (between generation steps)."""
