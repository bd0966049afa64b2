"""The bus commands of infra/cli/app.py as a user runs them (typer CliRunner, real broker)."""

from __future__ import annotations

import json

import pyarrow as pa
from typer.testing import CliRunner

from relax.infra.cli.app import app
from relax.schemas import topics
from relax.schemas.v1 import REWARDS
from relax.streams.client import ensure_topics, producer_kwargs
from relax.streams.errors import error_row
from relax.streams.producer import BatchProducer

from testdata import reward_rows, rollout_rows

TIMEOUT = "TimeoutError: reward 'gsm8k' took over 5.0 s"
NAN = "ValueError: reward 'gsm8k' returned NaN"


def _reward_run(bus, run: str) -> str:
    """``<run>.rewards`` with 8 rows, 2 of them failed, a tombstone, and one record in
    ``<run>.rewards.errors``; returns the rewards topic."""
    rewards = topics.run_topic(run, topics.REWARDS)
    ensure_topics(bus, {rewards: 2, topics.errors_topic(rewards): 1})
    rolls = rollout_rows(8, group_size=4)
    errors = [None] * 8
    errors[1], errors[6] = TIMEOUT, NAN
    values = [None if e else 1.0 for e in errors]
    from kafka import KafkaProducer

    p = BatchProducer(bus)
    p.send(rewards, pa.RecordBatch.from_pylist(reward_rows(rolls, "gsm8k", values, errors),
                                               schema=REWARDS))
    kp = KafkaProducer(**producer_kwargs(bus))
    kp.send(rewards, value=None, key=b"g0000", partition=0)  # a tombstone: skipped, no crash
    kp.flush()
    kp.close()
    p.send_errors(rewards, [error_row(source_topic=rewards, source_partition=0, source_offset=3,
                                      stage="aggregate/decode", error="undecodable bytes")])
    p.flush()
    p.close()
    return rewards


def test_errors_of_a_rewards_topic_lists_failed_reward_rows_too(bus, unique):
    rewards = _reward_run(bus, unique)
    res = CliRunner().invoke(app, ["errors", rewards, "-b", bus.bootstrap_servers])
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert f"{rewards}[0]@3 stage=aggregate/decode: undecodable bytes" in out
    assert f"errors=1 topic={topics.errors_topic(rewards)}" in out
    assert "reward=gsm8k rollout_id=g0000/1: " + TIMEOUT in out
    assert "reward=gsm8k rollout_id=g0001/2: " + NAN in out
    assert f"reward_errors=2 topic={rewards}" in out
    assert "rollout_id=g0000/0" not in out  # rows without an error are not listed

    res = CliRunner().invoke(app, ["errors", rewards, "--json", "-b", bus.bootstrap_servers])
    assert res.exit_code == 0, res.output
    recs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    rows = [r for r in recs if r.get("rollout_id")]
    assert sorted((r["rollout_id"], r["reward_name"], r["error"], r["stage"]) for r in rows) == [
        ("g0000/1", "gsm8k", TIMEOUT, "reward.gsm8k"), ("g0001/2", "gsm8k", NAN, "reward.gsm8k")]
    assert all(r["source_topic"] == rewards and r["source_offset"] is not None for r in rows)
    assert len(recs) == 3

    res = CliRunner().invoke(app, ["errors", rewards, "-n", "1", "-b", bus.bootstrap_servers])
    assert "reward_errors=2 topic=" in res.stdout and "(last 1 shown)" in res.stdout


def test_errors_without_reward_rows_when_asked_or_given_the_errors_topic(bus, unique):
    rewards = _reward_run(bus, unique)
    for args in (["errors", rewards, "--no-reward-rows"], ["errors", topics.errors_topic(rewards)]):
        res = CliRunner().invoke(app, [*args, "-b", bus.bootstrap_servers])
        assert res.exit_code == 0, res.output
        assert "errors=1 topic=" in res.stdout and "reward_errors" not in res.stdout
        assert "rollout_id=" not in res.stdout


def test_errors_help_says_reward_rows_are_listed():
    res = CliRunner().invoke(app, ["errors", "--help"])
    assert res.exit_code == 0 and "error" in res.output
    assert "--no-reward-rows" in res.output


def test_a_topic_or_run_that_is_not_there_is_an_error_not_an_empty_answer(bus, unique, tmp_path):
    b = ["-b", bus.bootstrap_servers]
    for args in (["tail", f"{unique}.rollouts"], ["errors", f"{unique}.rewards"],
                 ["archive", "--run", unique, "--out", str(tmp_path / "a")]):
        res = CliRunner().invoke(app, [*args, *b])
        assert res.exit_code == 1, (args, res.output)
        assert res.stderr.startswith(f"error: no topic '{unique}.") and \
            res.stderr.count("\n") == 1, res.stderr
    assert not (tmp_path / "a").exists()  # no manifest of a run that is not there
    res = CliRunner().invoke(app, ["replay", str(tmp_path / "nothing"), "--run", unique, *b])
    assert res.exit_code == 1 and "is not a run archive (no manifest.json there" in res.stderr
    # a topic that is there answers as before
    rewards = _reward_run(bus, unique)
    res = CliRunner().invoke(app, ["tail", topics.errors_topic(rewards), *b])
    assert res.exit_code == 0 and f"rows=1 topic={topics.errors_topic(rewards)}" in res.stdout


def test_a_runs_failed_records_are_kept_in_its_folder(bus, unique, tmp_path):
    from relax.infra.control.run_errors import write_run_errors

    rewards = _reward_run(bus, unique)
    names = [rewards, topics.errors_topic(rewards), topics.run_topic(unique, topics.ROLLOUTS)]
    path = tmp_path / "errors.jsonl"
    assert write_run_errors(bus, names, path) == {rewards: 2, topics.errors_topic(rewards): 1}
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert sorted((r["topic"], r.get("rollout_id"), r["error"]) for r in recs) == sorted([
        (rewards, "g0000/1", TIMEOUT), (rewards, "g0001/2", NAN),
        (topics.errors_topic(rewards), None, "undecodable bytes")])
    assert all("value" not in r and r["source_topic"] == rewards for r in recs)
    assert write_run_errors(bus, names[2:], tmp_path / "none.jsonl") == {}
    assert not (tmp_path / "none.jsonl").exists()
