"""GenRM: an LLM judge decides whether a response's answer matches the label.

For each row with a label, the judge model (any rollout engine implementing
:class:`relax.consumers.engines.base.Engine`) gets :data:`DEFAULT_TEMPLATE` (or the
``template`` option) filled with ``{label}`` and ``{answer}``, rendered with the
judge tokenizer's chat template, and generates a short verdict, near-greedy by
default (``top_k=1``). :func:`parse_verdict` reads it:

1. Text after the last ``</think>`` only.
2. An explicit verdict line (``Verdict: X``, ``Final verdict - X``, ``Judgement: X``):
   the last one decides.
3. Else a verdict word at the very start (``INCORRECT. The answer ...``) decides.
4. Else every verdict word in the text: all of one polarity decides; a mix (``is
   correct ... no wait, wrong``) or none gives None.

Verdict words: positive ``correct``, ``equivalent``, ``equal``, ``yes``, ``same``,
``match(es)``; negative ``incorrect``, ``wrong``, ``no``, ``different``, ``unequal``,
``mismatch``, and ``not``/``n't`` before a positive word (``is not equal``, ``doesn't
match``, ``not the same``). ``correct`` directly before ``answer``/``value``/``result``/... is a
noun phrase, not a verdict ("the correct answer is 6").

Values: 1.0 correct, 0.0 incorrect, None (abstain) when the verdict is unreadable or
the label is missing; details keep the verdict and the judge's text.

The answer shown to the judge is the response's final segment (after the last
``</think>``), its last ``max_answer_chars`` characters when longer. A list label
(``["3", "4"]``, :func:`relax.consumers.reward.base.label_answers`) is shown as
``3 or 4 (any one of these is correct)``: the judge grades any-of, as the other rewards.
"""

from __future__ import annotations

import functools
import re

from relax.consumers.engines.base import Engine, SamplingParams
from relax.consumers.reward.base import Score, clip_text, label_answers
from relax.consumers.reward.math import final_segment

DEFAULT_TEMPLATE = (
    "You are checking a student's final answer against the reference answer.\n"
    "Reference answer: {label}\n"
    "Student answer: {answer}\n"
    "Do they express the same final result (ignore formatting, units and wording)? "
    "Reply with one line: 'Verdict: CORRECT' or 'Verdict: INCORRECT'."
)
"""Judge prompt; ``{label}`` and ``{answer}`` are filled in."""

_NEG = (r"(?:\bnot|n't)\s+(?:correct|equivalent|equal|the\s+same|match(?:es|ed)?)\b"
        r"|\b(?:incorrect|wrong|inequivalent|unequal|mismatch(?:es|ed)?|no|different)\b")
_POS = (r"\b(?:correct(?!\s+(?:answer|value|result|solution|one|number|final))"
        r"|equivalent|equal|yes|same|match(?:es|ed)?)\b")
_WORD_RE = re.compile(rf"(?P<neg>{_NEG})|(?P<pos>{_POS})", re.IGNORECASE)
_LINE_RE = re.compile(r"(?:final\s+)?(?:verdict|judge?ment|decision|grade)\s*[:=\-]+\s*"
                      r"[\*\[\(\"'`]*\s*(?P<rest>[^\n]*)", re.IGNORECASE)
_LEAD_JUNK = " \t\n*#>\"'`[(.:-"


def _polarity(m: re.Match) -> bool:
    return m.group("pos") is not None


def parse_verdict(text: str) -> bool | None:
    """True (correct), False (incorrect) or None (unreadable) from a judge's output,
    by the rules in the module docstring."""
    seg = final_segment(text, ("</think>",))
    lines = list(_LINE_RE.finditer(seg))
    for line in reversed(lines):
        w = _WORD_RE.search(line.group("rest"))
        if w is not None:
            return _polarity(w)
    body = seg.lstrip(_LEAD_JUNK)
    first = _WORD_RE.match(body)
    if first is not None:
        return _polarity(first)
    found = {_polarity(m) for m in _WORD_RE.finditer(seg)}
    return found.pop() if len(found) == 1 else None


def judge_prompt(template: str, label: str, response: str, max_answer_chars: int = 2000) -> str:
    """The filled judge prompt for one row (``template`` with ``{label}``, ``{answer}``).

    Raises:
        KeyError: when the template names another placeholder.
    """
    answer = final_segment(response, ("</think>",)).strip()
    if len(answer) > max_answer_chars:
        answer = answer[-max_answer_chars:]
    golds = label_answers(label)
    shown = golds[0] if len(golds) == 1 else \
        " or ".join(golds) + " (any one of these is correct)"
    return template.format(label=shown, answer=answer)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn: through the tokenizer's chat template when
    it has one, else the plain text (no special tokens added)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def judge(engine: Engine, tokenizer, responses: list[str], labels: list[str | None], *,
          template: str = DEFAULT_TEMPLATE, params: SamplingParams | None = None,
          max_answer_chars: int = 2000) -> list[Score]:
    """Ask ``engine`` to grade each response against its label (module docstring).

    Args:
        engine: the judge engine (``generate(prompt_ids, params) -> [Generation]``).
        tokenizer: the judge's tokenizer (``encode``, optional ``apply_chat_template``,
            ``decode`` when a generation carries no text).
        responses: ``[N]`` responses; labels: ``[N]`` reference answers (None abstains).
        template: judge prompt with ``{label}`` and ``{answer}``.
        params: sampling settings (default: 32 new tokens, greedy via ``top_k=1``).
        max_answer_chars: longest answer tail shown to the judge (characters).

    Returns:
        ``[N]`` :class:`Score` with details ``{"verdict": "correct" | "incorrect" | None,
        "judge": str}``.
    """
    params = params or SamplingParams(max_new_tokens=32, temperature=1.0, top_k=1, seed=0)
    rows = [i for i, lab in enumerate(labels) if lab is not None]
    prompts = [encode_prompt(tokenizer, judge_prompt(template, labels[i], responses[i],
                                                     max_answer_chars)) for i in rows]
    gens = engine.generate(prompts, params) if prompts else []
    if len(gens) != len(prompts):
        raise RuntimeError(f"judge engine returned {len(gens)} generations for "
                           f"{len(prompts)} prompts")
    out: list[Score] = [Score(None, {"reason": "no label"}) for _ in responses]
    for i, g in zip(rows, gens):
        text = g.text or tokenizer.decode(g.token_ids, skip_special_tokens=True)
        verdict = parse_verdict(text)
        value = None if verdict is None else float(verdict)
        name = None if verdict is None else ("correct" if verdict else "incorrect")
        out[i] = Score(value, {"verdict": name, "judge": clip_text(text, 400)})
    return out


@functools.lru_cache(maxsize=2)
def load_judge(model: str, device: str = "cpu"):
    """``(engine, tokenizer)`` of the judge ``model`` (a name of
    :mod:`relax.trainer.models`, a folder or a Hub id) on ``device``; loaded once per
    process."""
    from relax.consumers.engines.hf import HFEngine

    engine = HFEngine(model, device=device, engine_id=f"genrm-{model}")
    return engine, engine.tokenizer


def genrm_reward(responses: list[str], labels: list[str | None], metadata: list[dict], *,
                 model: str = "smollm2-135m", device: str = "cpu",
                 template: str = DEFAULT_TEMPLATE, max_new_tokens: int = 32,
                 temperature: float = 1.0, top_k: int = 1, seed: int | None = 0,
                 max_answer_chars: int = 2000) -> list[Score]:
    """GenRM reward with a local judge model (module docstring).

    Args:
        responses, labels: ``[N]`` each; metadata: unused.
        model: judge model name/folder (``smollm2-135m``, ``tiny-llama``, ...).
        device: ``cpu`` or ``cuda[:i]``.
        template: judge prompt with ``{label}`` and ``{answer}``.
        max_new_tokens / temperature / top_k / seed: judge sampling (tokens; greedy by
            default).
        max_answer_chars: longest answer tail shown to the judge (characters).

    Returns:
        see :func:`judge`.
    """
    engine, tokenizer = load_judge(model, device)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                            top_k=top_k, seed=seed)
    return judge(engine, tokenizer, responses, labels, template=template, params=params,
                 max_answer_chars=max_answer_chars)
