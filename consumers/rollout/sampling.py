"""Sampling: the engine and environments a config asks for, ``G`` samples per prompt in
one engine call (:func:`sample_groups`), and the ROLLOUTS rows of a group
(:func:`rollout_batch`)."""

from __future__ import annotations

import json
import time

import pyarrow as pa

from relax.consumers.engines.base import Engine, SamplingParams
from relax.consumers.multiturn import Episode
from relax.consumers.rollout.config import RolloutConfig
from relax.schemas.v1 import REWARDS, ROLLOUTS
from relax.schemas.validate import validate


def build_engine(cfg: RolloutConfig) -> Engine:
    """The engine a config asks for (HF loads the model; SGLang connects to its server)."""
    if cfg.engine == "hf":
        from relax.consumers.engines.hf import HFEngine

        return HFEngine(
            cfg.model,
            engine_id=cfg.engine_id,
            device=cfg.device,
            partial_rollout=cfg.partial_rollout,
            chunk_tokens=cfg.chunk_tokens,
        )
    from relax.consumers.engines.sglang import SGLangEngine
    from relax.trainer.models import load_tokenizer

    return SGLangEngine(cfg.sglang_url, load_tokenizer(cfg.model), engine_id=cfg.engine_id,
                        tp_size=cfg.sglang_tp_size)


def now_ms() -> int:
    """Wall-clock now in ms since the epoch (UTC), as the rollout schema's timestamps."""
    return int(time.time() * 1000)


def rollout_batch(
    prompt_row: dict,
    group_id: str,
    samples: list[Episode],
    cfg: RolloutConfig,
    engine_id: str,
    started_at: int,
    finished_at: int,
) -> pa.RecordBatch:
    """ROLLOUTS rows of one group (validated).

    Raises:
        relax.schemas.validate.SchemaError: a row breaks the schema (a bug: never sent).
    """
    rows = []
    for k, e in enumerate(samples):
        rows.append(
            dict(
                rollout_id=f"{group_id}/{k}",
                group_id=group_id,
                prompt_id=prompt_row["prompt_id"],
                dataset=prompt_row["dataset"],
                sample_index=k,
                group_size=len(samples),
                prompt_ids=e.prompt_ids,
                response_ids=e.response_ids,
                loss_mask=e.loss_mask,
                logprobs=e.logprobs,
                token_policy_versions=e.token_policy_versions if e.versions_recorded else None,
                policy_version_start=e.policy_version_start,
                policy_version_end=e.policy_version_end,
                finish_reason=e.finish_reason,
                turns=[{"role": t["role"], "start": t["start"], "end": t["end"]} for t in e.turns],
                prompt_text=prompt_row["prompt"],
                response_text=e.response_text,
                label=prompt_row.get("label"),
                metadata=_metadata(prompt_row, e),
                media=e.media if e.media is not None else prompt_row.get("media"),
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                engine_id=engine_id,
                started_at=started_at,
                finished_at=finished_at,
            )
        )
    batch = pa.RecordBatch.from_pylist(rows, schema=ROLLOUTS)
    validate(batch, "rollouts")
    return batch


def environment_reward(e: Episode) -> float | None:
    """An episode's reward from its environment: the sum of the rewards its steps gave
    (None when none gave one: the reward abstains)."""
    given = [r for r in e.rewards if r is not None]
    return float(sum(given)) if given else None


def environment_reward_batch(rollouts: pa.RecordBatch, samples: list[Episode],
                             reward_name: str) -> pa.RecordBatch:
    """REWARDS rows (validated) of one group's episodes under ``reward_name``: value =
    :func:`environment_reward`; ``details`` = the per-step rewards as JSON."""
    rows = [dict(rollout_id=rid, group_id=gid, reward_name=reward_name,
                 value=environment_reward(e), details=json.dumps({"step_rewards": e.rewards}),
                 error=None, elapsed_s=0.0)
            for rid, gid, e in zip(rollouts.column("rollout_id").to_pylist(),
                                   rollouts.column("group_id").to_pylist(), samples)]
    batch = pa.RecordBatch.from_pylist(rows, schema=REWARDS)
    validate(batch, "rewards")
    return batch


def _metadata(prompt_row: dict, e: Episode) -> str:
    if not e.rewards:
        return prompt_row["metadata"]
    meta = json.loads(prompt_row["metadata"] or "{}")
    meta["env_rewards"] = e.rewards
    return json.dumps(meta)


def sample_groups(
    engine: Engine, prompts: list[list[int]], group_size: int, params: SamplingParams,
    media: list[dict] | None = None,
) -> list[list[Episode]]:
    """``group_size`` samples of each prompt in one engine call; ``[groups][G]`` episodes.
    ``media``: each prompt's media inputs (a multimodal model's; see ``HFEngine.generate``)."""
    if media is None:
        gens = engine.generate([p for p in prompts for _ in range(group_size)], params)
    else:
        gens = engine.generate([p for p in prompts for _ in range(group_size)], params,
                               media=[m for m in media for _ in range(group_size)])
    out = []
    for gi, p in enumerate(prompts):
        group = []
        for g in gens[gi * group_size : (gi + 1) * group_size]:
            n = len(g.token_ids)
            group.append(
                Episode(
                    prompt_ids=list(p),
                    response_ids=list(g.token_ids),
                    loss_mask=[1] * n,
                    logprobs=list(g.logprobs),
                    token_policy_versions=list(g.token_policy_versions or []),
                    versions_recorded=g.token_policy_versions is not None,
                    policy_version_start=g.policy_version_start,
                    policy_version_end=g.policy_version_end,
                    finish_reason=g.finish_reason,
                    turns=[{"role": "assistant", "start": 0, "end": n}],
                    texts=[g.text],
                )
            )
        out.append(group)
    return out


def sample_sglang_media(engine: Engine, processor, messages: list[list[dict]],
                        media: list[list[dict]], prompt_ids: list[list[int]], group_size: int,
                        params: SamplingParams) -> list[list[Episode]]:
    """Media prompts on SGLang: the server gets the chat template's unexpanded ids and the
    items (its processor expands them); the episodes keep ``prompt_ids``, the same
    processor's expansion here (unverified against SGLang: see its engine module).

    Raises:
        ValueError: see :func:`relax.trainer.multimodal.unexpanded_ids`.
    """
    from relax.trainer.multimodal import unexpanded_ids

    sent = [unexpanded_ids(processor, m, items) for m, items in zip(messages, media)]
    groups = sample_groups(engine, sent, group_size, params, media)
    for group, ids in zip(groups, prompt_ids):
        for e in group:
            e.prompt_ids = list(ids)
    return groups
