"""Error records: what cannot be processed goes to ``<topic>.errors`` as data.

A record whose bytes do not decode, whose schema does not match, or that a
stage rejects is written to the error topic of its source topic with the
original bytes (or the bad row), its origin (topic, partition, offset, row) and
the reason; the stage goes on. ``relax errors TOPIC`` prints them.
"""

from __future__ import annotations

import time

import pyarrow as pa

from relax.schemas.v1 import ERRORS


def error_row(*, source_topic: str, stage: str, error: str, source_partition: int | None = None,
              source_offset: int | None = None, row: int | None = None, key: bytes | None = None,
              value: bytes | None = None, headers: list[tuple[str, bytes]] | None = None) -> dict:
    """One row of the ``errors`` schema (see :data:`relax.schemas.ERRORS`)."""
    return {
        "ts": int(time.time() * 1000),
        "source_topic": source_topic,
        "source_partition": source_partition,
        "source_offset": source_offset,
        "row": row,
        "stage": stage,
        "error": error,
        "key": key,
        "value": value,
        "headers": [{"key": k, "value": v} for k, v in headers] if headers else None,
    }


def error_batch(rows: list[dict]) -> pa.RecordBatch:
    """Rows from :func:`error_row` as an ``errors`` record batch."""
    return pa.RecordBatch.from_pylist(rows, schema=ERRORS)
