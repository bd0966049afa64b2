"""The rollout stage's durable state on ``<run>.rollout_state`` (see
:data:`relax.schemas.topics.ROLLOUT_STATE`): per-partition epochs, and per instance the
groups whose prompts are not yet committed. Records of earlier releases also carry a
``started`` count (it once sized each instance's share of the credit; the claim log
``<run>.rollout_claims`` does that now): it is read past and ignored."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from relax.streams.client import BusConfig


@dataclass
class SavedState:
    """What ``<run>.rollout_state`` holds (see :data:`relax.schemas.topics.ROLLOUT_STATE`).

    Attributes:
        epochs: ``{(prompt topic, partition): epoch}``.
        pending: ``{engine_id: group_ids it produced whose prompt messages were not yet
            committed}`` (a restart would get those prompts again).
    """

    epochs: dict[tuple[str, int], int] = field(default_factory=dict)
    pending: dict[str, list[str]] = field(default_factory=dict)


def saved_state(bus: BusConfig, topic: str) -> SavedState:
    """Read ``<run>.rollout_state`` to its end: the latest record of each key wins (an
    empty state for a new run).

    Raises:
        ValueError: a record that is neither ``{topic, partition, epoch}`` nor
            ``{engine_id, pending}`` JSON (names its offset).
    """
    from relax.streams.read import read_partition

    out = SavedState()
    for m in read_partition(bus, topic, 0):
        try:
            r = json.loads(m.value)
            if "epoch" in r:
                out.epochs[(r["topic"], int(r["partition"]))] = int(r["epoch"])
            else:
                out.pending[r["engine_id"]] = [str(g) for g in r["pending"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{topic}@{m.offset}: expected {{topic, partition, epoch}} or "
                             f"{{engine_id, pending}} JSON, got {m.value[:80]!r}: "
                             f"{e}") from e
    return out
