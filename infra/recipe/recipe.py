"""Recipes: one YAML file that describes a whole run, with dotted overrides.

``relax train RECIPE.yaml key=value ...`` loads the YAML, applies the overrides
(``trainer.optim.lr=2e-5``, ``rollout.group_size=4``; values are parsed as YAML
scalars), then validates everything with pydantic: an unknown key or a bad value
is reported with its dotted path and the valid choices.

A recipe is the composition of the stages' own configs (docs/architecture.md,
"Recipe"): the sections ``rollout``, ``rewards[]``, ``reference``, ``aggregate`` and
``trainer`` carry every option of ``RolloutConfig``, ``RewardStageConfig``,
``ReferenceConfig``, ``AggregateConfig`` and ``TrainerConfig``/``TrainerStageConfig``
with the stage's own defaults (:func:`section_of`); the launcher fills the rest (the
``*_WIRING`` sets). A small shared block fills the stages where they leave a key
absent and raises when two places disagree:

* ``max_staleness`` and ``batch_groups`` (top level, ``rollout.*``, ``trainer.*``);
  ``mode`` chooses sync (``max_staleness = 0``: the rollout waits for every new
  policy_version, strictly on-policy), async (``max_staleness >= 1``) or colocate
  (``max_staleness = 0``, the trainer and the rollout in one process).
* ``model`` (top level, ``trainer.model``).
* reward names: declared once in ``rewards[].name``; ``advantage.rewards`` (default:
  every reward with its weight) and ``trainer.accuracy_reward`` must use those names
  (checked with the valid names listed by ``relax.infra.recipe.preflight``).
* ``kl:`` the KL penalty (``coef``, ``in: loss|reward``, ``estimator``) fills
  ``trainer.loss.kl_*`` or ``advantage.kl_*`` and turns the reference stage on (with
  ``advantage.estimator: gae`` and ``in: reward``, ``trainer.critic.kl_*``: per token).
* ``advantage.estimator: gae`` turns on PPO's critic (``trainer.critic``, its
  ``estimator_options`` ``gamma`` and ``lam`` filled in; the critic's optimizer and value
  loss are set under ``trainer.critic``).
"""

from __future__ import annotations

import os
import re
import time
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from relax.consumers.aggregate_config import AdvantageConfig
from relax.infra.recipe.overrides import parse_override, set_dotted
from relax.infra.recipe.sections import (  # ENVIRONMENT_REWARD, RecipeError, Resources: re-exported
    ENVIRONMENT_REWARD,
    AggregateSection,
    BusSection,
    KLSection,
    RecipeError,
    ReferenceSection,
    Resources,
    RewardSpec,
    RolloutSection,
    StrictModel,
    StuckConfig,
    TeacherSection,
    TrainerSection,
)
from relax.producers.media import VIDEO_FPS, VIDEO_MAX_FRAMES, MediaOptions
from relax.streams.http_token import check_bind
from relax.trainer.config import TrainerConfig
from relax.trainer.telemetry import TelemetryConfig

STAGES = ("rollout", "reward", "reference", "teacher", "aggregate", "trainer", "eval")
"""Stage names of a run (each one or more processes)."""


class DataConfig(StrictModel):
    """Training prompts: published into ``prompts.<dataset>`` before the run if the topic
    is empty (a file, a saved HF dataset, ``hf://...`` or ``reasoning_gym:TASK?...``);
    ``image_field`` / ``audio_field`` / ``video_field``: columns holding media (``relax
    publish --image-field``); ``video_fps`` / ``video_max_frames``: the frames publish
    keeps of each clip (``relax publish --video-fps``, ``--video-max-frames``)."""

    dataset: str
    source: str | None = None
    prompt_field: str = "question"
    label_field: str | None = "answer"
    image_field: str | None = None
    audio_field: str | None = None
    video_field: str | None = None
    video_fps: float = Field(VIDEO_FPS, gt=0, description="video frames kept per second of video")
    video_max_frames: int = Field(VIDEO_MAX_FRAMES, ge=1, description="most frames kept of one "
                                  "video")
    limit: int | None = Field(None, ge=1)
    partitions: int = Field(4, ge=1)

    def media(self) -> MediaOptions:
        """How publish reads the prompts' media
        (:class:`relax.producers.media.MediaOptions`)."""
        fields = ((self.image_field, "image"), (self.audio_field, "audio"),
                  (self.video_field, "video"))
        return MediaOptions(fields=tuple((f, k) for f, k in fields if f),
                            video_fps=self.video_fps, video_max_frames=self.video_max_frames)


class EvalConfig(StrictModel):
    """Greedy held-out accuracy before and after training, and every ``every`` policy_versions
    during it (``every`` 0 = never; else the eval stage, :mod:`relax.infra.control.eval_stage`,
    evaluates the trainer's versions every, 2 * every, ... as the run goes on; each result
    is a row of ``<run>.metrics``, component ``eval``, as ``before``'s is at version 0).

    ``source`` is read like a data source; prompts that also appear in the training
    data are removed (the same text and the same media), then the first ``size`` are used.
    ``image_field`` / ``audio_field`` / ``video_field`` name media columns as in ``data``
    (a clip's frames are sampled by ``data.video_fps`` and ``data.video_max_frames``, as
    the training prompts' are). Correct = the reward ``reward`` (default: the first
    counted reward not given by the environment) gives a value > ``threshold``."""

    source: str
    size: int = Field(200, ge=1)
    prompt_field: str = "question"
    label_field: str = "answer"
    image_field: str | None = None
    audio_field: str | None = None
    video_field: str | None = None
    max_new_tokens: int = Field(16, ge=1)
    batch_size: int = Field(50, ge=1)
    reward: RewardSpec | None = None
    threshold: float = 0.5
    before: bool = True
    after: bool = True
    every: int = Field(0, ge=0)
    max_pending: int = Field(2, ge=1, description="eval.every: versions kept waiting for their "
                             "eval (each a copy of the model); the oldest is dropped past it")


    def media(self, data: DataConfig) -> MediaOptions:
        """How the held-out prompts' media are read: this section's columns, ``data``'s
        frame rule (:class:`relax.producers.media.MediaOptions`)."""
        fields = ((self.image_field, "image"), (self.audio_field, "audio"),
                  (self.video_field, "video"))
        return MediaOptions(fields=tuple((f, k) for f, k in fields if f),
                            video_fps=data.video_fps, video_max_frames=data.video_max_frames)


class ApiSection(StrictModel):
    """The run's control API (``relax.infra.control.scale_api``): scale rollout instances live."""

    enabled: bool = True
    host: str = Field("127.0.0.1", description="address to listen on (another than loopback "
                      "needs $RELAX_API_TOKEN)")
    port: int = Field(0, ge=0, le=65535, description="TCP port (0 = a free one)")

    @model_validator(mode="after")
    def _token_for_wide_bind(self) -> ApiSection:
        if self.enabled:
            check_bind(self.host, "api.host")
        return self


class Recipe(StrictModel):
    """A whole run.

    Attributes:
        run: run name (topics ``<run>.*``); default: the recipe file name and a time stamp.
        mode: ``sync`` (max_staleness 0), ``async`` (max_staleness >= 1) or ``colocate``
            (max_staleness 0; the trainer and one HF rollout engine in one process on the
            same parameters, :mod:`relax.infra.control.colocate`).
        bootstrap_servers: Kafka cluster; None = start a local broker for the run.
        bus: replication, retention and client settings of the run's topics
            (:data:`relax.infra.recipe.sections.BusSection`).
        partitions: partition count of the run's co-partitioned topics.
        run_root: folder under which ``<run>/`` is written.
        model: the policy model (trainer, rollout, reference, eval).
        max_staleness / batch_groups: shared by the rollout and the trainer (module
            docstring); None here = taken from those sections or their defaults.
        kl: the KL penalty (:class:`KLSection`).
        teacher: the teacher stage of on-policy distillation (:data:`TeacherSection`);
            None = no distillation. Needs ``advantage.distill_coef`` > 0 and the reverse.
        ray_address: Ray cluster address (``ray://host:10001`` or ``host:6379``); default
            ``$RAY_ADDRESS`` as Ray's own tools read it; None = a local Ray on 127.0.0.1.
        api: the control API served while the run trains (:class:`ApiSection`).
        telemetry: the trainer's step metrics to TensorBoard, Prometheus and W&B
            (:class:`~relax.trainer.telemetry.TelemetryConfig`; W&B offline into
            ``<run>/wandb`` unless the user has a W&B key).
        max_restarts: restarts allowed per stage process before the run fails.
        stall_timeout_s: a stage alive but stuck this long (seconds; its loop inside one
            call, or input waiting and nothing committed) is restarted, counting against
            ``max_restarts`` (``relax.infra.control.watch``).
        step_timeout_s: the run fails with a report of every stage when no optimizer
            step happened for this long (seconds; None = never).
        stuck: when a run whose counted reward fails every row, or scores none, fails
            with one line naming it (:class:`~relax.infra.recipe.sections.StuckConfig`).
    """

    run: str | None = None
    mode: Literal["sync", "async", "colocate"] = "async"
    bootstrap_servers: str | None = None
    partitions: int = Field(4, ge=1)
    max_message_bytes: int = Field(1 << 20, ge=1024)
    bus: BusSection = Field(default_factory=BusSection)
    run_root: str = "runs"
    model: str = "tiny-llama"
    max_staleness: int | None = Field(None, ge=0)
    batch_groups: int | None = Field(None, ge=1)
    kl: KLSection = Field(default_factory=KLSection)
    data: DataConfig
    eval: EvalConfig | None = None
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    rewards: list[RewardSpec]
    reference: ReferenceSection = Field(default_factory=ReferenceSection)
    teacher: TeacherSection | None = None
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    aggregate: AggregateSection = Field(default_factory=AggregateSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    resources: dict[str, Resources] = Field(default_factory=dict)
    ray_address: str | None = Field(default_factory=lambda: os.environ.get("RAY_ADDRESS") or None)
    api: ApiSection = Field(default_factory=ApiSection)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    max_restarts: int = Field(3, ge=0)
    stall_timeout_s: float = Field(300.0, gt=0)
    step_timeout_s: float | None = Field(1800.0, gt=0)
    stuck: StuckConfig = Field(default_factory=StuckConfig)

    @model_validator(mode="after")
    def _check(self):
        bad = set(self.resources) - set(STAGES)
        if bad:
            raise ValueError(f"resources: unknown stage(s) {sorted(bad)}; valid: {', '.join(STAGES)}")
        multi = [s for s, r in self.resources.items() if r.processes > 1 and s != "trainer"]
        if multi:
            raise ValueError(f"resources: processes is for the trainer only (use "
                             f"rollout.instances for rollouts), set for {sorted(multi)}")
        placed = sorted(s for s, r in self.resources.items() if r.host)
        if placed and not self.ray_address:
            raise ValueError(f"resources.<stage>.host (set for {placed}) needs ray_address: a "
                             f"Ray cluster whose nodes offer the resources host:<name>")
        tr = self.resources_of("trainer")
        other = sorted(s for s, r in self.resources.items() if r.rank_hosts and s != "trainer")
        if other:
            raise ValueError(f"resources: rank_hosts is for the trainer only, set for {other}")
        if tr.rank_hosts is not None:
            if len(tr.rank_hosts) != tr.processes - 1:
                raise ValueError(f"resources.trainer.rank_hosts: one host per rank 1.."
                                 f"{tr.processes - 1}, got {len(tr.rank_hosts)}")
            if not self.ray_address:
                raise ValueError("resources.trainer.rank_hosts needs ray_address: a Ray "
                                 "cluster whose nodes offer the resources host:<name>")
        if self.trainer.backend == "megatron":
            mp = self.trainer.megatron
            if tr.processes != mp.tp * mp.pp:
                raise ValueError(f"trainer.backend megatron with trainer.megatron tp={mp.tp} x "
                                 f"pp={mp.pp} runs {mp.tp * mp.pp} trainer processes: set "
                                 f"resources.trainer.processes: {mp.tp * mp.pp}, got "
                                 f"{tr.processes}")
        ms = self.trainer.max_staleness
        if self.mode == "sync" and ms != 0:
            raise ValueError(f"mode 'sync' needs max_staleness 0, got {ms}")
        if self.mode == "async" and ms < 1:
            raise ValueError("mode 'async' needs max_staleness >= 1 (use mode: sync for 0)")
        if self.mode == "colocate":
            self._check_colocate()
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"rewards: names must be unique, got {names}")
        slow = [r.name for r in self.rewards if r.timeout_s >= self.stall_timeout_s]
        if slow:  # a reward call may take its timeout_s inside one turn of the stage loop
            raise ValueError(f"stall_timeout_s {self.stall_timeout_s:g} must exceed the "
                             f"timeout_s of rewards {slow}")
        env = [r.name for r in self.rewards if r.fn == ENVIRONMENT_REWARD]
        if len(env) > 1:
            raise ValueError(f"rewards: one reward may have fn {ENVIRONMENT_REWARD!r}, got {env}")
        if env and self.rollout.environment is None:
            raise ValueError(f"rewards: {env[0]!r} has fn {ENVIRONMENT_REWARD!r} (the rollout "
                             "environment's reward) but rollout.environment is not set")
        if self.eval is not None and self.eval.reward is None and not any(
                r.weight and r.fn != ENVIRONMENT_REWARD for r in self.rewards):
            raise ValueError("eval.reward: every counted reward is the environment's (fn: "
                             "environment), which greedy single-turn eval cannot call; set "
                             "eval.reward")
        if not any(r.weight for r in self.rewards):
            raise ValueError("rewards: at least one reward needs a weight != 0")
        distill = self.advantage.distill_coef > 0
        if distill != (self.teacher is not None):
            raise ValueError("on-policy distillation needs both a teacher: block and "
                             "advantage.distill_coef > 0 (one is set without the other)")
        if (self.trainer.critic is not None) != (self.advantage.estimator == "gae"):
            raise ValueError("trainer.critic is PPO's critic: it is on exactly when "
                             "advantage.estimator is gae (set the estimator, not the block "
                             "alone)")
        if distill and self.trainer.critic is not None:
            raise ValueError("advantage.distill_coef with advantage.estimator gae: the "
                             "critic's GAE advantages replace the aggregator's and would drop "
                             "the teacher's term; use a group estimator (grpo, rloo, ...)")
        if distill and self.trainer.batch_advantage is not None:
            raise ValueError(f"advantage.distill_coef with the batch estimator "
                             f"{self.trainer.batch_advantage!r}: the trainer recomputes its "
                             "advantages per batch and would drop the teacher's term; use a "
                             "group estimator (grpo, rloo, ...)")
        if self.trainer.model != self.model:
            raise ValueError(f"trainer.model {self.trainer.model!r} differs from model "
                             f"{self.model!r}: set only model")
        return self

    def eval_reward(self) -> tuple[str, RewardSpec]:
        """The eval reward and its recipe key: ``eval.reward``, else the first counted
        reward not given by the environment (``("rewards.<i>", spec)``)."""
        if self.eval is not None and self.eval.reward is not None:
            return "eval.reward", self.eval.reward
        return next((f"rewards.{i}", r) for i, r in enumerate(self.rewards)
                    if r.weight and r.fn != ENVIRONMENT_REWARD)

    def environment_reward(self) -> str | None:
        """The name of the reward with ``fn: environment``, or None."""
        return next((r.name for r in self.rewards if r.fn == ENVIRONMENT_REWARD), None)

    def _check_colocate(self) -> None:
        """``mode: colocate`` runs one HF engine on the torch back end's model in one
        trainer process, strictly on-policy.

        Raises:
            ValueError: naming the first key it cannot run with.
        """
        ro, tr = self.rollout, self.trainer
        bad = [("max_staleness", self.trainer.max_staleness, 0),
               ("rollout.instances", ro.instances, 1),
               ("rollout.engine", ro.engine, "hf"),
               ("trainer.backend", tr.backend, "torch"),
               ("resources.trainer.processes", self.resources_of("trainer").processes, 1)]
        for key, got, want in bad:
            if got != want:
                raise ValueError(f"mode 'colocate' needs {key} {want!r} (one engine on the "
                                 f"trainer's own parameters), got {got!r}")

    def resources_of(self, stage: str) -> Resources:
        """Resources of ``stage`` (defaults when the recipe gives none)."""
        return self.resources.get(stage, Resources())


def _unwrap(t) -> type[BaseModel] | None:
    if isinstance(t, type) and issubclass(t, BaseModel):
        return t
    for arg in typing.get_args(t):
        found = _unwrap(arg)
        if found is not None:
            return found
    return None


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Recipe
    for p in loc:
        if isinstance(p, int):
            continue
        field = model.model_fields.get(str(p)) if model else None
        if field is None:
            return None
        model = _unwrap(field.annotation)
    return model


def _explain(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            model = _model_at(err["loc"][:-1])
            hint = f"; valid keys here: {', '.join(sorted(model.model_fields))}" if model else ""
            lines.append(f"{loc}: unknown key{hint}")
        else:
            lines.append(f"{loc or '(recipe)'}: {err['msg']}")
    return "invalid recipe:\n  " + "\n  ".join(lines)


SHARED_KEYS = {"max_staleness": ("rollout", "trainer"), "batch_groups": ("rollout", "trainer")}
"""Top-level keys shared by stage sections: one value fills them all."""


def _section(tree: dict, path: str) -> dict:
    """The dict at dotted ``path`` of ``tree`` (created when absent)."""
    node = tree
    for k in path.split("."):
        if node.get(k) is None:
            node[k] = {}
        node = node[k]
        if not isinstance(node, dict):
            raise RecipeError(f"{path}: expected a mapping, got {node!r}")
    return node


def _fill(tree: dict, values: dict[str, Any], why: str) -> None:
    """Set each dotted key of ``values`` in ``tree`` where absent; raise where the tree
    gives another value (``why`` names the one place the value belongs)."""
    for path, want in values.items():
        where, _, key = path.rpartition(".")
        node = _section(tree, where) if where else tree
        if key in node and node[key] is not None and node[key] != want:
            raise RecipeError(f"{path}: {node[key]!r} conflicts with {want!r} from {why}")
        node[key] = want


def _fill_shared(tree: dict) -> None:
    """One value for each :data:`SHARED_KEYS` key, from wherever the recipe sets it (the
    top level, a section, ``mode: sync`` for max_staleness, else the trainer's default)."""
    for key, sections in SHARED_KEYS.items():
        given = {key: tree.get(key)} if tree.get(key) is not None else {}
        for sec in sections:
            node = tree.get(sec)
            if isinstance(node, dict) and node.get(key) is not None:
                given[f"{sec}.{key}"] = node[key]
        if len(set(given.values())) > 1:
            raise RecipeError(f"{key} is set differently in {given}: set it once, at the top level")
        if given:
            value = next(iter(given.values()))
        elif key == "max_staleness" and tree.get("mode") in ("sync", "colocate"):
            value = 0
        else:
            value = TrainerConfig.model_fields[key].default
        tree[key] = value
        _fill(tree, {f"{sec}.{key}": value for sec in sections}, f"the top-level {key}")


def _fill_kl(tree: dict) -> None:
    """Spread the ``kl:`` block over the stages (:class:`KLSection`)."""
    try:
        kl = KLSection.model_validate(tree.get("kl") or {})
    except ValidationError as e:
        raise RecipeError("invalid recipe:\n  " + "\n  ".join(
            f"kl.{'.'.join(map(str, err['loc']))}: {err['msg']}".replace("kl.: ", "kl: ")
            for err in e.errors())) from None
    values: dict[str, Any] = {"trainer.loss.kl_coef": 0.0, "advantage.kl_in_reward_coef": 0.0}
    if kl.in_ == "loss":
        values.update({"trainer.loss.kl_coef": kl.coef, "trainer.loss.kl_in": "loss",
                       "advantage.ref_logprobs": True})
        if kl.estimator:
            values["trainer.loss.kl_estimator"] = kl.estimator
    elif kl.in_ == "reward" and (tree.get("advantage") or {}).get("estimator") == "gae":
        # PPO's critic: the KL per token in the token rewards (veRL), not a sum in the reward
        values.update({"trainer.critic.kl_coef": kl.coef, "advantage.ref_logprobs": True})
        if kl.estimator:
            values["trainer.critic.kl_estimator"] = kl.estimator
    elif kl.in_ == "reward":
        values["advantage.kl_in_reward_coef"] = kl.coef
        if kl.estimator:
            values["advantage.kl_estimator"] = kl.estimator
    if kl.coef:
        values["reference.enabled"] = True
    _fill(tree, values, "the kl: block (set the KL penalty only there)")


def _fill_batch_advantage(tree: dict) -> None:
    """An estimator whose statistics span the global batch (REINFORCE++) runs in the
    trainer: ``advantage.estimator`` fills ``trainer.batch_advantage`` and its options."""
    from relax.trainer.advantage.names import BATCH_ESTIMATORS

    adv = tree.get("advantage") or {}
    if adv.get("estimator") in BATCH_ESTIMATORS:
        _fill(tree, {"trainer.batch_advantage": adv["estimator"],
                     "trainer.batch_advantage_options": adv.get("estimator_options") or {}},
              "advantage.estimator (a batch estimator runs in the trainer; set it there only)")


def _fill_critic(tree: dict) -> None:
    """``advantage.estimator: gae`` turns on PPO's critic in the trainer
    (``trainer.critic``, :mod:`relax.trainer.critic`), ``advantage.estimator_options``
    ``gamma`` and ``lam`` going to it."""
    adv = tree.get("advantage") or {}
    if adv.get("estimator") != "gae":
        return
    opts = adv.get("estimator_options") or {}
    unknown = sorted(set(opts) - {"gamma", "lam"})
    if unknown:
        raise RecipeError(f"advantage.estimator_options: {unknown} are not options of gae "
                          "(valid: gamma, lam)")
    trainer = _section(tree, "trainer")
    if trainer.get("critic") is None:
        trainer["critic"] = {}
    _fill(tree, {f"trainer.critic.{k}": v for k, v in opts.items()},
          "advantage.estimator_options (GAE's gamma and lam; set them there only)")


def _reward_weights(tree: dict) -> None:
    """``advantage.rewards`` defaults to every reward with a weight != 0."""
    if "rewards" in (tree.get("advantage") or {}):
        return
    weights = {r["name"]: r.get("weight", 1.0) for r in tree.get("rewards", [])
               if isinstance(r, dict) and "name" in r and r.get("weight", 1.0)}
    if weights:
        _section(tree, "advantage")["rewards"] = weights


def load_recipe(path: str | Path | None = None, overrides: list[str] = (),
                tree: dict | None = None) -> Recipe:
    """Read a recipe file (or ``tree``), apply ``key=value`` overrides, fill the shared
    block (module docstring), validate the recipe and every stage config it makes.

    Raises:
        RecipeError: listing every bad key (with the valid keys) or value, or two places
            that disagree on a shared key; a recipe file that is not YAML.
        ValueError: an override that is not ``key=value`` with a YAML value.
        FileNotFoundError: no such recipe file.
    """
    tree = dict(tree or {})
    if path is not None:
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as e:
            raise RecipeError(f"{path}: not YAML ({' '.join(str(e).split())})") from None
        if not isinstance(tree, dict):
            raise RecipeError(f"{path}: a recipe is a YAML mapping")
    for o in overrides:
        k, v = parse_override(o)
        set_dotted(tree, k, v)
    if "model" in tree:
        _fill(tree, {"trainer.model": tree["model"]}, "the top-level model")
    if "run" not in tree or tree["run"] is None:
        stem = Path(path).stem if path else "run"
        tree["run"] = re.sub(r"[^A-Za-z0-9_-]", "-", f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        _fill_shared(tree)
        _fill_kl(tree)
        _fill_batch_advantage(tree)
        _fill_critic(tree)
        _reward_weights(tree)
        recipe = Recipe.model_validate(tree)
    except ValidationError as e:
        raise RecipeError(_explain(e)) from None
    from relax.infra.recipe.specs import check_stage_configs

    check_stage_configs(recipe)
    return recipe
