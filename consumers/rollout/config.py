"""Settings of one rollout instance (:class:`RolloutConfig`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relax.consumers.engines.base import SamplingParams
from relax.schemas import topics
from relax.schemas.versions import DEFAULT_BATCH_GROUPS


class RolloutConfig(BaseModel):
    """Settings of one rollout instance.

    Attributes:
        run: run name (topics ``<run>.*``, consumer group ``<run>.rollout``).
        dataset: prompt topic ``prompts.<dataset>``.
        model: model name/folder/Hub id (``smollm2-135m``, ``tiny-llama``, ...).
        engine: ``hf`` (transformers) or ``sglang`` (an SGLang server at ``sglang_url``).
        sglang_tp_size: the SGLang server's tensor-parallel ranks (members of the weight
            broadcast group).
        engine_id: this instance's id (rollout rows, metrics component, weight member id).
        device: HF engine device (default: cuda if available).
        group_size: G, samples per prompt.
        batch_groups: groups the trainer consumes per step.
        max_staleness: see the module docstring (0 = sync mode).
        groups_per_generate: groups sampled together in one engine call (batch = this * G).
        prompt_template: applied to a prompt's text before the chat template
            (``"{prompt}"`` = as is; e.g. ``"{prompt}\nReply with just the number."``);
            rows with ``messages`` are rendered from their messages.
        max_new_tokens / temperature / top_p / top_k / stop / seed: sampling settings
            (``seed`` + the group counter seeds each call; None = random).
        epochs: passes over the prompt topic.
        partial_rollout / chunk_tokens: allow weight swaps every ``chunk_tokens`` tokens
            of a generation (HF engine; its tokens then carry their versions in
            ``token_policy_versions``); ``chunk_tokens`` must be below ``max_new_tokens``,
            else no generation has a point to swap at.
        follow_weights: join the weight broadcast (HF engine), and start no group while the
            engine's weights are more than ``max_staleness`` versions behind the trainer's
            (such samples would only be dropped as stale); after ``weights_wait_s`` the
            stage goes on with the weights it has (logged).
        weights_rendezvous: ``tcp://host:port`` of the trainer's publisher, to join before
            its first announcement (default: learnt from the first announcement).
        environment: a built-in environment (``calculator``, ``humaneval``) or
            ``module:Class`` / ``module:function`` making a new one per sample
            (:mod:`relax.consumers.environments`; multi-turn); None = single turn.
        environment_options: keyword arguments of the environment's constructor.
        environment_reward: write each episode's environment reward to ``<run>.rewards``
            under this reward_name (the recipe's reward with ``fn: environment``; wired
            by the launcher); None = the rewards stay in the rollout's metadata only.
        max_turns / max_total_tokens: multi-turn budgets (turns; response tokens).
        rollouts_partitions: partitions of ``<run>.rollouts`` if the stage creates it.
        poll_timeout_s: prompt poll timeout (seconds).
        metrics_every_s: seconds between metric flushes.
        from_beginning: where a new consumer group starts on the prompt topic.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str
    dataset: str
    model: str = "tiny-llama"
    engine: Literal["hf", "sglang"] = "hf"
    sglang_url: str | None = None
    sglang_tp_size: int = Field(1, ge=1)
    engine_id: str = "rollout-0"
    device: str | None = None
    group_size: int = Field(4, ge=1)
    batch_groups: int = Field(DEFAULT_BATCH_GROUPS, ge=1)
    max_staleness: int = Field(1, ge=0)
    groups_per_generate: int = Field(1, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    stop: tuple[str, ...] = ()
    seed: int | None = None
    prompt_template: str = "{prompt}"
    epochs: int = Field(1, ge=1)
    partial_rollout: bool = False
    chunk_tokens: int = Field(32, ge=1)
    follow_weights: bool = True
    weights_rendezvous: str | None = None
    weights_wait_s: float = Field(300.0, gt=0)
    environment: str | None = None
    environment_options: dict = Field(default_factory=dict)
    environment_reward: str | None = None
    max_turns: int = Field(1, ge=1)
    max_total_tokens: int | None = Field(None, ge=1)
    rollouts_partitions: int = Field(1, ge=1)
    poll_timeout_s: float = Field(0.5, gt=0)
    metrics_every_s: float = Field(5.0, gt=0)
    from_beginning: bool = True

    @model_validator(mode="after")
    def _check(self):
        if self.engine == "sglang" and not self.sglang_url:
            raise ValueError("engine 'sglang' needs sglang_url (http://host:port)")
        topics.check_name("run", self.run)
        if self.partial_rollout and self.chunk_tokens >= self.max_new_tokens:
            raise ValueError(
                f"partial_rollout needs chunk_tokens < max_new_tokens (weights swap between "
                f"chunks of chunk_tokens tokens), got chunk_tokens {self.chunk_tokens} >= "
                f"max_new_tokens {self.max_new_tokens}: no generation would ever be split")
        topics.check_name("dataset", self.dataset)
        if self.environment_reward is not None and self.environment is None:
            raise ValueError(f"environment_reward {self.environment_reward!r} needs an "
                             "environment")
        try:
            self.prompt_template.format(prompt="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"prompt_template must use only {{prompt}}, got {self.prompt_template!r}: {e!r}"
            ) from None
        return self

    def sampling(self, seed: int | None = None) -> SamplingParams:
        """The :class:`SamplingParams` of one engine call."""
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=tuple(self.stop),
            seed=seed,
        )
