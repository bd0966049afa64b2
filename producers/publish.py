"""Publish a prompt data set onto ``prompts.<dataset>`` (``relax publish``).

Rows follow the ``prompts`` schema (:data:`relax.schemas.PROMPTS`):

* ``prompt_id`` = first 16 hex digits of sha256 over the JSON of
  ``[prompt or messages, label]`` - the same prompt and label get the same id in
  every data set and every publish;
* ``prompt`` from ``prompt_field`` (text, or a list of ``{role, content}`` chat
  messages, then ``messages`` is set and ``prompt`` is the last user message);
* ``label`` from ``label_field`` (text; numbers are written as text; a null or NaN
  label fails its row; null when there is no ``label_field``);
* ``metadata`` = JSON ``{"source": SOURCE, "line": N, "fields": {other columns}}``,
  or for reasoning-gym ``{"source": "reasoning_gym", "task", "entry", "index",
  "seed", "size"}`` (read by the ``reasoning_gym`` reward).

A bad row (unreadable line, invalid UTF-8, missing field, wrong type, a row that
encodes over ``max_message_bytes``) is counted and written to
``prompts.<dataset>.errors`` (``source_topic`` = SOURCE, ``source_offset`` = line
number, ``value`` = the raw line bytes, truncated to half a message if larger);
the good rows still go. A ``prompt_field`` or ``label_field`` that none of the
first :data:`FIELD_CHECK_RECORDS` readable records has is taken as misspelled: the
publish stops before sending anything (:class:`FieldNotFound`, naming the fields
the records have). A source with no records at all (an empty file) is refused
before anything is sent or made (:class:`EmptySource`). Re-publishing prompt_ids
the topic already holds is refused (:class:`AlreadyPublished`) unless ``force``.

Delivery: every row is sent keyed by prompt_id and the call returns only after
the broker acknowledged all of them (:meth:`BatchProducer.flush` raises
:class:`~relax.streams.producer.DeliveryError` otherwise). Parsed rows are held in
memory (Arrow) until the duplicate check has passed, so a refused publish writes
nothing.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import pyarrow as pa

from relax.producers.media import (
    MediaError,
    MediaOptions,
)
from relax.producers.progress import Progress
from relax.producers.prompt_rows import RowError, prompt_id, prompt_row, usable_rows
from relax.producers.sources import (
    SourceError,
    SourceRow,
    read_source,
    source_folder,
)
from relax.schemas import topics as topic_names
from relax.schemas.v1 import PROMPTS
from relax.schemas.validate import validate
from relax.streams.client import BusConfig
from relax.streams.codec import encoded_size

DEFAULT_PARTITIONS = 4
SEND_CHUNK_ROWS = 1000
FIELD_CHECK_RECORDS = 100
"""Readable records whose fields :func:`publish` looks at before it calls a
``prompt_field`` / ``label_field`` that none of them has absent from the source."""

__all__ = ["AlreadyPublished", "EmptySource", "FieldNotFound", "PublishResult", "RowError",
           "SourceError", "prompt_id", "prompt_row", "publish", "usable_rows"]


class FieldNotFound(SourceError):
    """``--prompt-field`` / ``--label-field`` names a field absent from the source (none of
    its first :data:`FIELD_CHECK_RECORDS` readable records has it); nothing was sent.

    Attributes:
        option: ``--prompt-field`` or ``--label-field``.
        field: the field asked for.
        source: the SOURCE string.
        available: sorted field names those records have.
        checked: how many records were looked at.
    """

    def __init__(self, option: str, field: str, source: str, available: list[str], checked: int):
        self.option, self.field, self.source = option, field, source
        self.available, self.checked = available, checked
        have = ", ".join(repr(f) for f in available) or "none"
        super().__init__(f"{option} {field!r} is not a field of {source} (none of its first "
                         f"{checked} records has it); its fields are {have}. Nothing was sent.")


class EmptySource(SourceError):
    """The source held no records (an empty file or data set, or ``limit`` 0); nothing
    was sent and no topic was made.

    Attributes:
        source: the SOURCE string.
    """

    def __init__(self, source: str, limit: int | None = None):
        self.source = source
        what = (f"gave no rows within limit={limit}" if limit is not None and limit < 1
                else "held no rows (an empty file or data set)")
        super().__init__(f"{source} {what}; nothing was published")


class AlreadyPublished(RuntimeError):
    """The topic already holds some of the prompt_ids being published (pass ``force``).

    Attributes:
        topic: the prompt topic.
        duplicates: how many of the new rows' prompt_ids it already holds.
        total: rows that would have been published.
    """

    def __init__(self, topic: str, duplicates: int, total: int):
        self.topic, self.duplicates, self.total = topic, duplicates, total
        super().__init__(f"topic {topic} already holds {duplicates} of the {total} prompt_ids "
                         "being published; nothing was sent. Pass --force to publish them again.")


@dataclass(frozen=True)
class PublishResult:
    """What a publish did: rows ``published`` and ``errors`` (rows sent to the error
    topic), existing prompt_ids re-published (``duplicates``, only with force),
    wall time ``seconds``, ``repeated``: rows of the source whose content (so
    prompt_id) repeats an earlier row; they are skipped, since one prompt_id is one
    prompt (and one GRPO group per epoch), and ``first_error``: the error text of
    the first bad row (None when there is none)."""

    topic: str
    partitions: int
    published: int
    errors: int
    duplicates: int
    seconds: float
    repeated: int = 0
    first_error: str | None = None

    @property
    def rows_per_s(self) -> float:
        """Published rows per second of wall time (parse + send)."""
        return self.published / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        """``published=N errors=E topic=T partitions=P`` (the CLI's last line)."""
        return (f"published={self.published} errors={self.errors} topic={self.topic} "
                f"partitions={self.partitions}")


def _check_size(row: dict, max_message_bytes: int) -> None:
    """Raise :class:`RowError` if ``row`` alone encodes over ``max_message_bytes``.
    Exact (Arrow IPC size) only for rows whose text is near the limit."""
    approx = sum(len(row[k]) for k in ("prompt", "label", "metadata") if row[k])
    approx += sum(len(m["content"]) for m in row["messages"] or [])
    approx += sum(len(it["data"] or b"") for it in row["media"] or [])
    if approx * 4 < max_message_bytes - 8192:  # 4 bytes per char at most
        return
    n = encoded_size(pa.RecordBatch.from_pylist([row], schema=PROMPTS))
    if n > max_message_bytes:
        raise RowError(f"row encodes to {n} bytes, over max_message_bytes={max_message_bytes}")


def _error_row(src: SourceRow, source: str, error: str, max_message_bytes: int) -> dict:
    from relax.streams.errors import error_row

    value, limit = src.raw, max_message_bytes // 2
    if len(value) > limit:
        error += f" (value truncated to its first {limit} of {len(value)} bytes)"
        value = value[:limit]
    return error_row(source_topic=source, source_offset=src.line, stage="publish",
                     error=f"line {src.line}: {error}", value=value)


def _parse(source: str, *, dataset: str, prompt_field: str, label_field: str | None,
           limit: int | None, max_message_bytes: int, media: MediaOptions, on_row=None
           ) -> tuple[list[pa.RecordBatch], list[dict]]:
    """Read and convert the whole source: (good rows as PROMPTS batches, error rows)."""
    created_at = int(time.time() * 1000)
    batches: list[pa.RecordBatch] = []
    good: list[dict] = []
    errors: list[dict] = []
    fields = _FieldCheck(source, prompt_field, label_field)
    for src in read_source(source, limit):
        if on_row is not None:
            on_row()
        if src.record is None:
            errors.append(_error_row(src, source, src.error or "unreadable", max_message_bytes))
            continue
        fields.add(src.record)
        try:
            row = prompt_row(src.record, dataset=dataset, prompt_field=prompt_field,
                             label_field=label_field, source=source, line=src.line,
                             created_at_ms=created_at, media=media)
            _check_size(row, max_message_bytes)
        except (RowError, MediaError) as e:
            errors.append(_error_row(src, source, str(e), max_message_bytes))
            continue
        good.append(row)
        if len(good) >= SEND_CHUNK_ROWS:
            batches.append(pa.RecordBatch.from_pylist(good, schema=PROMPTS))
            good = []
    fields.check()
    if good:
        batches.append(pa.RecordBatch.from_pylist(good, schema=PROMPTS))
    for b in batches:
        validate(b, "prompts")
    return batches, errors


class _FieldCheck:
    """Collects the field names of the first :data:`FIELD_CHECK_RECORDS` readable records
    and raises :class:`FieldNotFound` once they are in (or at the end of the source) if
    the prompt or label field is in none of them."""

    def __init__(self, source: str, prompt_field: str, label_field: str | None):
        self.source = source
        self.wanted = [("--prompt-field", prompt_field)]
        if label_field is not None:
            self.wanted.append(("--label-field", label_field))
        self.seen: set[str] = set()
        self.records = 0
        self.done = False

    def add(self, record: dict) -> None:
        if self.done:
            return
        self.seen.update(record)
        self.records += 1
        if self.records >= FIELD_CHECK_RECORDS:
            self.check()

    def check(self) -> None:
        """Raises :class:`FieldNotFound` (no-op once checked, or with no readable record)."""
        if self.done or not self.records:
            return
        self.done = True
        for option, field in self.wanted:
            if field not in self.seen:
                raise FieldNotFound(option, field, self.source, sorted(self.seen), self.records)


def existing_prompt_ids(cfg: BusConfig, topic: str) -> set[str]:
    """Every prompt_id already on ``topic`` (reads the whole topic; empty if it does not exist)."""
    from relax.streams.read import read_table
    from relax.streams.client import topic_partitions

    if not topic_partitions(cfg, [topic]):
        return set()
    return set(read_table(cfg, topic, "prompts").column("prompt_id").to_pylist())


def dataset_of(topic: str) -> str:
    """``prompts.NAME`` -> ``NAME``.

    Raises:
        ValueError: ``topic`` is not ``prompts.<name>`` with a legal name.
    """
    if not topic.startswith(topic_names.PROMPTS_PREFIX):
        raise ValueError(f"topic {topic!r}: expected prompts.<dataset>")
    name = topic[len(topic_names.PROMPTS_PREFIX):]
    topic_names.prompts_topic(name)  # checks the name
    return name


def publish(cfg: BusConfig, source: str, topic: str, *, prompt_field: str = "prompt",
            label_field: str | None = None, limit: int | None = None,
            partitions: int | None = None, force: bool = False,
            progress: bool = False, media: MediaOptions | None = None) -> PublishResult:
    """Publish ``source`` onto the prompt topic ``topic`` (``prompts.<dataset>``).

    Args:
        cfg: bus settings (any Kafka-protocol cluster).
        source: see :mod:`relax.producers.sources` (file, ``datasets`` folder,
            ``hf://ORG/NAME[:split]``, ``reasoning_gym:TASK?size=N&seed=S``).
        prompt_field / label_field: input columns (reasoning-gym: ``question`` /
            ``answer`` are used whatever is given).
        limit: read at most this many input records.
        partitions: partitions of a new topic (default 4; an existing topic keeps its count).
        force: publish even if the topic already holds some of these prompt_ids.
        progress: show a rich progress bar on stderr.
        media: the image/audio columns and how items travel
            (:class:`~relax.producers.media.MediaOptions`; its ``base_dir`` defaults to the
            source's folder). Chat messages with media parts are read without it.

    Returns:
        counts of published and bad rows (:class:`PublishResult`).

    Raises:
        SourceError: the source cannot be opened.
        EmptySource: the source held no records (nothing was sent).
        FieldNotFound: ``prompt_field`` or ``label_field`` is in none of the first
            :data:`FIELD_CHECK_RECORDS` readable records (nothing was sent).
        ValueError: bad topic name, or an existing topic with another partition count.
        AlreadyPublished: duplicates without ``force`` (nothing was sent).
        relax.streams.producer.DeliveryError: the broker did not acknowledge every row.
    """
    from relax.streams.client import ensure_topics, topic_partitions
    from relax.streams.producer import BatchProducer

    t0 = time.perf_counter()
    dataset = dataset_of(topic)
    if source.startswith("reasoning_gym:"):
        prompt_field, label_field = "question", "answer"
    media = media or MediaOptions()
    if media.base_dir is None:
        media = dataclasses.replace(media, base_dir=source_folder(source))
    with Progress(progress) as bar:
        bar.start("reading " + source, None)
        batches, errors = _parse(source, dataset=dataset, prompt_field=prompt_field,
                                 label_field=label_field, limit=limit,
                                 max_message_bytes=cfg.max_message_bytes, media=media,
                                 on_row=bar.advance)
        batches, repeated = _first_occurrences(batches)
        n_good = sum(b.num_rows for b in batches)
        if not n_good and not errors:  # every record is good or an error
            raise EmptySource(source, limit)
        etopic = topic_names.errors_topic(topic)
        counts = topic_partitions(cfg, [topic, etopic])
        existing = counts.get(topic)
        partitions = partitions or existing or DEFAULT_PARTITIONS
        duplicates = 0
        if existing:
            have = existing_prompt_ids(cfg, topic)
            duplicates = sum(sum(1 for p in b.column("prompt_id").to_pylist() if p in have)
                             for b in batches)
            if duplicates and not force:
                raise AlreadyPublished(topic, duplicates, n_good)
        ensure_topics(cfg, {topic: partitions, etopic: counts.get(etopic, 1)})
        bar.start(f"sending to {topic}", n_good)
        producer = BatchProducer(cfg, producer_id=f"publish-{dataset}")
        try:
            for b in batches:
                producer.send(topic, b, schema="prompts")
                producer.flush()
                bar.advance(b.num_rows)
            if errors:
                producer.send_errors(topic, errors)
                producer.flush()
        finally:
            producer.close()
    return PublishResult(topic, partitions, n_good, len(errors), duplicates,
                         time.perf_counter() - t0, repeated,
                         errors[0]["error"] if errors else None)


def _first_occurrences(batches: list[pa.RecordBatch]) -> tuple[list[pa.RecordBatch], int]:
    """Keep the first row of each prompt_id; returns the batches and the rows dropped."""
    seen: set[str] = set()
    out, dropped = [], 0
    for b in batches:
        keep = []
        for i, pid in enumerate(b.column("prompt_id").to_pylist()):
            if pid not in seen:
                seen.add(pid)
                keep.append(i)
        dropped += b.num_rows - len(keep)
        if keep:
            out.append(b if len(keep) == b.num_rows else b.take(pa.array(keep)))
    return out, dropped
