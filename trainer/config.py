"""Trainer configuration (pydantic): model, optimizer, loss, batching, staleness,
checkpoints (:class:`TrainerConfig`, the recipe's ``trainer:`` section), and where the
trainer stage runs and what it writes (:class:`TrainerStageConfig`). Unknown keys and bad
values are rejected with the field's name. Torch-free: the driver and the stages without
torch load it for the recipe's checks."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relax.schemas.versions import DEFAULT_BATCH_GROUPS
from relax.trainer.losses.config import LossConfig, ValueLossConfig
from relax.trainer.telemetry import TelemetryConfig


class OptimConfig(BaseModel):
    """AdamW settings (Loshchilov & Hutter, arXiv 1711.05101).

    Attributes:
        lr: learning rate; betas, eps, weight_decay: AdamW's; grad_clip: max global
            gradient L2 norm (0 = off); warmup_steps: linear warm-up of lr (steps).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    lr: float = Field(1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, ge=0)
    warmup_steps: int = Field(0, ge=0)


class MegatronConfig(BaseModel):
    """Model parallelism of the megatron back end (``trainer.backend: megatron``).

    Attributes:
        tp: tensor-parallel size (the model's query groups must divide by it).
        pp: pipeline-parallel size (the model's layers must divide by it): relax's own
            1F1B schedule (:mod:`relax.trainer.backends.megatron_pipeline`), on the CPU too.
    The trainer stage runs ``tp * pp`` processes (``resources.trainer.processes``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)


class LoraConfig(BaseModel):
    """Low-rank adapters (LoRA, Hu et al., arXiv 2106.09685) trained instead of the
    model's weights, with ``peft`` (``trainer.lora``).

    Attributes:
        r: rank of each adapter (``A: [r, in]``, ``B: [out, r]``).
        alpha: scale numerator: the update is ``(alpha / r) * B @ A``.
        dropout: dropout on the adapters' input while training (0 = none: the trainer's
            log-probs are then the engines' for the same merged weights).
        target_modules: names (last component, e.g. ``q_proj``) of the linear layers that
            get an adapter, or ``["all-linear"]`` (every linear layer but the LM head).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    r: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        min_length=1)


class CriticConfig(BaseModel):
    """PPO's critic (``advantage.estimator: gae``): a value model trained in the trainer
    process (:mod:`relax.trainer.critic`). The recipe fills it from the ``advantage:``
    block (``estimator: gae``, ``estimator_options: {gamma, lam}``) and the ``kl:`` block
    (``in: reward``); the optimizer and the clip are set here (``trainer.critic``).

    Attributes:
        gamma: discount per token, in ``[0, 1]`` (veRL's default 1.0).
        lam: GAE lambda, in ``[0, 1]`` (veRL's default 1.0).
        optim: the critic's own AdamW (veRL's critic lr 1e-5).
        loss: the clipped value loss (:class:`ValueLossConfig`: ``clip_range`` c, veRL's
            ``cliprange_value`` 0.5, None = the plain squared error; ``loss_agg_mode``).
        updates: critic optimizer steps per trainer step over the batch (veRL's
            ``ppo_epochs`` for the critic): the first one's forward gives the values GAE
            uses, the later ones are clipped around them.
        kl_coef: the KL penalty per token in the token rewards (``kl: {in: reward}``,
            filled by the recipe; veRL ``apply_kl_penalty``).
        kl_estimator: one of ``KL_ESTIMATOR_NAMES`` for that penalty.
        whiten: whiten the GAE advantages over the batch's loss tokens (veRL, TRL).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    loss: ValueLossConfig = Field(default_factory=ValueLossConfig)
    updates: int = Field(1, ge=1)
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    whiten: bool = True


class TrainerConfig(BaseModel):
    """The trainer stage.

    Attributes:
        model: model name (``smollm2-135m``, ``tiny-llama``), folder or Hub id.
        backend: ``torch`` (CPU/GPU, DDP or FSDP2) or ``megatron`` (megatron-core GPTModel,
            tensor and pipeline parallel; the ``megatron`` install extra).
        megatron: its parallel sizes (:class:`MegatronConfig`).
        data_parallel: how the torch back end's ranks (``resources.trainer.processes``
            > 1) share the model: ``ddp`` (every rank holds it all; gradients
            all-reduced) or ``fsdp2`` (``fully_shard``: parameters, gradients and AdamW
            state sharded over the ranks; :mod:`relax.trainer.backends.fsdp`).
        steps: optimizer steps of the run (policy_version goes 0 -> steps).
        batch_groups: GRPO groups per optimizer step (N).
        max_staleness: admit a sample iff staleness <= max_staleness (0 = on-policy).
        max_tokens_per_microbatch: padded-token budget of one forward/backward (tokens).
        old_logprobs: pi_old of the PPO ratio: ``rollout`` (the engine's log-probs: the
            behaviour policy, no extra forward), ``recompute`` (a no-grad forward at the
            start of the step) or ``detached`` (current policy: ratio 1).
        checkpoint_every: save a checkpoint every K steps (0 = only at the end).
        keep_checkpoints: newest checkpoints kept on disk.
        num_threads: torch intra-op threads (None = torch's default).
        accuracy_reward: reward name whose value decides "correct" (default: the first
            counted reward); a sample is correct when that value > accuracy_threshold.
        batch_advantage: an estimator of ``BATCH_ESTIMATORS`` (REINFORCE++) computed over
            each global batch here, replacing the aggregator's per-group advantages
            (:mod:`relax.trainer.advantage.batch`); the recipe fills it from
            ``advantage.estimator``. None: the aggregator's advantages are trained on.
        batch_advantage_options: keyword options of that estimator.
        publish_bucket_bytes: weight broadcast bucket size (bytes).
        weights_snapshot_every: write the published weights as a safetensors snapshot
            (``<run_dir>/weights/v<version>/``, model-size bytes, written by the publisher's
            background thread) every K versions and for the first: what a subscriber that
            starts late loads before it joins the next broadcast. Every step costs a
            538 MB write for SmolLM2-135M (CPU and page cache the other stages need).
        weights_store: where those snapshots go: a folder or a ``pyarrow.fs`` URI
            (``s3://bucket/prefix?endpoint_override=host:port&scheme=http``; credentials
            from each host's environment; :mod:`relax.streams.weights.store`). None =
            ``<run_dir>/weights``, which only engines on the trainer's host can read: a
            run across hosts sets a store every host reaches.
        weights_shm: the publisher's send buffer is two files in ``/dev/shm`` (RAM for
            two versions of the weights), and engines that share it (the trainer's host)
            copy each version out of them with one memcpy instead of receiving the gloo
            broadcast over TCP on loopback (:mod:`relax.streams.weights.shm`; CPU
            weights only).
        checkpoint_store: where checkpoints and the final model go besides the trainer's
            disk: a folder or a ``pyarrow.fs`` URI (:mod:`relax.trainer.checkpoint`).
            None = ``<run_dir>/checkpoints`` on the trainer's host, which a trainer
            restarted on another host, and a driver on another host, cannot read.
        freeze: ``fnmatch`` patterns of parameter names (``model.named_parameters()``,
            e.g. ``model.audio_tower.*``) that are not trained: no gradient, no optimizer
            state; they are still published. What VLM/audio RL recipes use to keep a
            pretrained encoder (or the whole text model) fixed. Torch back end only.
        gradient_checkpointing: recompute each decoder layer's activations in the
            backward instead of keeping them (about one more forward of compute, a
            fraction of the activation memory; same gradients). Torch back end:
            :mod:`relax.trainer.checkpointing`; megatron: megatron-core's full activation
            recompute, one layer at a time.
        lora: train low-rank adapters instead of the weights (:class:`LoraConfig`,
            :mod:`relax.trainer.lora`); None = full fine-tuning. Torch back end only.
        logits_chunk_tokens: response tokens per LM-head chunk in the torch back end
            (:func:`relax.trainer.logprobs.head_logprobs`): the ``[tokens, vocab]`` logits
            are built, turned into log-probs and entropy, and recomputed in the backward,
            one chunk at a time. 0 = all response tokens of a micro-batch at once.
        critic: PPO's critic (:class:`CriticConfig`), on when the recipe's
            ``advantage.estimator`` is ``gae``; None = no critic.
        packing: the torch back end runs each micro-batch's (prompt, response) rows laid
            end to end in one row with position ids restarting per row (no padding;
            :func:`relax.trainer.batching.packed_row`) instead of padded rows sharing
            each group's prompt. Pays off when response lengths are skewed; micro-batches
            with media (images, audio) keep the padded path.
        dtype: parameter dtype of the torch back end's model: ``float32`` or ``bfloat16``
            (half the bytes of weights, gradients and AdamW state, pure bf16: no float32
            master copy; LoRA adapters stay float32, peft's default). The log-probs and
            the loss are float32 either way. The colocated engine generates with these
            parameters (``mode: colocate``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    model: str = "tiny-llama"
    backend: Literal["torch", "megatron"] = "torch"
    data_parallel: Literal["ddp", "fsdp2"] = "ddp"
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    steps: int = Field(3, ge=1)
    batch_groups: int = Field(DEFAULT_BATCH_GROUPS, ge=1)
    max_staleness: int = Field(1, ge=0)
    max_tokens_per_microbatch: int = Field(4096, ge=16)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    old_logprobs: Literal["rollout", "recompute", "detached"] = "rollout"
    checkpoint_every: int = Field(1, ge=0)
    keep_checkpoints: int = Field(2, ge=1)
    num_threads: int | None = Field(None, ge=1)
    seed: int = 0
    accuracy_reward: str | None = None
    accuracy_threshold: float = 0.5
    batch_advantage: str | None = None
    batch_advantage_options: dict[str, float | bool] = Field(default_factory=dict)
    publish_bucket_bytes: int = Field(512 << 20, ge=1 << 10)
    weights_snapshot_every: int = Field(10, ge=1)
    weights_store: str | None = None
    weights_shm: bool = True
    checkpoint_store: str | None = None
    freeze: tuple[str, ...] = ()
    gradient_checkpointing: bool = False
    lora: LoraConfig | None = None
    logits_chunk_tokens: int = Field(1024, ge=0)
    packing: bool = False
    critic: CriticConfig | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _check(self):
        from relax.trainer.advantage.names import BATCH_ESTIMATORS

        if self.batch_advantage is not None and self.batch_advantage not in BATCH_ESTIMATORS:
            raise ValueError(f"batch_advantage {self.batch_advantage!r}: expected one of "
                             f"{', '.join(BATCH_ESTIMATORS)} (the other estimators are "
                             f"per group and run in the aggregator)")
        if self.critic is not None and self.batch_advantage is not None:
            raise ValueError(f"trainer.critic with batch_advantage {self.batch_advantage!r}: "
                             "the critic's GAE advantages replace the batch estimator's")
        if self.backend != "megatron" and self.megatron != MegatronConfig():
            raise ValueError(f"trainer.megatron (tp={self.megatron.tp}, pp={self.megatron.pp}) "
                             f"is for backend 'megatron'; the {self.backend} back end ignores "
                             f"it")
        if self.backend == "megatron" and self.data_parallel != "ddp":
            raise ValueError(f"trainer.data_parallel {self.data_parallel!r} is for backend "
                             f"'torch'; the megatron back end splits the model by "
                             f"trainer.megatron tp and pp")
        if self.freeze and self.backend != "torch":
            raise ValueError(f"trainer.freeze: the {self.backend} back end trains every "
                             "parameter; freeze needs backend 'torch'")
        if self.dtype != "float32" and self.backend != "torch":
            raise ValueError(f"trainer.dtype {self.dtype!r}: the {self.backend} back end "
                             "trains float32; dtype needs backend 'torch'")
        if self.packing and self.backend != "torch":
            raise ValueError(f"trainer.packing: the {self.backend} back end runs padded rows; "
                             "packing needs backend 'torch'")
        if self.lora is not None and self.backend != "torch":
            raise ValueError(f"trainer.lora: not supported by the {self.backend} back end; "
                             f"it needs backend 'torch'")
        if self.lora is not None and self.freeze:
            raise ValueError("trainer.freeze with trainer.lora: LoRA already trains only the "
                             "adapters (trainer.lora.target_modules chooses where they go)")
        if self.loss.is_mode is not None and self.old_logprobs == "rollout":
            raise ValueError("loss.is_mode corrects between trainer and rollout log-probs: it "
                             "needs old_logprobs 'recompute' (with 'rollout' the weight is 1)")
        if self.loss.policy_loss == "m2po" and self.old_logprobs != "rollout":
            raise ValueError(f"loss.policy_loss 'm2po' bounds the ratio to the behaviour policy: "
                             f"it needs old_logprobs 'rollout', not {self.old_logprobs!r} (the "
                             f"ratio to a recomputed pi_old is ~1 and would mask nothing)")
        return self


class TrainerStageConfig(BaseModel):
    """Where the trainer runs and what it writes.

    Attributes:
        run: run name.
        run_dir: run folder (checkpoints, final model, TensorBoard events).
        trainer: the trainer settings.
        weights_host: address subscribers reach the weight rendezvous at (announced with
            every version); None = this node's address as Ray knows it
            (:func:`relax.trainer.distributed.node_address`; 127.0.0.1 outside Ray and in
            single-host runs).
        weights_port: rendezvous port (0 = free).
        telemetry: TensorBoard, Prometheus and W&B (recipe block ``telemetry:``,
            :class:`~relax.trainer.telemetry.TelemetryConfig`).
        processes: trainer ranks (``relax.trainer.ranks``): data-parallel with the torch
            back end, tensor-parallel (``tp * pp``) with megatron; this process is rank 0.
        rank_hosts: the host of each rank 1..processes-1 (Ray tasks on the nodes that
            offer ``host:<name>``, each asking for ``rank_num_cpus``); None = child
            processes on this host.
        publish_weights: send each version's weights (broadcast, same-host files,
            snapshots); False: announce each policy_version only
            (:meth:`~relax.streams.weights.publisher.WeightPublisher.announce_version`),
            for a colocated trainer in a run with no other weight subscriber (set by
            ``relax.infra.recipe.specs``): no send buffer of the model's size, no
            merged LoRA copy, no snapshot.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    run: str
    run_dir: str
    trainer: TrainerConfig
    weights_host: str | None = None
    weights_port: int = 0
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    processes: int = Field(1, ge=1)
    rank_hosts: list[str] | None = None
    rank_num_cpus: float = Field(1.0, ge=0)
    publish_weights: bool = True
