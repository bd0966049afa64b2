"""The reward-function contract shared by every family and by user functions.

A reward function scores a batch of rollouts::

    fn(responses: list[str], labels: list[str | None], metadata: list[dict], **options)
        -> list[float | None | Score]      # one item per row, same order

* ``responses``: the decoded model output of each rollout (``response_text``). Only the
  response: the prompt is never passed, so a format check cannot be satisfied by
  the prompt's own text (public case C15).
* ``labels``: the reference answer of each prompt (``label``), None when absent.
  A label that lists several accepted answers is the JSON text of an array of strings
  (``["3", "4"]``): :func:`label_text` writes a data file's list that way (``relax
  publish``, ``relax reward eval``), :func:`label_answers` reads it back.
* ``metadata``: the prompt row's metadata JSON object, parsed (``{}`` when empty).
* ``options``: keyword options fixed for the reward consumer (``--option k=v``).

Each item is a float (the value), None (abstain: the reward has no opinion on that
row), or a :class:`Score` carrying details and, optionally, a per-row error. The
stage stores values as float32. A function must accept an empty batch and return
``[]``: the worker calls it once that way at start, outside the time limit, so
imports and model loads happen before the clock runs.
"""

from __future__ import annotations

import json
import math
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


def label_text(value: object) -> str | None:
    """The ``label`` column's text for a label as a data file holds it.

    Text stays as it is; a number becomes its text (``3`` -> ``"3"``, ``2.5`` ->
    ``"2.5"``); a list of texts and numbers (several accepted answers) becomes the JSON
    text of an array of strings (``[3, "4"]`` -> ``'["3", "4"]'``); None stays None.

    Raises:
        ValueError: ``expected ..., got T`` for anything else (a bool, an object, NaN,
            an empty list, a list holding something other than texts and numbers).
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isnan(value):
            raise ValueError("expected text, a number or a list of them, got NaN")
        return str(value)
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("expected a list of at least one answer, got []")
        for v in value:
            if v is None or isinstance(v, (bool, list, tuple, dict)) or \
                    (isinstance(v, float) and math.isnan(v)):
                raise ValueError(f"expected a list of texts and numbers, got a list holding "
                                 f"{json.dumps(v)[:40]}")
        return json.dumps([label_text(v) for v in value], ensure_ascii=False)
    raise ValueError(f"expected text, a number or a list of them, got {type(value).__name__}")


def label_answers(label: str) -> list[str]:
    """The accepted answers of a label: the items of a JSON array of strings
    (``'["3", "4"]'``, as :func:`label_text` writes a list), else the label itself.

    Every built-in reward that reads labels scores a response right when it matches ANY
    of them (several accepted answers: aliases, annotators' answers, equivalent forms,
    as lm-eval scores a list of targets), and a label that is not a JSON array of
    strings is ONE answer: the text ``"3, 4"`` is the set or tuple ``3, 4`` for the
    ``math`` reward (and not a number for ``gsm8k``), and ``"[1, 2]"`` (numbers, no
    quotes) is the interval ``[1, 2]``.
    """
    text = label.strip()
    if not (text.startswith("[") and text.endswith("]") and '"' in text):
        return [label]
    try:
        items = json.loads(text)
    except ValueError:
        return [label]
    if isinstance(items, list) and items and all(isinstance(v, str) for v in items):
        return items
    return [label]
