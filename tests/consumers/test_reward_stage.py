"""The reward stage on the real broker: rollouts in, rewards out; attaching a second
reward to a finished run (CLI); faulty rewards recorded as error rows and metrics;
two instances sharing the consumer group; public case C15 through the stage."""

import json
import textwrap
import threading
import time

import pyarrow as pa
import pytest
from testdata import rollout_rows
from typer.testing import CliRunner

from relax.consumers.reward.stage import RewardStage, RewardStageConfig
from relax.infra.cli.app import app
from relax.streams.read import read_table
from relax.schemas import topics
from relax.schemas.v1 import ROLLOUTS
from relax.streams.client import ensure_topics, topic_partitions
from relax.streams.producer import BatchProducer

C15_PROMPT = "Add the numbers and write the final answer inside \\boxed{}."


def _publish_rollouts(bus, run, rows, partitions=2):
    src = topics.run_topic(run, topics.ROLLOUTS)
    ensure_topics(bus, {src: partitions})
    p = BatchProducer(bus)
    p.send(src, pa.RecordBatch.from_pylist(rows, schema=ROLLOUTS))
    p.flush()
    p.close()


def _rewards(bus, run, name):
    t = read_table(bus, topics.run_topic(run, topics.REWARDS))
    return {r["rollout_id"]: r for r in t.to_pylist() if r["reward_name"] == name}


def _rows(n=8):
    rows = rollout_rows(n, group_size=4)
    for i, r in enumerate(rows):
        r["prompt_text"] = C15_PROMPT
        r["label"] = str(10 + i)
        r["response_text"] = (f"So it is \\boxed{{{10 + i}}}.\n#### {10 + i}" if i % 2 == 0
                              else "So the total is 12.")
    return rows


def test_stage_scores_rollouts_and_a_second_reward_attaches_to_the_finished_run(bus, unique):
    run, rows = unique, _rows(8)
    _publish_rollouts(bus, run, rows)
    cfg = RewardStageConfig(run=run, reward="gsm8k", exit_when_idle_s=1.5,
                            poll_timeout_s=0.5)
    stats = RewardStage(cfg, bus).run()
    assert stats.rows_in == 8 and stats.errors == 0 and stats.commits >= 1
    got = _rewards(bus, run, "gsm8k")
    assert sorted(got) == sorted(r["rollout_id"] for r in rows)
    for i, r in enumerate(rows):
        row = got[r["rollout_id"]]
        assert row["value"] == (1.0 if i % 2 == 0 else 0.0)
        assert row["group_id"] == r["group_id"] and row["error"] is None
        assert json.loads(row["details"])["label"] == str(10 + i)
    assert topic_partitions(bus, [topics.run_topic(run, topics.REWARDS)]) == \
        {topics.run_topic(run, topics.REWARDS): 2}

    # attach a second reward (format, C15) to the finished run from the CLI
    res = CliRunner().invoke(app, ["reward", "attach", "format", "--run", run, "--bootstrap",
                                   bus.bootstrap_servers, "-o", "bonus=0.1", "--name", "fmt",
                                   "--exit-when-idle", "1.5"])
    assert res.exit_code == 0, res.output
    assert f"consumer group {run}.reward.fmt" in res.output and "rows=8 errors=0" in res.output
    fmt = _rewards(bus, run, "fmt")
    assert sorted(fmt) == sorted(got)
    for i, r in enumerate(rows):
        # C15: the prompt holds "\boxed{}" but only the response is scored
        assert fmt[r["rollout_id"]]["value"] == pytest.approx(0.1 if i % 2 == 0 else 0.0)
    assert len(_rewards(bus, run, "gsm8k")) == 8  # the first reward is untouched
    metrics = read_table(bus, topics.run_topic(run, topics.METRICS)).to_pylist()
    rows_metric = {(m["component"], m["name"]): 0 for m in metrics}
    for m in metrics:
        rows_metric[(m["component"], m["name"])] += m["value"]
    assert rows_metric[("reward.gsm8k", "reward_rows")] == 8
    assert rows_metric[("reward.fmt", "reward_rows")] == 8
    assert rows_metric[("reward.gsm8k", "reward_errors")] == 0
    assert rows_metric[("reward.gsm8k", "reward_rows_per_s")] > 0


FAULTY = textwrap.dedent('''
    import time

    def flaky(responses, labels, metadata):
        out = []
        for r in responses:
            if r == "raise":
                raise ValueError("cannot score this one")
            if r == "sleep":
                time.sleep(60)
            if r == "hog":
                out.append(float(len(bytearray(2 << 30))))
                continue
            out.append(float(len(r)))
        return out
''')


@pytest.fixture
def faulty_stage_module(tmp_path, monkeypatch):
    name = f"relax_test_stage_faulty_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(FAULTY)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers inherit sys.path
    return name


def test_stage_records_faulty_rewards_as_error_rows_and_keeps_going(bus, unique,
                                                                    faulty_stage_module):
    run = unique
    responses = ["raise", "a", "sleep", "bb", "hog", "ccc", "{bad json}", "dddd"]
    rows = rollout_rows(8, group_size=4)
    for r, text in zip(rows, responses):
        r["response_text"] = text
    rows[6]["metadata"] = "[1, 2]"  # metadata must be a JSON object
    _publish_rollouts(bus, run, rows)
    cfg = RewardStageConfig(run=run, reward=f"{faulty_stage_module}:flaky", name="flaky",
                            workers=2, timeout_s=2.0, memory_limit_bytes=512 << 20,
                            exit_when_idle_s=1.5, poll_timeout_s=0.5)
    stats = RewardStage(cfg, bus).run()
    assert stats.rows_in == 8 and stats.errors == 4
    got = {r["rollout_id"]: r for r in _rewards(bus, run, "flaky").values()}
    by_text = {text: got[r["rollout_id"]] for r, text in zip(rows, responses)}
    for text in ("a", "bb", "ccc", "dddd"):
        assert by_text[text]["value"] == float(len(text)) and by_text[text]["error"] is None
    assert "ValueError: cannot score this one" in by_text["raise"]["error"]
    assert "timeout" in by_text["sleep"]["error"]
    assert "MemoryError" in by_text["hog"]["error"]
    assert "metadata must be a JSON object" in by_text["{bad json}"]["error"]
    for text in ("raise", "sleep", "hog", "{bad json}"):
        assert by_text[text]["value"] is None
    metrics = read_table(bus, topics.run_topic(run, topics.METRICS)).to_pylist()
    total = {}
    for m in metrics:
        total[m["name"]] = total.get(m["name"], 0) + m["value"]
    assert total["reward_errors"] == 4 and total["reward_rows"] == 8
    assert total["reward_timeouts"] >= 1 and total["reward_exceptions"] >= 1
    assert total["reward_memory_errors"] >= 1 and total["reward_worker_restarts"] >= 2


def test_two_instances_share_the_consumer_group(bus, unique):
    run = unique
    src = topics.run_topic(run, topics.ROLLOUTS)
    ensure_topics(bus, {src: 4})
    cfg = RewardStageConfig(run=run, reward="gsm8k", poll_timeout_s=0.3)
    stages = [RewardStage(cfg, bus), RewardStage(cfg, bus)]
    stop = threading.Event()
    threads = [threading.Thread(target=s.run, args=(stop.is_set,), daemon=True) for s in stages]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while not (all(s.assignment for s in stages)
                   and sum(len(s.assignment) for s in stages) == 4):
            assert time.monotonic() < deadline, "the two instances never split the partitions"
            time.sleep(0.2)
        rows = _rows(32)
        _publish_rollouts(bus, run, rows, partitions=4)
        deadline = time.monotonic() + 30
        while sum(s.stats.rows_in for s in stages) < 32:
            assert time.monotonic() < deadline, [s.stats for s in stages]
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert all(s.stats.rows_in > 0 for s in stages)
    assert sorted(_rewards(bus, run, "gsm8k")) == sorted(r["rollout_id"] for r in rows)


def test_attach_to_a_missing_run_is_a_clear_error(bus, unique):
    res = CliRunner().invoke(app, ["reward", "attach", "gsm8k", "--run", unique, "--bootstrap",
                                   bus.bootstrap_servers, "--exit-when-idle", "1"])
    assert res.exit_code == 1 and f"has no topic '{unique}.rollouts'" in res.output
    res = CliRunner().invoke(app, ["reward", "attach", "gsmk8", "--run", unique, "--bootstrap",
                                   bus.bootstrap_servers])
    assert res.exit_code == 2 and "valid: math" in res.output



def test_relax_stage_kind_runs_a_contract_stage(bus, unique):
    """``relax stage reward``: the stage from the one table (CONTRACT_STAGES), its config
    from --set, the bus from --bootstrap; a missing run and an unknown kind are clear
    errors."""
    base = ["stage", "reward", "--run", unique, "--bootstrap", bus.bootstrap_servers,
            "--set", "reward=gsm8k", "--set", "name=viacli", "--set", "exit_when_idle_s=1.5"]
    res = CliRunner().invoke(app, base)
    assert res.exit_code == 1 and f"has no topic '{unique}.rollouts'" in res.output
    rows = _rows(4)
    _publish_rollouts(bus, unique, rows)
    res = CliRunner().invoke(app, base)
    assert res.exit_code == 0, res.output
    assert "reward stopped" in res.output and "rows_in=4" in res.output
    assert sorted(_rewards(bus, unique, "viacli")) == sorted(r["rollout_id"] for r in rows)
    res = CliRunner().invoke(app, ["stage", "trainerx", "--run", unique])
    assert res.exit_code == 2 and "unknown stage kind 'trainerx'; valid: rollout" in res.output
    res = CliRunner().invoke(app, ["stage", "reward", "--run", unique, "--set", "workers=0",
                                   "--set", "reward=gsm8k"])
    assert res.exit_code == 2 and "workers" in res.output
