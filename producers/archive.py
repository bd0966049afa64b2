"""Topics to Parquet, incrementally and resumably (``relax archive``).

The broker is transport, not storage (docs/architecture.md, section 8): the archive is
where a run's data lives after it. Layout of an archive folder ``DIR``::

    DIR/manifest.json                 what was archived and up to where
    DIR/<topic>/part-000000.parquet   rows of <topic>, in offset order per partition
    DIR/<topic>/part-000001.parquet   (one file per pass and per ~flush_bytes)
    DIR/errors.jsonl                  the messages that could not be archived (if any)

Each Parquet file has the columns of the topic's v1 schema (field docs kept)
plus ``_topic`` (string), ``_partition`` (int32), ``_offset`` (int64, the Kafka
offset of the message the row came in; rows of one message share it),
``_timestamp`` (timestamp[ms, UTC], the message timestamp) and ``_key`` (binary,
the Kafka key).

Resumable: the manifest keeps, per topic and partition, the next offset to
archive; it is rewritten atomically (temp file + rename) after every Parquet
file, and files the manifest does not list (left by a crash between the two) are
deleted on the next pass. A pass reads each partition from its position up to
the high watermark seen when the pass started, so a second pass appends only
what is new. Reads are group-less (no consumer group, no commits).

Bad messages: one whose bytes do not decode as the topic's schema, or whose rows
Parquet refuses (a null in a non-nullable column), is not archived; it is a line
of ``DIR/errors.jsonl`` (see :func:`error_record`), counted as ``errors`` per topic
in the manifest and in :class:`ArchiveResult`, and the pass goes on. The file's
length is in the manifest (``errors_bytes``) and a line written after it (a crash
before the manifest) is cut on the next pass, so each bad message is listed once.
(Whoever consumed such a message routed it to ``<topic>.errors`` too, which is
archived like any topic.) One archiver per folder at a time (nothing locks the folder).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from relax.schemas import topics as topic_names
from relax.schemas.v1 import TS, get_schema
from relax.streams.client import BusConfig

MANIFEST = "manifest.json"
ERRORS_FILE = "errors.jsonl"
FORMAT = "relax-archive"
FORMAT_VERSION = 1
DEFAULT_FLUSH_BYTES = 64 << 20

META_FIELDS = [
    pa.field("_topic", pa.string(), nullable=False, metadata={"doc": "source topic"}),
    pa.field("_partition", pa.int32(), nullable=False, metadata={"doc": "source partition"}),
    pa.field("_offset", pa.int64(), nullable=False,
             metadata={"doc": "offset of the Kafka message the row came in"}),
    pa.field("_timestamp", TS, nullable=False,
             metadata={"doc": "message timestamp", "unit": "ms since epoch, UTC"}),
    pa.field("_key", pa.binary(), metadata={"doc": "Kafka key of the message"}),
]
META_COLUMNS = tuple(f.name for f in META_FIELDS)


def archive_schema(schema_name: str) -> pa.Schema:
    """The Parquet schema of an archived topic: v1 schema ``schema_name`` + :data:`META_FIELDS`."""
    base = get_schema(schema_name)
    return pa.schema(list(base) + META_FIELDS, metadata=base.metadata)


def run_topic_names(run: str) -> list[str]:
    """Every topic of a run: ``<run>.<name>`` for each per-run topic and its ``.errors``."""
    out = []
    for name in topic_names.RUN_TOPICS:
        t = topic_names.run_topic(run, name)
        out += [t, topic_names.errors_topic(t)]
    return out


# --- manifest ------------------------------------------------------------------------


def load_manifest(out: Path | str) -> dict:
    """The archive's manifest (an empty one if the folder has none yet).

    Raises:
        ValueError: the file is not a relax archive manifest of a known version.
    """
    path = Path(out) / MANIFEST
    if not path.exists():
        return {"format": FORMAT, "version": FORMAT_VERSION, "run": None, "topics": {}}
    m = json.loads(path.read_text())
    if m.get("format") != FORMAT or m.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: not a {FORMAT} v{FORMAT_VERSION} manifest")
    return m


def save_manifest(out: Path | str, manifest: dict) -> None:
    """Write the manifest atomically (temp file, fsync, rename)."""
    path = Path(out) / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _topic_entry(manifest: dict, topic: str, partitions: int) -> dict:
    entry = manifest["topics"].setdefault(topic, {
        "schema": topic_names.schema_for_topic(topic), "partitions": partitions,
        "positions": {}, "rows": 0, "messages": 0, "errors": 0, "files": []})
    entry.setdefault("errors", 0)  # an archive written before errors.jsonl
    entry["partitions"] = max(entry["partitions"], partitions)
    return entry


def _remove_unlisted(out: Path, manifest: dict) -> None:
    """Delete Parquet/temp files a crashed pass left without a manifest entry, and cut
    ``errors.jsonl`` back to the length the manifest records."""
    errors = out / ERRORS_FILE
    if errors.exists() and errors.stat().st_size > manifest.get("errors_bytes", 0):
        os.truncate(errors, manifest.get("errors_bytes", 0))
    for topic, entry in manifest["topics"].items():
        d = out / topic
        if not d.is_dir():
            continue
        listed = set(entry["files"])
        for f in d.iterdir():
            if f.name not in listed:
                f.unlink()


# --- archiving ---------------------------------------------------------------------


def error_record(m, reason: str) -> dict:
    """The ``errors.jsonl`` line of a message that was not archived: ``topic``,
    ``partition``, ``offset``, ``timestamp`` (ms since epoch), ``reason``, ``key`` and
    ``value`` (its bytes, base64; None for a null one) and ``value_bytes`` (their size)."""
    def b64(b: bytes | None) -> str | None:
        return None if b is None else base64.b64encode(b).decode()

    return {"topic": m.topic, "partition": m.partition, "offset": m.offset,
            "timestamp": m.timestamp, "reason": reason, "key": b64(m.key),
            "value": b64(m.value), "value_bytes": len(m.value or b"")}


def read_errors(out: Path | str) -> list[dict]:
    """The lines of the archive's ``errors.jsonl`` (see :func:`error_record`), in the order
    written; [] when it has none."""
    path = Path(out) / ERRORS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@dataclass
class ArchiveResult:
    """What one or more passes did: ``rows`` and ``messages`` archived, value ``bytes``
    read, Parquet ``files``, ``errors`` (messages not archived: lines added to
    ``errors.jsonl``), wall ``seconds``, rows per topic."""

    rows: int = 0
    messages: int = 0
    bytes: int = 0
    files: int = 0
    errors: int = 0
    seconds: float = 0.0
    per_topic: dict[str, int] = field(default_factory=dict)

    @property
    def rows_per_s(self) -> float:
        """Archived rows per second of wall time."""
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        """One line for the CLI."""
        return (f"archived rows={self.rows} messages={self.messages} files={self.files} "
                f"errors={self.errors} topics={len(self.per_topic)} "
                f"seconds={self.seconds:.2f}")


class _Writer:
    """Buffers one topic's rows and writes them as Parquet files + manifest updates."""

    def __init__(self, out: Path, manifest: dict, topic: str, entry: dict, flush_bytes: int,
                 result: ArchiveResult):
        self.out, self.manifest, self.topic, self.entry = out, manifest, topic, entry
        self.flush_bytes, self.result = flush_bytes, result
        self.schema = archive_schema(entry["schema"])
        self.tables: list[pa.Table] = []
        self.meta: list[tuple] = []  # (partition, offset, timestamp ms, key, rows) per message
        self.kept: list = []  # the message of each table (for errors.jsonl if Parquet refuses it)
        self.errors: list[dict] = []  # error_record of each message not archived
        self.nbytes = 0
        self.positions: dict[int, int] = {}
        self.messages = 0

    def add(self, m, table: pa.Table | None, why: str | None = None) -> None:
        """Add the rows of one message (``table`` None: it did not decode, ``why``)."""
        self.positions[m.partition] = m.offset + 1
        self.nbytes += len(m.value or b"")
        if table is None:
            self.errors.append(error_record(m, f"does not decode: {why}"))
        else:
            self.messages += 1
            if table.num_rows:
                self.tables.append(table)
                self.meta.append((m.partition, m.offset, m.timestamp, m.key, table.num_rows))
                self.kept.append(m)
        if self.nbytes >= self.flush_bytes:
            self.flush()

    def _drop_unwritable(self, error: pa.ArrowInvalid) -> None:
        """Parquet refused the buffered rows (``error``): move each message whose rows it
        refuses alone to ``self.errors``.

        Raises:
            pyarrow.ArrowInvalid: ``error`` again when no single message is at fault.
        """
        import pyarrow.parquet as pq

        keep = []
        for i, table in enumerate(self.tables):
            try:
                pq.write_table(table, pa.BufferOutputStream())
                keep.append(i)
            except pa.ArrowInvalid as e:
                self.errors.append(error_record(
                    self.kept[i], f"its rows cannot be stored as {self.entry['schema']!r}: {e}"))
                self.messages -= 1
        if len(keep) == len(self.tables):
            raise error
        self.tables = [self.tables[i] for i in keep]
        self.meta = [self.meta[i] for i in keep]
        self.kept = [self.kept[i] for i in keep]

    def _with_meta(self) -> pa.Table:
        """The buffered rows with the meta columns (one value per message, repeated)."""
        import numpy as np

        data = pa.concat_tables(self.tables)
        parts, offsets, stamps, keys, counts = zip(*self.meta)
        idx = pa.array(np.repeat(np.arange(len(counts)), counts))
        meta = [pa.array([self.topic] * len(counts), pa.string()),
                pa.array(parts, pa.int32()), pa.array(offsets, pa.int64()),
                pa.array(stamps, TS), pa.array(keys, pa.binary())]
        return pa.Table.from_arrays(list(data.columns) + [a.take(idx) for a in meta],
                                    schema=self.schema)

    def _write_parquet(self, path: Path) -> None:
        """The buffered rows to ``path``; messages Parquet refuses go to ``self.errors``."""
        import pyarrow.parquet as pq

        try:
            pq.write_table(self._with_meta(), path, compression="zstd")
        except pa.ArrowInvalid as e:  # e.g. a null in a non-nullable column
            self._drop_unwritable(e)
            if self.tables:
                pq.write_table(self._with_meta(), path, compression="zstd")
            else:
                path.unlink(missing_ok=True)

    def _write_errors(self) -> None:
        """Append ``self.errors`` to errors.jsonl in offset order per partition (fsynced;
        its new length into the manifest)."""
        path = self.out / ERRORS_FILE
        self.errors.sort(key=lambda e: (e["partition"], e["offset"]))
        with open(path, "a") as f:
            f.writelines(json.dumps(e) + "\n" for e in self.errors)
            f.flush()
            os.fsync(f.fileno())
        self.manifest["errors_bytes"] = path.stat().st_size

    def flush(self) -> None:
        """Write buffered rows (if any) to a new Parquet file, bad messages to
        errors.jsonl, then the manifest."""
        if not self.positions:
            return
        if self.tables:
            d = self.out / self.topic
            d.mkdir(parents=True, exist_ok=True)
            name = f"part-{len(self.entry['files']):06d}.parquet"
            tmp = d / f".{name}.tmp"
            self._write_parquet(tmp)
            if self.tables:
                os.replace(tmp, d / name)
                self.entry["files"].append(name)
                self.result.files += 1
        if self.errors:
            self._write_errors()
        rows = sum(n for *_, n in self.meta)
        for p, pos in self.positions.items():
            self.entry["positions"][str(p)] = pos
        self.entry["rows"] += rows
        self.entry["messages"] += self.messages
        self.entry["errors"] += len(self.errors)
        save_manifest(self.out, self.manifest)
        self.result.rows += rows
        self.result.messages += self.messages
        self.result.bytes += self.nbytes
        self.result.errors += len(self.errors)
        self.result.per_topic[self.topic] = self.result.per_topic.get(self.topic, 0) + rows
        self.tables, self.meta, self.kept, self.errors = [], [], [], []
        self.nbytes, self.positions, self.messages = 0, {}, 0


def archive_topics(cfg: BusConfig, topics: list[str], out: Path | str, *, run: str | None = None,
                   flush_bytes: int = DEFAULT_FLUSH_BYTES, timeout_s: float = 120.0,
                   result: ArchiveResult | None = None) -> ArchiveResult:
    """One archive pass: every topic of ``topics`` that exists, from the manifest's
    positions up to the high watermarks seen at the start of the pass.

    Args:
        cfg: bus settings.
        topics: topic names (missing ones are skipped; their schema comes from the name).
        out: archive folder (created if needed).
        run: run name recorded in the manifest.
        flush_bytes: write a Parquet file every this many message bytes (per topic).
        timeout_s: longest wait for the next records of a topic still below its
            watermarks (seconds).
        result: a result to add to (``--follow`` sums passes).

    Raises:
        ValueError: a partition's high watermark is below the archived position (the
            topic was deleted and recreated: archive it into a new folder), or the
            manifest belongs to another run.
        TimeoutError: a topic gave no records for ``timeout_s`` before its watermarks.
    """
    from relax.streams.client import topic_partitions
    from relax.streams.lag import high_watermarks

    t0 = time.perf_counter()
    result = result or ArchiveResult()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = load_manifest(out)
    if run is not None:
        if manifest.get("run") not in (None, run):
            raise ValueError(f"{out} archives run {manifest['run']!r}, not {run!r}")
        manifest["run"] = run
    _remove_unlisted(out, manifest)
    counts = topic_partitions(cfg, topics)
    present = [t for t in topics if counts.get(t)]
    hw = high_watermarks(cfg, present) if present else {}
    for topic in present:
        entry = _topic_entry(manifest, topic, counts[topic])
        todo = {}
        for p in range(counts[topic]):
            pos, end = entry["positions"].get(str(p), 0), hw[(topic, p)]
            if end < pos:
                raise ValueError(f"{topic}[{p}]: high watermark {end} is below the archived "
                                 f"position {pos}; the topic was recreated - archive it into a "
                                 "new folder")
            if end > pos:
                todo[p] = (pos, end)
        if todo:
            writer = _Writer(out, manifest, topic, entry, flush_bytes, result)
            _read_into(cfg, topic, entry["schema"], todo, writer, timeout_s)
            writer.flush()
    save_manifest(out, manifest)  # also records topics that had nothing new
    result.seconds += time.perf_counter() - t0
    return result


def _read_into(cfg: BusConfig, topic: str, schema: str, todo: dict[int, tuple[int, int]],
               writer: _Writer, timeout_s: float) -> None:
    """Read ``{partition: (start, end)}`` of ``topic`` into ``writer`` in offset order."""
    from relax.streams.read import TopicReader, decode_or_reason

    reader = TopicReader(cfg, "archive")
    try:
        for m in reader.read_range({(topic, p): r for p, r in todo.items()}, timeout_s):
            writer.add(m, *decode_or_reason(m, schema))
    finally:
        reader.close()


def archive_run(cfg: BusConfig, run: str, out: Path | str, *, follow: bool = False,
                interval_s: float = 2.0, should_stop: Callable[[], bool] | None = None,
                flush_bytes: int = DEFAULT_FLUSH_BYTES) -> ArchiveResult:
    """Archive every topic of ``run`` (:func:`run_topic_names`) into ``out``.

    With ``follow``, repeat a pass every ``interval_s`` seconds until
    ``should_stop()`` is true (checked between passes and while waiting); the
    archive is consistent after every pass.

    Raises:
        see :func:`archive_topics`.
    """
    topics = run_topic_names(run)
    result = archive_topics(cfg, topics, out, run=run, flush_bytes=flush_bytes)
    stop = should_stop or (lambda: False)
    while follow and not stop():
        deadline = time.monotonic() + interval_s
        while time.monotonic() < deadline and not stop():
            time.sleep(min(0.2, interval_s))
        if not stop():
            archive_topics(cfg, topics, out, run=run, flush_bytes=flush_bytes, result=result)
    return result


def stop_on_signals() -> threading.Event:
    """An event set by SIGINT or SIGTERM (call from the main thread): lets ``--follow``
    finish its pass and leave a consistent archive."""
    ev = threading.Event()

    def handler(signum, frame):
        ev.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return ev


# --- reading an archive back -----------------------------------------------------------


def iter_archive(out: Path | str, topic: str) -> Iterator[pa.Table]:
    """The archived rows of ``topic`` (full topic name), one table per Parquet file in
    the order written, each with the schema of :func:`archive_schema`. Within a
    partition, rows are in offset order across files.

    Raises:
        KeyError: the archive has no such topic (lists the archived ones).
    """
    import pyarrow.parquet as pq

    out = Path(out)
    m = load_manifest(out)
    if topic not in m["topics"]:
        raise KeyError(f"{out} has no topic {topic!r}; archived: {sorted(m['topics'])}")
    for name in m["topics"][topic]["files"]:
        yield pq.read_table(out / topic / name)


def strip_meta(table: pa.Table, schema_name: str) -> pa.Table:
    """An archived table back to the v1 schema ``schema_name`` (meta columns dropped)."""
    schema = get_schema(schema_name)
    return table.select(schema.names).cast(schema)
