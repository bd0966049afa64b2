"""A finished run's failed records, kept in its folder (``errors.jsonl``): what went to
each of its error topics, and the reward rows whose function failed (rows of
``<run>.rewards`` with ``error`` set). A run on its own local broker loses its topics when
the broker stops; this file is what is left to look at (``relax errors`` reads the topics
while they exist).
"""

from __future__ import annotations

import json
from pathlib import Path

from relax.schemas import topics as topic_names
from relax.streams.client import BusConfig
from relax.streams.lag import high_watermarks
from relax.streams.read import read_reward_errors, read_table

ERRORS_FILE = "errors.jsonl"


def write_run_errors(cfg: BusConfig, run_topics: list[str], path: Path) -> dict[str, int]:
    """Write one JSON object per failed record of the topics ``run_topics`` (error topics
    and ``rewards`` topics among them; the others are skipped) to ``path``, oldest first
    within each topic; no file when there are none.

    Each object: ``topic`` (where it is on the bus), ``ts`` (ISO 8601), ``source_topic``,
    ``source_partition``, ``source_offset``, ``stage``, ``error``, and for a failed reward
    row ``row``, ``rollout_id``, ``group_id`` and ``reward_name``. The failed message's
    bytes (``value``) stay on the bus.

    Returns:
        ``{topic: records written}`` for the topics with any.
    """
    out: list[dict] = []
    wanted = [t for t in run_topics if t.endswith(topic_names.ERRORS_SUFFIX) or _is_rewards(t)]
    # one client asks every topic's end; only those with records are read (a run has a
    # dozen error topics, nearly always empty: a reader each took seconds)
    written = {t for (t, _), end in high_watermarks(cfg, wanted).items() if end > 0}
    for t in wanted:
        if t not in written:
            continue
        if t.endswith(topic_names.ERRORS_SUFFIX):
            rows = read_table(cfg, t, "errors").to_pylist()
        else:
            rows = read_reward_errors(cfg, t)[0]
        out.extend({"topic": t, **{k: v for k, v in r.items() if k != "value"}} for r in rows)
    if out:
        with open(path, "w") as f:
            for r in out:
                f.write(json.dumps(r, default=str) + "\n")
    counts: dict[str, int] = {}
    for r in out:
        counts[r["topic"]] = counts.get(r["topic"], 0) + 1
    return counts


def _is_rewards(topic: str) -> bool:
    try:
        return topic_names.schema_for_topic(topic) == topic_names.REWARDS
    except ValueError:  # not a relax topic name
        return False
