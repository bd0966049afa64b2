"""Topic and consumer-group names: public API, versioned with the schemas.

Renaming any of these breaks running pipelines, committed offsets and faust
table changelogs, so they live here as the one place that spells them
(docs/architecture.md, section 2).

Per-run topics are ``<run>.<name>``; the prompt topic ``prompts.<dataset>`` is
shared across runs; every topic ``T`` has an error topic ``T.errors``.
"""

from __future__ import annotations

import re

NAMES_VERSION = 1

ROLLOUTS = "rollouts"
REWARDS = "rewards"
REF_LOGPROBS = "ref_logprobs"
TEACHER_LOGPROBS = "teacher_logprobs"
"""``<run>.teacher_logprobs``: a teacher model's log-probs of each rollout's response (the
teacher stage, on-policy distillation); co-partitioned with the rollouts."""
TRAIN_SAMPLES = "train_samples"
WEIGHTS = "weights"
METRICS = "metrics"
PROGRESS = "progress"
"""``<run>.progress`` (compacted, one partition, key ``trainer``): the trainer's
groups_consumed / groups_needed and policy_version, the input of the rollout stage's
credit. Its own topic, so the run's correctness does not ride on the metrics."""

REWARD_CHANGES = "reward_changes"
"""``<run>.reward_changes`` (one partition, ordered): the run's control stream for
rewards. ``relax reward attach --weight`` / ``relax reward detach`` announce a change and
the policy_version from which it counts; the aggregator applies them
(:mod:`relax.consumers.reward.plan`)."""

RUN_TOPICS = (ROLLOUTS, REWARDS, REF_LOGPROBS, TEACHER_LOGPROBS, TRAIN_SAMPLES, WEIGHTS,
              METRICS, PROGRESS, REWARD_CHANGES)
"""Every per-run topic name (without the ``<run>.`` prefix)."""

ONE_PARTITION = (WEIGHTS, METRICS, PROGRESS, REWARD_CHANGES)
"""Per-run topics of one partition (streams read in order). The other :data:`RUN_TOPICS`
are keyed by group_id and co-partitioned with each other (the recipe's ``partitions``)."""

AGGREGATE_CHANGELOG = "aggregate_changelog"
"""``<run>.aggregate_changelog``: the aggregator's state changelog (internal; holds the
input rows of groups not yet emitted and an ``emitted`` marker per group)."""

ROLLOUT_STATE = "rollout_state"
"""``<run>.rollout_state``: the rollout stage's durable state (internal; JSON records): the
epoch of each prompt partition, keyed ``<topic>:<partition>``, and per rollout instance
the groups not yet covered by a prompt commit, keyed ``started:<engine_id>`` (the key of
earlier releases, kept so that compaction replaces their records)."""

ROLLOUT_CLAIMS = "rollout_claims"
"""``<run>.rollout_claims`` (internal; one partition, JSON records, never compacted): the
rollout instances' claims on the run's credit, ``{claim, engine_id, group_ids,
allowance}``. Every instance reads it in order and grants the same groups
(:class:`relax.consumers.rollout.credit.ClaimLedger`)."""

COMPACTED = (ROLLOUT_STATE, PROGRESS)
"""Internal topics created with ``cleanup.policy=compact``: every record is keyed and the
latest record of a key is that key's whole state, so the broker may drop older ones.
Not ``aggregate_changelog``: its records are deltas (a group's rollouts, then its rewards,
then its emitted marker, all under the group_id), and compaction would keep only the
last delta of a partial group."""

KEPT = (AGGREGATE_CHANGELOG, ROLLOUT_CLAIMS)
"""Internal logs a stage rebuilds its state from by reading every record: created with
``retention.ms=-1`` (the broker's time retention would drop state a long run still
needs)."""

ERRORS_SUFFIX = ".errors"
PROMPTS_PREFIX = "prompts."

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,100}$")


def check_name(kind: str, name: str) -> str:
    """Return ``name`` if it is a legal run/dataset/reward name.

    Raises:
        ValueError: naming ``kind`` and the allowed pattern, when ``name`` has a
            dot, a space or another character Kafka topic names reject.
    """
    if not _NAME_RE.match(name):
        raise ValueError(
            f"{kind} name {name!r} is invalid: expected letters, digits, '_' or '-' "
            f"(1-101 characters, no dots)"
        )
    return name


def run_topic(run: str, name: str) -> str:
    """``<run>.<name>`` for one of :data:`RUN_TOPICS`.

    Raises:
        ValueError: if ``name`` is not a per-run topic (lists the valid ones).
    """
    if name not in RUN_TOPICS:
        raise ValueError(f"unknown run topic {name!r}; valid: {', '.join(RUN_TOPICS)}")
    return f"{check_name('run', run)}.{name}"


def changelog_topic(run: str) -> str:
    """``<run>.aggregate_changelog``, the aggregator's state changelog."""
    return f"{check_name('run', run)}.{AGGREGATE_CHANGELOG}"


def rollout_state_topic(run: str) -> str:
    """``<run>.rollout_state``, the rollout stage's durable state (see :data:`ROLLOUT_STATE`)."""
    return f"{check_name('run', run)}.{ROLLOUT_STATE}"


def rollout_claims_topic(run: str) -> str:
    """``<run>.rollout_claims``, the rollout instances' credit claims (see
    :data:`ROLLOUT_CLAIMS`)."""
    return f"{check_name('run', run)}.{ROLLOUT_CLAIMS}"


def run_topic_partitions(run: str, partitions: int) -> dict[str, int]:
    """Every topic of run ``run`` with its partition count, the one list of them: the
    :data:`RUN_TOPICS` (:data:`ONE_PARTITION` ones 1, the others ``partitions``), the
    aggregator's changelog (``partitions``), the rollout state and claims (1), and each
    one's errors topic (1). The shared ``prompts.<dataset>`` is not a run's.

    Raises:
        ValueError: an illegal run name (:func:`check_name`).
    """
    parts = {run_topic(run, n): 1 if n in ONE_PARTITION else partitions for n in RUN_TOPICS}
    parts[changelog_topic(run)] = partitions
    parts[rollout_state_topic(run)] = 1
    parts[rollout_claims_topic(run)] = 1
    for t in list(parts):
        parts[errors_topic(t)] = 1
    return parts


def kept(topic: str) -> bool:
    """Whether ``topic`` is an internal log of :data:`KEPT` (``<run>.<name>``)."""
    return not topic.startswith(PROMPTS_PREFIX) and topic.partition(".")[2] in KEPT


def compacted(topic: str) -> bool:
    """Whether ``topic`` is a keyed state topic of :data:`COMPACTED` (``<run>.<name>``)."""
    return not topic.startswith(PROMPTS_PREFIX) and topic.partition(".")[2] in COMPACTED


def prompts_topic(dataset: str) -> str:
    """``prompts.<dataset>``: the prompt topic shared by every run on that data set."""
    return PROMPTS_PREFIX + check_name("dataset", dataset)


def errors_topic(topic: str) -> str:
    """``<topic>.errors``: where records of ``topic`` that cannot be processed go."""
    return topic + ERRORS_SUFFIX


def group(run: str, stage: str) -> str:
    """Consumer-group id ``<run>.<stage>`` (e.g. ``exp1.rollout``, ``exp1.trainer``)."""
    return f"{check_name('run', run)}.{stage}"


def reward_group(run: str, reward_name: str) -> str:
    """Consumer group ``<run>.reward.<name>``: one group per reward function, so a
    new reward attached at run time reads every rollout independently."""
    return f"{check_name('run', run)}.reward.{reward_name}"


def run_of(topic: str) -> str | None:
    """The run a per-run topic belongs to, or None for prompt and other topics."""
    if topic.startswith(PROMPTS_PREFIX):
        return None
    base = topic[: -len(ERRORS_SUFFIX)] if topic.endswith(ERRORS_SUFFIX) else topic
    run, _, name = base.partition(".")
    return run if name in RUN_TOPICS else None


def schema_for_topic(topic: str) -> str:
    """The v1 schema name of a topic: ``prompts.*`` -> prompts, ``*.errors`` -> errors,
    ``<run>.<name>`` -> name.

    Raises:
        ValueError: for a topic that is neither (names the topic and the forms).
    """
    if topic.endswith(ERRORS_SUFFIX):
        return "errors"
    if topic.startswith(PROMPTS_PREFIX):
        return "prompts"
    _, _, name = topic.partition(".")
    if name in RUN_TOPICS:
        return name
    raise ValueError(f"topic {topic!r} is not a relax topic: expected prompts.<dataset>, "
                     f"<run>.<{'|'.join(RUN_TOPICS)}> or <topic>.errors")
