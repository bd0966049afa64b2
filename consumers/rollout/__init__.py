"""The rollout stage: prompts in, sampled groups of rollouts out, under a staleness budget.

Flow: consume ``prompts.<dataset>`` in consumer group ``<run>.rollout``; render each
prompt with the chat template (``apply_chat_template(add_generation_prompt=True)``);
sample ``group_size`` (G) responses per prompt with the engine; write ``<run>.rollouts``
keyed by ``group_id = <prompt_id>:<epoch>`` (``rollout_id = <group_id>/<sample_index>``),
every row validated against ROLLOUTS before it is sent.

Delivery (at-least-once): a prompt message is marked done only after every group of
its rows was produced and flushed; then the finished prefix is committed. A crash
re-samples the uncommitted prompts (same group_ids); downstream drops duplicate
rollout_ids. A prompt row the stage cannot render (e.g. the chat template fails on its
messages) goes to ``prompts.<dataset>.errors``; the stage goes on.

Staleness budget (docs/architecture.md section 4,
``schemas.versions.in_flight_budget``; the arithmetic is in :mod:`.credit`): at most
``B = (max_staleness + 1) * batch_groups`` groups may be sampled and not yet decided by
the trainer. The stage counts the groups it started; the trainer's
progress comes from two sources: its policy_version ``V`` in ``<run>.weights``
announcements (it decides ``batch_groups`` groups per step) and its
``groups_consumed`` / ``groups_needed`` metrics on ``<run>.metrics`` (groups trained or
dropped as stale/filtered, and groups still needed to finish the run; see
``schemas.metric_names``). A new group starts only while ``started < consumed +
min(B, needed)`` with ``consumed = max((V - V0) * batch_groups, groups_consumed)``
counted since the stage started (``V0`` = the trainer version then, 0 for a new run).
Without the metrics this is ``started < (V - V0 + max_staleness + 1) * batch_groups``;
with them, groups the trainer dropped are replaced instead of stalling the run, and no
group beyond what the run still needs is sampled. While the budget is used up the stage
pauses its prompt partitions (keeping its group membership) and waits for an
announcement or new progress. Several rollout instances (``num_instances`` = n,
``instance_index`` = i) split the same global credit: instance i may start
``floor((C + n - 1 - i) / n)`` of ``C = consumed + min(B, needed)`` (the parts sum to
``C``), each counting only its own groups; Kafka gives each instance its own prompt
partitions. This is exact for n = 1 and balanced when the trainer consumes the
instances' groups evenly; an instance whose groups are consumed faster than its
share waits a little longer. After a restart an instance counts what its predecessor
(same ``engine_id``) started and the trainer has not decided yet as started by itself:
each instance records, on ``<run>.rollout_state`` after its groups are acknowledged,
how many groups it started and which of them came from prompt messages not yet
committed (those prompts come again after a restart and are skipped, not re-sampled).

Weights: with ``follow_weights`` the HF engine subscribes to the weight broadcast
(:class:`relax.streams.weights.WeightSubscriber`) and swaps at its safe points:
between generate calls (so without ``partial_rollout`` no sample mixes two versions;
a multi-turn group holds one version for all its turns), or with ``partial_rollout``
also between chunks, with per-token versions. No group starts while the engine's
weights (staged included) are more than ``max_staleness`` versions behind the announced
version (they would only be dropped as stale), for at most ``weights_wait_s``.

Epochs: when every prompt of a partition has been sampled and ``epochs`` allows, the
partition is read again from offset 0 with the epoch + 1 (``group_id`` carries the
epoch). This assumes the prompt topic is complete before the run starts. Each epoch
change is recorded on ``<run>.rollout_state`` before any offset of the new epoch is
committed (the local broker drops commit metadata, so the epoch cannot ride on the
offset), so a restarted instance goes on in the epoch of its committed offsets, not
at epoch 0, whose group_ids the trainer already decided.

Metrics (``<run>.metrics``, component = ``engine_id``; names from
``schemas.metric_names``): ``gen_tokens_per_s``, ``groups_in_flight``, ``budget_wait_s``
(cumulative seconds waiting for budget), ``groups_sampled``, and ``weight_wait_s``
(cumulative seconds waiting for announced weights).

Modules: :mod:`.config` (:class:`RolloutConfig`), :mod:`.credit` (the credit maths, pure
functions; its input, the trainer's progress, is read by
:class:`relax.streams.progress.TrainerProgress`), :mod:`.state`
(``<run>.rollout_state``), :mod:`.prompts` (the prompt queue and epochs),
:mod:`.sampling` (engine, :func:`sample_groups`, :func:`rollout_batch`), :mod:`.errors`
(unrenderable prompts), :mod:`.metrics` (counters and metrics), :mod:`.stage` (the loop,
:class:`RolloutStage`).
"""

from __future__ import annotations

from relax.consumers.rollout.config import RolloutConfig
from relax.consumers.rollout.credit import instance_budget, share
from relax.consumers.rollout.metrics import WEIGHT_WAIT_S, RolloutStats
from relax.consumers.rollout.prompts import _Item as _Item  # tests build queue items
from relax.consumers.environments import load_environment_factory
from relax.consumers.rollout.sampling import build_engine, rollout_batch, sample_groups
from relax.consumers.rollout.stage import RolloutStage
from relax.consumers.rollout.state import SavedState, saved_state
from relax.streams.progress import TrainerProgress

__all__ = [
    "WEIGHT_WAIT_S",
    "RolloutConfig",
    "RolloutStage",
    "RolloutStats",
    "SavedState",
    "TrainerProgress",
    "build_engine",
    "instance_budget",
    "load_environment_factory",
    "rollout_batch",
    "sample_groups",
    "saved_state",
    "share",
]
