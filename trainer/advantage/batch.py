"""Advantages over a whole global batch, computed by the trainer.

REINFORCE++ normalises by the statistics of the global batch (Hu et al., arXiv
2501.03262; verl's ``compute_reinforce_plus_plus*_outcome_advantage`` whitens over the
batch the trainer holds). In relax the aggregator sees one group at a time, so such an
estimator would normalise over one group. For the estimators of
:data:`~relax.trainer.advantage.names.BATCH_ESTIMATORS` the aggregator's per-group values
are therefore replaced by the trainer, once per optimizer step, over exactly the rows of
the step's batch (``TrainerConfig.batch_advantage``, filled by the recipe from
``advantage.estimator``).
Rows the batch does not hold (stale, filtered, errors) are in no statistic; overlong-
filtered rows (loss_mask 0) are, as in the group estimators (public case C23).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from relax.trainer.advantage.registry import compute_advantages
from relax.trainer.batching import list_column


def row_advantages(groups: list[pa.Table], estimator: str,
                   options: dict[str, float | bool] | None = None) -> torch.Tensor:
    """One advantage per row of the batch: ``estimator`` over the final rewards of every
    row of every group, with each group's rows sharing a group id.

    Args:
        groups: the batch, one ``train_samples`` table per group (``reward`` float32).
        estimator: a key of ``ADVANTAGE_ESTIMATORS`` (in practice one of
            :data:`~relax.trainer.advantage.names.BATCH_ESTIMATORS`).
        options: keyword options of the estimator.

    Returns:
        ``[N]`` float32, rows in batch order (group by group).

    Raises:
        ValueError: unknown estimator (lists the valid ones); non-finite reward.
    """
    rewards = torch.as_tensor(np.concatenate(
        [g.column("reward").to_numpy().astype(np.float32) for g in groups]))
    gids = torch.repeat_interleave(torch.arange(len(groups)),
                                   torch.as_tensor([g.num_rows for g in groups]))
    return compute_advantages(estimator, rewards, gids, **(options or {}))


def with_batch_advantages(groups: list[pa.Table], estimator: str,
                          options: dict[str, float | bool] | None = None) -> list[pa.Table]:
    """``groups`` with their ``advantages`` column replaced: each row's value from
    :func:`row_advantages` on every one of its response tokens (``[len(response_ids)]``
    float32, the ``train_samples`` convention)."""
    adv = row_advantages(groups, estimator, options).numpy()
    out, start = [], 0
    for g in groups:
        lengths = pc.list_value_length(g.column("response_ids")).to_numpy(zero_copy_only=False)
        col = list_column(np.repeat(adv[start:start + g.num_rows], lengths), lengths,
                          pa.float32())
        i = g.schema.get_field_index("advantages")
        out.append(g.set_column(i, g.schema.field(i), col))
        start += g.num_rows
    return out
