"""reasoning-gym tasks scored by the task's own ``score_answer``.

Prompt-row metadata this reward reads (the publisher writes it)::

    {"task": "basic_arithmetic",              # reasoning-gym data set name
     "entry": {"question": "...", "answer": "...", "metadata": {...}}}   # the entry as generated

``entry`` is the data set item exactly as ``reasoning_gym.create_dataset(...)[i]``
returns it (JSON round trip). ``task`` may be omitted when
``entry["metadata"]["source_dataset"]`` names the task (reasoning-gym sets it on every
entry, and it names the real task inside a ``composite`` data set, so it wins when both
are present).

The scorer comes from ``reasoning_gym.get_score_answer_fn(task)``: the data set class
built with its default config, without generating any item, cached per task (scoring
depends on the entry, not on the config). The answer is the content of the last
``<answer>...</answer>`` (``reasoning_gym.utils.extract_answer``); without tags, the
text after the last ``</think>``, stripped. The value is ``score_answer``'s float
(1.0 right, partial credit for some tasks).

Known limit: entries whose metadata holds tuples (``arc_agi``, ``rearc``) lose them in
JSON and score partial credit for a right answer; carry those tasks' grids as lists
in the publisher, or score them with a ``module:function`` of your own.
"""

from __future__ import annotations

import functools

from relax.consumers.reward.base import Score, clip_text
from relax.consumers.reward.math import final_segment


@functools.lru_cache(maxsize=256)
def scorer(task: str):
    """``score_answer(answer, entry) -> float`` of the reasoning-gym task ``task``.

    Raises:
        ValueError: naming the task when reasoning-gym does not know it.
    """
    import reasoning_gym

    try:
        return reasoning_gym.get_score_answer_fn(task)
    except ValueError:
        from reasoning_gym.factory import DATASETS

        raise ValueError(f"reasoning-gym has no task {task!r} (known: {len(DATASETS)} tasks, "
                         f"e.g. {', '.join(sorted(DATASETS)[:5])}, ...)") from None


def task_and_entry(meta: dict) -> tuple[str, dict]:
    """``(task, entry)`` from a prompt row's metadata (module docstring for the keys).

    Raises:
        ValueError: naming the missing or mistyped key.
    """
    entry = meta.get("entry")
    if not isinstance(entry, dict):
        raise ValueError("reasoning_gym reward needs metadata key 'entry' (the reasoning-gym "
                         f"item as a JSON object); got keys {sorted(meta)}")
    source = (entry.get("metadata") or {}).get("source_dataset")
    task = source or meta.get("task")
    if not isinstance(task, str) or not task:
        raise ValueError("reasoning_gym reward needs metadata key 'task' (a reasoning-gym "
                         "data set name) or entry.metadata.source_dataset")
    return task, entry


def extract_answer(text: str) -> str:
    """The answer of a response: the last ``<answer>`` tag's content, else the final
    segment after ``</think>``, stripped."""
    from reasoning_gym.utils import extract_answer as tagged

    found = tagged(text)
    return found if found is not None else final_segment(text, ("</think>",)).strip()


def reasoning_gym_reward(responses: list[str], labels: list[str | None],
                         metadata: list[dict]) -> list[Score]:
    """Score each response with its task's ``score_answer`` (module docstring).

    Args:
        responses: ``[N]`` responses; labels: unused (the entry holds the answer);
            metadata: ``[N]`` objects with ``task`` and ``entry``.

    Returns:
        ``[N]`` :class:`Score` with details ``{"task": str, "extracted": str}``; a per-row
        error for missing metadata keys or an unknown task.
    """
    import reasoning_gym  # noqa: F401  (loaded here so the worker's warm-up imports it)

    out = []
    for text, meta in zip(responses, metadata):
        try:
            task, entry = task_and_entry(meta)
            score = scorer(task)
        except ValueError as e:
            out.append(Score(None, {}, error=str(e)))
            continue
        answer = extract_answer(text)
        out.append(Score(float(score(answer, entry)),
                         {"task": task, "extracted": clip_text(answer)}))
    return out
