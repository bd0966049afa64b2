"""The control API of a live run (``relax train`` in a subprocess, the tiny recipe on the
test broker): requests without the token are refused, then the rollout instances go
1 -> 2 -> 1 through ``relax scale``'s client while the run trains (the instance that
stays is never restarted), and the run still accounts for every rollout with none
trained twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from testdata import PARITY_REWARD, RECIPES

from relax.infra.cli.scale import ApiClient, scale_to

pytestmark = pytest.mark.e2e


def _wait_for(path, proc, log, timeout_s=180.0):
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"relax train exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout_s:.0f}s"
        time.sleep(0.5)


def _wait_rows_from(broker: str, run: str, engine: str, proc, log, timeout_s=180.0) -> None:
    """Until ``<run>.rollouts`` holds a row of ``engine`` (the instances share one credit:
    a new one samples once it claims some, which the other may have taken first)."""
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table

    deadline = time.monotonic() + timeout_s
    while engine not in set(read_table(BusConfig(bootstrap_servers=broker),
                                       f"{run}.rollouts").column("engine_id").to_pylist()):
        assert proc.poll() is None, f"relax train exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no rollout of {engine} after {timeout_s:.0f}s"
        time.sleep(2.0)


def test_scale_rollouts_1_2_1_in_a_live_run(broker, tmp_path):
    """Scaling used to restart the instance that stays (its fixed credit share changed);
    that restart, or a stage that failed a commit during the rebalance
    (REBALANCE_IN_PROGRESS, now skipped), could leave a member whose JoinGroup completed
    after its LeaveGroup on the broker of the time, and the group never synced again."""
    run = "scale" + uuid.uuid4().hex[:6]
    run_dir = tmp_path / run
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(RECIPES.parent / "tests"), os.environ.get("PYTHONPATH")])))
    env.pop("RELAX_API_TOKEN", None)
    log = tmp_path / "train.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relax.infra.cli.app", "train", str(RECIPES / "tiny_ci.yaml"),
             # 120 steps: scaling out and back in (with the wait for rollout-1's rows)
             # takes 15-40 s here and a tiny step under a second: runs of 20 and then 40
             # steps ended in CI while they scaled (40 steps ran 38-47 s in all)
             f"run={run}", f"run_root={tmp_path}", PARITY_REWARD, "trainer.steps=120",
             "--bootstrap", broker, "--timeout-s", "600"],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(run_dir / "api.json", proc, log)
        url = json.loads((run_dir / "api.json").read_text())["url"]
        assert httpx.get(f"{url}/status").status_code == 401
        assert httpx.get(f"{url}/status", headers={"Authorization": "Bearer nope"}).status_code == 403
        assert "/rollout/scale_out" in httpx.get(f"{url}/openapi.json").json()["paths"]
        api = ApiClient(run_dir)
        engines = api.get("/rollout/engines")
        assert [e["name"] for e in engines] == ["rollout-0"]
        pid0 = engines[0]["pid"]
        with pytest.raises(httpx.HTTPStatusError, match="422"):  # 2 prompt partitions
            api.post("/rollout/scale_out", {"instances": 2})

        op = scale_to(run_dir, 2, timeout_s=240, say=lambda _: None)
        assert op["state"] == "ACTIVE", op
        assert [h.split(" ", 1)[1].split(":")[0] for h in op["history"]] == \
            ["PENDING", "STARTING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "ACTIVE"]
        engines = api.get("/rollout/engines")
        assert [e["name"] for e in engines] == ["rollout-0", "rollout-1"], engines
        # the instance that stays goes on: the credit does not depend on the count
        assert engines[0]["pid"] == pid0, engines
        _wait_rows_from(broker, run, "rollout-1", proc, log)
        status = api.get("/status")
        assert status["rollout_instances"] == 2 and status["policy_version"] is not None

        op = scale_to(run_dir, 1, timeout_s=240, say=lambda _: None)
        assert op["state"] == "ACTIVE", op
        engines = api.get("/rollout/engines")
        assert [e["name"] for e in engines] == ["rollout-0"] and engines[0]["pid"] == pid0
        assert proc.poll() is None, "the run ended before the scaling was done: more steps"
        proc.wait(timeout=500)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    f = dict(kv.split("=") for kv in text.strip().splitlines()[-1].split())
    assert f["steps"] == "120"
    assert int(f["trained"]) + int(f["stale"]) + int(f["filtered"]) + int(f["errors"]) \
        == int(f["sampled"]) > 0, f
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table

    rollouts = read_table(BusConfig(bootstrap_servers=broker), f"{run}.rollouts")
    engines = set(rollouts.column("engine_id").to_pylist())
    assert engines == {"rollout-0", "rollout-1"}, engines
    # a group is sampled once: an instance that gets partitions in a rebalance reads every
    # instance's pending groups first (a scale-in once sampled 14 groups of 160 again)
    sampled_by: dict[str, set[str]] = {}
    for gid, engine in zip(rollouts.column("group_id").to_pylist(),
                           rollouts.column("engine_id").to_pylist()):
        sampled_by.setdefault(gid, set()).add(engine)
    twice = {g: e for g, e in sampled_by.items() if len(e) > 1}
    assert not twice and rollouts.num_rows == 4 * len(sampled_by), twice
