"""A reward attached to a live run, then detached, through ``relax reward attach --weight``
and ``relax reward detach`` (issue 16): every stage its own process, the real broker."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from testdata import tiny_recipe

from relax.schemas import metric_names as M
from relax.streams.client import BusConfig
from relax.streams.read import read_table
from relax.trainer import checkpoint
from relax.trainer.ledger import Ledger

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("local_ray")]

CLI = [sys.executable, "-m", "relax.infra.cli.app", "reward"]


def _changes(bus: BusConfig, run: str) -> list[dict]:
    return read_table(bus, f"{run}.reward_changes").to_pylist()


def test_reward_attached_then_detached_counts_only_for_groups_sampled_in_between(broker, tmp_path):
    """``bonus`` (1.0 on every response, weight 0.5) is attached after step 1 and detached
    two steps after the attach counts, in a 30-step run (the trainer goes on while each
    command starts, and a tiny step can take under a second: with a detach at a fixed
    step, one CI run had the attach count from v9 and the detach from v10, and no group
    was sampled in between; with 8 steps, a detach at v8 left no aggregator turn to
    record it; with 16, a CI run had the attach count from v9 and the detach from v17,
    after the last step). Every group counts it iff its group policy_version (the
    least policy_version_start of its rollouts) is in [attach version, detach version):
    then its final reward is exactly parity + 0.5, otherwise parity alone; no group waits
    for it and times out; the metrics give its weight at both versions and the ledger
    names it for exactly the rollouts trained with it."""
    from relax.infra.control.launch import train

    run = "live" + uuid.uuid4().hex[:6]
    recipe = tiny_recipe(broker, tmp_path, run, "trainer.steps=30")
    bus = BusConfig(bootstrap_servers=broker)
    attach_log = tmp_path / "attach.log"
    attached: list[subprocess.Popen] = []
    detached: list[subprocess.CompletedProcess] = []

    def on_step(s, run_dir):
        if int(s["step"]) >= 1 and not attached:
            attached.append(subprocess.Popen(
                CLI + ["attach", "testdata:bonus_reward", "--run", run, "--name", "bonus",
                       "--weight", "0.5", "--bootstrap", broker],
                stdout=attach_log.open("w"), stderr=subprocess.STDOUT, env=os.environ.copy()))
        on = _changes(bus, run) if attached and not detached else []
        if on and int(s["step"]) >= on[0]["from_policy_version"] + 2:
            detached.append(subprocess.run(CLI + ["detach", "bonus", "--run", run,
                                                  "--bootstrap", broker],
                                           capture_output=True, text=True, timeout=120,
                                           env=os.environ.copy()))

    lines: list[str] = []
    try:
        s = train(recipe, say=lines.append, on_step=on_step, timeout_s=600)
    finally:
        for p in attached:
            p.terminate()
            p.wait(60)
    out = attach_log.read_text()
    assert detached and detached[0].returncode == 0, detached and detached[0].stderr
    assert s["steps"] == 30 and s["balanced"], (s, lines, out)

    changes = _changes(bus, run)
    assert [(c["action"], c["reward_name"], c["weight"]) for c in changes] == \
        [("attach", "bonus", 0.5), ("detach", "bonus", 0.0)], changes
    v_on, v_off = (c["from_policy_version"] for c in changes)
    assert 1 < v_on < v_off, changes
    assert f"policy_version >= {v_on}" in out, out
    assert f"policy_version >= {v_off}" in detached[0].stdout

    samples = read_table(bus, f"{run}.train_samples").to_pylist()
    assert not [r for r in samples if r["drop_reason"] == "filtered_group_timeout"]
    groups = defaultdict(list)
    for r in samples:
        groups[r["group_id"]].append(r)
    with_bonus = set()
    seen = defaultdict(int)
    for rows in groups.values():
        version = min(r["policy_version_start"] for r in rows)
        counts = v_on <= version < v_off
        seen["before" if version < v_on else "during" if counts else "after"] += 1
        for r in rows:
            c = dict(r["reward_components"] or [])
            if r["drop_reason"] is not None and r["drop_reason"].startswith("error"):
                continue
            assert ("bonus" in c) == counts, (version, v_on, v_off, r["reward_components"])
            assert r["reward"] == pytest.approx(c["parity"] + (0.5 if counts else 0.0), abs=1e-6)
            if counts:
                with_bonus.add(r["rollout_id"])
    # the rule above holds for every group (groups after the detach exist when it came
    # early enough)
    assert seen["before"] and seen["during"], dict(seen)

    weights = sorted((m["policy_version"], m["value"])
                     for m in read_table(bus, f"{run}.metrics").to_pylist()
                     if m["name"] == M.REWARD_WEIGHT_PREFIX + "bonus")
    assert weights == [(v_on, 0.5), (v_off, 0.0)], weights

    ledger = Ledger.load(checkpoint.latest(Path(s["run_dir"])) / "ledger.parquet")
    named = {rid for rid in ledger.ids() if "bonus" in (ledger.rewards(rid) or "").split(",")}
    assert named and named == with_bonus & ledger.ids(), (len(named), len(with_bonus))
