"""Short-answer match: the label word is the response's answer (VQA answers such as
``circle``, ``yes``, ``teal``; spoken-arithmetic numbers).

Both sides are normalised (lower case, punctuation and surrounding space removed). Modes:

* ``first_word`` (default): the response's first word equals the label: what a model
  told to "answer with one word" must get right; "yes, it is" scores for ``yes``;
* ``full``: the whole normalised response equals the label;
* ``contains``: the label appears as a whole word anywhere (lenient; rewards hedging
  such as "circle or triangle", so use it for evaluation, not training).

A list label (``["circle", "round"]``, :func:`relax.consumers.reward.base.label_answers`)
matches when any of its answers does. A row without a label abstains (None).
"""

from __future__ import annotations

import re

from relax.consumers.reward.base import Score, label_answers

MODES = ("first_word", "full", "contains")
_WORD = re.compile(r"[\w.-]+")


def _norm(text: str) -> str:
    return " ".join(w.strip(".").lower() for w in _WORD.findall(text) if w.strip("."))


def _matches(want: str, got: str, mode: str) -> bool:
    if mode == "first_word":
        return bool(want) and (got == want or got.startswith(want + " ")
                               if " " in want else got.split(" ", 1)[0] == want)
    if mode == "full":
        return got == want
    return f" {want} " in f" {got} "


def exact_reward(responses: list[str], labels: list[str | None], metadata: list[dict], *,
                 mode: str = "first_word") -> list[Score | None]:
    """1.0 when the normalised response matches the normalised label under ``mode``, else
    0.0; None for a row without a label.

    Args:
        responses, labels: ``[N]`` texts; metadata: unused.
        mode: one of :data:`MODES`.

    Returns:
        ``[N]`` :class:`Score` with details ``{"answer": first word or response}``.

    Raises:
        ValueError: an unknown mode (lists the valid ones).
    """
    if mode not in MODES:
        raise ValueError(f"exact reward mode {mode!r}; valid: {', '.join(MODES)}")
    out: list[Score | None] = []
    for resp, label in zip(responses, labels):
        if label is None:
            out.append(None)
            continue
        got = _norm(resp)
        answer = got.split(" ", 1)[0] if mode == "first_word" else got
        ok = any(_matches(_norm(want), got, mode) for want in label_answers(label))
        out.append(Score(1.0 if ok else 0.0, {"answer": answer}))
    return out
