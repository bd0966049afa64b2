"""Dynamic credit on the real broker: the claim log ``<run>.rollout_claims``
(:mod:`relax.consumers.rollout.claims`) and two rollout instances sharing one credit."""

from __future__ import annotations

import threading
import time

import pytest
from stagerun import StageRunner as _Runner
from stagerun import publish_prompts as _publish_prompts
from stagerun import trainer_progress as _trainer_progress
from stagerun import wait_for as _wait
from testdata import prompt_rows

from relax.consumers.rollout.claims import ClaimLog
from relax.consumers.rollout.config import RolloutConfig
from relax.consumers.rollout.credit import ClaimLedger
from relax.consumers.rollout.stage import RolloutStage
from relax.schemas import topics
from relax.streams.producer import BatchProducer
from relax.streams.read import read_partition, read_table


def test_racing_claims_on_the_broker_agree_and_never_exceed_the_allowance(bus, unique):
    """Three claimants on threads, 40 claims each under a growing allowance: every one
    of them (and a reader started afterwards) holds the same ledger, the grants each saw
    are those of the log order, and no group_id is granted twice."""
    producers = [BatchProducer(bus) for _ in range(3)]
    logs = [ClaimLog(bus, unique, f"rollout-{i}", producers[i]) for i in range(3)]
    got: dict[int, list[str]] = {i: [] for i in range(3)}

    def claim(i: int) -> None:
        for k in range(40):
            logs[i].poll(0)
            got[i] += logs[i].claim([f"p{i}-{k}", f"p{(i + 1) % 3}-{k}"], allowance=20 + k)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    late = ClaimLog(bus, unique, "late", producers[0])
    for cl in logs:
        cl.poll(1.0)
    try:
        granted = [cl.ledger.granted for cl in logs]
        assert granted[0] == granted[1] == granted[2] == late.ledger.granted
        assert late.granted == 20 + 39  # the last claims' allowance, used to the end
        assert late.claims_read == 120
        # replaying the records gives the grants each claimant was told
        replay, seen = ClaimLedger(), {i: [] for i in range(3)}
        import json

        for m in read_partition(bus, topics.rollout_claims_topic(unique), 0):
            r = json.loads(m.value)
            seen[int(r["engine_id"].split("-")[1])] += replay.apply(r["group_ids"], r["allowance"])
        assert seen == got
    finally:
        for cl in logs + [late]:
            cl.close()
        for p in producers:
            p.close()


def test_a_bad_claim_record_is_skipped_by_every_reader(bus, unique, caplog):
    p = BatchProducer(bus)
    first = ClaimLog(bus, unique, "rollout-0", p)
    p.send_value(topics.rollout_claims_topic(unique), b"not json")
    p.flush()
    assert first.claim(["a", "b"], allowance=1) == ["a"]
    second = ClaimLog(bus, unique, "rollout-1", p)
    assert second.granted == 1 and second.claims_read == 1
    assert any("expected {claim, group_ids, allowance} JSON" in r.message for r in caplog.records)
    first.close(), second.close(), p.close()


class _SlowEngine:
    """Wraps an engine: every generate call sleeps ``delay_s`` first."""

    def __init__(self, engine, delay_s: float):
        self._engine, self._delay = engine, delay_s

    def generate(self, prompts, params):
        time.sleep(self._delay)
        return self._engine.generate(prompts, params)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.mark.timeout(300)
def test_a_fast_instance_takes_the_credit_a_slow_one_leaves(bus, unique):
    """Two instances in one consumer group, one prompt partition each, one credit of
    B = 8 groups: the slow instance (6 s per engine call) starts 1 or 2 groups while the
    fast one starts the rest (a fixed share would have held it at 4); never more than the
    credit; when the trainer reports the 8 decided, the remaining 8 prompts are sampled;
    the slow instance leaves in the middle and the fast one samples what it left. Every
    prompt's group exactly once.

    The prompts are keyed by prompt_id: p0000-p0015 hash 10 to one partition and 6 to
    the other, and which instance holds which is the group's choice, so the fast one has
    6 or 10 of its own. The credit comes once each instance holds its partition (with
    both partitions, the slow one would start every group it had queued before a
    rebalance gave the fast one its share: the stage polls between engine calls)."""
    from relax.consumers.rollout.sampling import build_engine

    rows = prompt_rows(16, dataset=unique)
    rows = [dict(r, messages=None) for r in rows]
    _publish_prompts(bus, unique, rows, partitions=2)
    base = dict(run=unique, dataset=unique, group_size=1, batch_groups=4,
                max_staleness=1, max_new_tokens=3, follow_weights=False, metrics_every_s=0.5,
                groups_per_generate=1)
    fast_cfg = RolloutConfig(**base, engine_id="rollout-0")
    slow_cfg = RolloutConfig(**base, engine_id="rollout-1")
    fast = RolloutStage(fast_cfg, bus)
    slow = RolloutStage(slow_cfg, bus, engine=_SlowEngine(build_engine(slow_cfg), 6.0))
    _trainer_progress(bus, unique, consumed=0, needed=0)  # no credit until both are in
    runners = [_Runner(slow), _Runner(fast)]
    try:
        _wait(lambda: [r.check() for r in runners] and fast.stats.budget_waits > 0
              and slow.stats.budget_waits > 0 and fast.prompt_partitions() == 1
              and slow.prompt_partitions() == 1,
              what="both instances waiting for credit, a prompt partition each")
        _trainer_progress(bus, unique, consumed=0, needed=16)
        _wait(lambda: [r.check() for r in runners] and fast.stats.groups + slow.stats.groups >= 8,
              what="8 groups")
        time.sleep(3.0)
        first = (fast.stats.groups, slow.stats.groups)
        assert sum(first) == 8  # the credit, not more
        assert first[0] >= 5 and first[1] <= 3, first  # a fixed share: 4 and 4
        assert fast.groups_in_flight() == slow.groups_in_flight() == 8
        _trainer_progress(bus, unique, consumed=8, needed=8)
        _wait(lambda: [r.check() for r in runners] and fast.stats.groups + slow.stats.groups >= 9,
              what="groups on new credit")
        runners[0].stop()  # the slow instance leaves
        _wait(lambda: runners[1].check() or fast.stats.groups + slow.stats.groups >= 16,
              timeout_s=120, what="all 16 groups")
        time.sleep(2.0)
    finally:
        for r in runners:
            r.stop()
    gids = read_table(bus, topics.run_topic(unique, "rollouts")).column("group_id").to_pylist()
    assert sorted(gids) == sorted(f"{r['prompt_id']}:0" for r in rows)
    assert fast.stats.groups + slow.stats.groups == 16
    print(f"first credit: fast {first[0]}, slow {first[1]}; in all: fast {fast.stats.groups}, "
          f"slow {slow.stats.groups}; claims refused: fast {fast.stats.claims_refused}, "
          f"slow {slow.stats.claims_refused}")


@pytest.mark.timeout(180)
def test_groups_granted_to_a_dead_instance_are_sampled_with_the_credit_all_spent(bus, unique):
    """The wedge of CI's chaos run (rollout-0 killed while sampling the last groups the
    credit allowed): an instance died after its claim was granted and before it produced
    the groups, so the claim log holds the run's whole allowance and the trainer needs
    exactly those groups. Its successor gets the prompts again and samples them on the
    old grants, taking no new credit (before the fix it waited for credit forever)."""
    rows = [dict(r, messages=None) for r in prompt_rows(4, dataset=unique)]
    _publish_prompts(bus, unique, rows)
    gids = [f"{r['prompt_id']}:0" for r in rows]
    p = BatchProducer(bus)
    dead = ClaimLog(bus, unique, "rollout-0", p)
    assert dead.claim(gids, allowance=4) == gids  # granted; never produced, never committed
    dead.close(), p.close()
    # B = (1 + 1) * 2 = 4 and the trainer needs 4: allowance 4, all granted, budget 0
    _trainer_progress(bus, unique, consumed=0, needed=4)
    cfg = RolloutConfig(run=unique, dataset=unique, group_size=1, batch_groups=2,
                        max_staleness=1, max_new_tokens=3, follow_weights=False,
                        metrics_every_s=0.5, groups_per_generate=1, engine_id="rollout-0")
    stage = RolloutStage(cfg, bus)
    runner = _Runner(stage)
    try:
        _wait(lambda: runner.check() or stage.stats.groups >= 4, timeout_s=60,
              what="the 4 granted groups sampled")
        time.sleep(1.0)
        assert stage.budget() == 0 and stage.groups_in_flight() == 4
    finally:
        runner.stop()
    got = read_table(bus, topics.run_topic(unique, "rollouts")).column("group_id").to_pylist()
    assert sorted(got) == sorted(gids)
    late = ClaimLog(bus, unique, "late", BatchProducer(bus))
    try:
        assert late.granted == 4 and late.claims_read == 5  # the dead one's and 4 regrants
    finally:
        late.close()
