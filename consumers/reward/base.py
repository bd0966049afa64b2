"""The reward-function contract shared by every family and by user functions.

A reward function scores a batch of rollouts::

    fn(responses: list[str], labels: list[str | None], metadata: list[dict], **options)
        -> list[float | None | Score]      # one item per row, same order

* ``responses``: the decoded model output of each rollout (``response_text``). Only the
  response: the prompt is never passed, so a format check cannot be satisfied by
  the prompt's own text (public case C15).
* ``labels``: the reference answer of each prompt (``label``), None when absent.
* ``metadata``: the prompt row's metadata JSON object, parsed (``{}`` when empty).
* ``options``: keyword options fixed for the reward consumer (``--option k=v``).

Each item is a float (the value), None (abstain: the reward has no opinion on that
row), or a :class:`Score` carrying details and, optionally, a per-row error. The
stage stores values as float32. A function must accept an empty batch and return
``[]``: the worker calls it once that way at start, outside the time limit, so
imports and model loads happen before the clock runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

RewardFn = Callable[..., list]
"""``fn(responses, labels, metadata, **options) -> list[float | None | Score]``."""


@dataclass(frozen=True)
class Score:
    """One row's outcome with its explanation.

    Attributes:
        value: the reward, or None (abstain, or error when ``error`` is set).
        details: JSON-serialisable facts for people: extracted answer, parts of the
            score, the judge's raw text, ... (stored as the ``details`` column).
        error: why this row could not be scored (bad label, bad metadata); the row's
            value is then null and the stage counts it as an error.
    """

    value: float | None
    details: dict = field(default_factory=dict)
    error: str | None = None


def clip_text(text: str | None, limit: int = 200) -> str | None:
    """``text`` shortened to ``limit`` characters (with an ellipsis) for ``details``."""
    if text is None or len(text) <= limit:
        return text
    return text[: limit - 3] + "..."
