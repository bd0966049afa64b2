"""Greedy held-out accuracy of a model: the "before and after" numbers of a run, and the
curve of ``eval.every`` (the eval stage, :mod:`relax.infra.control.eval_stage`).

Prompts are rendered exactly as the rollout stage renders them (prompt template,
then the chat template with the generation prompt; a prompt with images or audio
through the model's processor, placeholders expanded), decoded greedily (top-k 1)
by the ``hf`` engine, and scored by a reward function in a :class:`RewardPool` as the
reward stage scores (warm-up, a time limit, failed calls retried row by row); a prompt is
correct when the reward value is > ``threshold``, and a row whose reward failed counts as
wrong and is counted in ``errors``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from relax.producers.media import MediaOptions, media_digest
from relax.producers.prompt_rows import usable_rows
from relax.schemas import metric_names as M


class TooFewEvalRows(ValueError):
    """The eval source has fewer usable prompts outside the training data than asked for."""


@dataclass
class EvalResult:
    """Accuracy of one evaluation: ``correct`` of ``n`` prompts, wall ``seconds``, a few
    ``examples`` (prompt, response, value) to look at, and the rows whose reward failed
    (``errors``; the first one's text in ``first_error``), which count as wrong."""

    accuracy: float
    n: int
    correct: int
    seconds: float
    examples: list[dict] = field(default_factory=list)
    errors: int = 0
    first_error: str | None = None


def prompt_key(row: dict) -> tuple[str, tuple[str, ...]]:
    """What makes two PROMPTS rows the same question: the prompt text and the digests of
    its media (spoken questions share one instruction text and differ in their audio)."""
    return row["prompt"], tuple(media_digest(row["media"] or []))


def source_keys(source: str, *, prompt_field: str, label_field: str | None,
                media: MediaOptions = MediaOptions(), limit: int | None = None) -> set[tuple]:
    """:func:`prompt_key` of every usable row of ``source`` (the training prompts)."""
    return {prompt_key(r) for r in usable_rows(source, prompt_field=prompt_field,
                                               label_field=label_field, media=media, limit=limit)
            if r is not None}


def eval_rows(source: str, size: int, *, prompt_field: str, label_field: str,
              exclude: set[tuple] = frozenset(), dataset: str = "eval",
              media: MediaOptions = MediaOptions()) -> list[dict]:
    """The first ``size`` prompt rows of ``source`` whose :func:`prompt_key` is not in
    ``exclude`` (the training prompts' keys), as PROMPTS-schema dicts, media read from the
    columns ``media`` names.

    Raises:
        TooFewEvalRows: fewer than ``size`` usable rows in the source.
    """
    rows, seen, bad, training = [], set(), 0, 0
    for row in usable_rows(source, prompt_field=prompt_field, label_field=label_field,
                           media=media, dataset=dataset):
        if row is None:
            bad += 1
            continue
        key = prompt_key(row)
        training += key in exclude
        if key in exclude or key in seen:
            continue
        seen.add(key)
        rows.append(row)
        if len(rows) == size:
            return rows
    raise TooFewEvalRows(f"eval source {source!r} has only {len(rows)} usable prompts not in "
                         f"the training data ({training} rows are training prompts, {bad} rows "
                         f"have no usable prompt or label); {size} wanted")


def greedy_accuracy(model: str, rows: list[dict], *, reward_fn: str | None = None,
                    reward_options: dict | None = None, pool=None,
                    prompt_template: str = "{prompt}", max_new_tokens: int = 16,
                    batch_size: int = 50, threshold: float = 0.5) -> EvalResult:
    """Greedy-decode every row with ``model`` and score it with ``reward_fn``.

    Args:
        model: model name, folder (e.g. a run's ``final_model``) or Hub id.
        rows: PROMPTS-schema dicts (:func:`eval_rows`).
        reward_fn: a ``REWARD_FNS`` name or ``module:function``; ``reward_options`` its
            options; scored by a one-worker :class:`RewardPool` started and closed here.
        pool: a started :class:`RewardPool` to score with instead (left open).
        prompt_template: applied to the prompt text before the chat template.
        max_new_tokens: generation budget (tokens); batch_size: prompts per engine call.
        threshold: a value > threshold counts as correct.

    Raises:
        relax.consumers.reward.pool.RewardLoadError: the reward function does not load or
            fails its warm-up call on an empty batch.
        ValueError: the model takes no media and a row has some.
    """
    from relax.consumers.reward.pool import RewardPool
    from relax.trainer.models import load, load_processor

    t0 = time.perf_counter()
    m, tok = load(model)
    processor = load_processor(model)
    if processor is None and any(r["media"] for r in rows):
        raise ValueError(f"{model} takes no images or audio, and the eval rows have media")
    with contextlib.ExitStack() as stack:
        if pool is None:
            pool = stack.enter_context(RewardPool(reward_fn, reward_options or {}, workers=1,
                                                  batch_rows=batch_size))
        r = greedy_accuracy_of(m, tok, rows, pool, processor=processor,
                               prompt_template=prompt_template, max_new_tokens=max_new_tokens,
                               batch_size=batch_size, threshold=threshold)
    r.seconds = time.perf_counter() - t0  # with the model's load
    return r


def greedy_accuracy_of(model, tokenizer, rows: list[dict], pool, *, processor=None,
                       prompt_template: str = "{prompt}", max_new_tokens: int = 16,
                       batch_size: int = 50, threshold: float = 0.5,
                       pulse: Callable[[], object] | None = None) -> EvalResult:
    """:func:`greedy_accuracy` of a loaded ``model`` (a transformers causal LM, on its
    device, its weights used as they are: the eval stage installs each policy_version into
    it) with its ``tokenizer`` and ``processor`` (a multimodal model's, else None), scored
    through a started :class:`RewardPool` ``pool`` (left open). ``seconds``: generation and
    scoring only. ``pulse`` is called after each engine call (a stage's ``should_stop``,
    whose calls tell the controller the stage is not stuck; its answer is not used).

    Raises:
        ValueError: the model takes no media (``processor`` None) and a row has some.
    """
    from relax.consumers.engines.base import SamplingParams
    from relax.consumers.engines.hf import HFEngine

    if processor is None and any(r["media"] for r in rows):
        raise ValueError("the model takes no images or audio, and the eval rows have media")
    t0 = time.perf_counter()
    engine = HFEngine(model, tokenizer, engine_id="eval")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_k=1)
    correct, examples, errors = 0, [], []
    for i in range(0, len(rows), batch_size):
        correct += _score_chunk(engine, processor, tokenizer, pool, rows[i:i + batch_size],
                                params, prompt_template, threshold, examples, errors)
        if pulse is not None:
            pulse()
    n = len(rows)
    return EvalResult(correct / n if n else 0.0, n, correct, time.perf_counter() - t0, examples,
                      len(errors), errors[0] if errors else None)


def eval_metrics(r: EvalResult) -> dict[str, float]:
    """The metric rows of one evaluation (component ``eval`` in ``<run>.metrics``, names in
    :mod:`relax.schemas.metric_names`): accuracy in [0, 1], prompts, correct prompts, rows
    whose reward failed, and wall seconds of generation and scoring."""
    return {M.EVAL_ACCURACY: r.accuracy, M.EVAL_N: r.n, M.EVAL_CORRECT: r.correct,
            M.EVAL_REWARD_ERRORS: r.errors, M.EVAL_S: r.seconds}


def next_due(version: int, every: int) -> int:
    """The first policy_version after ``version`` that ``eval.every`` = ``every`` evaluates:
    the next multiple of ``every`` (``next_due(0, 2) == 2``, ``next_due(3, 2) == 4``).

    Raises:
        ValueError: ``every`` < 1 or ``version`` < 0.
    """
    if every < 1 or version < 0:
        raise ValueError(f"next_due: every must be >= 1 and version >= 0, got every={every}, "
                         f"version={version}")
    return (version // every + 1) * every


def _score_chunk(engine, processor, tok, pool, chunk: list[dict], params, prompt_template: str,
                 threshold: float, examples: list[dict], errors: list[str]) -> int:
    """Generate and score one engine call's rows; the number correct. Appends to
    ``examples`` (up to 5) and the error text of each failed row to ``errors``."""
    from relax.consumers.multiturn import prompt_messages, render_ids
    from relax.trainer.multimodal import encode_prompt

    ids, media = [], []
    for r in chunk:
        msgs = prompt_messages({**r, "prompt": prompt_template.format(prompt=r["prompt"])})
        if r["media"]:  # as the rollout stage renders it (consumers/rollout/stage.py)
            p, inputs = encode_prompt(processor, msgs, r["media"])
        else:
            p, inputs = render_ids(tok, msgs), None
        ids.append(p)
        media.append(inputs)
    gens = engine.generate(ids, params, media=media if any(media) else None)
    texts = [g.text for g in gens]
    results = pool.score(texts, [r["label"] for r in chunk],
                         [json.loads(r["metadata"]) for r in chunk])
    correct = 0
    for r, text, res in zip(chunk, texts, results):
        correct += res.value is not None and res.value > threshold
        if res.error is not None:
            line = json.loads(r["metadata"]).get("line")  # a file source's; else the prompt
            where = f"line {line}" if line is not None else f"prompt {r['prompt'][:60]!r}"
            errors.append(f"{where}: {res.error}")
        if len(examples) < 5:
            examples.append({"prompt": r["prompt"], "label": r["label"], "response": text,
                             "value": res.value, **({"error": res.error} if res.error else {})})
    return correct
