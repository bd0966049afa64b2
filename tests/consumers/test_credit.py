"""The rollout stage's credit maths (``relax.consumers.rollout.credit``): plain numbers in,
numbers out, no broker."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from relax.consumers.rollout import RolloutConfig, RolloutStage
from relax.consumers.rollout.credit import (
    consumed_since,
    credit_left,
    groups_in_flight,
    groups_per_call,
    inherited_in_flight,
    instance_budget,
    oldest_usable_version,
    share,
)


def test_share_splits_a_total_into_near_equal_parts_that_sum_to_it():
    for n in range(1, 6):
        for total in range(0, 31):
            parts = [share(total, i, n) for i in range(n)]
            assert sum(parts) == total
            assert max(parts) - min(parts) <= 1
            assert parts == sorted(parts, reverse=True)  # the extra groups go to low indices
    assert [share(7, i, 3) for i in range(3)] == [3, 2, 2]
    assert share(5) == 5


def test_sync_mode_allows_one_batch_per_trainer_version():
    """max_staleness 0: the stage may run exactly one batch ahead of the trainer."""
    for v in range(4):
        assert instance_budget(v, 0, 0, 4) == (v + 1) * 4
    assert credit_left(0, 0, 0, 4, groups_started=3) == 1
    assert credit_left(0, 0, 0, 4, groups_started=4) == 0  # wait for v1
    assert credit_left(1, 0, 0, 4, groups_started=4) == 4
    # a group started now, behind nothing in flight, needs the trainer's own version
    assert oldest_usable_version(3, None, 0, 4, 0) == 3
    # behind a full batch in flight, it is trained one version later
    assert oldest_usable_version(3, None, 4, 4, 0) == 4


def test_staleness_adds_whole_batches_of_credit():
    assert instance_budget(0, 0, 1, 4) == 8
    assert instance_budget(0, 0, 2, 3) == 9
    assert instance_budget(3, 0, 1, 4) == 20  # (3 + 1 + 1) * 4
    assert oldest_usable_version(3, None, 0, 4, 2) == 1


def test_a_stage_started_late_counts_versions_from_its_base_version():
    assert instance_budget(7, 7, 0, 3) == 3
    assert instance_budget(9, 7, 0, 3) == 9
    # an announcement older than the base version gives no negative credit
    assert instance_budget(5, 7, 1, 3) == 6


def test_the_trainers_report_wins_over_its_version():
    # dropped groups are replaced: 7 decided at v2 (not 2 * 2)
    assert instance_budget(2, 0, 0, 2, groups_consumed=7) == 9
    # and the report is the truth even behind the version (no V * B floor)
    assert instance_budget(2, 0, 0, 2, groups_consumed=3) == 5
    assert instance_budget(2, 0, 0, 2, groups_consumed=0) == 2


def test_no_group_beyond_what_the_trainer_still_needs():
    # needed < B caps the credit; needed >= B does not matter
    assert instance_budget(0, 0, 1, 4, groups_consumed=4, groups_needed=1) == 5
    assert instance_budget(0, 0, 1, 4, groups_consumed=4, groups_needed=8) == 12
    assert instance_budget(0, 0, 1, 4, groups_consumed=4, groups_needed=100) == 12
    # consumed == needed: the cap is what is still needed
    assert instance_budget(0, 0, 1, 4, groups_consumed=4, groups_needed=4) == 8
    # the run needs nothing more: credit is exactly what was decided, nothing to start
    assert instance_budget(0, 0, 1, 4, groups_consumed=6, groups_needed=0) == 6
    assert credit_left(0, 0, 1, 4, 6, groups_consumed=6, groups_needed=0) == 0
    # a negative "needed" (over-decided run) counts as 0
    assert instance_budget(0, 0, 1, 4, groups_consumed=6, groups_needed=-3) == 6
    # needed without a consumed report still caps the version-based credit
    assert instance_budget(1, 0, 1, 4, groups_needed=2) == 6


def test_credit_left_is_the_budget_less_the_groups_started():
    assert credit_left(1, 0, 1, 4, 0) == 12
    assert credit_left(1, 0, 1, 4, 12) == 0
    # more started than allowed (the trainer restarted from an older count): negative
    assert credit_left(0, 0, 1, 4, 10, groups_consumed=0) == -2


def test_groups_per_call_never_exceeds_the_credit_or_the_generate_size():
    assert groups_per_call(5, 1) == 1
    assert groups_per_call(1, 4) == 1
    assert groups_per_call(3, 3) == 3


def test_consumed_since_the_stage_started():
    assert consumed_since(None, 0) is None
    assert consumed_since(None, 5) is None
    assert consumed_since(10, 4) == 6
    assert consumed_since(4, 4) == 0
    # a trainer restarted from an older checkpoint reports fewer: never negative
    assert consumed_since(3, 4) == 0


def test_groups_in_flight_take_the_larger_consumed_count():
    assert groups_in_flight(2, 0, 4, 10) == 2  # 8 consumed by version
    assert groups_in_flight(2, 0, 4, 10, groups_consumed=9) == 1  # the report is larger
    assert groups_in_flight(2, 0, 4, 10, groups_consumed=3) == 2  # the versions are larger
    assert groups_in_flight(0, 0, 4, 5, groups_consumed=9) == 0  # never negative
    assert groups_in_flight(3, 3, 4, 4) == 4  # counted from the base version
    # this instance's share of the consumed groups: share(5, 1, 2) = 2
    assert groups_in_flight(0, 0, 4, 3, 1, 2, groups_consumed=5) == 1
    assert groups_in_flight(0, 0, 4, 3, 0, 2, groups_consumed=5) == 0


def test_a_restarted_instance_counts_its_predecessors_groups_in_flight():
    # as tests/consumers/test_rollout.py: B = 4, the predecessor used it all, the trainer
    # decided nothing: the successor may start nothing
    started = inherited_in_flight(4, 0)
    assert started == 4
    assert credit_left(0, 0, 1, 2, started, groups_consumed=consumed_since(None, 0)) == 0
    # 10 started, 3 decided when the successor starts: 7 still in flight, over B = 4
    started = inherited_in_flight(10, 3)
    assert started == 7
    assert credit_left(5, 5, 1, 2, started, groups_consumed=consumed_since(3, 3)) == -3
    assert credit_left(5, 5, 1, 2, started, groups_consumed=consumed_since(6, 3)) == 0
    assert credit_left(5, 5, 1, 2, started, groups_consumed=consumed_since(7, 3)) == 1
    # a predecessor that started fewer than were decided leaves nothing in flight
    assert inherited_in_flight(2, 5) == 0
    assert inherited_in_flight(0, 0) == 0
    # several instances: each takes its share of the run's groups in flight (10 - 7)
    assert inherited_in_flight(10, 7, 0, 2) == 2
    assert inherited_in_flight(10, 7, 1, 2) == 1
    # scale-in 2 -> 1: rollout-0 started 30, the removed rollout-1 10, 36 decided: the
    # survivor counts all 4 in flight (its own 30 - 36 would count none and let it
    # sample 4 groups beyond what the run needs)
    assert inherited_in_flight(30 + 10, 36, 0, 1) == 4


def test_several_instances_split_one_global_credit():
    for n in range(1, 5):
        for consumed in range(0, 20):
            parts = [instance_budget(0, 0, 1, 3, i, n, groups_consumed=consumed)
                     for i in range(n)]
            assert sum(parts) == consumed + 6
            assert max(parts) - min(parts) <= 1
            # each instance that started its part has no credit left
            assert all(credit_left(0, 0, 1, 3, p, i, n, groups_consumed=consumed) == 0
                       for i, p in enumerate(parts))
    # one group still needed over three instances: only one of them may start it
    parts = [credit_left(0, 0, 1, 3, share(9, i, 3), i, 3, groups_consumed=9, groups_needed=1)
             for i in range(3)]
    assert sorted(parts) == [0, 0, 1]
    shares = [instance_budget(2, 0, 1, 5, i, 3) for i in range(3)]
    assert shares == [7, 7, 6]


def test_oldest_usable_version():
    assert oldest_usable_version(None, None, 0, 4, 1) is None
    assert oldest_usable_version(2, 5, 0, 4, 1) == 4  # the newer of the two versions
    assert oldest_usable_version(5, 2, 0, 4, 1) == 4
    assert oldest_usable_version(None, 3, 0, 4, 0) == 3
    # in flight counted for every instance: 3 * 2 // 4 = 1 step ahead
    assert oldest_usable_version(3, None, 3, 4, 1, num_instances=2) == 3
    assert oldest_usable_version(3, None, 3, 4, 1) == 2
    # early in a run any weights do
    assert oldest_usable_version(0, None, 0, 4, 2) == -2


def test_invalid_settings_raise():
    with pytest.raises(ValueError, match="max_staleness"):
        instance_budget(0, 0, -1, 4)
    with pytest.raises(ValueError, match="batch_groups"):
        instance_budget(0, 0, 0, 0)
    with pytest.raises(ValueError):
        credit_left(0, 0, 0, 0, 0)


def test_the_stage_computes_its_credit_with_these_functions():
    """RolloutStage's budget, groups in flight and weights needed are these functions of
    its counters (no broker: the trainer's progress is a stand-in)."""
    cfg = RolloutConfig(bus={"bootstrap_servers": "unused:1"}, run="r", dataset="d",
                        batch_groups=4, max_staleness=1, instance_index=1, num_instances=2)
    stage = RolloutStage(cfg, engine=SimpleNamespace(tokenizer=None))
    # nothing known yet: version 0, no progress
    assert stage.budget() == share(8, 1, 2) == 4
    assert stage.groups_in_flight() == 0 and stage.weights_needed() is None
    stage.trainer_version, stage.base_version, stage.groups_started = 5, 3, 9
    stage._progress = SimpleNamespace(consumed=None, needed=None, version=None)
    assert stage.budget() == credit_left(5, 3, 1, 4, 9, 1, 2) == 8 - 9
    assert stage.groups_in_flight() == groups_in_flight(5, 3, 4, 9, 1, 2) == 5
    assert stage.weights_needed() == oldest_usable_version(5, None, 5, 4, 1, 2) == 6
    stage._consumed0 = 10
    stage._progress = SimpleNamespace(consumed=21, needed=3, version=6)
    assert stage.budget() == credit_left(5, 3, 1, 4, 9, 1, 2, groups_consumed=11,
                                         groups_needed=3) == 7 - 9
    assert stage.groups_in_flight() == groups_in_flight(5, 3, 4, 9, 1, 2, groups_consumed=11)
    assert stage.groups_in_flight() == 4
    assert stage.weights_needed() == oldest_usable_version(5, 6, 4, 4, 1, 2) == 7


def test_every_revocation_drops_its_queued_prompts():
    """The consumer's I/O thread reports revocations through one bound callback: a
    second rebalance after a first drop still reaches the queue (before: the callback
    was bound to the first set, which the first drop had replaced)."""
    from types import SimpleNamespace

    from kafka import TopicPartition

    from relax.consumers.rollout.config import RolloutConfig
    from relax.consumers.rollout.metrics import RolloutStats
    from relax.consumers.rollout.prompts import PromptQueue
    from relax.streams.client import BusConfig

    cfg = RolloutConfig(bus=BusConfig(bootstrap_servers="127.0.0.1:9"), run="r", dataset="d")
    q = PromptQueue(cfg, "r.rollout_state", RolloutStats())
    on_revoke = q.note_revoked  # bound once, as the consumer holds it
    q.items = [SimpleNamespace(delivery=SimpleNamespace(topic="prompts.d", partition=p))
               for p in (0, 1, 2)]
    on_revoke([TopicPartition("prompts.d", 0)])
    q.drop_revoked()
    assert [i.delivery.partition for i in q.items] == [1, 2]
    on_revoke([TopicPartition("prompts.d", 1)])
    q.drop_revoked()
    assert [i.delivery.partition for i in q.items] == [2]
