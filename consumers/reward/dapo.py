"""DAPO's maths reward: +1 right, -1 wrong, with the answer near the end.

Convention (DAPO, arXiv 2503.14476, and verl ``utils/reward_score/math_dapo.py``):

* Default mode: the answer is the last ``Answer: ...`` line (case-insensitive, up to
  the end of that line).
* Strict-box mode (``strict_box=True``): the answer is the last box
  (:func:`relax.consumers.reward.math.find_last_boxed`: balanced braces, last box
  wins).
* The answer must *start* within the last ``budget_chars`` characters (300, as
  DAPO). The window only decides where an answer may start; the answer itself is read
  on the whole text, so no inner window ever cuts it off. verl clips to the last 300
  characters and then, in strict-box mode, to the last 100 again, which loses a
  ``\\boxed{`` that starts 106 characters from the end (public case C16a).
* Equivalence: math-verify (:func:`relax.consumers.reward.math.equivalent`) instead
  of DAPO's Minerva string normalisation; a missing answer scores ``incorrect``.
* A list label (``["3", "4"]``, :func:`relax.consumers.reward.base.label_answers`):
  right when equivalent to any of its answers.
"""

from __future__ import annotations

import re

from relax.consumers.reward.base import Score, clip_text, label_answers
from relax.consumers.reward.math import equivalent, find_last_boxed

ANSWER_BUDGET_CHARS = 300
"""DAPO's documented answer budget: the answer starts within the last 300 characters."""

_ANSWER_LINE_RE = re.compile(r"(?i)answer\s*:[ \t]*([^\n]*)")


def _answer_line(text: str, window_start: int) -> str | None:
    for m in reversed(list(_ANSWER_LINE_RE.finditer(text))):
        if m.start() < window_start:
            return None
        value = m.group(1).strip()
        if value:
            return value
    return None


def extract_dapo_answer(text: str, *, strict_box: bool = False,
                        budget_chars: int = ANSWER_BUDGET_CHARS) -> str | None:
    """The answer of ``text`` under the DAPO rules (module docstring), or None.

    Args:
        text: the response.
        strict_box: read the last box instead of the last ``Answer:`` line.
        budget_chars: the answer must start within the last ``budget_chars`` characters.
    """
    window_start = max(0, len(text) - budget_chars)
    if strict_box:
        found = find_last_boxed(text)
        if found is None or found[1] < window_start:
            return None
        return found[0]
    return _answer_line(text, window_start)


def dapo_reward(responses: list[str], labels: list[str | None], metadata: list[dict], *,
                strict_box: bool = False, budget_chars: int = ANSWER_BUDGET_CHARS,
                correct: float = 1.0, incorrect: float = -1.0) -> list[Score]:
    """DAPO maths reward (module docstring).

    Args:
        responses: ``[N]`` responses; labels: ``[N]`` reference answers (a list label:
            any-of); metadata: unused.
        strict_box: box mode instead of the ``Answer:`` line.
        budget_chars: the answer window (characters from the end).
        correct / incorrect: values for a match and for a mismatch or missing answer.

    Returns:
        ``[N]`` :class:`Score` with details ``{"pred": str | None, "acc": bool}``; None
        (abstain) where the label is None.
    """
    import math_verify  # noqa: F401  (loaded here so the worker's warm-up imports it)

    cache: dict = {}
    out = []
    for text, label in zip(responses, labels):
        if label is None:
            out.append(Score(None, {"reason": "no label"}))
            continue
        pred = extract_dapo_answer(text, strict_box=strict_box, budget_chars=budget_chars)
        acc = pred is not None and any(equivalent(gold, pred, cache)
                                       for gold in label_answers(label))
        out.append(Score(correct if acc else incorrect, {"pred": clip_text(pred), "acc": acc}))
    return out
