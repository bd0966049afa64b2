"""The processes of a run: what each stage is and how it is configured.

:func:`stage_specs` turns a recipe into one :class:`StageSpec` per process
(``rollout-0``, ``reward.<name>``, ``reference``, ``eval``, ``aggregate``, ``trainer``;
``mode: colocate`` makes rollout-0 and the trainer one ``colocate`` process named
``trainer``, :mod:`relax.infra.control.colocate`), each config checked by its stage's own
config class (the eval stage's, :class:`EvalStageConfig`, is here, so the check needs no
stage); :func:`relax.infra.control.runners.run_stage_process` builds the stage from its JSON
config inside whatever process runs it (a Ray actor, a plain subprocess, a test) and runs
it until told to stop. Each stage is an independent consumer of the bus, so any of them
can be killed and restarted: Kafka hands its partitions to the survivors meanwhile and its
committed offsets tell the restarted one where to go on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from relax.infra.recipe.sections import (
    ENVIRONMENT_REWARD,
    TRAINER_STAGE_KEYS,
    RecipeError,
    Resources,
    RewardSpec,
)
from relax.producers.media import VIDEO_FPS, VIDEO_MAX_FRAMES, MediaOptions
from relax.schemas import topics
from relax.streams.client import BusConfig
from relax.streams.fsuri import is_local
from relax.trainer.telemetry import TelemetryConfig

Recipe = BaseModel
"""What ``recipe`` is here: a :class:`relax.infra.recipe.recipe.Recipe`. Not imported:
``load_recipe`` checks its stage configs with this module, so an import back would close a
circle; these functions read the recipe's fields only."""


CONTRACT_STAGES: dict[str, tuple[str, str]] = {
    "rollout": ("relax.consumers.rollout.stage:RolloutStage",
                "relax.consumers.rollout.config:RolloutConfig"),
    "reward": ("relax.consumers.reward.stage:RewardStage",
               "relax.consumers.reward.stage:RewardStageConfig"),
    "reference": ("relax.consumers.reference:ReferenceStage",
                  "relax.consumers.reference_config:ReferenceConfig"),
    "aggregate": ("relax.consumers.aggregate:AggregateStage",
                  "relax.consumers.aggregate_config:AggregateConfig"),
    "trainer": ("relax.trainer.loop:TrainerStage", "relax.trainer.config:TrainerStageConfig"),
    "eval": ("relax.infra.control.eval_stage:EvalStage",
             "relax.infra.recipe.specs:EvalStageConfig"),
}
"""The stages on the stage contract (:mod:`relax.streams.stage_contract`) by kind, as
``(module:Stage, module:Config)``: the one table the controller's runners
(:mod:`relax.infra.control.runners`), ``relax stage KIND`` and the config checks below
read. Every stage of a run is here but the colocated one, which runs a rollout and a
trainer of this table in one process (:mod:`relax.infra.control.colocate`). The eval
stage's module is above this one (``infra/control``); it is named, not imported, here.
Each class declares its ``config_type`` (the second entry names the same class:
``tests/streams/test_stage_contract.py``) and its topics; it is made as
``Class(config_type(**config), bus)``. Both are imported when asked for
(:func:`stage_class`, :func:`stage_config_type`): the stages bring torch and their
engines, their configs do not (the driver and the reward stage run without torch)."""


def _load(kind: str, which: int) -> type:
    import importlib

    if kind not in CONTRACT_STAGES:
        raise ValueError(f"unknown stage kind {kind!r}; valid: {', '.join(CONTRACT_STAGES)}")
    module, _, name = CONTRACT_STAGES[kind][which].partition(":")
    return getattr(importlib.import_module(module), name)


def stage_class(kind: str) -> type:
    """The stage class of ``kind`` (:data:`CONTRACT_STAGES`).

    Raises:
        ValueError: ``kind`` is not a contract stage (lists the valid ones).
    """
    return _load(kind, 0)


def stage_config_type(kind: str) -> type:
    """The config class of stage ``kind`` (its ``config_type``) without importing the
    stage's own module (:data:`CONTRACT_STAGES`).

    Raises:
        ValueError: ``kind`` is not a contract stage (lists the valid ones).
    """
    return _load(kind, 1)


@dataclass(frozen=True)
class StageSpec:
    """One process of a run: ``name`` (unique), ``kind`` (a key of
    :data:`relax.infra.control.runners.RUNNERS`), its JSON ``config`` and the
    ``resources`` it asks for."""

    name: str
    kind: str
    config: dict
    resources: Resources


class PromptSource(BaseModel):
    """A prompt source as ``relax publish`` reads it (``data`` and ``eval`` keys of the
    same names): ``limit`` rows at most (None = all)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str
    prompt_field: str = "question"
    label_field: str | None = "answer"
    image_field: str | None = None
    audio_field: str | None = None
    video_field: str | None = None
    video_fps: float = Field(VIDEO_FPS, gt=0)
    video_max_frames: int = Field(VIDEO_MAX_FRAMES, ge=1)
    limit: int | None = Field(None, ge=1)

    def media(self) -> MediaOptions:
        """The media columns to read, and the frames kept of a clip."""
        fields = ((self.image_field, "image"), (self.audio_field, "audio"),
                  (self.video_field, "video"))
        return MediaOptions(fields=tuple((f, k) for f, k in fields if f),
                            video_fps=self.video_fps, video_max_frames=self.video_max_frames)


class EvalStageConfig(BaseModel):
    """Settings of the eval stage (made from the recipe's ``eval`` section; see
    :class:`relax.infra.recipe.recipe.EvalConfig`).

    Attributes:
        run: run name. run_dir: the run folder (TensorBoard, W&B).
        model: the policy model (its architecture; the weights come from the channel).
        every: evaluate every policy_version that is a multiple of this (>= 1).
        held_out: the eval prompts' source; ``size``: how many of its prompts.
        training: the training prompts' source (its prompts are left out), or None.
        reward: the eval reward (``eval.reward``, else the first counted reward).
        prompt_template, max_new_tokens (tokens), batch_size (prompts per engine call),
        threshold (a reward value > threshold is correct): as ``eval.*``.
        telemetry: TensorBoard and W&B settings (the Prometheus port is the trainer's).
        member_id: id in the weight group. device: default cuda if available.
        weights_rendezvous: ``tcp://host:port`` of the publisher (None: learnt from the
            first announcement).
        max_pending: versions kept waiting for their eval (each a copy of the model).
        poll_timeout_s: seconds per loop turn waiting for a version.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str
    run_dir: str
    model: str
    every: int = Field(ge=1)
    held_out: PromptSource
    size: int = Field(ge=1)
    training: PromptSource | None = None
    reward: RewardSpec
    prompt_template: str = "{prompt}"
    max_new_tokens: int = Field(16, ge=1)
    batch_size: int = Field(50, ge=1)
    threshold: float = 0.5
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    member_id: str = "eval-0"
    device: str | None = None
    weights_rendezvous: str | None = None
    max_pending: int = Field(2, ge=1)
    poll_timeout_s: float = Field(1.0, gt=0)


def _checked(what: str, config: type[BaseModel], values: dict) -> dict:
    """``values`` validated by the stage's own ``config`` class, as JSON-ready data.

    Raises:
        RecipeError: naming ``what`` (e.g. ``stage rollout-0 (rollout)``) and the complaint.
    """
    try:
        return config(**values).model_dump(mode="json")
    except ValidationError as e:
        lines = [f"{'.'.join(map(str, x['loc'])) or '(config)'}: {x['msg']}" for x in e.errors()]
        raise RecipeError(f"invalid recipe: {what}:\n  " + "\n  ".join(lines)) from None


def stage_specs(recipe: Recipe, run_dir: Path) -> list[StageSpec]:
    """Every process the recipe asks for, trainer last: each stage's config is its recipe
    section plus the wiring (``relax.infra.recipe.sections.*_WIRING``), checked by the
    stage's own config class. No config holds the bus: the controller gives each stage
    the run's (:func:`run_bus`) as its argument.

    Raises:
        RecipeError: a stage config does not validate.
    """
    RolloutConfig, RewardStageConfig, ReferenceConfig, AggregateConfig, TrainerStageConfig = (
        stage_config_type(k) for k in ("rollout", "reward", "reference", "aggregate", "trainer"))

    run, ro = recipe.run, recipe.rollout
    specs = []
    options = ro.model_dump(exclude={"instances", "sglang_urls"})
    for i in range(ro.instances):
        name = f"rollout-{i}"
        server = {"sglang_url": ro.sglang_urls[i]} if ro.sglang_urls else {}
        if recipe.mode == "colocate":  # the engine shares the trainer's parameters
            options["follow_weights"] = False
        config = _checked(f"stage {name} (rollout)", RolloutConfig, dict(
            options, **server, run=run, dataset=recipe.data.dataset,
            model=recipe.model, engine_id=name,
            rollouts_partitions=recipe.partitions,
            environment_reward=recipe.environment_reward()))
        specs.append(StageSpec(name, "rollout", config, recipe.resources_of("rollout")))
    for r in recipe.rewards:
        if r.fn == ENVIRONMENT_REWARD:  # written by the rollout stage
            continue
        name = f"reward.{r.name}"
        options = r.model_dump(exclude={"fn", "weight"})
        config = _checked(f"stage {name} (reward)", RewardStageConfig,
                          dict(options, run=run, reward=r.fn))
        specs.append(StageSpec(name, "reward", config, recipe.resources_of("reward")))
    if recipe.reference.enabled:
        options = recipe.reference.model_dump(exclude={"enabled"})
        specs.append(StageSpec("reference", "reference", _checked(
            "stage reference (reference)", ReferenceConfig,
            dict(options, run=run, model=recipe.model)),
            recipe.resources_of("reference")))
    if recipe.teacher is not None:
        specs.append(StageSpec("teacher", "reference", _checked(
            "stage teacher (reference)", ReferenceConfig,
            dict(recipe.teacher.model_dump(), run=run, role="teacher",
                 member_id="teacher-0")), recipe.resources_of("teacher")))
    if recipe.eval is not None and recipe.eval.every:
        specs.append(StageSpec("eval", "eval", _eval_config(recipe, run_dir),
                               recipe.resources_of("eval")))
    specs.append(StageSpec("aggregate", "aggregate", _checked(
        "stage aggregate (aggregate)", AggregateConfig, dict(
            recipe.aggregate.model_dump(), run=run, partitions=recipe.partitions,
            advantage=recipe.advantage.model_dump())), recipe.resources_of("aggregate")))
    trainer = recipe.trainer.model_dump(exclude=TRAINER_STAGE_KEYS)
    stage = recipe.trainer.model_dump(include=TRAINER_STAGE_KEYS)
    if stage["weights_host"] is None and not recipe.ray_address:
        stage["weights_host"] = "127.0.0.1"  # one host: loopback (else the Ray node's address)
    config = _checked("stage trainer (trainer)", TrainerStageConfig, dict(
        stage, run=run, run_dir=str(run_dir), trainer=trainer,
        processes=recipe.resources_of("trainer").processes,
        rank_hosts=recipe.resources_of("trainer").rank_hosts,
        rank_num_cpus=recipe.resources_of("trainer").num_cpus,
        telemetry=recipe.telemetry.model_dump()))
    if recipe.mode == "colocate":  # rollout-0 and the trainer: one process, named trainer
        rollout = specs.pop(0)
        # weights go to no other process unless a stage subscribes: versions only
        config["publish_weights"] = bool(
            (recipe.reference.enabled and recipe.reference.follow_every)
            or (recipe.eval is not None and recipe.eval.every))
        specs.append(StageSpec("trainer", "colocate", {"run": run, "rollout": rollout.config,
                                                       "trainer": config},
                               recipe.resources_of("trainer")))
        return specs
    specs.append(StageSpec("trainer", "trainer", config, recipe.resources_of("trainer")))
    return specs


def _eval_config(recipe: Recipe, run_dir: Path) -> dict:
    """The eval stage's config (``eval.every``): the ``eval`` section, the training
    prompts to leave out, the eval reward, the rollout's prompt template."""
    ev, d = recipe.eval, recipe.data
    media = {"prompt_field", "label_field", "image_field", "audio_field", "video_field"}
    frames = {"video_fps": d.video_fps, "video_max_frames": d.video_max_frames}
    return _checked("stage eval (eval)", EvalStageConfig, {
        "run": recipe.run, "run_dir": str(run_dir), "model": recipe.model,
        "every": ev.every, "held_out": {**ev.model_dump(include=media | {"source"}), **frames},
        "size": ev.size,
        "training": ({**d.model_dump(include=media | {"source", "limit"}), **frames}
                     if d.source else None),
        "reward": recipe.eval_reward()[1].model_dump(),
        "prompt_template": recipe.rollout.prompt_template,
        "max_new_tokens": ev.max_new_tokens, "batch_size": ev.batch_size,
        "threshold": ev.threshold, "telemetry": recipe.telemetry.model_dump(),
        "max_pending": ev.max_pending})


def run_topics(recipe: Recipe) -> dict[str, int]:
    """Every topic of the run with its partition count
    (:func:`relax.schemas.topics.run_topic_partitions`), and the errors topic of its
    prompts topic (1)."""
    parts = topics.run_topic_partitions(recipe.run, recipe.partitions)
    parts[topics.errors_topic(topics.prompts_topic(recipe.data.dataset))] = 1
    return parts


def run_bus(recipe: Recipe, bootstrap: str, run_dir: Path) -> BusConfig:
    """The run's :class:`BusConfig`: ``bootstrap`` (the recipe's cluster or the local
    broker), the recipe's ``max_message_bytes`` and ``bus`` section, the blob store
    ``bus.blob_store`` (None: ``<run_dir>/blobs``)."""
    return BusConfig(**_checked("section bus", BusConfig, dict(
        recipe.bus.model_dump(), bootstrap_servers=bootstrap,
        max_message_bytes=recipe.max_message_bytes,
        blob_store=recipe.bus.blob_store or str(run_dir / "blobs"))))


def disk_warnings(recipe: Recipe, bus: BusConfig, nodes: dict[str, str | None],
                  here: str) -> list[str]:
    """What a run whose stages sit on several hosts (``nodes``: stage -> host address;
    ``here``: the driver's) would lose to a folder only one host has, one line per
    recipe key to set; [] on one host or when every such key names a remote store (a
    local path every host mounts, NFS say, is fine too: each line says so)."""
    hosts = sorted({h for h in nodes.values() if h})
    trainer = nodes.get("trainer")
    t = recipe.trainer
    out = []
    if len(hosts) > 1 and bus.blob_store and is_local(bus.blob_store):
        out.append(f"bus.blob_store: stages run on {len(hosts)} hosts ({', '.join(hosts)}) "
                   f"but values over max_message_bytes (images, audio) go to "
                   f"{bus.blob_store}, a folder only its own host reads unless every host "
                   f"mounts it; set a store every host reaches "
                   f"(s3://bucket/prefix?endpoint_override=host:port)")
    if trainer and len(hosts) > 1 and (t.weights_store is None or is_local(t.weights_store)):
        out.append(f"trainer.weights_store: a rollout engine that starts late on a host "
                   f"other than the trainer's ({trainer}) cannot read the weight "
                   f"snapshots in a folder there unless every host mounts it; set a "
                   f"store every host reaches")
    if trainer and trainer != here and (t.checkpoint_store is None
                                         or is_local(t.checkpoint_store)):
        out.append(f"trainer.checkpoint_store: the trainer runs on {trainer}, not on this "
                   f"host ({here}): its checkpoints and final model stay on its disk, so "
                   f"this run's accounting and eval after cannot read them here, and a "
                   f"restart on another host starts from scratch (unless every host "
                   f"mounts that folder); set a store every host reaches")
    return out


def check_stage_configs(recipe: Recipe) -> None:
    """Validate every stage config the recipe makes (with a placeholder bus and run folder).

    Raises:
        RecipeError: naming the stage and the bad key.
    """
    run_dir = Path("runs") / recipe.run
    run_bus(recipe, "localhost:9092", run_dir)  # the bus section's own checks
    stage_specs(recipe, run_dir)


def spec_json(spec: StageSpec) -> str:
    """A stage spec as JSON (what crosses to the process that runs it)."""
    return json.dumps({"name": spec.name, "kind": spec.kind, "config": spec.config,
                       "resources": spec.resources.model_dump()})
