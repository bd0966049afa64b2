"""The local broker and the bus CLI, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa

from relax.infra.broker import free_port, pid_alive, port_open, start_broker, stop_broker
from relax.schemas import topics
from relax.schemas.v1 import ROLLOUTS
from relax.streams.client import ensure_topics
from relax.streams.producer import BatchProducer

from testdata import rollout_rows


def relax(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "relax.infra.cli", *args], capture_output=True,
                       text=True, timeout=120, env=os.environ.copy())
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_start_stop_leaves_no_process():
    h = start_broker()
    assert port_open(h.host, h.port) and pid_alive(h.pid)
    stop_broker(h)
    assert not pid_alive(h.pid) and not port_open(h.host, h.port)


def test_cli_broker_start_topics_stop():
    port = free_port()
    out = relax("broker", "start", "--port", str(port)).stdout
    assert f"bootstrap=127.0.0.1:{port}" in out
    pid = int(out.split("pid=")[1].split()[0])
    try:
        assert "running" in relax("broker", "status").stdout
        assert relax("broker", "start", check=False).returncode == 1  # already running
        assert "no topics" in relax("topics", "--bootstrap", f"127.0.0.1:{port}").stdout
    finally:
        relax("broker", "stop")
    assert not pid_alive(pid)
    assert relax("broker", "status", check=False).returncode == 1


def test_cli_topics_tail_errors(bus, unique):
    t = topics.run_topic(unique, "rollouts")
    ensure_topics(bus, {t: 2})
    p = BatchProducer(bus)
    p.send(t, pa.RecordBatch.from_pylist(rollout_rows(12, group_size=3), schema=ROLLOUTS))
    p.flush()
    counts = json.loads(relax("topics", "--json", "-b", bus.bootstrap_servers).stdout)
    assert sum(counts[t].values()) == 4  # 4 groups -> 4 messages
    rows = [json.loads(line) for line in
            relax("tail", t, "-n", "5", "--json", "-b", bus.bootstrap_servers).stdout.splitlines()]
    assert len(rows) == 5 and all(r["group_id"].startswith("g") for r in rows)
    p.send_errors(t, [dict(ts=0, source_topic=t, source_partition=0, source_offset=7, row=None,
                           stage="test", error="bad thing", key=None, value=b"x", headers=None)])
    p.flush()
    out = relax("errors", t, "-b", bus.bootstrap_servers).stdout
    assert f"{t}[0]@7 stage=test: bad thing" in out and "errors=1" in out
    p.close()


def test_commands_without_broker_say_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("RELAX_HOME", str(tmp_path))
    monkeypatch.delenv("RELAX_BOOTSTRAP", raising=False)
    r = relax("topics", check=False)
    assert r.returncode != 0 and "relax broker start" in (r.stdout + r.stderr)
