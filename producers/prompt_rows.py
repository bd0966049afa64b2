"""One input record as one ``prompts`` row (the schema :data:`relax.schemas.PROMPTS`), and
a source read as such rows: what :func:`relax.producers.publish.publish` sends and what the
run's checks (the eval set, the published prompts) compare, without a bus.

* ``prompt_id`` = first 16 hex digits of sha256 over the JSON of
  ``[prompt or messages, label]`` (and the sha256 of each media item);
* ``prompt`` from ``prompt_field`` (text, or chat messages: then ``messages`` is set and
  ``prompt`` is the last user message); ``label`` from ``label_field`` (text; numbers as
  text; a list of several accepted answers as the JSON text of an array of strings,
  :func:`relax.consumers.reward.base.label_text`; a null or NaN label fails its row; null
  without a ``label_field``);
* ``metadata`` = JSON ``{"source", "line", "fields": {other columns}}``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator

from relax.consumers.reward.base import label_text
from relax.producers.media import (
    MediaError,
    MediaOptions,
    field_items,
    media_digest,
    message_content,
)
from relax.producers.sources import json_default, read_source

PROMPT_ID_HEX = 16


class RowError(ValueError):
    """One input record cannot become a prompt row (names the field and what was expected)."""


def prompt_id(prompt: str, messages: list[dict] | None, label: str | None,
              media: list[str] | None = None) -> str:
    """Stable id of a prompt: first 16 hex digits of sha256 over the UTF-8 JSON of
    ``[messages or prompt, label]``, with the sha256 of each media item appended when
    there are any (the same question about two images is two prompts); independent of
    the data set name and row order."""
    content = messages if messages is not None else prompt
    key = [content, label] + ([media] if media else [])
    blob = json.dumps(key, ensure_ascii=False, sort_keys=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:PROMPT_ID_HEX]


def _messages(value: list, field: str, media: MediaOptions) -> tuple[list[dict], list[dict]]:
    """Chat messages and the media items of their content parts (in order)."""
    out, items = [], []
    for i, m in enumerate(value):
        if isinstance(m, dict) and isinstance(m.get("role"), str) \
                and isinstance(m.get("content"), list):
            text, got = message_content(m["content"], f"field {field!r} item {i}", media)
            m = {"role": m["role"], "content": text}
            items += got
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise RowError(f"field {field!r} item {i}: expected {{role: str, content: str or "
                           f"a list of parts}}, got {json.dumps(m, default=json_default)[:80]}")
        out.append({"role": m["role"], "content": m["content"]})
    if not out:
        raise RowError(f"field {field!r}: expected a non-empty text or message list, got []")
    return out, items


def prompt_row(record: dict, *, dataset: str, prompt_field: str, label_field: str | None,
               source: str, line: int, created_at_ms: int,
               media: MediaOptions = MediaOptions()) -> dict:
    """One ``prompts`` row (a dict) from one input record; its ``media`` come from the
    columns of ``media.fields`` and the media parts of chat messages
    (:mod:`relax.producers.media`), null when there are none.

    Raises:
        RowError: ``prompt_field`` (or ``label_field``) is missing, or has the wrong type
            (prompt: non-empty text or chat messages; label: text, a number or a list of
            them, not null or NaN).
        relax.producers.media.MediaError: a media column is missing or an item is bad.
    """
    if prompt_field not in record:
        raise RowError(f"missing field {prompt_field!r} (the prompt field); record has "
                       f"{sorted(record)[:10]}")
    value = record[prompt_field]
    messages, items = None, field_items(record, media)
    if isinstance(value, str):
        if not value.strip():
            raise RowError(f"field {prompt_field!r}: expected non-empty text, got an empty string")
        prompt = value
    elif isinstance(value, list):
        messages, parts = _messages(value, prompt_field, media)
        items += parts
        users = [m["content"] for m in messages if m["role"] == "user"]
        prompt = users[-1] if users else messages[-1]["content"]
    else:
        raise RowError(f"field {prompt_field!r}: expected text or a list of chat messages, "
                       f"got {type(value).__name__}")
    label = None
    if label_field is not None:
        if label_field not in record:
            raise RowError(f"missing field {label_field!r} (the label field)")
        raw_label = record[label_field]
        if raw_label is None or (isinstance(raw_label, float) and math.isnan(raw_label)):
            raise RowError(f"field {label_field!r} (the label field) is null; give the row a "
                           "label, or publish without a label field for rewards that need none")
        try:
            label = label_text(raw_label)
        except ValueError as e:
            raise RowError(f"field {label_field!r}: {e}") from None
    rg = record.get("_reasoning_gym")
    if rg is not None:
        meta = rg
    else:
        skip = {prompt_field, label_field, *(f for f, _ in media.fields)}
        fields = {k: v for k, v in record.items() if k not in skip}
        meta = {"source": source, "line": line, "fields": fields}
    return {
        "prompt_id": prompt_id(prompt, messages, label, media_digest(items)),
        "dataset": dataset,
        "prompt": prompt,
        "messages": messages,
        "label": label,
        "metadata": json.dumps(meta, ensure_ascii=False, default=json_default),
        "media": items or None,
        "created_at": created_at_ms,
    }


def usable_rows(source: str, *, prompt_field: str, label_field: str | None,
                media: MediaOptions = MediaOptions(), limit: int | None = None,
                dataset: str = "train") -> Iterator[dict | None]:
    """Each record of ``source`` (the first ``limit``) as a ``prompts`` row dict, or None
    for a record :func:`prompt_row` rejects (blank lines are skipped): what publishing it
    would send, without a bus.

    Raises:
        relax.producers.sources.SourceError: the source cannot be read.
    """
    for src in read_source(source, limit):
        if src.record is None:
            continue
        try:
            yield prompt_row(src.record, dataset=dataset, prompt_field=prompt_field,
                             label_field=label_field, source=source, line=src.line,
                             created_at_ms=0, media=media)
        except (RowError, MediaError):
            yield None
