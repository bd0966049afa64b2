"""Multi-turn rollouts: an environment interface and token-in/token-out accumulation.

Environment (any object with these two methods; one instance per sample):

* ``reset(prompt_row: dict) -> observation | None``: the conversation to start from
  (``None`` = the prompt row's ``messages``, or its ``prompt`` as one user message);
* ``step(response_text: str) -> (observation | None, done: bool, reward: float | None)``:
  react to the model's turn.

An observation is a chat message ``{"role": ..., "content": ...}``, a list of them,
or a plain string (one ``user`` message).

Token-in/token-out (the conversation is never re-tokenised): the model's sampled
tokens are appended as they are (``loss_mask`` 1, their log-probs). An observation is
rendered once with the chat template, as the difference between the template's
render of the conversation *with* the new message(s) (plus the generation prompt for
the next assistant turn) and *without* them. The part of the template's assistant
turn that follows the model's end-of-turn token (e.g. ChatML's newline after
``<|im_end|>``) is taken from the same render, so the accumulated sequence equals the
template's full render token for token (public case C22, verl #6501: dropping that
newline shifts every later position). Those tokens have ``loss_mask`` 0 and log-prob 0.
If the template is not prefix-stable (a later message changes how earlier ones
render, e.g. templates that strip earlier ``<think>`` blocks), :class:`TemplateError`
is raised rather than training on a context the model never saw.

Media (a multimodal model: ``processor`` given): the prompt row's images and audio,
and those an observation returns as content parts (``{"type": "image", "image": bytes
or PIL image}``, ``{"type": "audio", "audio": WAV bytes}``), accumulate in the episode's
``media`` (each item with the turn it came in) and stand as marks in the conversation;
the renders above are the processor's chat template, and the observation's piece is
tokenized by the processor, which expands each new item's placeholders (loss_mask 0).
Every turn is sampled with all the media so far, so the sequence equals the processor's
full render of the conversation with all its items.

Budgets: ``max_turns`` model turns (then ``turn_budget`` unless the environment said
done; the environment still scores the last turn, its observation is not appended),
``max_total_tokens`` response tokens in all (model + environment; then
``token_budget``). A model turn cut at ``max_new_tokens`` ends the episode with
``length`` (or ``token_budget`` when the total budget cut it); the environment still
scores such a turn (its observation is dropped). An episode the environment ends has
the last turn's reason (``stop``).
Without partial rollout, every turn of an episode uses one policy_version (the engine's
``hold()`` defers weight swaps until the group finishes).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

from relax.consumers.engines.base import Engine, SamplingParams
from relax.trainer.multimodal import (
    chat_with_media,
    encode_prompt,
    mark_media,
    media_inputs,
    observation_media,
    tokens_of,
)


CUT = ("length", "token_budget")
"""Finish reasons of a model turn cut by a budget: the environment still scores the turn
(its observation is dropped), as a single-turn reward scores a truncated answer."""


@runtime_checkable
class Environment(Protocol):
    """What a multi-turn environment provides (see the module docstring)."""

    def reset(self, prompt_row: dict):
        """Start an episode for ``prompt_row``; returns the starting conversation or None."""

    def step(self, response_text: str):
        """Return ``(observation | None, done, reward | None)`` for the model's turn."""


class TemplateError(ValueError):
    """The chat template does not render a conversation as a prefix of its extension."""


def as_messages(observation) -> list[dict]:
    """An observation as a list of chat messages.

    Raises:
        TypeError: for anything but a str, a message dict or a list of message dicts.
    """
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict):
        observation = [observation]
    if isinstance(observation, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in observation
    ):
        return [{"role": m["role"], "content": m["content"]} for m in observation]
    raise TypeError(
        f"an observation must be a str, a {{role, content}} dict or a list of them, "
        f"got {type(observation).__name__}: {observation!r:.200}"
    )


def prompt_messages(prompt_row: dict) -> list[dict]:
    """The chat messages of a PROMPTS row: ``messages`` if set, else ``prompt`` as one
    user message."""
    msgs = prompt_row.get("messages")
    if msgs:
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    return [{"role": "user", "content": prompt_row["prompt"]}]


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    """The chat template's text for ``messages``."""
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """The chat template's token ids for ``messages`` (the prompt of a rollout)."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    return [int(i) for i in ids]


def observation_ids(
    tokenizer,
    conversation: list[dict],
    new_messages: list[dict],
    *,
    ended_with_eot: bool,
    eot_text: str,
    processor=None,
    items: list[dict] = (),
    new_items: list[dict] = (),
) -> list[int]:
    """Tokens to append after a model turn so the sequence equals the full render.

    Args:
        conversation: every message so far, the model's last turn included (as an
            ``assistant`` message with its decoded text).
        new_messages: the observation's messages.
        ended_with_eot: the model's tokens end with the end-of-turn token (``stop``);
            otherwise the template's end-of-turn is appended too (loss_mask 0).
        eot_text: the template's end-of-turn text (e.g. ``<|im_end|>``).
        processor: a multimodal model's processor (renders and tokenizes instead of
            ``tokenizer``); ``items`` are the media so far, ``new_items`` those the new
            messages' marks stand for.

    Returns:
        token ids of: the template's text after the model's end of turn, the new
        messages, and the generation prompt of the next assistant turn.

    Raises:
        TemplateError: the render without the new messages is not a prefix of the render
            with them, or the end-of-turn text is not in the render.
    """
    if processor is None:
        before = render(tokenizer, conversation, add_generation_prompt=False)
        after = render(tokenizer, conversation + new_messages, add_generation_prompt=True)
    else:
        before = render(processor, chat_with_media(conversation, items), False)
        after = render(processor, chat_with_media(conversation + new_messages,
                                                  [*items, *new_items]), True)
    if not after.startswith(before):
        raise TemplateError(
            "the chat template renders the conversation differently once a "
            "message is added (not prefix-stable); token-in/token-out "
            "accumulation would train on a context the model never saw"
        )
    cut = before.rfind(eot_text)
    if cut < 0:
        raise TemplateError(
            f"end-of-turn text {eot_text!r} not found in the rendered assistant turn"
        )
    tail = before[cut + len(eot_text) :] if ended_with_eot else before[cut:]
    if processor is not None:
        return tokens_of(processor, tail + after[len(before) :], list(new_items))
    return list(tokenizer.encode(tail + after[len(before) :], add_special_tokens=False))


@dataclass
class Episode:
    """One multi-turn trajectory, in ROLLOUTS terms (lists are per response token)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_policy_versions: list[int] = field(default_factory=list)
    versions_recorded: bool = False
    policy_version_start: int | None = None
    policy_version_end: int | None = None
    finish_reason: str | None = None
    turns: list[dict] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    media: list[dict] | None = None

    @property
    def response_text(self) -> str:
        """The model's turns joined by newlines."""
        return "\n".join(self.texts)


def _eot_text(tokenizer) -> str:
    return tokenizer.eos_token or ""


def run_episodes(
    engine: Engine,
    tokenizer,
    envs: list,
    prompt_row: dict,
    params: SamplingParams,
    *,
    max_turns: int,
    max_total_tokens: int | None = None,
    processor=None,
) -> list[Episode]:
    """Roll out one episode per environment for ``prompt_row``, all in lockstep (one
    engine call per turn for every episode still running with the same token limit).

    Args:
        engine: the rollout engine (its ``stop_token_ids`` tell end-of-turn tokens).
        tokenizer: the engine's tokenizer (chat template).
        envs: one fresh environment per sample.
        prompt_row: the PROMPTS row.
        params: sampling settings of each turn (``max_new_tokens`` per turn).
        max_turns: most model turns (>= 1).
        max_total_tokens: most response tokens per episode, model and environment
            tokens together (None = unlimited).
        processor: a multimodal model's processor (see the module docstring).

    Returns:
        one :class:`Episode` per environment, in order.

    Raises:
        TemplateError: see :func:`observation_ids`.
        ValueError: ``max_turns < 1``; media for a text-only model (no ``processor``).
        TypeError: an observation part that is not text, image or audio.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    stop_ids = getattr(engine, "stop_token_ids", frozenset({tokenizer.eos_token_id}))
    eot = _eot_text(tokenizer)
    episodes: list[Episode] = []
    for env in envs:
        start = env.reset(prompt_row)
        msgs = prompt_messages(prompt_row) if start is None else as_messages(start)
        msgs, items = _with_media(msgs, list(prompt_row.get("media") or []), 0, processor)
        if items:
            msgs = mark_media(msgs, items)  # later messages must not move them
            ids = encode_prompt(processor, msgs, items)[0]
            episodes.append(Episode(prompt_ids=ids, messages=msgs, media=items))
        else:
            episodes.append(Episode(prompt_ids=render_ids(tokenizer, msgs), messages=msgs))
    if hasattr(engine, "apply_pending"):  # weights staged since the last group: use them
        engine.apply_pending()
    hold = engine.hold() if hasattr(engine, "hold") else contextlib.nullcontext()
    with hold:
        for _turn in range(max_turns):
            active = [i for i, e in enumerate(episodes) if e.finish_reason is None]
            if not active:
                break
            limits: dict[int, list[int]] = {}
            for i in active:
                left = (
                    max_total_tokens - len(episodes[i].response_ids)
                    if max_total_tokens is not None
                    else params.max_new_tokens
                )
                if left < 1:
                    episodes[i].finish_reason = "token_budget"
                    continue
                limits.setdefault(min(params.max_new_tokens, left), []).append(i)
            for limit, idx in limits.items():
                media = [media_inputs(processor, episodes[i].media) for i in idx] \
                    if any(episodes[i].media for i in idx) else None
                gens = engine.generate(
                    [episodes[i].prompt_ids + episodes[i].response_ids for i in idx],
                    replace(params, max_new_tokens=limit),
                    **({"media": media} if media else {}),
                )
                for i, g in zip(idx, gens):
                    _model_turn(episodes[i], g, limit < params.max_new_tokens)
            for i in active:
                e = episodes[i]
                if e.finish_reason is not None:
                    if e.finish_reason in CUT and len(e.rewards) < len(e.texts):
                        # a turn cut by a budget ends the episode, and is still scored
                        e.rewards.append(envs[i].step(e.texts[-1])[2])
                    continue
                obs, done, reward = envs[i].step(e.texts[-1])
                e.rewards.append(reward)
                if done or obs is None:
                    e.finish_reason = e.turns[-1].get("_reason", "stop")
                    continue
                if _turn == max_turns - 1:  # no model turn would answer the observation
                    e.finish_reason = "turn_budget"
                    continue
                new, new_items = _with_media(as_messages(obs), [], _turn + 1, processor)
                ended_with_eot = bool(e.response_ids) and e.response_ids[-1] in stop_ids
                ids = observation_ids(
                    tokenizer, e.messages, new, ended_with_eot=ended_with_eot, eot_text=eot,
                    **({"processor": processor, "items": e.media or [], "new_items": new_items}
                       if e.media or new_items else {}))
                if (
                    max_total_tokens is not None
                    and len(e.response_ids) + len(ids) > max_total_tokens
                ):
                    e.finish_reason = "token_budget"
                    continue
                start_at = len(e.response_ids)
                e.response_ids += ids
                e.loss_mask += [0] * len(ids)
                e.logprobs += [0.0] * len(ids)
                e.token_policy_versions += [e.policy_version_end] * len(ids)
                e.turns.append(
                    {"role": new[-1]["role"], "start": start_at, "end": len(e.response_ids)}
                )
                e.messages = e.messages + new
                if new_items:
                    e.media = [*(e.media or []), *new_items]
        for e in episodes:
            if e.finish_reason is None:
                e.finish_reason = "turn_budget"
    for e in episodes:
        for t in e.turns:
            t.pop("_reason", None)
    return episodes


def _with_media(messages: list[dict], items: list[dict], turn: int, processor
                ) -> tuple[list[dict], list[dict]]:
    """``messages`` with media parts turned into marks, and ``items`` plus theirs.

    Raises:
        ValueError: media for a text-only model (no ``processor``).
    """
    out = []
    for m in messages:
        m, found = observation_media(m, turn)
        out.append(m)
        items = items + found
    if items and processor is None:
        raise ValueError(f"turn {turn} has {len(items)} media items but the model takes "
                         "no images or audio (no processor)")
    return out, items


def _model_turn(e: Episode, g, budget_limited: bool) -> None:
    start = len(e.response_ids)
    e.response_ids += g.token_ids
    e.loss_mask += [1] * len(g.token_ids)
    e.logprobs += list(g.logprobs)
    if g.token_policy_versions is not None:
        e.versions_recorded = True
        e.token_policy_versions += list(g.token_policy_versions)
    else:
        e.token_policy_versions += [g.policy_version_start] * len(g.token_ids)
    if e.policy_version_start is None:
        e.policy_version_start = g.policy_version_start
    e.policy_version_end = g.policy_version_end
    e.turns.append(
        {
            "role": "assistant",
            "start": start,
            "end": len(e.response_ids),
            "_reason": g.finish_reason,
        }
    )
    e.texts.append(g.text)
    e.messages = e.messages + [{"role": "assistant", "content": g.text}]
    if g.finish_reason == "length":
        e.finish_reason = "token_budget" if budget_limited else "length"
    elif g.finish_reason != "stop":
        e.finish_reason = g.finish_reason
