"""A long tiny run with every kind of late joiner (issue 52): 160 optimizer steps, the
weight snapshots written every 10 versions with the newest 3 kept, so from step 30 on
the early snapshots are gone. After the window has moved on, rollout-0 is killed (its
successor loads the newest kept snapshot), the rollout instances go 1 -> 2 -> 1 (the
added one starts late too) and the reference stage, which follows the policy's weights,
is killed. The run must finish with every sampled rollout in exactly one ledger bucket
and none trained twice."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import pytest
from testdata import tiny_recipe

from relax.infra.control.chaos import Kill, chaos_run

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("local_ray")]

STEPS = 160
SNAPSHOT_EVERY, KEPT = 10, 3
WINDOW = SNAPSHOT_EVERY * KEPT
"""Versions whose snapshots the store still holds: a joiner after this many steps finds
v0 deleted."""


def _snapshots(run_dir: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in (run_dir / "weights").glob("v*") if p.is_dir())


def _rollout_engines(broker: str, run: str) -> set[str]:
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table

    table = read_table(BusConfig(bootstrap_servers=broker), f"{run}.rollouts")
    return set(table.column("engine_id").to_pylist())


def test_late_joiners_past_the_snapshot_window_a_long_run_finishes_whole(broker, tmp_path):
    from relax.infra.cli.scale import scale_to

    run = "soak" + uuid.uuid4().hex[:6]
    recipe = tiny_recipe(broker, tmp_path, run, f"trainer.steps={STEPS}",
                         f"trainer.weights_snapshot_every={SNAPSHOT_EVERY}",
                         "trainer.checkpoint_every=5", "kl.coef=0.01", "kl.in=loss",
                         "reference.follow_every=5")
    seen: dict[str, object] = {}
    scaling: list[dict] = []

    def scale_1_2_1(run_dir: Path) -> None:
        """Out to 2 instances, until rollout-1 has sampled, and back to 1 (in its own
        thread: the driver's watch loop moves the operations on)."""
        scaling.append(scale_to(run_dir, 2, timeout_s=240, say=lambda _: None))
        deadline = time.monotonic() + 180
        while "rollout-1" not in _rollout_engines(broker, run) and time.monotonic() < deadline:
            time.sleep(2.0)
        seen["rollout-1 sampled"] = "rollout-1" in _rollout_engines(broker, run)
        scaling.append(scale_to(run_dir, 1, timeout_s=240, say=lambda _: None))

    threads: list[threading.Thread] = []

    def also(s: dict, run_dir: Path) -> None:
        step = int(s["step"])
        if step == WINDOW + 15:  # the rollout kill below lands after this step
            seen["snapshots at the rollout kill"] = _snapshots(run_dir)
        if step == WINDOW + 30:
            t = threading.Thread(target=scale_1_2_1, args=(run_dir,), daemon=True)
            t.start()
            threads.append(t)

    kills = [Kill("rollout-0", WINDOW + 15, 0.3), Kill("reference", 120, 0.3)]
    r = chaos_run(recipe, kills, 900, also=also)
    for t in threads:
        t.join(timeout=5)
    detail = json.dumps({**r.as_dict(), "seen": seen, "scaling": scaling}, default=str)[:4000]
    assert r.finished, detail
    assert sorted(k.split("@")[0] for k in r.killed) == ["reference", "rollout-0"], detail
    assert min(seen["snapshots at the rollout kill"]) > 0, detail  # v0 was gone
    assert [op["state"] for op in scaling] == ["ACTIVE", "ACTIVE"], detail
    assert seen["rollout-1 sampled"], detail
    assert r.lost == 0 and r.trained_twice == 0, detail
    assert r.trained + r.stale + r.filtered + r.errors == r.sampled > 0, detail
