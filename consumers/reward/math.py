"""Maths answers, DeepScaleR convention: the last box of the final answer segment,
checked against the label by math-verify.

Convention (DeepScaleR ``deepscaler_reward_fn``, agentica-project/rllm, as slime's
``get_deepscaler_rule_based_reward``; fixes from the public cases):

1. Final segment: the text after the last answer marker (``</think>``,
   ``###Response``); the whole text when none occurs (DeepScaleR scores a response
   without a marker as a format error: ``require_marker=True``). Always the *last*
   marker, never the second split piece (public case C14).
2. Answer: the last box of that segment (:func:`find_last_boxed`), read with a
   balanced-brace scan, so nested braces survive and an earlier, retracted box never
   wins (C18). One rule for the space form: ``\\boxed 5`` counts as a box whose
   argument is the next whitespace-delimited token; whichever box form comes *last*
   wins, so an earlier ``\\boxed 3`` never overrides a later ``\\boxed{5}`` (C17).
   A last box that is opened but never closed (a truncated response) gives no
   answer rather than falling back to an earlier box.
3. Equivalence: ``math_verify.verify(parse(label), parse(answer))`` (both wrapped in
   ``\\boxed{}``), so ``0.75`` = ``\\frac{3}{4}``, ``-12`` != ``12`` (C20), ``x=5`` = ``5``.
4. A list label (``["3", "4"]``, :func:`relax.consumers.reward.base.label_answers`):
   right when equivalent to any of its answers. The text ``3, 4`` is one answer, the
   set ``{3, 4}``.
5. Values: 1.0 correct, 0.0 wrong or no box; None (abstain) without a label.
"""

from __future__ import annotations

import re
import threading

from relax.consumers.reward.base import Score, clip_text, label_answers

ANSWER_MARKERS = ("</think>", "###Response")
"""Markers after which the final answer segment starts (the last occurrence counts)."""

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_SPACE_ARG_RE = re.compile(r"[^\s$]+")
_TRAILING_PUNCT = ".,;:!?"
MATH_VERIFY_TIMEOUT_S = 5


def final_segment(text: str, markers: tuple[str, ...] | list[str] = ANSWER_MARKERS) -> str:
    """The text after the last occurrence of any of ``markers`` (public case C14), or
    ``text`` itself when none occurs."""
    cut = 0
    for m in markers:
        i = text.rfind(m)
        if i >= 0:
            cut = max(cut, i + len(m))
    return text[cut:]


def _balanced(text: str, open_at: int) -> str | None:
    """Content between the ``{`` at ``open_at`` and its matching ``}``; ``\\{`` and
    ``\\}`` are literal braces. None when the brace never closes."""
    depth, i = 0, open_at
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1: i]
        i += 1
    return None


def find_last_boxed(text: str) -> tuple[str | None, int] | None:
    """The last ``\\boxed``/``\\fbox`` with an argument in ``text``.

    Returns:
        ``(content, start)``: ``content`` is the braced argument (balanced scan) or,
        for the space form ``\\boxed 5``, the next token without trailing
        punctuation; it is None when the last box opens a brace that never closes.
        ``start`` is the character index of the backslash. None when ``text`` has no
        box with an argument.
    """
    for m in reversed(list(_BOX_RE.finditer(text))):
        k = m.end()
        while k < len(text) and text[k] in " \t":
            k += 1
        if k < len(text) and text[k] == "{":
            return _balanced(text, k), m.start()
        if k > m.end():
            arg = _SPACE_ARG_RE.match(text, k)
            token = arg.group(0).rstrip(_TRAILING_PUNCT) if arg else ""
            if token:
                return token, m.start()
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last box of ``text`` (see :func:`find_last_boxed`), or None."""
    found = find_last_boxed(text)
    return found[0] if found else None


def _timeout_s() -> int | None:
    # math-verify times out with SIGALRM, which only the main thread may set.
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def bare_answer(text: str) -> str:
    """The answer inside a label or an extracted answer: the content of its last box if
    it has one, else the text without surrounding whitespace, ``$`` and a final period."""
    boxed = last_boxed(text)
    inner = boxed if boxed is not None else text
    return inner.strip().strip("$").strip().rstrip(".").strip()


def equivalent(label: str, answer: str, _gold_cache: dict | None = None) -> bool:
    """True when math-verify finds ``answer`` equal to ``label``.

    Both sides go through :func:`bare_answer` and are parsed as ``\\boxed{...}``
    (LaTeX or plain); equality is numeric, symbolic, set or interval equality as
    ``math_verify.verify`` defines it (gold first). ``_gold_cache`` maps labels to their
    parse within one batch (labels repeat across a GRPO group)."""
    from math_verify import parse, verify

    t = _timeout_s()
    gold = None if _gold_cache is None else _gold_cache.get(label)
    if gold is None:
        gold = parse("\\boxed{" + bare_answer(label) + "}", parsing_timeout=t)
        if _gold_cache is not None:
            _gold_cache[label] = gold
    pred = parse("\\boxed{" + bare_answer(answer) + "}", parsing_timeout=t)
    return bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=t)


def math_reward(responses: list[str], labels: list[str | None], metadata: list[dict], *,
                markers: list[str] | tuple[str, ...] = ANSWER_MARKERS, correct: float = 1.0,
                incorrect: float = 0.0, no_answer: float = 0.0,
                require_marker: bool = False) -> list[Score]:
    """DeepScaleR-style maths reward (see the module docstring for the rules).

    Args:
        responses: ``[N]`` decoded responses; labels: ``[N]`` reference answers
            (plain or boxed LaTeX, or a list of them: any-of); metadata: ``[N]`` (unused).
        markers: answer markers; the final segment follows the last one.
        correct / incorrect / no_answer: values for a match, a mismatch, no box.
        require_marker: a response with no marker scores ``no_answer`` (DeepScaleR).

    Returns:
        ``[N]`` :class:`Score` with details ``{"extracted": str | None}``; value None
        where the label is None.
    """
    import math_verify  # noqa: F401  (loaded here so the worker's warm-up imports it)

    cache: dict = {}
    out = []
    for text, label in zip(responses, labels):
        if label is None:
            out.append(Score(None, {"reason": "no label"}))
            continue
        marked = any(m in text for m in markers)
        answer = last_boxed(final_segment(text, tuple(markers))) \
            if marked or not require_marker else None
        if answer is None:
            out.append(Score(no_answer, {"extracted": None}))
            continue
        ok = any(equivalent(gold, answer, cache) for gold in label_answers(label))
        out.append(Score(correct if ok else incorrect, {"extracted": clip_text(answer)}))
    return out
