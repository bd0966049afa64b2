"""From one joined GRPO group to train samples: final reward, filters, advantages.

Pure function over Arrow tables (no Kafka): the aggregator calls
:func:`build_train_samples` when a group is complete (or timed out). Every
rollout of the group comes out as one ``train_samples`` row, trained or not:
``drop_reason`` says why one is not (so the trainer's ledger accounts for every
sampled rollout, docs/architecture.md, section 3).

Order of operations (each optional step off by default):

1. final reward = sum over the counted reward names of weight x value; an
   abstaining reward (null value, no error) adds 0 (TRL's ``nansum``
   convention); a counted reward that failed (null value with an error) drops
   the rollout (``error_reward``); a rollout with ``finish_reason == "error"``
   is dropped (``error_rollout``);
2. soft overlong punishment added to the reward (DAPO Eq. 13);
3. KL in the reward (when ``kl_in == "reward"``): reward -= kl_coef x sum over
   loss tokens of the per-token KL estimate between rollout and reference
   log-probs (a sequence-level penalty, since outcome estimators take one
   reward per sample). The per-token estimates are the loss's own
   (``relax.trainer.losses.registry.KL_ESTIMATORS``, verl's formulas and clamps); summed over
   the response this is verl's KL-in-reward for an outcome estimator (its
   ``apply_kl_penalty`` subtracts per token, and ``compute_grpo_outcome_advantage``
   sums the token rewards);
4. advantages by the configured estimator over the kept rollouts of the group;
5. DAPO dynamic sampling: a kept group with zero reward variance is dropped
   (``filtered_zero_variance``);
6. overlong filtering: a ``finish_reason == "length"`` rollout keeps its row and
   its place in the group statistics, but its ``loss_mask`` becomes all 0 (C23);
7. on-policy distillation (``distill_coef`` > 0): every kept rollout's per-token
   advantage gets ``-distill_coef x (logprobs_t - teacher_logprobs_t)`` added on its
   loss tokens (:func:`relax.trainer.advantage.distill.distill_advantages`), after the
   filters: a zero-variance group still learns from the teacher unless dynamic sampling
   dropped it.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from relax.consumers.aggregate_config import AdvantageConfig
from relax.schemas.v1 import TRAIN_SAMPLES
from relax.trainer.advantage.distill import distill_advantages
from relax.trainer.advantage.filters import (
    TRUNCATED_REASONS,
    keep_groups_with_variance,
    soft_overlong_penalty,
)
from relax.trainer.advantage.registry import compute_advantages
from relax.trainer.batching import list_column
from relax.trainer.losses.registry import KL_ESTIMATORS

RewardCell = tuple[float | None, str | None]
"""One reward result: (value or None, error text or None)."""


def kl_penalty(logprobs: list[np.ndarray], ref: list[np.ndarray], masks: list[np.ndarray],
               estimator: str) -> np.ndarray:
    """Sequence KL penalties: per rollout, the sum over its loss tokens of the per-token
    estimate ``KL_ESTIMATORS[estimator](logprobs, ref_logprobs)`` (the same functions the
    loss uses, so KL in the reward and KL in the loss never disagree).

    Args:
        logprobs: per rollout, ``[T_i]`` rollout log-probs.
        ref: per rollout, ``[T_i]`` reference log-probs.
        masks: per rollout, ``[T_i]`` loss_mask (0/1).
        estimator: a key of ``KL_ESTIMATORS``.

    Returns:
        ``[N]`` float64 penalties (nats).
    """
    fn = KL_ESTIMATORS[estimator]
    out = np.zeros(len(logprobs), np.float64)
    for i, (lp, rl, m) in enumerate(zip(logprobs, ref, masks)):
        kl = fn(torch.tensor(lp, dtype=torch.float64), torch.tensor(rl, dtype=torch.float64))
        out[i] = float(kl[torch.as_tensor(m).bool()].sum())
    return out


def build_train_samples(rollouts: pa.Table, rewards: dict[str, dict[str, RewardCell]],
                        ref_logprobs: dict[str, list[float]] | None, cfg: AdvantageConfig,
                        timed_out: set[str] | None = None,
                        teacher_logprobs: dict[str, list[float]] | None = None) -> pa.Table:
    """Turn one group's rollouts into ``train_samples`` rows.

    Args:
        rollouts: ``[n rows]`` of the ``rollouts`` schema, all with the same group_id.
        rewards: ``{rollout_id: {reward_name: (value, error)}}``; must hold every
            counted reward of every rollout not in ``timed_out``.
        ref_logprobs: ``{rollout_id: [len(response_ids)] float}`` or None (KL off).
        cfg: the advantage configuration.
        timed_out: rollout_ids whose results did not all arrive before the group
            timeout; they are emitted with ``drop_reason = filtered_group_timeout``
            and left out of the group statistics (public case C02: uneven groups).
        teacher_logprobs: ``{rollout_id: [len(response_ids)] float}`` (nats) or None
            (distillation off).

    Returns:
        ``[n rows]`` table with the ``train_samples`` schema, in the input order.

    Raises:
        KeyError: a counted reward is missing for a rollout not in ``timed_out``, or
            ``distill_coef`` > 0 and a kept rollout has no teacher log-probs.
    """
    timed_out = timed_out or set()
    n = rollouts.num_rows
    ids = rollouts.column("rollout_id").to_pylist()
    finish = rollouts.column("finish_reason").to_pylist()
    drop: list[str | None] = [None] * n
    reward = np.zeros(n, np.float64)
    components: list[list[tuple[str, float]]] = []
    for i, rid in enumerate(ids):
        comp = []
        if rid in timed_out:
            drop[i] = "filtered_group_timeout"
        elif finish[i] in ("error", "abort"):
            drop[i] = "error_rollout"
        for name, weight in cfg.rewards.items():
            if rid in timed_out and name not in rewards.get(rid, {}):
                continue
            value, error = rewards[rid][name]
            if value is None:
                if error is not None and drop[i] is None:
                    drop[i] = "error_reward"
                continue
            comp.append((name, float(value)))
            reward[i] += weight * float(value)
        components.append(comp)
    lengths = pc.list_value_length(rollouts.column("response_ids")).to_numpy(zero_copy_only=False)
    if cfg.soft_overlong is not None:
        so = cfg.soft_overlong
        reward += so.penalty * soft_overlong_penalty(
            torch.tensor(lengths), max_length=so.max_length, cache_length=so.cache_length
        ).double().numpy()
    mask_col = rollouts.column("loss_mask").combine_chunks()
    flat_mask = mask_col.flatten().to_numpy(zero_copy_only=False).copy()
    starts = np.concatenate([[0], np.cumsum(lengths)])
    ref_col = None
    if ref_logprobs is not None:
        ref_col = [ref_logprobs.get(rid) for rid in ids]
    if cfg.kl_in_reward_coef > 0:
        if ref_col is None or any(r is None for r, d in zip(ref_col, drop) if d is None):
            raise KeyError("kl_in_reward_coef > 0 needs ref_logprobs for every kept rollout")
        lp = rollouts.column("logprobs").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        keep_idx = [i for i in range(n) if drop[i] is None]
        pen = kl_penalty([lp[starts[i]:starts[i + 1]] for i in keep_idx],
                         [np.asarray(ref_col[i], np.float64) for i in keep_idx],
                         [flat_mask[starts[i]:starts[i + 1]] for i in keep_idx], cfg.kl_estimator)
        reward[keep_idx] -= cfg.kl_in_reward_coef * pen
    keep = np.array([d is None for d in drop])
    adv = np.zeros(n, np.float32)
    if keep.any():
        r = torch.as_tensor(reward[keep], dtype=torch.float32)
        g = torch.zeros(int(keep.sum()), dtype=torch.int64)
        opts = dict(cfg.estimator_options)
        adv[keep] = compute_advantages(cfg.estimator, r, g, **opts).numpy()
        if cfg.dynamic_sampling and not bool(keep_groups_with_variance(r, g).all()):
            for i in np.flatnonzero(keep):
                drop[i] = "filtered_zero_variance"
            adv[:] = 0
    if cfg.overlong_filter:
        for i in range(n):
            if finish[i] in TRUNCATED_REASONS:
                flat_mask[starts[i]:starts[i + 1]] = 0
    token_adv = np.repeat(adv, lengths)
    teacher_col = None
    if cfg.distill_coef > 0:
        teacher_col = [(teacher_logprobs or {}).get(rid) for rid in ids]
        lp = rollouts.column("logprobs").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        for i in range(n):
            if drop[i] is not None:
                continue
            if teacher_col[i] is None:
                raise KeyError(f"distill_coef > 0 needs teacher_logprobs for rollout {ids[i]!r}")
            s, e = starts[i], starts[i + 1]
            token_adv[s:e] += distill_advantages(
                torch.tensor(lp[s:e], dtype=torch.float32),
                torch.as_tensor(teacher_col[i], dtype=torch.float32),
                torch.as_tensor(flat_mask[s:e]), coef=cfg.distill_coef).numpy()
    cols = {name: rollouts.column(name) for name in TRAIN_SAMPLES.names if name in rollouts.schema.names}
    cols["group_size"] = pa.array(np.full(n, n, np.int32))
    cols["loss_mask"] = list_column(flat_mask, lengths, pa.int8())
    cols["ref_logprobs"] = _list_or_nulls(ref_col, n)
    cols["teacher_logprobs"] = _list_or_nulls(teacher_col, n)
    cols["advantages"] = list_column(token_adv, lengths, pa.float32())
    cols["reward"] = pa.array(reward.astype(np.float32))
    cols["reward_components"] = pa.array(components, TRAIN_SAMPLES.field("reward_components").type)
    cols["drop_reason"] = pa.array(drop, pa.string())
    arrays = [cols[f.name] for f in TRAIN_SAMPLES]
    arrays = [a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a for a in arrays]
    return pa.Table.from_arrays(arrays, schema=TRAIN_SAMPLES)


def _list_or_nulls(values: list | None, n: int) -> pa.Array:
    """A ``list<float32>`` column of ``values``, or ``n`` nulls when None."""
    return pa.array(values if values is not None else [None] * n, pa.list_(pa.float32()))


def reward_details(cells: dict[str, RewardCell]) -> str:
    """JSON of one rollout's reward cells (for logs and error records)."""
    return json.dumps({k: {"value": v, "error": e} for k, (v, e) in cells.items()})
