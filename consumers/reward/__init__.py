"""Reward functions and the reward stage (docs/architecture.md, section 6, "reward").

Every reward is a plain function listed in :data:`REWARD_FNS` (the contract is in
:mod:`relax.consumers.reward.base`: ``fn(responses, labels, metadata, **options) ->
[float | None | Score]``), or any user function named ``module:function``.
:mod:`.stage` runs one reward as its own consumer group on ``<run>.rollouts`` and
writes ``<run>.rewards``; :mod:`.pool` isolates the function in worker processes
with a time and memory limit. Heavy libraries (math-verify, reasoning-gym, torch)
load inside the functions, so importing this package stays light.
"""

from __future__ import annotations

import functools
import importlib

from relax.consumers.reward.base import RewardFn, Score
from relax.consumers.reward.dapo import dapo_reward
from relax.consumers.reward.exact import exact_reward
from relax.consumers.reward.format import format_reward
from relax.consumers.reward.genrm import genrm_reward
from relax.consumers.reward.gsm8k import gsm8k_reward
from relax.consumers.reward.math import math_reward
from relax.consumers.reward.reasoning_gym import reasoning_gym_reward
from relax.consumers.reward.remote import remote_reward

REWARD_FNS: dict[str, RewardFn] = {
    "math": math_reward,
    "deepscaler": math_reward,
    "dapo": dapo_reward,
    "gsm8k": gsm8k_reward,
    "reasoning_gym": reasoning_gym_reward,
    "format": format_reward,
    "exact": exact_reward,
    "genrm": genrm_reward,
    "remote": remote_reward,
}
"""Built-in rewards by name (``deepscaler`` is another name for ``math``)."""


def load_reward_fn(spec: str) -> RewardFn:
    """The reward function ``spec``: a :data:`REWARD_FNS` name or ``module:function``
    (``module:Class.attr`` works too).

    Raises:
        ValueError: for an unknown name (listing the valid ones), a module that does not
            import, a missing attribute or one that is not callable.
    """
    if spec in REWARD_FNS:
        return REWARD_FNS[spec]
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"unknown reward {spec!r}; valid: {', '.join(REWARD_FNS)}, "
                         f"or module:function")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {module!r}: {e} (is its "
                         "folder on PYTHONPATH? the reward processes import it too)") from e
    try:
        fn = functools.reduce(getattr, attr.split("."), obj)
    except AttributeError:
        raise ValueError(f"reward {spec!r}: module {module!r} has no attribute {attr!r}") \
            from None
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def default_reward_name(spec: str) -> str:
    """The ``reward_name`` a reward gets unless one is given: its :data:`REWARD_FNS`
    name, or the function name of ``module:function`` (``pkg.mod:my_fn`` -> ``my_fn``)."""
    return spec if spec in REWARD_FNS else spec.rpartition(":")[2].rpartition(".")[2]


__all__ = ["REWARD_FNS", "RewardFn", "Score", "default_reward_name", "load_reward_fn"]
