"""The trainer's ledger: the fate of every rollout that reached it.

Every sampled rollout ends in exactly one of ``trained``, ``stale`` (dropped by
staleness admission), ``filtered`` (dropped by a filter upstream: zero variance,
group timeout) or ``error`` (reward or rollout error) (docs/architecture.md, section 3).
The ledger is saved with each checkpoint, so a restarted trainer neither trains a
rollout twice nor forgets one; redelivered rows of a known rollout_id are
duplicates and are skipped.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUTCOMES = ("trained", "stale", "filtered", "error")

_SCHEMA = pa.schema([("rollout_id", pa.string()), ("outcome", pa.string()),
                     ("policy_version", pa.int64()), ("staleness", pa.int64())])


def outcome_of(drop_reason: str | None) -> str:
    """Ledger outcome of a train sample's ``drop_reason`` (None -> not decided here)."""
    if drop_reason is None:
        raise ValueError("a sample without drop_reason is decided by admission, not here")
    return "error" if drop_reason.startswith("error") else "filtered"


class Ledger:
    """rollout_id -> (outcome, trainer policy_version at the decision, staleness)."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[str, int, int]] = {}

    def __contains__(self, rollout_id: str) -> bool:
        return rollout_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def record(self, rollout_id: str, outcome: str, policy_version: int, staleness: int = -1) -> None:
        """Record a rollout's fate.

        Raises:
            ValueError: unknown outcome, or the rollout already has one (a double decision
                would mean training a rollout twice).
        """
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; valid: {', '.join(OUTCOMES)}")
        if rollout_id in self._rows:
            raise ValueError(f"rollout {rollout_id!r} already recorded as {self._rows[rollout_id][0]}")
        self._rows[rollout_id] = (outcome, policy_version, staleness)

    def counts(self) -> dict[str, int]:
        """``{outcome: count}`` for every outcome (0 when none)."""
        c = Counter(o for o, _, _ in self._rows.values())
        return {o: c.get(o, 0) for o in OUTCOMES}

    def items(self):
        """``(rollout_id, (outcome, policy_version, staleness))`` pairs."""
        return self._rows.items()

    def ids(self, outcome: str | None = None) -> set[str]:
        """rollout_ids with ``outcome`` (all when None)."""
        return {r for r, (o, _, _) in self._rows.items() if outcome is None or o == outcome}

    def save(self, path: Path) -> None:
        """Write as Parquet."""
        ids = list(self._rows)
        cols = list(zip(*self._rows.values())) if ids else [[], [], []]
        pq.write_table(pa.table([ids, list(cols[0]), list(cols[1]), list(cols[2])], schema=_SCHEMA),
                       path)

    @classmethod
    def load(cls, path: Path) -> "Ledger":
        """Read a ledger written by :meth:`save`."""
        led = cls()
        t = pq.read_table(path)
        for rid, o, v, s in zip(*(t.column(n).to_pylist() for n in _SCHEMA.names)):
            led._rows[rid] = (o, v, s)
        return led
