"""GSM8K: the final number of the response against the label's number.

Modes (verl ``utils/reward_score/gsm8k.py`` and lm-eval's GSM8K filters):

* ``strict``: the number after the last ``####`` marker (GSM8K's own answer format).
* ``flexible``: the last number anywhere in the response.

Numbers keep their sign (``-12``, ``+12``; public case C20), thousands separators
(``1,234,567``), decimals (``3.5``, ``.5``) and a currency sign (``$18``, ``-$5``);
a ``-`` counts as a sign only when it is glued to the number and does not follow a
letter, digit or ``)`` (so ``3-5`` reads ``5``). The whole response is searched: no
tail window can cut the marker off (verl keeps only the last 300 characters; C16b).
Comparison is exact decimal equality (``18.00`` = ``18``, ``1,000`` = ``1000``).

A label is a bare number (``18``, ``1,000``) or a full GSM8K solution ending in
``#### N``: the number after the last ``####``; a list label (``["3", "4"]``,
:func:`relax.consumers.reward.base.label_answers`) is several such answers and any of
them counts. A label (or list item) that holds no number is a per-row error, ``"3, 4"``
included. Values: 1.0 equal, 0.0 different or no number; None without a label.
"""

from __future__ import annotations

import re
from decimal import Decimal

from relax.consumers.reward.base import Score, label_answers

MODES = ("strict", "flexible")

_NUMBER = (r"(?P<sign>[-+\u2212]?)(?P<cur>\$?)(?P<sign2>[-+\u2212]?)"
           r"(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?![\d,]*\d)")
_NUMBER_RE = re.compile(r"(?<![\w)])" + _NUMBER)
_UNSIGNED_RE = re.compile(r"(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")
_STRICT_RE = re.compile(r"####\s*" + _NUMBER)


def _value(m: re.Match) -> Decimal:
    sign = m.group("sign") or m.group("sign2")
    v = Decimal(m.group("digits").replace(",", ""))
    return -v if sign in ("-", "\u2212") else v


def _last_number(text: str) -> Decimal | None:
    last = None
    for m in _NUMBER_RE.finditer(text):
        last = m
    if last is not None:
        return _value(last)
    # a number glued to a word or digit run ("x3", "3-5"): read it unsigned
    last = None
    for m in _UNSIGNED_RE.finditer(text):
        last = m
    return Decimal(last.group("digits").replace(",", "")) if last else None


def extract_number(text: str, mode: str = "strict") -> Decimal | None:
    """The answer number of ``text``: after the last ``####`` (``strict``) or the last
    number (``flexible``); None when there is none.

    Raises:
        ValueError: for an unknown mode (lists the valid ones).
    """
    if mode == "strict":
        last = None
        for m in _STRICT_RE.finditer(text):
            last = m
        return _value(last) if last else None
    if mode == "flexible":
        return _last_number(text)
    raise ValueError(f"unknown gsm8k mode {mode!r}; valid: {', '.join(MODES)}")


def label_number(label: str) -> Decimal:
    """The number a label stands for: after its last ``####`` when it has one (a full
    GSM8K solution), else the label read as a number (``1,000``, ``$5``, ``-3.5``).

    Raises:
        ValueError: naming the label when it holds no number.
    """
    if "####" in label:
        n = extract_number(label, "strict")
    else:
        m = re.fullmatch(r"\s*" + _NUMBER + r"\s*\.?\s*", label)
        n = _value(m) if m else None
    if n is None:
        raise ValueError(f"gsm8k label {label[:80]!r} is not a number or a solution ending "
                         f"in '#### N'")
    return n


def gsm8k_reward(responses: list[str], labels: list[str | None], metadata: list[dict], *,
                 mode: str = "strict", correct: float = 1.0, incorrect: float = 0.0) -> list[Score]:
    """GSM8K reward (module docstring).

    Args:
        responses: ``[N]`` responses; labels: ``[N]`` numbers or GSM8K solutions, or
            lists of them (any-of); metadata: unused.
        mode: ``strict`` (``#### N``) or ``flexible`` (last number).
        correct / incorrect: values for equal and for different or missing numbers.

    Returns:
        ``[N]`` :class:`Score` with details ``{"extracted": str | None, "label": str}``
        (``label`` a list of str for a list label); None (abstain) without a label; a
        per-row error for a label with no number.

    Raises:
        ValueError: for an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"unknown gsm8k mode {mode!r}; valid: {', '.join(MODES)}")
    out = []
    for text, label in zip(responses, labels):
        if label is None:
            out.append(Score(None, {"reason": "no label"}))
            continue
        try:
            golds = [label_number(a) for a in label_answers(label)]
        except ValueError as e:
            out.append(Score(None, {}, error=str(e)))
            continue
        pred = extract_number(text, mode)
        ok = pred is not None and pred in golds
        shown = str(golds[0]) if len(golds) == 1 else [str(g) for g in golds]
        out.append(Score(correct if ok else incorrect,
                         {"extracted": None if pred is None else str(pred), "label": shown}))
    return out
