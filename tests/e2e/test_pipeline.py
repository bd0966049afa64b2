"""The whole pipeline, every stage its own process, through the real broker (tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import datetime
from pathlib import Path

import pytest
from testdata import PARITY_REWARD, RECIPES, kill_when, s3_uri, tiny_recipe

from relax.schemas import metric_names as M
from relax.streams.fsuri import open_uri
from relax.streams.weights.shm_folders import SHM_ROOT
from relax.trainer import checkpoint
from relax.trainer.ledger import Ledger

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("local_ray")]


def _ledger(run_dir) -> Ledger:
    return Ledger.load(checkpoint.latest(Path(run_dir)) / "ledger.parquet")


def test_tiny_async_run_accounts_for_every_rollout(tiny_run, broker):
    recipe, s = tiny_run
    assert s["steps"] == 3 and s["balanced"], s
    assert s["trained"] + s["stale"] + s["filtered"] + s["errors"] == s["sampled"] > 0
    assert checkpoint.latest(Path(s["run_dir"])).name == "step_000003"  # policy_version 3
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table

    weights = read_table(BusConfig(bootstrap_servers=broker), f"{recipe.run}.weights")
    assert sorted(set(weights.column("policy_version").to_pylist())) == [0, 1, 2, 3]
    # the rollout engine shares the trainer's host: every version after the one it
    # started from came as a same-host file, none by broadcast; the run left no file
    shm = [r["policy_version"] for r in weights.to_pylist() if r["transport"] == "shm"]
    assert {1, 2, 3} <= set(shm), shm
    assert not list(Path(SHM_ROOT).glob(f"relax-weights-{recipe.run}-*"))
    assert [ln.split()[1] for ln in s["lines"] if ln.startswith("step")] == ["1/3", "2/3", "3/3"]
    # where the start-up went: every lap once, in order, and one line that says them
    laps = s["startup_s"]
    assert list(laps) == ["preflight", "held_out", "bus", "eval_before", "specs",
                          "ray_and_stages", "first_step"] and all(v >= 0 for v in laps.values())
    (said,) = [ln for ln in s["lines"] if ln.startswith("first step after")]
    assert f"ray_and_stages {laps['ray_and_stages']:.1f}" in said
    assert (Path(s["run_dir"]) / "curves.png").stat().st_size > 1000
    assert (Path(s["run_dir"]) / "final_model" / "model.safetensors").exists()
    from testdata import documented, readme_metric_names

    metrics = read_table(BusConfig(bootstrap_servers=broker), f"{recipe.run}.metrics")
    written = set(metrics.column("name").to_pylist())
    sent = [(r["name"], r["value"]) for r in metrics.to_pylist() if r["policy_version"] == 3
            and r["name"] in ("weights_local_subscribers", "weights_broadcast_subscribers")]
    assert sorted(sent) == [("weights_broadcast_subscribers", 0.0),
                            ("weights_local_subscribers", 1.0)], sent
    from relax.infra.observe.monitor import snapshot

    latest = snapshot(BusConfig(bootstrap_servers=broker), recipe.run)["latest"]
    peaks = {c: latest[c].get("peak_rss_mb", 0) for c in
             ("trainer", "rollout-0", "aggregate-0", "reward.parity")}  # relax monitor's
    assert all(v > 50 for v in peaks.values()), peaks
    names = readme_metric_names()
    assert not sorted(n for n in written if not documented(n, names)), "README metrics table"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    stages = EventAccumulator(str(Path(s["run_dir"]) / "tensorboard" / "stages"))
    stages.Reload()  # every other stage's rows, from the driver
    components = {t.split("/")[0] for t in stages.Tags()["scalars"]}
    assert {"rollout-0", "aggregate-0", "reward.parity"} <= components, components
    from wandb_records import history  # W&B offline (telemetry.wandb): one row per step

    rows = history(Path(s["run_dir"]))
    assert [r["_step"] for r in rows] == [1, 2, 3]
    assert all(0.0 <= r["reward_mean"] <= 1.0 and r["step_s"] > 0 for r in rows), rows


def test_the_topics_a_run_makes_are_the_declared_ones(tiny_run, broker):
    """Every topic of the tiny run's name on the broker is in the one list
    (:func:`relax.schemas.topics.run_topic_partitions`) with its partition count: no stage
    makes a topic of its own that the list lacks, and the list names none it never made."""
    from relax.schemas import topics
    from relax.streams.client import BusConfig, topic_partitions

    recipe, _ = tiny_run
    made = {t: n for t, n in topic_partitions(BusConfig(bootstrap_servers=broker)).items()
            if t.startswith(recipe.run + ".")}
    assert made == topics.run_topic_partitions(recipe.run, recipe.partitions)


def test_cli_last_line_and_reinforce_pp_over_the_global_batch(tmp_path, broker):
    """``relax train`` prints one summary line; with ``advantage.estimator: reinforce_pp``
    the trainer normalises over each step's whole batch (issue 16): every step's
    advantages have mean 0 and sample std 1 over its rows (per-group normalisation, what
    the aggregator alone would do, gives a pooled std below 1)."""
    run = "cli" + uuid.uuid4().hex[:6]
    r = subprocess.run([sys.executable, "-m", "relax.infra.cli.app", "train",
                        str(RECIPES / "tiny_ci.yaml"), f"run={run}", f"run_root={tmp_path}",
                        PARITY_REWARD, "advantage.estimator=reinforce_pp",
                        "--bootstrap", broker, "--timeout-s", "400"],
                       capture_output=True, text=True, timeout=500, env=os.environ.copy())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    f = dict(kv.split("=") for kv in last.split())
    assert f["steps"] == "3"
    assert int(f["trained"]) + int(f["stale"]) + int(f["filtered"]) + int(f["errors"]) \
        == int(f["sampled"]) > 0
    from relax.schemas import metric_names as M
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table

    rows = read_table(BusConfig(bootstrap_servers=broker), f"{run}.metrics").to_pylist()
    adv = {(x["policy_version"], x["name"]): x["value"] for x in rows
           if x["component"] == "trainer" and x["name"] in (M.ADVANTAGE_MEAN, M.ADVANTAGE_STD)}
    stds = [adv[(v, M.ADVANTAGE_STD)] for v in (1, 2, 3)]
    assert all(abs(adv[(v, M.ADVANTAGE_MEAN)]) < 1e-5 for v in (1, 2, 3)), adv
    # 1 unless every reward of the step was equal (then 0): 8 parity rewards per step
    assert all(abs(s - 1) < 1e-4 or s == 0 for s in stds) and any(abs(s - 1) < 1e-4
                                                                   for s in stds), stds


def _train(recipe, on_step, timeout_s=500) -> tuple[dict, list[str]]:
    """``train`` with its progress lines kept; a run that does not finish fails with
    those lines and the tail of every stage's log (what each stage was waiting for)."""
    from relax.infra.control.launch import train

    lines: list[str] = []
    try:
        return train(recipe, say=lines.append, on_step=on_step, timeout_s=timeout_s), lines
    except TimeoutError as e:
        logs = Path(recipe.run_root) / recipe.run / "logs"
        tails = [f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-25:])
                 for f in sorted(logs.glob("*.log"))]
        raise AssertionError("\n".join([str(e), *lines, *tails])) from e


def test_trainer_killed_after_step_2_resumes_at_step_3(broker, tmp_path, s3_endpoint):
    """The restarted trainer resumes from its checkpoint store (an S3-compatible server,
    ``trainer.checkpoint_store``: what a trainer restarted on another host reads); the
    trainer keeps no checkpoint on its disk. Local checkpoints resume in the chaos runs."""
    run = "resume" + uuid.uuid4().hex[:6]
    # credentials in the URI: the shared Ray's stage processes do not see this test's
    # environment (the store's own tests use the environment)
    store = s3_uri(s3_endpoint, f"relax-test/{run}").replace("s3://", "s3://test:test@")
    recipe = tiny_recipe(broker, tmp_path, run, f"trainer.checkpoint_store={store}")
    fs, base = open_uri(store)
    stages = tmp_path / run / "stages.json"
    # once step 2's checkpoint is complete in the store (its state file is written last):
    # step 3 is still to come, however fast the trainer is
    with kill_when(lambda: "step_000002" in checkpoint._complete(fs, base),
                   lambda: [json.loads(stages.read_text())["trainer"]["pid"]],
                   poll_s=0.05) as killed:
        s, _ = _train(recipe, on_step=None)
    assert len(killed) == 1, killed
    assert s["steps"] == 3 and s["balanced"], json.dumps(s, default=str)
    log = (Path(s["run_dir"]) / "logs" / "trainer.log").read_text()
    assert "resumed from" in log and "policy_version 2" in log
    assert "checkpoints/store/step_000002" in log  # downloaded from the store
    last = checkpoint.latest(Path(s["run_dir"]), store)
    assert last.name == "step_000003"
    assert not list((Path(s["run_dir"]) / "checkpoints").glob("step_*"))
    assert len(Ledger.load(last / "ledger.parquet").ids("trained")) == s["trained"]
    # the checkpoint holds its step's metric row, and the resumed trainer wrote step 2's
    # again: the only copy when the kill came before the first one's flush
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["metrics"][M.STEP_S] > 0 and M.SAMPLES_PER_S in state["metrics"]
    rows = [json.loads(ln) for ln in
            (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    step2 = [r for r in rows if r["component"] == "trainer" and r["name"] == M.STEP_S
             and r["policy_version"] == 2]
    after_kill = [r for r in step2 if datetime.fromisoformat(r["ts"]) > killed[0][1]]
    assert len(step2) in (1, 2) and len(after_kill) == 1, (killed, step2)
