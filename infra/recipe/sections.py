"""Recipe sections made of the stages' own configs (docs/architecture.md, "Recipe").

Each stage owns one frozen pydantic config with its defaults (``RolloutConfig``,
``RewardStageConfig``, ``ReferenceConfig``, ``AggregateConfig``,
``TrainerConfig``/``TrainerStageConfig``). Its recipe section is that config minus the
*wiring* (what the launcher fills: bus, run, ids, partitions, the shared model), made
by :func:`section_of`, so every option of every stage is a recipe key and a
``key=value`` override, with the stage's own default (``tests/infra/test_recipe.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from relax.consumers.aggregate_config import AggregateConfig
from relax.consumers.reference_config import ReferenceConfig
from relax.consumers.reward.stage import RewardStageConfig
from relax.consumers.rollout.config import RolloutConfig
from relax.streams.client import BusConfig
from relax.trainer.config import TrainerConfig, TrainerStageConfig


class StrictModel(BaseModel):
    """A frozen model that rejects unknown keys (every recipe section)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RecipeError(ValueError):
    """A recipe that does not validate; the message lists each bad key with its path."""


ENVIRONMENT_REWARD = "environment"
"""``rewards[].fn`` of the reward the rollout environment gives (no reward stage)."""


class Resources(StrictModel):
    """What one process of a stage asks Ray for, and its torch threads."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    torch_threads: int | None = Field(None, ge=1)
    host: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]+$",
        description="run on the Ray node that offers the custom resource 'host:<host>' "
        "(`ray start --resources '{\"host:<host>\": 1000}'`); None = wherever Ray places it")
    processes: int = Field(
        1, ge=1, description="trainer only: trainer ranks (trainer/ranks.py; gloo on CPU, "
        "nccl on GPU): data-parallel with backend torch, tp x pp with backend megatron; more "
        "rollout processes come from rollout.instances")
    rank_hosts: list[str] | None = Field(
        None, description="trainer only: the host of each rank 1..processes-1 (Ray nodes "
        "offering 'host:<name>'; each rank asks for num_cpus there); None = child processes "
        "on the trainer's host")


def section_of(config: type[BaseModel], title: str, wiring: frozenset[str], doc: str,
               base: type[BaseModel] = StrictModel, /, **extra) -> type[BaseModel]:
    """A recipe section made of a stage's own config: every field of ``config`` except
    ``wiring`` (what the launcher fills: bus, run, ids, ...), with the stage's types,
    defaults and descriptions, plus ``extra`` fields (``name=(type, Field(...))``).

    The stage's own validators run when :func:`relax.infra.recipe.specs.stage_specs` builds
    the config (:func:`load_recipe` does so, so a bad value fails at load time).
    """
    fields = {n: (f.annotation, f) for n, f in config.model_fields.items() if n not in wiring}
    fields.update(extra)
    return create_model(title, __base__=base, __doc__=doc, **fields)


ROLLOUT_WIRING = frozenset({"run", "dataset", "model", "engine_id", "rollouts_partitions",
                            "environment_reward"})
REWARD_WIRING = frozenset({"run", "reward", "name"})
REFERENCE_WIRING = frozenset({"run", "model", "role"})
TEACHER_WIRING = frozenset({"run", "role", "member_id", "follow_every",
                            "weights_rendezvous"})
AGGREGATE_WIRING = frozenset({"run", "partitions", "advantage"})
TRAINER_WIRING = frozenset({"run", "run_dir", "trainer", "processes", "rank_hosts",
                            "rank_num_cpus", "telemetry"})
BUS_WIRING = frozenset({"bootstrap_servers", "max_message_bytes"})
"""Per stage, the fields of its config the launcher fills (from the recipe's top level,
``data``, ``advantage``, ``resources`` and the process's place in the run); every other
field is a key of the stage's recipe section (``tests/infra/test_recipe.py`` checks it)."""

class _RolloutBase(StrictModel):
    """The rollout section's own rules: one SGLang server per instance."""

    @model_validator(mode="after")
    def _servers(self):
        urls, n = self.sglang_urls, self.instances
        if urls and self.engine != "sglang":
            raise ValueError(f"rollout.sglang_urls needs rollout.engine: sglang, got "
                             f"{self.engine!r}")
        if urls and len(urls) != n:
            raise ValueError(f"rollout.sglang_urls: one SGLang server per instance, got "
                             f"{len(urls)} for rollout.instances {n}")
        if len(set(urls)) != len(urls):
            raise ValueError(f"rollout.sglang_urls: a server drives one instance (it joins "
                             f"the weight broadcast once), got {urls}")
        if self.engine == "sglang" and n > 1 and not urls and self.follow_weights:
            raise ValueError(f"rollout.instances {n} on engine sglang: give each instance "
                             f"its server in rollout.sglang_urls (one sglang_url would join "
                             f"the weight broadcast {n} times)")
        return self


RolloutSection = section_of(
    RolloutConfig, "RolloutSection", ROLLOUT_WIRING,
    "Sampling: every option of ``RolloutConfig`` (``consumers/rollout``) plus ``instances`` "
    "and ``sglang_urls``.", _RolloutBase,
    instances=(int, Field(1, ge=1, description="rollout processes (consumer group members)")),
    sglang_urls=(list[str], Field(default_factory=list, description=(
        "engine sglang: the server of each instance (instance i drives sglang_urls[i]; "
        "else every instance drives sglang_url); the control API's engine_urls add and "
        "remove servers"))))

RewardSpec = section_of(
    RewardStageConfig, "RewardSpec", REWARD_WIRING,
    "One reward consumer: ``fn`` (a REWARD_FNS name or ``module:function``) scored under "
    "``name``; ``weight`` counts it in the final reward (0 = recorded only); every other "
    "option of ``RewardStageConfig`` (``consumers/reward/stage.py``). ``fn: environment`` "
    "is the reward of ``rollout.environment``: no consumer, the rollout stage writes it.",
    name=(str, Field(description="reward_name on the rows; the name every other key uses")),
    fn=(str, Field(description="a REWARD_FNS name, module:function, or environment (the "
                               "rollout environment's reward)")),
    weight=(float, Field(1.0, description="weight in the final reward (0 = recorded only)")))

ReferenceSection = section_of(
    ReferenceConfig, "ReferenceSection", REFERENCE_WIRING,
    "Reference log-probs (on whenever the KL penalty is): ``ReferenceConfig``'s options.",
    enabled=(bool, Field(False, description="run the reference stage")))

TeacherSection = section_of(
    ReferenceConfig, "TeacherSection", TEACHER_WIRING,
    "The teacher of on-policy distillation (``advantage.distill_coef`` > 0): the reference "
    "stage with ``role: teacher`` and its own frozen model; ``ReferenceConfig``'s options.",
    model=(str, Field(description="the teacher model: a folder (e.g. a run's final_model), "
                                  "a built-in name or a Hub id; must share the policy's "
                                  "tokenizer")))

AggregateSection = section_of(
    AggregateConfig, "AggregateSection", AGGREGATE_WIRING,
    "Join of rollouts, rewards and reference log-probs: ``AggregateConfig``'s options "
    "(its advantage settings are the recipe's ``advantage`` section).")

TrainerSection = section_of(
    TrainerStageConfig, "TrainerSection", TRAINER_WIRING,
    "The trainer: ``TrainerConfig`` plus the trainer stage's own options "
    "(``TrainerStageConfig``: weight rendezvous address; telemetry is the recipe's "
    "``telemetry`` block).",
    TrainerConfig)
BusSection = section_of(
    BusConfig, "BusSection", BUS_WIRING,
    "Client and topic settings of the run's bus (``BusConfig``): replication factor, "
    "min.insync.replicas, retention, compression, consumer-group timeouts. The cluster "
    "and the message size are the top-level ``bootstrap_servers`` / ``max_message_bytes``.",
    StrictModel,
    blob_store=(str | None, Field(
        None, description="where values over max_message_bytes (images, audio) go: a "
        "folder or a pyarrow.fs URI (s3://bucket/prefix?endpoint_override=host:port). "
        "None = <run folder>/blobs, which only stages on the driver's host can read: "
        "a run across hosts needs a store every host reaches")))

TRAINER_STAGE_KEYS = frozenset(TrainerSection.model_fields) - frozenset(TrainerConfig.model_fields)


class KLSection(StrictModel):
    """The KL penalty to the reference policy, set in one place.

    ``in: loss`` adds ``coef * KL`` to the loss (``trainer.loss.kl_*``; the aggregator
    joins ``ref_logprobs`` onto the train samples); ``in: reward`` subtracts it from the
    reward (``advantage.kl_in_reward_coef``). Either turns the reference stage on.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              serialize_by_alias=True)
    coef: float = Field(0.0, ge=0, description="beta, weight of the KL (0 = off)")
    in_: Literal["loss", "reward"] | None = Field(None, alias="in")
    estimator: str | None = Field(None, description="k1 | k2 | k3 (| low_var_kl in the loss); "
                                  "None = the stage's default")

    @model_validator(mode="after")
    def _check(self):
        if self.coef and self.in_ is None:
            raise ValueError("kl.coef > 0 needs kl.in: loss or reward")
        return self


class StuckConfig(StrictModel):
    """When a run that cannot train ends (:mod:`relax.infra.control.stuck`); recipe section
    ``stuck:``."""

    failed_groups: int | None = Field(
        16, ge=1, description="the run fails when every row of a counted reward in its last "
        "this many groups (x rollout.group_size rows, polls in a row) failed; None = never")
    unscored_s: float | None = Field(
        600.0, gt=0, description="the run fails when a counted reward scored no row for this "
        "long (seconds) while groups sampled after its last scored row waited; None = never")
