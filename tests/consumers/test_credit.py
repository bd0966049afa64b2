"""The rollout stage's credit maths (``relax.consumers.rollout.credit``): plain numbers and
group_ids in, numbers and grants out, no broker."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from relax.consumers.rollout.config import RolloutConfig
from relax.consumers.rollout.credit import (
    ClaimLedger,
    credit_left,
    groups_decided,
    groups_in_flight,
    groups_per_call,
    oldest_usable_version,
    report_lags,
    run_allowance,
)
from relax.consumers.rollout.stage import RolloutStage


def test_sync_mode_allows_one_batch_per_trainer_version():
    """max_staleness 0: the run may be exactly one batch ahead of the trainer."""
    for v in range(4):
        assert run_allowance(v, 0, 4) == (v + 1) * 4
    assert credit_left(run_allowance(0, 0, 4), granted=3) == 1
    assert credit_left(run_allowance(0, 0, 4), granted=4) == 0  # wait for v1
    assert credit_left(run_allowance(1, 0, 4), granted=4) == 4
    # a group started now, behind nothing in flight, needs the trainer's own version
    assert oldest_usable_version(3, None, 0, 4, 0) == 3
    # behind a full batch in flight, it is trained one version later
    assert oldest_usable_version(3, None, 4, 4, 0) == 4


def test_staleness_adds_whole_batches_of_credit():
    assert run_allowance(0, 1, 4) == 8
    assert run_allowance(0, 2, 3) == 9
    assert run_allowance(3, 1, 4) == 20  # (3 + 1 + 1) * 4
    assert oldest_usable_version(3, None, 0, 4, 2) == 1


def test_the_trainers_report_wins_over_its_version():
    # dropped groups are replaced: 7 decided at v2 (not 2 * 2)
    assert run_allowance(2, 0, 2, groups_consumed=7) == 9
    # and the report is the truth even behind the version (no V * B floor)
    assert run_allowance(2, 0, 2, groups_consumed=3) == 5
    assert run_allowance(2, 0, 2, groups_consumed=0) == 2
    assert groups_decided(2, 2, None) == 4 and groups_decided(2, 2, 3) == 3
    assert groups_decided(-1, 2, None) == 0 and groups_decided(0, 2, -4) == 0


def test_no_group_beyond_what_the_trainer_still_needs():
    # needed < B caps the allowance; needed >= B does not matter
    assert run_allowance(0, 1, 4, groups_consumed=4, groups_needed=1) == 5
    assert run_allowance(0, 1, 4, groups_consumed=4, groups_needed=8) == 12
    assert run_allowance(0, 1, 4, groups_consumed=4, groups_needed=100) == 12
    assert run_allowance(0, 1, 4, groups_consumed=4, groups_needed=4) == 8
    # the run needs nothing more: the allowance is what was decided, nothing to start
    assert run_allowance(0, 1, 4, groups_consumed=6, groups_needed=0) == 6
    assert credit_left(run_allowance(0, 1, 4, groups_consumed=6, groups_needed=0), 6) == 0
    # a negative "needed" (over-decided run) counts as 0
    assert run_allowance(0, 1, 4, groups_consumed=6, groups_needed=-3) == 6
    # needed without a consumed report still caps the version-based allowance
    assert run_allowance(1, 1, 4, groups_needed=2) == 6


def test_credit_left_can_go_negative():
    # more granted than allowed (a trainer restarted from an older count): wait
    assert credit_left(run_allowance(0, 1, 4, groups_consumed=0), 10) == -2


def test_groups_in_flight_are_granted_less_decided():
    assert groups_in_flight(10, 8) == 2
    assert groups_in_flight(5, 9) == 0  # never negative


def test_groups_per_call_never_exceeds_the_credit_or_the_generate_size():
    assert groups_per_call(5, 1) == 1
    assert groups_per_call(1, 4) == 1
    assert groups_per_call(3, 3) == 3


def test_a_claim_is_granted_within_its_allowance_in_order():
    led = ClaimLedger()
    assert led.apply(["a", "b", "c"], 2) == ["a", "b"]
    assert led.count == 2
    assert led.apply(["c", "d"], 2) == []  # no room under the same allowance
    assert led.apply(["c", "d"], 3) == ["c"]
    # a group_id granted before is granted again for free (a prompt delivered again)
    assert led.apply(["a", "e"], 3) == ["a"]
    assert led.count == 3
    # repeated ids inside one claim count once
    assert led.apply(["f", "f", "g"], 5) == ["f", "f", "g"] and led.count == 5


def test_racing_claims_never_grant_beyond_the_allowance():
    """Two instances claim from the same stale view: the log order decides, the later
    claim gets what is left, and the total granted never exceeds the allowance."""
    led = ClaimLedger()
    assert led.apply([f"x{i}" for i in range(4)], 6) == ["x0", "x1", "x2", "x3"]
    assert led.apply([f"y{i}" for i in range(4)], 6) == ["y0", "y1"]
    assert led.count == 6


def test_every_reader_of_the_same_log_grants_the_same_groups():
    """The ledger is a function of the claim sequence: replaying it (a restarted or new
    instance reading the log from the start) gives the same grants, and no allowance
    is ever exceeded at the moment of its claim."""
    rng = random.Random(7)
    log = []
    allowance = 0
    for _ in range(300):
        allowance += rng.randint(0, 2)
        log.append(([f"g{rng.randint(0, 150)}" for _ in range(rng.randint(1, 4))], allowance))
    first, second = ClaimLedger(), ClaimLedger()
    grants = []
    for gids, a in log:
        before = first.count
        held = first.apply(gids, a)
        new = first.count - before
        assert first.count <= max(a, before) and new <= len(set(gids))
        assert set(held) <= first.granted
        grants.append(held)
    assert [second.apply(g, a) for g, a in log] == grants
    assert second.granted == first.granted


def test_oldest_usable_version():
    assert oldest_usable_version(None, None, 0, 4, 1) is None
    assert oldest_usable_version(2, 5, 0, 4, 1) == 4  # the newer of the two versions
    assert oldest_usable_version(5, 2, 0, 4, 1) == 4
    assert oldest_usable_version(None, 3, 0, 4, 0) == 3
    # the run's groups in flight go first: 6 // 4 = 1 step ahead
    assert oldest_usable_version(3, None, 6, 4, 1) == 3
    assert oldest_usable_version(3, None, 3, 4, 1) == 2
    # early in a run any weights do
    assert oldest_usable_version(0, None, 0, 4, 2) == -2


def test_a_report_lags_only_behind_a_newer_announcement():
    # v3 announced, the report still of v2: its step's groups count as in flight, so the
    # version needed is a step too new until the report comes
    assert report_lags(3, 2)
    assert oldest_usable_version(3, 2, 8, 8, 0) == 4
    assert not report_lags(3, 3) and not report_lags(2, 3)
    assert not report_lags(None, 2) and not report_lags(3, None)


def test_invalid_settings_raise():
    with pytest.raises(ValueError, match="max_staleness"):
        run_allowance(0, -1, 4)
    with pytest.raises(ValueError, match="batch_groups"):
        run_allowance(0, 0, 0)


def test_the_stage_computes_its_credit_with_these_functions():
    """RolloutStage's budget, groups in flight and weights needed are these functions of
    the trainer's progress and the claim ledger (no broker: stand-ins for both)."""
    cfg = RolloutConfig(run="r", dataset="d",
                        batch_groups=4, max_staleness=1)
    stage = RolloutStage(cfg, engine=SimpleNamespace(tokenizer=None))
    # nothing known yet: version 0, no progress, nothing granted
    assert stage.budget() == 8
    assert stage.groups_in_flight() == 0 and stage.weights_needed() is None
    stage.trainer_version = 5
    stage._claims = SimpleNamespace(granted=29)
    stage._progress = SimpleNamespace(consumed=None, needed=None, version=None)
    assert stage.budget() == credit_left(run_allowance(5, 1, 4), 29) == 28 - 29
    assert stage.groups_in_flight() == groups_in_flight(29, 20) == 9
    assert stage.weights_needed() == oldest_usable_version(5, None, 9, 4, 1) == 6
    stage._progress = SimpleNamespace(consumed=21, needed=3, version=6)
    assert stage.budget() == credit_left(run_allowance(5, 1, 4, 21, 3), 29) == 24 - 29
    assert stage.groups_in_flight() == 8
    assert stage.weights_needed() == oldest_usable_version(5, 6, 8, 4, 1) == 7
