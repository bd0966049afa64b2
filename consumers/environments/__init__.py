"""Built-in environments for multi-turn rollouts (``rollout.environment``), and the loader
of user environments.

An environment is any object with ``reset(prompt_row)`` and ``step(response_text)``
(:mod:`relax.consumers.multiturn`); one is made per sample. Built in:

* ``calculator`` (:class:`~.calculator.CalculatorEnv`): a calculator tool; reward 1.0
  when the final answer equals the label;
* ``humaneval`` (:class:`~.humaneval.HumanEvalEnv`): a Python sandbox tool; reward 1.0
  when the task's tests pass on the answer.

Tool calls use the chat template's tool format (:mod:`.tools`). The episode's reward
(the sum of the rewards its steps gave; None when none gave one) is a real reward: the
rollout stage writes it to ``<run>.rewards`` under the recipe's reward with
``fn: environment``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

ENVIRONMENTS = {
    "calculator": "relax.consumers.environments.calculator:CalculatorEnv",
    "humaneval": "relax.consumers.environments.humaneval:HumanEvalEnv",
}
"""Built-in environment names -> ``module:Class``."""


def load_environment_factory(spec: str, options: dict | None = None) -> Callable[[], object]:
    """A function that makes one new environment: a built-in name (:data:`ENVIRONMENTS`)
    or ``module:Class`` / ``module:function``, called with ``options`` as keywords.

    Raises:
        ValueError: neither a built-in name nor ``module:attr``, or not loadable (names
            it and the built-in names).
    """
    target = ENVIRONMENTS.get(spec, spec)
    mod, sep, attr = target.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"environment {spec!r}: expected a built-in name "
                         f"({', '.join(ENVIRONMENTS)}) or module:Class")
    try:
        make = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"environment {spec!r} cannot be loaded: {e}") from e
    kwargs = dict(options or {})
    return lambda: make(**kwargs)
