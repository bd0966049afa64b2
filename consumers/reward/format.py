"""Format bonus: does the *response* have the requested shape?

Only the response is scored, never the prompt: the reward contract passes no prompt
text at all, so a system prompt that itself contains ``\\boxed{}`` cannot pay the
bonus (EasyR1 PR #26; public case C15).

Patterns:

* ``boxed``: a complete box (``\\boxed{...}`` with balanced braces, or the space form
  ``\\boxed 5``) in the final answer segment (after the last ``</think>``).
* ``think``: exactly one ``</think>``, at most one ``<think>`` before it, and a
  non-empty answer after it (R1-style reasoning then answer).
* ``answer_tag``: a non-empty ``<answer>...</answer>`` (reasoning-gym's format).
* ``regex``: the ``regex`` option matches the response (``re.search``, DOTALL).
"""

from __future__ import annotations

import re

from relax.consumers.reward.base import Score
from relax.consumers.reward.math import ANSWER_MARKERS, final_segment, find_last_boxed

PATTERNS = ("boxed", "think", "answer_tag", "regex")

_ANSWER_TAG_RE = re.compile(r"<answer>\s*\S.*?</answer>", re.DOTALL)


def _has_box(text: str) -> bool:
    found = find_last_boxed(final_segment(text, ANSWER_MARKERS))
    return found is not None and found[0] is not None and found[0].strip() != ""


def _think_format(text: str) -> bool:
    if text.count("</think>") != 1 or text.count("<think>") > 1:
        return False
    head, _, tail = text.partition("</think>")
    return tail.strip() != "" and ("<think>" not in text or "<think>" in head)


def format_reward(responses: list[str], labels: list[str | None], metadata: list[dict], *,
                  pattern: str = "boxed", bonus: float = 1.0, regex: str | None = None) -> list[Score]:
    """``bonus`` when a response has the format ``pattern`` (module docstring), else 0.

    Args:
        responses: ``[N]`` responses (only these are looked at); labels, metadata: unused.
        pattern: one of :data:`PATTERNS`.
        bonus: value paid for the format (e.g. 0.1 as a shaping term).
        regex: the pattern for ``pattern="regex"``.

    Returns:
        ``[N]`` :class:`Score` with details ``{"pattern": pattern, "ok": bool}``.

    Raises:
        ValueError: for an unknown pattern (lists the valid ones) or ``regex`` missing.
    """
    if pattern == "boxed":
        check = _has_box
    elif pattern == "think":
        check = _think_format
    elif pattern == "answer_tag":
        check = _ANSWER_TAG_RE.search
    elif pattern == "regex":
        if not regex:
            raise ValueError("format pattern 'regex' needs the option regex=<pattern>")
        check = re.compile(regex, re.DOTALL).search
    else:
        raise ValueError(f"unknown format pattern {pattern!r}; valid: {', '.join(PATTERNS)}")
    out = []
    for text in responses:
        ok = bool(check(text))
        out.append(Score(bonus if ok else 0.0, {"pattern": pattern, "ok": ok}))
    return out
