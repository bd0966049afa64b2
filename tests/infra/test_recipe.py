"""A recipe reaches every stage option (infra/recipe/recipe.py, infra/recipe/specs.py); shared keys,
the kl: block and reward names are set once."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from testdata import RECIPES

from relax.consumers.aggregate_config import AggregateConfig
from relax.consumers.reference_config import ReferenceConfig
from relax.consumers.reward.stage import RewardStageConfig
from relax.consumers.rollout.config import RolloutConfig
from relax.infra.recipe.recipe import RecipeError, load_recipe
from relax.infra.recipe.sections import (
    AGGREGATE_WIRING,
    REFERENCE_WIRING,
    REWARD_WIRING,
    ROLLOUT_WIRING,
    TEACHER_WIRING,
    TRAINER_WIRING,
)
from relax.infra.recipe.specs import run_bus, stage_specs
from relax.streams.client import FETCH_WAIT_MS, BusConfig, consumer_kwargs
from relax.trainer.config import TrainerConfig, TrainerStageConfig

# stage kind -> (config class, recipe path of its section, wiring the launcher fills)
STAGES = {
    "rollout": (RolloutConfig, "rollout", ROLLOUT_WIRING),
    "reward": (RewardStageConfig, "rewards.0", REWARD_WIRING),
    "reference": (ReferenceConfig, "reference", REFERENCE_WIRING),
    "teacher": (ReferenceConfig, "teacher", TEACHER_WIRING),
    "aggregate": (AggregateConfig, "aggregate", AGGREGATE_WIRING),
    "trainer": (TrainerStageConfig, "trainer", TRAINER_WIRING),
}

SPECIAL = {  # options whose other value must come with another key, or has a rule
    ("rollout", "engine"): ("sglang", ["rollout.sglang_url=http://127.0.0.1:30000"]),
    ("rollout", "max_staleness"): (3, []),  # shared with the trainer: moves both
    ("rollout", "batch_groups"): (5, ["trainer.batch_groups=5"]),
    ("rollout", "prompt_template"): ("Q: {prompt}", []),
    ("rollout", "stop"): (["END"], []),
    ("rollout", "weights_rendezvous"): ("tcp://127.0.0.1:1234", []),
    ("rollout", "environment"): ("testdata:parity_env", []),
    ("rollout", "environment_options"): ({"turns": 2}, ["rollout.environment=calculator"]),
    ("rollout", "device"): ("cpu", []),
    ("rollout", "top_p"): (0.9, []),
    ("rollout", "partial_rollout"): (True, ["rollout.chunk_tokens=4"]),  # < max_new_tokens
    ("reference", "device"): ("cpu", []),
    ("reference", "weights_rendezvous"): ("tcp://127.0.0.1:1234", []),
    ("teacher", "device"): ("cpu", []),
    ("teacher", "model"): ("smollm2-135m", []),
    ("reward", "options"): ({"mode": "strict"}, []),
    ("reward", "memory_limit_bytes"): (1 << 30, []),
    ("trainer", "weights_host"): ("10.0.0.1", []),
}


def _other_value(field, default):
    """A valid value different from ``default`` for a plain field."""
    ann = field.annotation
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) is typing.Literal:
        return next(v for v in typing.get_args(ann) if v != default)
    base = args[0] if args else ann
    if base is bool:
        return not default
    if base is int:
        return (default or 1) + 1
    if base is float:
        return (default or 1.0) * 2 + 0.5
    if base is str:
        return "other"
    raise AssertionError(f"no test value for {field}")


def _recipe(*overrides):
    return load_recipe(RECIPES / "tiny_ci.yaml", ["reference.enabled=true", *DISTILL, *overrides])


DISTILL = ("teacher.model=tiny-llama", "advantage.distill_coef=0.5")


def _spec(recipe, stage):
    """The spec of ``stage`` (``rollout``, ``reward``, ``reference``, ``teacher``, ...: its
    name before ``-<i>`` or ``.<reward name>``)."""
    specs = stage_specs(recipe, Path("runs/x"))
    return next(s for s in specs if s.name.split("-")[0].split(".")[0] == stage)


@pytest.mark.parametrize("kind", list(STAGES))
def test_every_stage_option_is_reachable_from_a_recipe(kind):
    """Each field of each stage's config is either filled by the launcher (the wiring) or
    set by ``<section>.<field>=value`` and arrives in the process's config."""
    config, section, wiring = STAGES[kind]
    options = [n for n in config.model_fields if n not in wiring]
    assert options, kind
    for name in options:
        field = config.model_fields[name]
        value, extra = SPECIAL.get((kind, name), (None, []))
        if value is None:
            value = _other_value(field, field.default)
        override = f"{section}.{name}={value!r}" if not isinstance(value, (dict, list)) \
            else f"{section}.{name}={value}"
        spec = _spec(_recipe(override, *extra), kind)
        got = spec.config[name]
        assert got == (list(value) if isinstance(value, tuple) else value), (kind, name, got)


def test_the_trainer_section_is_the_trainer_config():
    for name, field in TrainerConfig.model_fields.items():
        if field.annotation in (int, float, bool) and name not in ("max_staleness", "batch_groups"):
            value = _other_value(field, field.default)
            spec = _spec(_recipe(f"trainer.{name}={value}"), "trainer")
            assert spec.config["trainer"][name] == value, name


def test_wiring_names_only_real_fields():
    for kind, (config, _, wiring) in STAGES.items():
        assert wiring <= set(config.model_fields), (kind, wiring - set(config.model_fields))


def test_shared_keys_fill_both_stages_and_conflicts_raise():
    r = _recipe("max_staleness=2", "trainer.batch_groups=3")
    assert (r.trainer.max_staleness, r.rollout.max_staleness) == (2, 2)
    assert _spec(r, "rollout").config["batch_groups"] == 3
    assert _spec(r, "trainer").config["trainer"]["batch_groups"] == 3
    r = _recipe("trainer.max_staleness=4")  # one place is enough: it fills the other
    assert r.rollout.max_staleness == 4 and r.max_staleness == 4
    with pytest.raises(RecipeError, match=r"max_staleness is set differently.*rollout\.max_staleness"):
        _recipe("trainer.max_staleness=2", "rollout.max_staleness=3")
    with pytest.raises(RecipeError, match="mode 'sync' needs max_staleness 0"):
        _recipe("mode=sync", "max_staleness=2")
    assert _recipe("mode=sync").rollout.max_staleness == 0


def test_one_default_for_batch_groups():
    """Before: the trainer's default batch_groups was 2 and the rollout's 8."""
    r = load_recipe(tree={"data": {"dataset": "d"}, "rewards": [{"name": "c", "fn": "gsm8k"}]})
    assert r.rollout.batch_groups == r.trainer.batch_groups == TrainerConfig().batch_groups


def test_kl_block_in_loss_turns_on_reference_and_the_join():
    r = load_recipe(RECIPES / "tiny_ci.yaml", ["kl={coef: 0.05, in: loss, estimator: k2}"])
    assert (r.trainer.loss.kl_coef, r.trainer.loss.kl_in, r.trainer.loss.kl_estimator) == \
        (0.05, "loss", "k2")
    assert r.reference.enabled and r.advantage.needs_ref  # the aggregator joins ref_logprobs
    assert r.advantage.kl_in_reward_coef == 0
    kinds = {s.kind for s in stage_specs(r, Path("r"))}
    assert "reference" in kinds


def test_kl_block_in_reward():
    r = load_recipe(RECIPES / "tiny_ci.yaml", ["kl={coef: 0.1, in: reward}"])
    assert r.advantage.kl_in_reward_coef == 0.1 and r.trainer.loss.kl_coef == 0
    assert r.reference.enabled


@pytest.mark.parametrize("overrides,match", [
    (["trainer.loss.kl_coef=0.1", "trainer.loss.kl_in=loss"], "kl_coef: 0.1 conflicts with 0.0 from the kl: block"),
    (["advantage.kl_in_reward_coef=0.1"], "kl_in_reward_coef: 0.1 conflicts"),
    (["kl={coef: 0.1, in: loss}", "reference.enabled=false"], "reference.enabled: False conflicts"),
    (["kl={coef: 0.1}"], "kl: .*needs kl.in"),
])
def test_kl_is_set_only_in_the_kl_block(overrides, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(RECIPES / "tiny_ci.yaml", overrides)


def test_a_loss_option_of_another_policy_loss_is_an_error():
    with pytest.raises(RecipeError, match="dual_clip_c applies to policy_loss ppo_clip only, not 'gspo'"):
        load_recipe(RECIPES / "tiny_ci.yaml", ["trainer.loss.policy_loss=gspo",
                                               "trainer.loss.dual_clip_c=3.0"])


def test_a_stage_rule_fails_at_load_naming_the_stage():
    with pytest.raises(RecipeError, match=r"(?s)stage rollout-0 \(rollout\).*sglang_url"):
        load_recipe(RECIPES / "tiny_ci.yaml", ["rollout.engine=sglang"])


def test_each_sglang_instance_drives_its_own_server():
    urls = ["http://10.0.0.7:30000", "http://10.0.0.8:30000"]
    r = _recipe("rollout.engine=sglang", "rollout.instances=2",
                f"rollout.sglang_urls=[{urls[0]}, {urls[1]}]", "rollout.sglang_tp_size=2")
    specs = [s for s in stage_specs(r, Path("runs/x")) if s.kind == "rollout"]
    assert [(s.config["engine_id"], s.config["sglang_url"], s.config["sglang_tp_size"])
            for s in specs] == [("rollout-0", urls[0], 2), ("rollout-1", urls[1], 2)]
    with pytest.raises(RecipeError, match="give each instance its server in rollout.sglang_urls"):
        _recipe("rollout.engine=sglang", "rollout.sglang_url=http://a:1", "rollout.instances=2")
    with pytest.raises(RecipeError, match="one SGLang server per instance, got 1"):
        _recipe("rollout.engine=sglang", "rollout.sglang_urls=[http://a:1]", "rollout.instances=2")


def test_a_dumped_recipe_loads_again_unchanged():
    r = load_recipe(RECIPES / "arith_grpo_smollm2.yaml", ["kl={coef: 0.01, in: loss}"])
    again = load_recipe(tree=r.model_dump(mode="json"))
    assert again == r


def test_bus_settings_are_recipe_keys():
    """Replication, retention and client settings reach the run's BusConfig (and with
    it every stage's config)."""
    from relax.infra.recipe.sections import BUS_WIRING

    r = _recipe("bus.replication_factor=3", "bus.min_insync_replicas=2",
                "bus.retention_ms=86400000", "bus.compression=lz4", "max_message_bytes=4194304",
                "bus.fetch_wait_ms=1000")
    bus = run_bus(r, "k1:9092,k2:9092,k3:9092", Path("runs/x"))
    assert (bus.replication_factor, bus.min_insync_replicas, bus.retention_ms, bus.compression,
            bus.max_message_bytes, bus.fetch_wait_ms) == (3, 2, 86400000, "lz4", 4194304, 1000)
    assert consumer_kwargs(bus, "g")["fetch_max_wait_ms"] == 1000
    assert consumer_kwargs(run_bus(_recipe(), "k:1", Path("r")), "g")["fetch_max_wait_ms"] \
        == FETCH_WAIT_MS
    assert bus.blob_store == str(Path("runs/x/blobs"))
    specs = stage_specs(r, Path("runs/x"))
    assert specs and not any("bus" in s.config for s in specs)  # the bus: each stage's argument
    assert set(BusConfig.model_fields) - BUS_WIRING == set(type(r.bus).model_fields)
    store = "s3://blobs/x?endpoint_override=10.0.0.1:9000"
    assert run_bus(_recipe(f"bus.blob_store={store}"), "k:1", Path("r")).blob_store == store
    with pytest.raises(RecipeError, match="min_insync_replicas 3 exceeds replication_factor 2"):
        run_bus(_recipe("bus.replication_factor=2", "bus.min_insync_replicas=3"), "k:1", Path("r"))


@pytest.mark.parametrize(("overrides", "match"), [
    (["resources.rollout.processes=2"], r"processes is for the trainer only.*\['rollout'\]"),
    (["resources.trainer.processes=2", "trainer.backend=megatron"],
     r"tp=1 x pp=1 runs 1 trainer processes: set resources.trainer.processes: 1, got 2"),
    (["trainer.backend=megatron", "trainer.megatron.tp=2"], r"processes: 2, got 1"),
    (["trainer.megatron.pp=2"], r"trainer.megatron \(tp=1, pp=2\) is for backend 'megatron'"),
    (["trainer.backend=megatron", "trainer.data_parallel=fsdp2"],
     r"data_parallel 'fsdp2' is for backend 'torch'"),
    (["resources.rollout.host=b"], r"host \(set for \['rollout'\]\) needs ray_address"),
    (["resources.rollout.host=b c"], "resources.rollout.host"),
    (["resources.trainer.processes=3", "resources.trainer.rank_hosts=[b]",
      "ray_address=h:1"], r"one host per rank 1\.\.2, got 1"),
    (["resources.trainer.processes=2", "resources.trainer.rank_hosts=[b]"], "needs ray_address"),
    (["resources.rollout.rank_hosts=[b]"], r"rank_hosts is for the trainer only"),
])
def test_placement_and_processes_are_checked(overrides, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(RECIPES / "tiny_ci.yaml", overrides)


def test_trainer_processes_and_hosts_reach_the_stages():
    r = _recipe("trainer.backend=megatron", "trainer.megatron.tp=2",
                "resources.trainer.processes=2")
    cfg = _spec(r, "trainer").config
    assert cfg["processes"] == 2 and cfg["trainer"]["megatron"] == {"tp": 2, "pp": 1}
    r = _recipe("resources.trainer.processes=2", "ray_address=10.0.0.1:6379",
                "resources.rollout.host=b")
    assert _spec(r, "trainer").config["processes"] == 2
    assert _spec(r, "rollout").resources.host == "b"
    r = _recipe("resources.trainer.processes=3", "ray_address=10.0.0.1:6379",
                "resources.trainer.rank_hosts=[b, c]", "resources.trainer.num_cpus=2")
    cfg = _spec(r, "trainer").config
    assert cfg["rank_hosts"] == ["b", "c"] and cfg["rank_num_cpus"] == 2.0


def test_the_telemetry_block_reaches_the_trainer():
    """``telemetry.*`` (W&B, Prometheus, TensorBoard) arrive in the trainer's config; a bad
    value is named with its path."""
    spec = _spec(_recipe("telemetry.prometheus_port=0", "telemetry.wandb=offline",
                         "telemetry.wandb_project=arith", "telemetry.tensorboard=false"),
                 "trainer")
    assert spec.config["telemetry"] == {"tensorboard": False, "prometheus_port": 0,
                                        "prometheus_host": "127.0.0.1",
                                        "wandb": "offline", "wandb_project": "arith",
                                        "wandb_entity": None}
    with pytest.raises(RecipeError, match="telemetry.wandb"):
        _recipe("telemetry.wandb=cloud")


def test_distillation_needs_a_teacher_and_a_coefficient_and_a_group_estimator():
    """``teacher:`` and ``advantage.distill_coef`` come together; the teacher stage is the
    reference stage with role teacher, frozen, its own model; a batch estimator (whose
    advantages the trainer recomputes) is refused."""
    base = ["reference.enabled=false"]
    spec = _spec(load_recipe(RECIPES / "tiny_ci.yaml", [*base, *DISTILL]), "teacher")
    assert spec.kind == "reference"
    assert (spec.config["role"], spec.config["model"], spec.config["follow_every"]) == \
        ("teacher", "tiny-llama", 0)
    for one in DISTILL:
        with pytest.raises(RecipeError, match="needs both a teacher: block and"):
            load_recipe(RECIPES / "tiny_ci.yaml", [*base, one])
    with pytest.raises(RecipeError, match="batch estimator 'reinforce_pp'"):
        load_recipe(RECIPES / "tiny_ci.yaml", [*base, *DISTILL, "advantage.estimator=reinforce_pp"])
    with pytest.raises(RecipeError, match="teacher.follow_every: unknown key"):
        load_recipe(RECIPES / "tiny_ci.yaml", [*base, *DISTILL, "teacher.follow_every=1"])
    agg = _spec(load_recipe(RECIPES / "tiny_ci.yaml", [*base, *DISTILL]), "aggregate")
    assert agg.config["advantage"]["distill_coef"] == 0.5


def test_the_environment_reward_is_written_by_the_rollout_stage():
    """``fn: environment``: no reward stage; the rollout writes it under that name; it
    needs rollout.environment, one at most, and eval needs a reward it can call."""
    env = ['rewards=[{name: correct, fn: environment}]', "rollout.environment=calculator"]
    specs = stage_specs(load_recipe(RECIPES / "tiny_ci.yaml", env), Path("runs/x"))
    assert [s.kind for s in specs].count("reward") == 0
    roll = next(s for s in specs if s.kind == "rollout")
    assert roll.config["environment_reward"] == "correct"
    assert roll.config["environment"] == "calculator"
    with pytest.raises(RecipeError, match="rollout.environment is not set"):
        load_recipe(RECIPES / "tiny_ci.yaml", env[:1])
    with pytest.raises(RecipeError, match="one reward may have fn 'environment'"):
        load_recipe(RECIPES / "tiny_ci.yaml", [
            'rewards=[{name: a, fn: environment}, {name: b, fn: environment}]', env[1]])
    with pytest.raises(RecipeError, match="eval.reward"):
        load_recipe(RECIPES / "calc_tool_grpo.yaml", ["eval.source=x.jsonl"])


def test_ray_address_defaults_to_the_environment_as_ray_does(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert _recipe().ray_address == "10.0.0.5:6379"
    assert _recipe("ray_address=h:1").ray_address == "h:1"  # the recipe's own wins
    monkeypatch.setenv("RAY_ADDRESS", "")
    assert _recipe().ray_address is None  # a local Ray
