"""The chaos plan's draws (:func:`relax.infra.control.chaos.plan_kills`): pure, seeded,
deterministic. The runs themselves are in ``tests/e2e/test_chaos.py``."""

from __future__ import annotations

import random

import pytest

from relax.infra.control.chaos import (
    BROKER_FAULTS,
    BROKER_NODE_LOST,
    BROKER_RESTART,
    STAGES,
    Kill,
    chaos_run,
    plan_kills,
)

STEPS, WINDOW = 12, 6
STAGES_REF = STAGES + ("reference",)


def _plans(seed: int, n: int, **kw) -> list[list[Kill]]:
    rng = random.Random(seed)
    return [plan_kills(rng, STEPS, STAGES_REF, **kw) for _ in range(n)]


def test_same_seed_same_plans_other_seed_other_plans():
    assert _plans(0, 50, window=WINDOW) == _plans(0, 50, window=WINDOW)
    assert _plans(0, 50, window=WINDOW) != _plans(1, 50, window=WINDOW)
    assert _plans(0, 20, broker=BROKER_RESTART) == _plans(0, 20, broker=BROKER_RESTART)


def test_without_window_and_broker_the_draws_are_the_first_plans():
    """Seeds named in tests/e2e/test_chaos.py (3, 11) keep the plans they were named for."""
    assert plan_kills(random.Random(11), 5) == plan_kills(random.Random(11), 5, STAGES, None, None)
    got = [plan_kills(random.Random(s), 5) for s in (3, 11)]
    assert got == [_first_plan(random.Random(s), 5) for s in (3, 11)]


def _first_plan(rng: random.Random, steps: int) -> list[Kill]:
    """plan_kills as it was before windows and broker faults (commit f443fb8)."""
    kind = rng.choice(["one", "one", "two", "twice"])
    first = rng.choice(STAGES)
    names = ([first] if kind == "one" else
             [first, rng.choice([s for s in STAGES if s != first])] if kind == "two" else
             [first, first])
    at = sorted(rng.randint(1, steps - 1) for _ in names)
    if kind == "twice" and at[0] == at[1]:
        at = [at[0], at[0] + 1] if at[0] + 1 < steps else [at[0] - 1, at[0]]
        at = [max(1, a) for a in at]
    return [Kill(n, a, round(rng.uniform(0.0, 2.0), 2)) for n, a in zip(names, at)]


def test_window_draws_early_and_late_kills_of_every_stage():
    kills = [k for plan in _plans(0, 2000, window=WINDOW) for k in plan]
    steps = [k.after_step for k in kills]
    assert min(steps) == 1 and max(steps) == STEPS - 1
    late = sum(s > WINDOW for s in steps) / len(steps)
    # even odds (0.496 for seed 0), not the 5/11 of a uniform draw (0.466 for seed 0)
    assert 0.485 < late < 0.515, late
    assert {k.stage for k in kills} == set(STAGES_REF)
    assert all(0.0 <= k.delay_s <= 2.0 for k in kills)


def test_two_kills_of_one_stage_never_share_a_step():
    for plan in _plans(5, 400, window=WINDOW):
        if len(plan) == 2 and plan[0].stage == plan[1].stage:
            assert plan[0].after_step < plan[1].after_step, plan
        assert [k.after_step for k in plan] == sorted(k.after_step for k in plan)


@pytest.mark.parametrize("fault", BROKER_FAULTS)
def test_a_broker_plan_is_that_one_fault_early_or_late(fault):
    plans = _plans(2, 200, window=WINDOW, broker=fault)
    assert all(len(p) == 1 and p[0].stage == fault for p in plans)
    steps = {p[0].after_step for p in plans}
    assert steps == set(range(1, STEPS))  # every step, early and late


def test_bad_plan_arguments_name_what_was_expected():
    with pytest.raises(ValueError, match="steps >= 2, got 1"):
        plan_kills(random.Random(0), 1)
    with pytest.raises(ValueError, match=r"window must be in 1..steps-2 = 1..10 .* got 11"):
        plan_kills(random.Random(0), STEPS, window=STEPS - 1)
    with pytest.raises(ValueError, match="unknown broker fault 'broker:gone'; valid: "
                                         "broker:restart, broker:node-lost"):
        plan_kills(random.Random(0), STEPS, broker="broker:gone")


def test_a_broker_fault_needs_the_kafka_it_fires_on(tmp_path):
    """Refused before anything starts (no broker, no stage process is needed)."""
    from testdata import tiny_recipe

    from relax.infra.broker.local import BrokerHandle, KafkaNode

    recipe = tiny_recipe("127.0.0.1:1", tmp_path, "r")
    with pytest.raises(ValueError, match="need the handle of the local Apache Kafka"):
        chaos_run(recipe, [Kill(BROKER_RESTART, 1, 0.0)])
    one = BrokerHandle(1, "127.0.0.1", 1, "", 0.0, nodes=[KafkaNode(1, 1, 2)])
    with pytest.raises(ValueError, match="needs a 3-node Kafka cluster .* got 1 node"):
        chaos_run(recipe, [Kill(BROKER_NODE_LOST, 1, 0.0)], broker=one)
