"""The progress check's rules (infra/control/stuck.py) on metrics rows made by hand: a counted
reward whose last groups all failed, or that scored nothing while groups waited, is
named; one that fails some rows, abstains, or is not counted never is."""

from __future__ import annotations

import datetime as dt

import pytest

from relax.infra.control.stuck import ProgressCheck
from relax.infra.recipe.recipe import RecipeError
from relax.infra.recipe.sections import StuckConfig
from relax.schemas import metric_names as M

GROUP = 4


def poll(ts_ms: int, rows: int, failed: int, reward: str = "bad") -> list[dict]:
    """The two metrics rows one reward poll writes (as MetricsWriter.add_many orders them)."""
    c = f"reward.{reward}"
    return [{"ts": ts_ms, "component": c, "name": M.REWARD_ROWS, "value": float(rows)},
            {"ts": ts_ms, "component": c, "name": M.REWARD_ABSTAINS, "value": 0.0},
            {"ts": ts_ms, "component": c, "name": M.REWARD_ERRORS, "value": float(failed)}]


def sampled(ts_ms: int, groups: int, instance: int = 0) -> list[dict]:
    return [{"ts": ts_ms, "component": f"rollout-{instance}", "name": M.GROUPS_SAMPLED,
             "value": float(groups)}]


def check(failed_groups: int | None = 16, unscored_s: float | None = 600.0,
          rewards: tuple[str, ...] = ("bad",)) -> ProgressCheck:
    return ProgressCheck(list(rewards), GROUP, StuckConfig(failed_groups=failed_groups,
                                                           unscored_s=unscored_s))


def test_every_row_of_the_last_n_groups_failed_names_the_reward_and_share():
    c = check()
    for i in range(7):  # 7 polls of 8 rows (2 groups each): 56 rows = 14 groups
        c.add(poll(1000 + i, 8, 8))
    assert c.stuck(2000) is None
    c.add(poll(1007, 4, 4))  # 60 rows: 15 groups, one short
    assert c.stuck(2000) is None
    c.add(poll(1008, 8, 8))  # 68 rows: past 16 groups
    s = c.stuck(2000)
    assert (s.reward, s.rule, s.rows, s.failed, s.groups, s.since_ms) == (
        "bad", "failed_groups", 68, 68, 17, 1000)
    assert s.line("ValueError: no") == ("reward 'bad' failed 100% of its rows in the last 17 "
                                        "groups (68/68); first: ValueError: no; the run "
                                        "cannot train")


def test_a_reward_that_fails_30_percent_of_rows_never_ends_the_run():
    c = check()
    for i in range(1000):  # 10,000 rows, 3,000 failed, far past the window
        c.add(poll(1000 + i, 10, 3))
        assert c.stuck(1000 + i) is None
    assert (c.tallies["reward.bad"].rows, c.tallies["reward.bad"].failed) == (10_000, 3_000)


def test_one_scored_poll_starts_the_count_again():
    c = check()
    for i in range(7):
        c.add(poll(1000 + i, 8, 8))
    c.add(poll(1100, 8, 7))  # one row with a value
    for i in range(7):
        c.add(poll(1200 + i, 8, 8))
    assert c.stuck(2000) is None  # 56 failed rows in a row since, not 64
    c.add(poll(1300, 8, 8))
    s = c.stuck(2000)
    assert (s.rows, s.since_ms) == (64, 1200)


def test_abstentions_are_no_failures():
    c = check()
    for i in range(100):
        c.add(poll(1000 + i, 8, 0))  # null values without an error: the reward abstains
    assert c.stuck(10**9) is None


def test_rewards_not_counted_are_not_watched():
    c = check(rewards=("good",))
    for i in range(100):
        c.add(poll(1000 + i, 8, 8, reward="recorded_only"))
        c.add(poll(1000 + i, 8, 1, reward="good"))
    assert c.stuck(10**9) is None


def test_failed_groups_none_never_fires():
    c = check(failed_groups=None, unscored_s=None)
    for i in range(100):
        c.add(poll(1000 + i, 8, 8))
    assert c.stuck(10**12) is None


def test_datetime_ts_as_decoded_rows_carry_it():
    c = check(failed_groups=1)
    t = dt.datetime(2026, 12, 7, 9, 0, tzinfo=dt.UTC)
    c.add(poll(t, 4, 4))  # type: ignore[arg-type]
    assert c.stuck(0).since_ms == int(t.timestamp() * 1000)
    assert c.stuck(0).line(None).startswith("reward 'bad' failed 100% of its rows in the last "
                                            "group (4/4); the run")


def test_groups_that_wait_unscored_past_unscored_s_name_the_reward():
    c = check(unscored_s=60.0)
    c.add(sampled(1_000, 0))  # before any group: nothing waits
    assert c.stuck(1_000_000) is None
    c.add(sampled(5_000, 2))  # groups sampled; the reward is inside its first poll
    assert c.stuck(64_999) is None
    s = c.stuck(65_000)
    assert (s.rule, s.since_ms, s.waited_s, s.rows) == ("unscored_s", 5_000, 60.0, 0)
    assert s.line(None, 30.0) == (
        "reward 'bad' scored no row for 60s while groups sampled after its last scored row "
        "waited; it wrote no row since (a call may take timeout_s=30s, then each row alone "
        "as long); the run cannot train")
    c.add(poll(6_000, 8, 8))  # failed rows do not count as scored: the groups still wait
    s = c.stuck(65_000)
    assert s.rule == "unscored_s" and s.line("TimeoutError: x").endswith(
        "waited; 100% of the 8 rows it wrote since failed (8/8); first: TimeoutError: x; "
        "the run cannot train")
    c.add(poll(7_000, 8, 2))  # a scored row: nothing waits any more
    assert c.stuck(10**9) is None


def test_groups_sampled_before_the_last_scored_poll_do_not_wait():
    """The rollout's metrics are periodic: an increase seen after a scored poll may hold
    groups sampled before it and scored by it. Only an interval that begins after the
    last scored poll counts."""
    c = check(unscored_s=60.0)
    c.add(sampled(1_000, 2))
    c.add(poll(2_000, 8, 0))  # scored them
    c.add(sampled(3_000, 4))  # interval (1000, 3000]: may be groups the poll scored
    assert c.stuck(10**9) is None  # e.g. the trainer is slow and the budget is full
    c.add(sampled(4_000, 6))  # interval (3000, 4000]: after the scored poll
    assert c.stuck(63_999) is None
    assert c.stuck(64_000).since_ms == 4_000
    c.add(sampled(5_000, 6))  # no new group: nothing changes
    assert c.stuck(64_000).since_ms == 4_000


def test_a_restarted_rollout_instance_counts_from_zero_again():
    c = check(unscored_s=60.0)
    c.add(sampled(1_000, 8))
    c.add(poll(2_000, 8, 0))
    c.add(sampled(3_000, 0))  # restarted: its count begins again
    c.add(sampled(4_000, 2))  # new groups after the scored poll
    assert c.stuck(64_000).since_ms == 4_000


def test_unscored_s_counts_no_time_before_the_watch_began():
    """A resumed run reads its earlier part's metrics again: groups that waited while no
    driver ran wait from the resume on."""
    c = ProgressCheck(["bad"], GROUP, StuckConfig(unscored_s=60.0), start_ms=1_000_000)
    c.add(sampled(1_000, 2))  # long before the resume
    assert c.stuck(1_059_999) is None
    s = c.stuck(1_060_000)
    assert (s.since_ms, s.waited_s) == (1_000, 60.0)


def test_the_recipe_section(tmp_path):
    from testdata import tiny_recipe

    r = tiny_recipe("127.0.0.1:1", tmp_path, "r1")
    assert (r.stuck.failed_groups, r.stuck.unscored_s) == (16, 600.0)
    r = tiny_recipe("127.0.0.1:1", tmp_path, "r1", "stuck.failed_groups=2",
                    "stuck.unscored_s=null")
    assert (r.stuck.failed_groups, r.stuck.unscored_s) == (2, None)
    with pytest.raises(RecipeError, match="stuck.groups: unknown key; valid keys here: "
                                          "failed_groups, unscored_s"):
        tiny_recipe("127.0.0.1:1", tmp_path, "r1", "stuck.groups=2")
    with pytest.raises(RecipeError, match="stuck.failed_groups"):
        tiny_recipe("127.0.0.1:1", tmp_path, "r1", "stuck.failed_groups=0")
