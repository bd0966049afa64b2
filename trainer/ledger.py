"""The trainer's ledger: the fate of every rollout that reached it.

Every sampled rollout ends in exactly one of ``trained``, ``stale`` (dropped by
staleness admission), ``filtered`` (dropped by a filter upstream: zero variance,
group timeout) or ``error`` (reward or rollout error) (docs/architecture.md, section 3).
The ledger is saved with each checkpoint, so a restarted trainer neither trains a
rollout twice nor forgets one; redelivered rows of a known rollout_id are
duplicates and are skipped. It also keeps the rewards each rollout was scored with
(the names of its ``reward_components``): where a reward was attached or detached
live, the ledger shows from which rollouts on it counted.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUTCOMES = ("trained", "stale", "filtered", "error")

_SCHEMA = pa.schema([("rollout_id", pa.string()), ("outcome", pa.string()),
                     ("policy_version", pa.int64()), ("staleness", pa.int64()),
                     ("rewards", pa.string())])
"""``rewards``: the counted reward names of the rollout, sorted, comma-separated (null
when not known: a checkpoint of an older relax)."""


def outcome_of(drop_reason: str | None) -> str:
    """Ledger outcome of a train sample's ``drop_reason`` (None -> not decided here)."""
    if drop_reason is None:
        raise ValueError("a sample without drop_reason is decided by admission, not here")
    return "error" if drop_reason.startswith("error") else "filtered"


def reward_names(samples: pa.Table) -> list[list[str]]:
    """Per ``train_samples`` row, the names of its ``reward_components`` (the rewards it
    was scored with)."""
    return [[k for k, _ in (c or [])] for c in samples.column("reward_components").to_pylist()]


class Ledger:
    """rollout_id -> (outcome, trainer policy_version at the decision, staleness)."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[str, int, int]] = {}
        self._rewards: dict[str, str] = {}

    def __contains__(self, rollout_id: str) -> bool:
        return rollout_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def record(self, rollout_id: str, outcome: str, policy_version: int, staleness: int = -1,
               rewards: list[str] | None = None) -> None:
        """Record a rollout's fate (and the reward names it was scored with, when known).

        Raises:
            ValueError: unknown outcome, or the rollout already has one (a double decision
                would mean training a rollout twice).
        """
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; valid: {', '.join(OUTCOMES)}")
        if rollout_id in self._rows:
            raise ValueError(f"rollout {rollout_id!r} already recorded as {self._rows[rollout_id][0]}")
        self._rows[rollout_id] = (outcome, policy_version, staleness)
        if rewards is not None:
            self._rewards[rollout_id] = ",".join(sorted(rewards))

    def rewards(self, rollout_id: str) -> str | None:
        """The counted reward names of a rollout, sorted and comma-separated (None when
        not recorded)."""
        return self._rewards.get(rollout_id)

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
        pq.write_table(pa.table([ids, list(cols[0]), list(cols[1]), list(cols[2]),
                                  [self._rewards.get(r) for r in ids]], schema=_SCHEMA), path)

    @classmethod
    def load(cls, path: Path) -> "Ledger":
        """Read a ledger written by :meth:`save`."""
        led = cls()
        t = pq.read_table(path)
        rewards = t.column("rewards").to_pylist() if "rewards" in t.column_names \
            else [None] * t.num_rows
        for rid, o, v, s, r in zip(*(t.column(n).to_pylist() for n in _SCHEMA.names[:4]), rewards):
            led._rows[rid] = (o, v, s)
            if r is not None:
                led._rewards[rid] = r
        return led
