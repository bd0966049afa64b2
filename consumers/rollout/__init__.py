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
``B = (max_staleness + 1) * batch_groups`` groups of the run may be sampled and not yet
decided by the trainer, every instance together. The trainer's progress comes from two
sources: its policy_version ``V`` in ``<run>.weights`` announcements (it decides
``batch_groups`` groups per step) and its ``groups_consumed`` / ``groups_needed`` on
``<run>.progress`` (groups trained or dropped as stale/filtered since the run began, and
groups still needed to finish the run). The run may have started ``consumed +
min(B, needed)`` groups, ``consumed = groups_consumed`` (``V * batch_groups`` before the
first report): groups the trainer dropped are replaced instead of stalling the run, and
no group beyond what the run still needs is sampled. While the budget is used up the
stage holds one fetch of prompts, pauses its prompt partitions (keeping its group
membership) and waits for an announcement or new progress; a held prompt whose group
the claim log granted before (to an instance that died before producing it) is sampled
at once, since its claim already holds that credit.

Dynamic credit: the instances share that one credit through the claim log
``<run>.rollout_claims`` (:mod:`.claims`). Before sampling, an instance appends a claim
(its group_ids and its view of the allowance) and reads the log up to it; every
instance applies the claims in log order (:class:`.credit.ClaimLedger`), so they agree
on every grant. A fast instance is never held back by a slow one's fixed share; an
instance that joins reads the log and sees every group in flight; one that leaves holds
no credit (its uncommitted prompts come to another instance, whose claim on the same
group_ids is granted again for free). Nothing depends on the number of instances, so
scaling starts and stops instances without restarting the others. Each instance records
on ``<run>.rollout_state``, after its groups are acknowledged, which of them came from
prompt messages not yet committed (those prompts come again after a restart or a
rebalance and are skipped, not re-sampled).

Weights: with ``follow_weights`` the HF engine subscribes to the weight broadcast
(:class:`relax.streams.weights.subscriber.WeightSubscriber`) and swaps at its safe points:
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
functions and the claim ledger; its input, the trainer's progress, is read by
:class:`relax.streams.progress.TrainerProgress`), :mod:`.claims` (the claim log),
:mod:`.state`
(``<run>.rollout_state``), :mod:`.prompts` (the prompt queue and epochs),
:mod:`.sampling` (engine, :func:`sample_groups`, :func:`rollout_batch`), :mod:`.errors`
(unrenderable prompts), :mod:`.metrics` (counters and metrics), :mod:`.stage` (the loop,
:class:`RolloutStage`). The package itself imports nothing, so :mod:`.config` loads in
processes without torch (the driver's recipe checks).
"""
