"""An archive back onto the bus as a new run (``relax replay DIR --run NEW``).

Every archived topic ``<old>.<name>`` (and ``<old>.<name>.errors``) is written
to ``<new>.<name>`` with the same partition count, each archived Kafka message
re-sent as one message (its rows in their order, re-split only if it no longer
fits ``max_message_bytes``) with the same key, to the same partition, in offset
order. So rows, keys, partitions and per-key order match the original; offsets
match too when the target topics are new and the archive holds the topics from
offset 0. Message timestamps are new (replaying old timestamps into a cluster
with time retention would expire them at once). Rows are kept as archived:
``rollout_id`` / ``group_id`` and the ``source_topic`` of error rows still name
the original run's data. Messages the archive could not hold (its ``errors.jsonl``)
are not replayed; :attr:`ReplayResult.left_out` counts them.

A target topic that already holds messages (the archive replayed there before, or
another run of that name) makes the replay refuse before sending anything
(:class:`TargetNotEmpty`) unless ``append``: the rows would be there twice.

Delivery: each topic is flushed before the next; any failed send raises
:class:`~relax.streams.producer.DeliveryError`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from relax.producers.archive import iter_archive, load_manifest, strip_meta
from relax.schemas import topics as topic_names
from relax.schemas.v1 import SCHEMA_VERSION
from relax.streams.client import BusConfig


class TargetNotEmpty(ValueError):
    """A topic of the target run already holds messages; nothing was sent (pass
    ``append`` to add the archive to it anyway).

    Attributes:
        topic: the first such topic (in the archive's topic order).
        rows: the rows it holds (messages that do not decode count none).
        others: how many more of the target topics hold messages.
    """

    def __init__(self, topic: str, rows: int, others: int):
        self.topic, self.rows, self.others = topic, rows, others
        more = f" (and {others} more of the run's topics hold rows)" if others else ""
        super().__init__(f"topic {topic} already holds {rows} rows{more}; replaying would add "
                         "the archive's rows to them a second time. Nothing was sent: pass "
                         "--append to add them anyway, or choose another --run")


@dataclass
class ReplayResult:
    """What a replay sent: ``rows``, ``messages``, value ``bytes``, wall ``seconds``,
    ``{archived topic: new topic}`` (every archived topic is made, empty ones too),
    ``{archived topic: rows sent}`` (those with rows) and ``left_out``: messages of
    the chosen topics the archive could not hold (listed in its ``errors.jsonl``)."""

    rows: int = 0
    messages: int = 0
    bytes: int = 0
    seconds: float = 0.0
    topics: dict[str, str] = field(default_factory=dict)
    per_topic: dict[str, int] = field(default_factory=dict)
    left_out: int = 0

    @property
    def rows_per_s(self) -> float:
        """Replayed rows per second of wall time."""
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        """One line for the CLI."""
        empty = len(self.topics) - len(self.per_topic)
        return (f"replayed rows={self.rows} messages={self.messages} "
                f"topics={len(self.per_topic)} empty_topics={empty} left_out={self.left_out} "
                f"seconds={self.seconds:.2f}")


def renamed(topic: str, old_run: str, new_run: str) -> str:
    """``<old_run>.<rest>`` -> ``<new_run>.<rest>``.

    Raises:
        ValueError: ``topic`` is not a topic of ``old_run``.
    """
    prefix = old_run + "."
    if not topic.startswith(prefix) or topic_names.run_of(topic) != old_run:
        raise ValueError(f"archived topic {topic!r} is not a topic of run {old_run!r}")
    return topic_names.check_name("run", new_run) + "." + topic[len(prefix):]


def _messages(table: pa.Table) -> list[tuple[int, bytes | None, int, int]]:
    """Row ranges of the original messages in an archived table:
    ``[(partition, key, start, stop)]`` in file order (offset order per partition)."""
    part = table.column("_partition").to_numpy()
    off = table.column("_offset").to_numpy()
    if len(off) == 0:
        return []
    change = np.flatnonzero((np.diff(off) != 0) | (np.diff(part) != 0)) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [len(off)]])
    keys = table.column("_key")
    return [(int(part[s]), keys[int(s)].as_py(), int(s), int(e)) for s, e in zip(starts, ends)]


def _refuse_if_not_empty(cfg: BusConfig, targets: list[str]) -> None:
    """Raise :class:`TargetNotEmpty` if a topic of ``targets`` holds messages."""
    from relax.streams.lag import high_watermarks
    from relax.streams.read import read_table

    hw = high_watermarks(cfg, targets)
    holding = {topic for (topic, _), end in hw.items() if end}
    full = [t for t in targets if t in holding]
    if full:
        raise TargetNotEmpty(full[0], read_table(cfg, full[0]).num_rows, len(full) - 1)


def replay(cfg: BusConfig, archive_dir: Path | str, new_run: str, *,
           topics: list[str] | None = None, append: bool = False,
           timeout_s: float = 120.0) -> ReplayResult:
    """Send the archive in ``archive_dir`` to the topics of run ``new_run``.

    Args:
        cfg: bus settings of the target cluster.
        archive_dir: a folder written by :mod:`relax.producers.archive`.
        new_run: the new run name (must differ from the archived one).
        topics: archived topic names to replay (default: all).
        append: replay even into target topics that already hold messages.
        timeout_s: longest wait for the broker to acknowledge one topic (seconds).

    Raises:
        TargetNotEmpty: a target topic holds messages and not ``append`` (nothing sent).
        ValueError: no run in the manifest, ``new_run`` equals it, or a target topic
            exists with another partition count.
        relax.streams.producer.DeliveryError: a message was not acknowledged.
    """
    from kafka import KafkaProducer

    from relax.streams.blobs import BlobStore
    from relax.streams.client import ensure_topics, producer_kwargs
    from relax.streams.codec import encode, encode_messages

    t0 = time.perf_counter()
    manifest = load_manifest(archive_dir)
    old = manifest.get("run")
    if not old:
        raise ValueError(f"{archive_dir}: the manifest names no run (not a run archive)")
    if old == new_run:
        raise ValueError(f"replaying run {old!r} into itself would duplicate its data; "
                         "choose another --run")
    chosen = topics or sorted(manifest["topics"])
    result = ReplayResult()
    result.topics = {t: renamed(t, old, new_run) for t in chosen}
    result.left_out = sum(manifest["topics"][t].get("errors", 0) for t in chosen)
    if not append:
        _refuse_if_not_empty(cfg, [result.topics[t] for t in chosen])
    ensure_topics(cfg, {result.topics[t]: manifest["topics"][t]["partitions"] for t in chosen})
    producer_id = f"replay-{new_run}"
    blobs = BlobStore(cfg.blob_store) if cfg.blob_store else None
    kp = KafkaProducer(**producer_kwargs(cfg, f"{producer_id}-{uuid.uuid4().hex[:6]}"))
    try:
        for t in chosen:
            schema = manifest["topics"][t]["schema"]
            headers = [("relax-schema", schema.encode()),
                       ("relax-schema-version", str(SCHEMA_VERSION).encode()),
                       ("relax-producer", producer_id.encode())]
            target = result.topics[t]
            futures = []
            for table in iter_archive(archive_dir, t):
                data = strip_meta(table, schema)
                for partition, key, start, stop in _messages(table):
                    rows = data.slice(start, stop - start)
                    value = encode(rows)  # archived messages fit; re-split only if not
                    values = [value] if len(value) <= cfg.max_message_bytes else \
                        encode_messages(rows, cfg.max_message_bytes, blobs)
                    for value in values:
                        futures.append(kp.send(target, value=value, key=key, headers=headers,
                                               partition=partition))
                        result.messages += 1
                        result.bytes += len(value)
                    result.rows += rows.num_rows
                    if rows.num_rows:
                        result.per_topic[t] = result.per_topic.get(t, 0) + rows.num_rows
            _wait(kp, futures, timeout_s)
    finally:
        kp.close(timeout=10)
    result.seconds = time.perf_counter() - t0
    return result


def _wait(kp, futures: list, timeout_s: float) -> None:
    """Flush and check every send; raise DeliveryError listing the failures."""
    from kafka.errors import KafkaError

    from relax.streams.producer import DeliveryError

    kp.flush(timeout=timeout_s)
    errors = []
    for f in futures:
        try:
            f.get(timeout=timeout_s)
        except KafkaError as e:
            errors.append(e)
    if errors:
        raise DeliveryError(len(errors), len(futures) - len(errors), errors[:5])
