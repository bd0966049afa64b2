"""The processes of a run: what each stage is, how it is configured and started.

:func:`stage_specs` turns a recipe into one :class:`StageSpec` per process
(``rollout-0``, ``reward.<name>``, ``reference``, ``aggregate``, ``trainer``);
:func:`run_stage` builds the stage from its JSON config inside whatever process
runs it (a Ray actor, a plain subprocess, a test) and runs it until told to
stop. Each stage is an independent consumer of the bus, so any of them can be
killed and restarted: Kafka hands its partitions to the survivors meanwhile and
its committed offsets tell the restarted one where to go on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from relax.infra.recipe import Recipe, Resources
from relax.streams.client import BusConfig


@dataclass(frozen=True)
class StageSpec:
    """One process of a run: ``name`` (unique), ``kind`` (a key of :data:`RUNNERS`), its
    JSON ``config`` and the ``resources`` it asks for."""

    name: str
    kind: str
    config: dict
    resources: Resources


def stage_specs(recipe: Recipe, bus: BusConfig, run_dir: Path) -> list[StageSpec]:
    """Every process the recipe asks for, trainer last."""
    run, ro, t = recipe.run, recipe.rollout, recipe.trainer
    busd = bus.model_dump()
    # co-located cores: rollouts flag their generate calls, the trainer takes the idle core
    max_threads = recipe.resources_of("trainer").max_torch_threads
    busy_dir = str(run_dir / "busy") if max_threads else None
    specs = []
    for i in range(ro.instances):
        specs.append(StageSpec(f"rollout-{i}", "rollout", dict(
            bus=busd, run=run, dataset=recipe.data.dataset, model=recipe.model,
            engine_id=f"rollout-{i}", group_size=ro.group_size, batch_groups=t.batch_groups,
            max_staleness=t.max_staleness, groups_per_generate=ro.groups_per_generate,
            max_new_tokens=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p,
            top_k=ro.top_k, stop=list(ro.stop), seed=ro.seed, epochs=ro.epochs,
            partial_rollout=ro.partial_rollout, prompt_template=ro.prompt_template,
            instance_index=i, num_instances=ro.instances, rollouts_partitions=recipe.partitions,
            busy_dir=busy_dir),
            recipe.resources_of("rollout")))
    for r in recipe.rewards:
        specs.append(StageSpec(f"reward.{r.name}", "reward", dict(
            bus=busd, run=run, reward=r.fn, name=r.name, options=r.options, workers=r.workers,
            timeout_s=r.timeout_s), recipe.resources_of("reward")))
    if recipe.reference.enabled:
        specs.append(StageSpec("reference", "reference", dict(
            bus=busd, run=run, model=recipe.model, follow_every=recipe.reference.follow_every),
            recipe.resources_of("reference")))
    specs.append(StageSpec("aggregate", "aggregate", dict(
        run=run, partitions=recipe.partitions, advantage=recipe.advantage.model_dump(),
        group_timeout_s=recipe.aggregate.group_timeout_s), recipe.resources_of("aggregate")))
    specs.append(StageSpec("trainer", "trainer", dict(
        run=run, run_dir=str(run_dir), trainer=t.model_dump(), busy_dir=busy_dir,
        max_threads=max_threads), recipe.resources_of("trainer")))
    return specs


def _rollout(config: dict, bus: BusConfig, should_stop: Callable[[], bool]) -> None:
    from relax.consumers.rollout import RolloutConfig, RolloutStage

    RolloutStage(RolloutConfig(**config)).run(should_stop)


def _reward(config: dict, bus: BusConfig, should_stop: Callable[[], bool]) -> None:
    from relax.consumers.reward.stage import RewardStage, RewardStageConfig

    RewardStage(RewardStageConfig(**config)).run(should_stop)


def _reference(config: dict, bus: BusConfig, should_stop: Callable[[], bool]) -> None:
    from relax.consumers.reference import ReferenceConfig, ReferenceStage

    ReferenceStage(ReferenceConfig(**config)).run(should_stop)


def _aggregate(config: dict, bus: BusConfig, should_stop: Callable[[], bool]) -> None:
    from relax.consumers.aggregate import AggregateConfig, AggregateStage

    AggregateStage(AggregateConfig(**config), bus).run(should_stop)


def _trainer(config: dict, bus: BusConfig, should_stop: Callable[[], bool]) -> None:
    from relax.trainer.loop import TrainerStage, TrainerStageConfig

    TrainerStage(TrainerStageConfig(**config), bus).run(should_stop)


RUNNERS: dict[str, Callable[[dict, BusConfig, Callable[[], bool]], None]] = {
    "rollout": _rollout,
    "reward": _reward,
    "reference": _reference,
    "aggregate": _aggregate,
    "trainer": _trainer,
}


def run_stage(kind: str, config: dict, bus: BusConfig, should_stop: Callable[[], bool],
              torch_threads: int | None = None, log_file: str | None = None) -> None:
    """Build stage ``kind`` from ``config`` and run it until ``should_stop()`` or its
    own end (the trainer ends after its last step).

    Raises:
        ValueError: unknown kind (lists the valid ones); whatever the stage raises.
    """
    if kind not in RUNNERS:
        raise ValueError(f"unknown stage kind {kind!r}; valid: {', '.join(RUNNERS)}")
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        logging.basicConfig(filename=log_file, level=logging.INFO, force=True,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        logging.getLogger("kafka").setLevel(logging.WARNING)
        logging.getLogger("kafka.coordinator").setLevel(logging.INFO)  # joins, assignments
    if torch_threads:
        import torch

        torch.set_num_threads(torch_threads)
    RUNNERS[kind](config, bus, should_stop)


def spec_json(spec: StageSpec) -> str:
    """A stage spec as JSON (what crosses to the process that runs it)."""
    return json.dumps({"name": spec.name, "kind": spec.kind, "config": spec.config,
                       "resources": spec.resources.model_dump()})
