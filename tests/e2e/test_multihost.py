"""A run across three hosts (network namespaces on this machine, ``tests/hosts.py``): the
broker, the Ray head and the trainer (rank 0) on host a, two rollout instances on host b,
the reward, the aggregator and the trainer's rank 1 (FSDP2 over gloo, a Ray task) on
host c, placed by the recipe (``resources.<stage>.host``,
each Ray node offering ``host:<name>``). Every byte between stages crosses the veth
links: the bus to a's address, the weights from the trainer's rendezvous on a's address
to the rollout engines on b, the weight snapshots a late joiner loads from an
S3-compatible server on a (moto's; ``trainer.weights_store``), read back on b; the
trainer's checkpoints (``trainer.checkpoint_store``, where the summary's accounting reads
the ledger) and the blob store (``bus.blob_store``) on that server too. Skipped where
network namespaces cannot be made (not root, no iproute2).

Nothing is shared on disk: hosts b and c each have a disk of their own at the run root
(:meth:`Hosts.own_disk`, with a ``/dev/shm`` of its own), so each stage writes its log on
its own host, as on separate machines, the engines on b get the weights by broadcast (no
same-host file), and a stage that read another host's run folder would find nothing there. Host
a (the driver, the broker, the trainer's rank 0) keeps the run folder the summary writes.
Shared still: this machine's installed packages and model cache (``$RELAX_CACHE``),
which every host has a copy of in a real cluster."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from hosts import Hosts, unavailable
from testdata import PARITY_REWARD, RECIPES, s3_uri

why_not = unavailable()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(why_not is not None, reason=str(why_not))]

TESTS = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
READ = """
import json, sys
from relax.streams.client import BusConfig
from relax.streams.read import read_table
bus = BusConfig(bootstrap_servers=sys.argv[1])
t = read_table(bus, sys.argv[2] + ".rollouts")
by = {}
for e, v in zip(t.column("engine_id").to_pylist(), t.column("policy_version_end").to_pylist()):
    by.setdefault(e, []).append(v)
sent = {}
for r in read_table(bus, sys.argv[2] + ".metrics").to_pylist():
    if r["name"] in ("weights_local_subscribers", "weights_broadcast_subscribers"):
        sent.setdefault(r["name"], []).append(r["value"])
print(json.dumps({"rows": by, "sent": sent}))
"""
SNAPSHOT = """
import json, sys
from relax.streams.client import BusConfig
from relax.streams.read import read_table
from relax.streams.weights.layout import checksum
from relax.streams.weights.store import read_snapshot
every = read_table(BusConfig(bootstrap_servers=sys.argv[1]), sys.argv[2] + ".weights").to_pylist()
rows = [r for r in every if r["transport"] == "checkpoint"]
newest = max(rows, key=lambda r: r["policy_version"])
flat, _ = read_snapshot(newest["checkpoint_uri"])
print(json.dumps({"uri": newest["checkpoint_uri"], "version": newest["policy_version"],
                  "same": checksum(flat) == newest["checksum"], "bytes": flat.numel(),
                  "shm": sum(r["transport"] == "shm" for r in every)}))
"""


@contextlib.contextmanager
def _forget_cluster(head: str):
    """Remove the address file `ray start --head` leaves (``/tmp/ray/ray_current_cluster``)
    when it names this test's cluster: a later ``ray.init()`` would try to join it."""
    from ray._private.utils import get_ray_address_file

    try:
        yield
    finally:
        f = Path(get_ray_address_file(None))
        if f.exists() and f.read_text().strip().startswith(head + ":"):
            f.unlink()


def test_stages_on_three_hosts(tmp_path):
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RELAX_HOME=str(tmp_path / "home"),
               RAY_USAGE_STATS_ENABLED="0", AWS_ACCESS_KEY_ID="test",
               AWS_SECRET_ACCESS_KEY="test", AWS_REGION="us-east-1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    run = "mh" + uuid.uuid4().hex[:6]
    root = tmp_path / "runs"
    with Hosts(["a", "b", "c"]) as h, _forget_cluster(h.addr("a")):
        a = h.addr("a")
        for name in ("b", "c"):
            for d in (root, tmp_path / f"disk-{name}"):
                d.mkdir(exist_ok=True)
            h.own_disk(name, str(root), str(tmp_path / f"disk-{name}"))
        for name in h.names:  # a route for Ray's own address lookup; no uplink behind it
            h.run(name, ["ip", "route", "add", "default", "dev", "eth0"], check=True)
        bootstrap, ray_head = f"{a}:19092", f"{a}:6379"
        h.run("a", [sys.executable, "-m", "relax.infra.cli.app", "broker", "start", "--host", a,
                    "--port", "19092"], env=env, check=True, timeout=60)
        h.popen("a", [sys.executable, "-m", "moto.server", "-H", a, "-p", "19000"], env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        store = s3_uri(f"{a}:19000", f"relax-weights/{run}")
        for name in h.names:
            head = ["--head", "--port=6379", "--include-dashboard=false"] if name == "a" \
                else [f"--address={ray_head}"]
            r = h.run(name, [RAY, "start", *head, f"--node-ip-address={h.addr(name)}",
                             "--num-cpus=3", f'--resources={{"host:{name}": 1000}}',
                             "--disable-usage-stats"], env=env, timeout=180,
                      capture_output=True, text=True)
            assert r.returncode == 0, f"ray start on {name}: {r.stdout[-1500:]}{r.stderr[-3000:]}"
        r = h.run("a", [sys.executable, "-m", "relax.infra.cli.app", "train",
                        str(RECIPES / "tiny_ci.yaml"), f"run={run}", f"run_root={root}",
                        PARITY_REWARD, f"ray_address={ray_head}", "rollout.instances=2",
                        "trainer.steps=4", "resources.trainer.host=a",
                        "resources.rollout.host=b", "resources.reward.host=c",
                        "resources.aggregate.host=c", f"trainer.weights_store={store}",
                        "trainer.checkpoint_store=" + s3_uri(f"{a}:19000", f"relax-ckpt/{run}"),
                        "bus.blob_store=" + s3_uri(f"{a}:19000", f"relax-blobs/{run}"),
                        "trainer.weights_snapshot_every=2", "resources.trainer.processes=2",
                        "resources.trainer.rank_hosts=[c]", "trainer.data_parallel=fsdp2",
                        "--bootstrap", bootstrap,
                        "--timeout-s", "400"],
                  env=env, capture_output=True, text=True, timeout=500)
        logs = root / run / "logs"
        tails = "\n".join(f"--- {f}\n{f.read_text(errors='replace')[-1500:]}"
                          for d in (root, tmp_path / "disk-b", tmp_path / "disk-c")
                          for f in sorted((d / run / "logs").glob("*.log")))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:] + tails
        f = dict(kv.split("=") for kv in r.stdout.strip().splitlines()[-1].split())
        assert f["steps"] == "4"
        assert "warning:" not in r.stdout, r.stdout  # every host reaches every store
        # the accounting above read the trainer's ledger from the checkpoint store: the
        # trainer kept no checkpoint on its disk
        assert [p.name for p in (root / run / "checkpoints").iterdir()] == ["store-part"]
        assert int(f["trained"]) + int(f["stale"]) + int(f["filtered"]) + int(f["errors"]) \
            == int(f["sampled"]) > 0, f
        stages = json.loads((root / run / "stages.json").read_text())
        where = {name: s["node"] for name, s in stages.items()}
        assert where == {"trainer": a, "rollout-0": h.addr("b"), "rollout-1": h.addr("b"),
                         "reward.parity": h.addr("c"), "aggregate": h.addr("c")}, where
        seen = h.run("b", [sys.executable, "-c", READ, bootstrap, run], env=env,
                     capture_output=True, text=True, timeout=120)
        assert seen.returncode == 0, seen.stderr[-3000:]
        seen = json.loads(seen.stdout)
        by_engine = seen["rows"]
        # the engines share one credit (dynamic claims): in 4 steps one may sample every
        # group, so which engine wrote rows is left open; the trainer on a sent a version
        # to both by broadcast, none through a same-host file
        assert by_engine and set(by_engine) <= {"rollout-0", "rollout-1"}, by_engine.keys()
        assert max(seen["sent"]["weights_broadcast_subscribers"]) == 2, seen["sent"]
        assert set(seen["sent"]["weights_local_subscribers"]) == {0}, seen["sent"]
        # the engines on b sampled with weights the trainer on a published after step 1
        assert max(max(v) for v in by_engine.values()) >= 2, by_engine
        # each stage logged on its own host's disk: nothing of b's or c's is on a
        on = {name: sorted(f.name for f in (tmp_path / f"disk-{name}" / run / "logs").glob("*"))
              for name in ("b", "c")}
        assert on == {"b": ["rollout-0.log", "rollout-1.log"],
                      "c": ["aggregate.log", "reward.parity.log", "trainer-rank1.log"]}, on
        assert not {f.name for f in logs.glob("*")} & {*on["b"], *on["c"]}, list(logs.glob("*"))
        # the trainer's rank 1 ran on c and took every step with rank 0 on a
        rank1 = (tmp_path / "disk-c" / run / "logs" / "trainer-rank1.log").read_text()
        assert f"rank 1 on {h.addr('c')} joins rank 0 at {a}:" in rank1, rank1[-2000:]
        assert "rank 1 done after 4 steps" in rank1, rank1[-2000:]
        # the newest weight snapshot, read on b from the store on a: what a late joiner loads
        snap = h.run("b", [sys.executable, "-c", SNAPSHOT, bootstrap, run], env=env,
                     capture_output=True, text=True, timeout=120)
        assert snap.returncode == 0, snap.stderr[-3000:]
        got = json.loads(snap.stdout)
        assert got["uri"].startswith(f"s3://relax-weights/{run}/v") and got["same"], got
        assert got["version"] >= 2 and got["bytes"] > 0, got
        assert got["shm"] == 0, got  # b has a /dev/shm of its own: no same-host file
