"""What one optimizer step computes from a batch of groups, the same in the trainer stage
(:mod:`relax.trainer.loop`) and offline (``relax train --from-archive``): batch-level
advantages when the recipe asks for them (REINFORCE++, or GAE from the critic), then only the rows that can move
the weights, with the loss normalised by the counts of the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from relax.trainer.advantage.batch import with_batch_advantages
from relax.trainer.batching import informative_rows, loss_counts
from relax.trainer.config import TrainerConfig


@dataclass
class StepBatch:
    """One step's input.

    Attributes:
        advantaged: every group of the batch, with batch-level advantages when configured
            (what the advantage metrics describe).
        trained: the groups (rows) the forward and backward run on.
        counts: ``(loss tokens, sequences with >= 1 loss token)`` of the whole batch, the
            loss's ``global_tokens`` / ``global_seqs``.
        metrics: the critic's metrics of the step (``value_loss``, ...), empty without one.
    """

    advantaged: list[pa.Table]
    trained: list[pa.Table]
    counts: tuple[int, int]
    metrics: dict[str, float] = field(default_factory=dict)


def skips_zero_rows(t: TrainerConfig) -> bool:
    """Whether rows with no non-zero advantage can be left out of the forward and backward:
    they add exactly 0 to a pure policy-gradient loss, but not to a KL-in-loss or entropy
    term."""
    return not (t.loss.kl_coef and t.loss.kl_in == "loss") and t.loss.entropy_coef == 0


def step_batch(groups: list[pa.Table], t: TrainerConfig, critic=None) -> StepBatch:
    """The input of one optimizer step on ``groups`` (``train_samples`` tables, one a group)
    under trainer settings ``t``. With ``t.critic``, ``critic`` (a
    :class:`relax.trainer.critic.Critic`) computes the GAE advantages and takes its own
    update on the batch first.

    Raises:
        ValueError: ``t.critic`` is set and no ``critic`` is given.
    """
    metrics: dict[str, float] = {}
    if t.critic is not None:
        if critic is None:
            raise ValueError("trainer.critic (advantage.estimator: gae) needs the critic's "
                             "values: this trainer has no critic (offline training from an "
                             "archive does not build one yet)")
        groups, metrics = critic.step(groups)
    elif t.batch_advantage is not None:
        groups = with_batch_advantages(groups, t.batch_advantage, t.batch_advantage_options)
    trained = informative_rows(groups) if skips_zero_rows(t) else groups
    return StepBatch(groups, trained, loss_counts(groups), metrics)
