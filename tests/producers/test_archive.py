"""relax archive / relax replay: a run to Parquet and back into a new run.

The run here is synthetic (``testdata.produce_run``: rows of every per-run topic
built with the v1 schemas). ``_archive_replay_roundtrip`` takes any run name, so
the same check can be pointed at a real tiny-model run once the trainer exists.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
from testdata import produce_run

from relax.streams.read import read_messages
from relax.producers.archive import (
    META_COLUMNS,
    archive_run,
    iter_archive,
    load_manifest,
    run_topic_names,
)
from relax.producers.replay import replay
from relax.schemas.topics import schema_for_topic
from relax.streams.client import topic_partitions
from relax.streams.codec import decode
from relax.streams.lag import high_watermarks


def _by_partition(cfg, topic: str) -> dict[int, list[tuple[bytes | None, list[dict]]]]:
    """``{partition: [(key, rows of one message), ...]}`` in offset order."""
    out: dict[int, list] = {}
    name = schema_for_topic(topic)
    for m in sorted(read_messages(cfg, topic), key=lambda m: (m.partition, m.offset)):
        out.setdefault(m.partition, []).append((m.key, decode(m.value, name).to_pylist()))
    return out


def _archive_replay_roundtrip(cfg, run: str, tmp_path) -> None:
    """Archive ``run``, replay it as ``<run>r``; every topic must match message by
    message: same partition count, and per partition the same keys and rows in order."""
    out = tmp_path / "archive"
    res = archive_run(cfg, run, out)
    manifest = load_manifest(out)
    assert manifest["run"] == run
    existing = topic_partitions(cfg, run_topic_names(run))
    assert set(manifest["topics"]) == set(existing)
    new = run + "r"
    rep = replay(cfg, out, new)
    assert rep.rows == res.rows and rep.messages == res.messages
    # both count the topics with rows alike; replay also makes the empty ones
    assert rep.per_topic == res.per_topic
    assert f"topics={len(res.per_topic)} empty_topics={len(existing) - len(res.per_topic)} " \
        in rep.summary()
    targets = {topic: new + topic[len(run):] for topic in existing}
    assert topic_partitions(cfg, list(targets.values())) == \
        {targets[t]: n for t, n in existing.items()}
    hw = high_watermarks(cfg, list(existing) + list(targets.values()))
    for topic, target in targets.items():
        assert [hw[(target, p)] for p in range(existing[topic])] == \
            [hw[(topic, p)] for p in range(existing[topic])], topic
        if any(hw[(topic, p)] for p in range(existing[topic])):  # (reading empty ones is slow)
            assert _by_partition(cfg, target) == _by_partition(cfg, topic), topic


def test_archive_replay_roundtrip_of_a_synthetic_run(bus, unique, tmp_path):
    written = produce_run(bus, unique, steps=3)
    _archive_replay_roundtrip(bus, unique, tmp_path)
    # the archive's Parquet columns: schema + meta columns, rows as written
    out = tmp_path / "archive"
    t = f"{unique}.train_samples"
    tables = list(iter_archive(out, t))
    assert sum(x.num_rows for x in tables) == written[t]
    assert tables[0].schema.names[-5:] == list(META_COLUMNS)
    assert tables[0].schema.field("advantages").metadata[b"doc"]  # field docs kept
    keys = set(tables[0].column("_key").to_pylist())
    assert keys == {g.encode() for g in tables[0].column("group_id").to_pylist()}


def test_archive_is_resumable_second_pass_adds_only_new_rows(bus, unique, tmp_path):
    from typer.testing import CliRunner

    from relax.infra.cli.app import app

    out = tmp_path / "archive"
    first = produce_run(bus, unique, steps=2)
    r1 = archive_run(bus, unique, out)
    assert r1.rows == sum(first.values()) and r1.per_topic == first
    # a crash between a Parquet file and the manifest leaves an unlisted file: dropped
    stray = out / f"{unique}.rollouts" / "part-000009.parquet"
    stray.write_bytes(b"partial")
    again = archive_run(bus, unique, out)  # nothing new
    assert (again.rows, again.files) == (0, 0) and not stray.exists()

    second = produce_run(bus, unique, steps=1)
    res = CliRunner().invoke(app, ["archive", "--run", unique, "--out", str(out),
                                   "--bootstrap", bus.bootstrap_servers])
    assert res.exit_code == 0, res.output
    assert f"archived rows={sum(second.values())} " in res.output.splitlines()[-1]

    manifest = json.loads((out / "manifest.json").read_text())
    for topic, n in first.items():
        entry = manifest["topics"][topic]
        assert entry["rows"] == n + second[topic]
        assert len(entry["files"]) == 2  # one file per pass with new rows
        seen = []
        for f in entry["files"]:
            t = pq.read_table(out / topic / f)
            seen += list(zip(t.column("_partition").to_pylist(), t.column("_offset").to_pylist(),
                             t.column("_key").to_pylist()))
        msgs = {(p, o) for p, o, _ in seen}
        hw = {int(p): pos for p, pos in entry["positions"].items()}
        assert msgs == {(m.partition, m.offset) for m in read_messages(bus, topic)}
        assert all(o < hw[p] for p, o in msgs)


def test_archive_follow_keeps_going_until_sigterm(bus, unique, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "archive"
    first = produce_run(bus, unique, steps=1)

    def archived_rows() -> int:
        if not (out / "manifest.json").exists():
            return 0
        return sum(e["rows"] for e in load_manifest(out)["topics"].values())

    def wait_for(rows: int) -> None:
        deadline = time.monotonic() + 60
        while archived_rows() < rows:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"archived {archived_rows()} of {rows} rows"
            time.sleep(0.1)

    proc = subprocess.Popen(
        [sys.executable, "-m", "relax.infra.cli.app", "archive", "--run", unique, "--out", str(out),
         "--follow", "--interval", "0.2", "--bootstrap", bus.bootstrap_servers],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(sum(first.values()))
        second = produce_run(bus, unique, steps=1)  # arrives while it follows
        total = sum(first.values()) + sum(second.values())
        wait_for(total)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert stdout.strip().splitlines()[-1].startswith(f"archived rows={total} ")
    assert archived_rows() == total


def test_archive_replay_of_a_real_tiny_run(tiny_run, bus, tmp_path):
    recipe, summary = tiny_run
    assert summary["steps"] == 3
    _archive_replay_roundtrip(bus, recipe.run, tmp_path)
