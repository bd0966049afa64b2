"""Recipes: one YAML file that describes a whole run, with dotted overrides.

``relax train RECIPE.yaml key=value ...`` loads the YAML, applies the overrides
(``trainer.optim.lr=2e-5``, ``rollout.group_size=4``; values are parsed as YAML
scalars), then validates everything with pydantic: an unknown key or a bad value
is reported with its dotted path and the valid choices.

``mode`` chooses sync (``max_staleness = 0``, the rollout stage waits for every
new policy_version: strictly on-policy) or async (``max_staleness >= 1``, stages
overlap). Same code, different values.
"""

from __future__ import annotations

import re
import time
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from relax.consumers.advantage.samples import AdvantageConfig
from relax.trainer.config import TrainerConfig

STAGES = ("rollout", "reward", "reference", "aggregate", "trainer")
"""Stage names of a run (each one or more processes)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataConfig(_Strict):
    """Training prompts: published into ``prompts.<dataset>`` before the run if the topic
    is empty (a file, a saved HF dataset, ``hf://...`` or ``reasoning_gym:TASK?...``)."""

    dataset: str
    source: str | None = None
    prompt_field: str = "question"
    label_field: str | None = "answer"
    limit: int | None = Field(None, ge=1)
    partitions: int = Field(4, ge=1)


class RewardSpec(_Strict):
    """One reward consumer: ``fn`` (a REWARD_FNS name or ``module:function``) scored
    under ``name``; ``weight`` counts it in the final reward (0 = recorded only)."""

    name: str
    fn: str
    weight: float = 1.0
    options: dict[str, Any] = Field(default_factory=dict)
    workers: int = Field(1, ge=1)
    timeout_s: float = Field(30.0, gt=0)


class EvalConfig(_Strict):
    """Greedy held-out accuracy before and after training.

    ``source`` is read like a data source; prompts that also appear in the training
    data are removed, then the first ``size`` are used. Correct = the reward ``reward``
    (default: the first counted reward) gives a value > ``threshold``."""

    source: str
    size: int = Field(200, ge=1)
    prompt_field: str = "question"
    label_field: str = "answer"
    max_new_tokens: int = Field(16, ge=1)
    batch_size: int = Field(50, ge=1)
    reward: RewardSpec | None = None
    threshold: float = 0.5
    before: bool = True
    after: bool = True


class RolloutSection(_Strict):
    """Sampling (see ``consumers/rollout.py``)."""

    group_size: int = Field(8, ge=1)
    groups_per_generate: int = Field(1, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    stop: tuple[str, ...] = ()
    prompt_template: str = "{prompt}"
    instances: int = Field(1, ge=1)
    epochs: int = Field(100, ge=1)
    partial_rollout: bool = False
    seed: int | None = None


class ReferenceSection(_Strict):
    """Reference log-probs (needed when the KL penalty is on)."""

    enabled: bool = False
    follow_every: int = Field(0, ge=0)


class AggregateSection(_Strict):
    """Join of rollouts, rewards and reference log-probs."""

    group_timeout_s: float = Field(300.0, gt=0)


class Resources(_Strict):
    """What one process of a stage asks Ray for, and its torch threads."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    torch_threads: int | None = Field(None, ge=1)
    max_torch_threads: int | None = Field(
        None, ge=1, description="trainer only: threads while no rollout engine of the run "
        "generates (co-located stages, trainer/cores.py); None = torch_threads always")

    @model_validator(mode="after")
    def _check_threads(self):
        if self.max_torch_threads is not None and self.max_torch_threads < (self.torch_threads or 1):
            raise ValueError(f"max_torch_threads {self.max_torch_threads} is below torch_threads "
                             f"{self.torch_threads or 1}")
        return self


class Recipe(_Strict):
    """A whole run.

    Attributes:
        run: run name (topics ``<run>.*``); default: the recipe file name and a time stamp.
        mode: ``sync`` (max_staleness 0) or ``async`` (max_staleness >= 1).
        bootstrap_servers: Kafka cluster; None = start a local broker for the run.
        partitions: partition count of the run's co-partitioned topics.
        run_root: folder under which ``<run>/`` is written.
        model: the policy model (trainer, rollout, reference, eval).
        ray_address: Ray cluster address; None = a local Ray on 127.0.0.1.
        max_restarts: restarts allowed per stage process before the run fails.
        stall_timeout_s: a stage alive but stuck this long (seconds; its loop inside one
            call, or input waiting and nothing committed) is restarted, counting against
            ``max_restarts`` (``relax.infra.watch``).
        step_timeout_s: the run fails with a report of every stage when no optimizer
            step happened for this long (seconds; None = never).
    """

    run: str | None = None
    mode: Literal["sync", "async"] = "async"
    bootstrap_servers: str | None = None
    partitions: int = Field(4, ge=1)
    max_message_bytes: int = Field(1 << 20, ge=1024)
    run_root: str = "runs"
    model: str = "tiny-llama"
    data: DataConfig
    eval: EvalConfig | None = None
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    rewards: list[RewardSpec]
    reference: ReferenceSection = Field(default_factory=ReferenceSection)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    aggregate: AggregateSection = Field(default_factory=AggregateSection)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    resources: dict[str, Resources] = Field(default_factory=dict)
    ray_address: str | None = None
    max_restarts: int = Field(3, ge=0)
    stall_timeout_s: float = Field(300.0, gt=0)
    step_timeout_s: float | None = Field(1800.0, gt=0)

    @model_validator(mode="after")
    def _check(self):
        bad = set(self.resources) - set(STAGES)
        if bad:
            raise ValueError(f"resources: unknown stage(s) {sorted(bad)}; valid: {', '.join(STAGES)}")
        elastic = [s for s, r in self.resources.items() if r.max_torch_threads and s != "trainer"]
        if elastic:
            raise ValueError(f"resources: max_torch_threads is for the trainer only, set for "
                             f"{sorted(elastic)}")
        ms = self.trainer.max_staleness
        if self.mode == "sync" and ms != 0:
            raise ValueError(f"mode 'sync' needs trainer.max_staleness 0, got {ms}")
        if self.mode == "async" and ms < 1:
            raise ValueError("mode 'async' needs trainer.max_staleness >= 1 (use mode: sync for 0)")
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"rewards: names must be unique, got {names}")
        slow = [r.name for r in self.rewards if r.timeout_s >= self.stall_timeout_s]
        if slow:  # a reward call may take its timeout_s inside one turn of the stage loop
            raise ValueError(f"stall_timeout_s {self.stall_timeout_s:g} must exceed the "
                             f"timeout_s of rewards {slow}")
        if not any(r.weight for r in self.rewards):
            raise ValueError("rewards: at least one reward needs a weight != 0")
        if self.trainer.model != self.model:
            raise ValueError(f"trainer.model {self.trainer.model!r} differs from model "
                             f"{self.model!r}: set only model")
        if self.advantage.needs_ref or (self.trainer.loss.kl_in == "loss" and self.trainer.loss.kl_coef):
            if not self.reference.enabled:
                raise ValueError("the KL penalty needs reference.enabled: true")
        if self.advantage.kl_in_reward_coef and self.trainer.loss.kl_in == "loss" \
                and self.trainer.loss.kl_coef:
            raise ValueError("KL is configured both in the reward (advantage.kl_in_reward_coef) and "
                             "in the loss (trainer.loss.kl_coef): use one")
        return self

    def resources_of(self, stage: str) -> Resources:
        """Resources of ``stage`` (defaults when the recipe gives none)."""
        return self.resources.get(stage, Resources())


def set_dotted(tree: dict, path: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``path = "a.b.c"`` (creating dicts)."""
    keys = path.split(".")
    node = tree
    for k in keys[:-1]:
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise ValueError(f"override {path!r}: {k!r} is not a section")
        node = nxt
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=1e-5"`` -> ``("a.b", 1e-05)`` (the value is read as YAML).

    Raises:
        ValueError: without ``=`` or with an empty key.
    """
    key, eq, raw = text.partition("=")
    if not eq or not key.strip():
        raise ValueError(f"override {text!r}: expected key=value (e.g. trainer.steps=3)")
    value = yaml.safe_load(raw) if raw.strip() else None
    if isinstance(value, str) and re.fullmatch(r"[-+]?\d*\.?\d+([eE][-+]?\d+)?", value):
        value = float(value)  # YAML 1.1 reads 2e-5 as a string
    return key.strip(), value


class RecipeError(ValueError):
    """A recipe that does not validate; the message lists each bad key with its path."""


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


def load_recipe(path: str | Path | None = None, overrides: list[str] = (),
                tree: dict | None = None) -> Recipe:
    """Read a recipe file (or ``tree``), apply ``key=value`` overrides, validate.

    The top-level ``model`` also fills ``trainer.model`` when that is not given.

    Raises:
        RecipeError: listing every bad key (with the valid keys) or value.
        FileNotFoundError: no such recipe file.
    """
    tree = dict(tree or {})
    if path is not None:
        tree = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(tree, dict):
            raise RecipeError(f"{path}: a recipe is a YAML mapping")
    for o in overrides:
        k, v = parse_override(o)
        set_dotted(tree, k, v)
    tree.setdefault("trainer", {})
    if isinstance(tree["trainer"], dict) and "model" in tree:
        tree["trainer"].setdefault("model", tree["model"])
    if isinstance(tree["trainer"], dict) and tree.get("mode") == "sync":
        tree["trainer"].setdefault("max_staleness", 0)
    if "run" not in tree or tree["run"] is None:
        stem = Path(path).stem if path else "run"
        tree["run"] = re.sub(r"[^A-Za-z0-9_-]", "-", f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    if "advantage" not in tree or "rewards" not in (tree.get("advantage") or {}):
        weights = {r["name"]: r.get("weight", 1.0) for r in tree.get("rewards", [])
                   if isinstance(r, dict) and "name" in r and r.get("weight", 1.0)}
        if weights:
            tree.setdefault("advantage", {})
            tree["advantage"] = {**(tree["advantage"] or {}), "rewards": weights}
    try:
        return Recipe.model_validate(tree)
    except ValidationError as e:
        raise RecipeError(_explain(e)) from None
