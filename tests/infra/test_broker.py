"""The local broker and the bus CLI, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pytest

from relax.infra.broker import (free_port, kafka_missing, pid_alive, port_open, start_broker,
                                start_kafka, stop_broker)
from relax.streams.read import read_table
from relax.schemas import topics
from relax.schemas.v1 import ROLLOUTS
from relax.streams.client import BusConfig, ensure_topics
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


def _needs_kafka():
    reason = kafka_missing()
    if reason:
        pytest.skip(reason)


@pytest.mark.kafka
def test_cli_kafka_start_status_stop_and_start_again_with_its_data(tmp_path, unique):
    """`relax broker start --kind kafka --dir D`, then stop and start on D again: the
    same cluster, same address, every record still there (Kafka is durable)."""
    _needs_kafka()
    d = tmp_path / "kafka"
    out = relax("broker", "start", "--kind", "kafka", "--dir", str(d)).stdout
    assert "kind=kafka" in out and f"dir={d}" in out
    bootstrap = out.split("bootstrap=")[1].split()[0]
    pid = int(out.split("pid=")[1].split()[0])
    t = topics.run_topic(unique, "rollouts")
    try:
        st = relax("broker", "status").stdout
        assert st.startswith("running: kind=kafka") and "node 1: up" in st
        cfg = BusConfig(bootstrap_servers=bootstrap)
        ensure_topics(cfg, {t: 2})
        p = BatchProducer(cfg)
        p.send(t, pa.RecordBatch.from_pylist(rollout_rows(12, group_size=3), schema=ROLLOUTS))
        p.close()
    finally:
        relax("broker", "stop")
    assert not pid_alive(pid)
    assert relax("broker", "status", check=False).returncode == 1
    out = relax("broker", "start", "--kind", "kafka", "--dir", str(d)).stdout
    try:
        assert out.split("bootstrap=")[1].split()[0] == bootstrap
        assert read_table(BusConfig(bootstrap_servers=bootstrap), t).num_rows == 12
    finally:
        relax("broker", "stop")


@pytest.mark.kafka
def test_kafka_three_nodes_replicate_every_topic(tmp_path, unique):
    _needs_kafka()
    h = start_kafka(tmp_path / "kafka3", brokers=3)
    try:
        assert len(h.nodes) == 3 and len(h.bootstrap.split(",")) == 3
        cfg = BusConfig(bootstrap_servers=h.bootstrap)
        t = topics.run_topic(unique, "rollouts")
        ensure_topics(cfg, {t: 2})
        from relax.streams.client import admin

        a = admin(cfg)
        try:
            parts = a.describe_topics([t])[0]["partitions"]
        finally:
            a.close()
        assert [len(x["replica_nodes"]) for x in parts] == [3, 3]
        p = BatchProducer(cfg)
        p.send(t, pa.RecordBatch.from_pylist(rollout_rows(12, group_size=3), schema=ROLLOUTS))
        p.close()
        assert read_table(cfg, t).num_rows == 12
    finally:
        stop_broker(h)
    assert not any(pid_alive(x) for x in h.pids)
