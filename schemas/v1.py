"""Arrow schemas v1: what flows on each topic (docs/architecture.md, section 2).

Each schema carries schema-level metadata ``relax.schema`` (its name) and
``relax.version``; each field carries ``doc`` and, where it has one, ``unit`` in
its Arrow field metadata, so ``relax tail`` and any Arrow tool can explain a
column. Designed for what comes later without a breaking change:

* multi-turn rollouts: ``response_ids`` holds every token after the prompt
  (model tokens and environment/tool tokens), ``loss_mask`` marks model tokens,
  ``turns`` gives each turn's span;
* partial rollouts: ``token_policy_versions`` per response token;
* images and audio: ``media`` is a list of items, each a URI or small inline
  bytes (large values are moved to the blob store by the codec and keep a URI).

Token ids are int32 (vocabularies < 2**31); log-probs float32 in nats.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1

FINISH_REASONS = ("stop", "length", "abort", "turn_budget", "token_budget", "error")
"""Allowed ``finish_reason`` values: ``stop`` (EOS/stop string/end of turn),
``length`` (hit max_new_tokens), ``abort`` (cancelled, e.g. at a weight swap),
``turn_budget`` / ``token_budget`` (multi-turn budgets), ``error`` (engine error)."""

DROP_REASONS = (
    "filtered_zero_variance",
    "filtered_overlong",
    "filtered_group_timeout",
    "error_reward",
    "error_rollout",
)
"""Allowed ``drop_reason`` values on train samples (null = train on it)."""


def _f(name: str, typ: pa.DataType, doc: str, unit: str | None = None,
       nullable: bool = False) -> pa.Field:
    meta = {"doc": doc}
    if unit:
        meta["unit"] = unit
    return pa.field(name, typ, nullable=nullable, metadata=meta)


def _schema(name: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(fields, metadata={"relax.schema": name,
                                       "relax.version": str(SCHEMA_VERSION)})


TS = pa.timestamp("ms", tz="UTC")

MEDIA_ITEM = pa.struct([
    pa.field("kind", pa.string(), nullable=False,
             metadata={"doc": "image | audio | video"}),
    pa.field("uri", pa.string(), metadata={
        "doc": "where the bytes live (file://, s3://, blob store); null if inline"}),
    pa.field("data", pa.binary(), metadata={
        "doc": "inline bytes (small items only); null if uri is set", "unit": "bytes"}),
    pa.field("mime", pa.string(), metadata={"doc": "media type, e.g. image/png"}),
    pa.field("turn", pa.int32(), metadata={
        "doc": "turn index the item belongs to (0 = prompt)"}),
])
MEDIA = pa.list_(MEDIA_ITEM)

MESSAGE = pa.struct([
    pa.field("role", pa.string(), nullable=False),
    pa.field("content", pa.string(), nullable=False),
])

TURN = pa.struct([
    pa.field("role", pa.string(), nullable=False,
             metadata={"doc": "assistant (model tokens) | tool | user | env"}),
    pa.field("start", pa.int32(), nullable=False,
             metadata={"doc": "first index into response_ids", "unit": "tokens"}),
    pa.field("end", pa.int32(), nullable=False,
             metadata={"doc": "one past the last index into response_ids",
                       "unit": "tokens"}),
])

_ID_FIELDS = [
    _f("rollout_id", pa.string(), "unique id of one sampled trajectory: <group_id>/<sample_index>"),
    _f("group_id", pa.string(), "sampling group: <prompt_id>:<epoch>; the Kafka key"),
]

PROMPTS = _schema("prompts", [
    _f("prompt_id", pa.string(), "stable id from the prompt content (sha256 prefix); the Kafka key"),
    _f("dataset", pa.string(), "data set name"),
    _f("prompt", pa.string(), "user prompt text (used when messages is null)"),
    _f("messages", pa.list_(MESSAGE), "chat messages to render with the chat template", nullable=True),
    _f("label", pa.string(), "reference answer as text (null if none)", nullable=True),
    _f("metadata", pa.string(), "JSON object: source line, task name and entry, ..."),
    _f("media", MEDIA, "images/audio of the prompt", nullable=True),
    _f("created_at", TS, "publish time", unit="ms since epoch, UTC"),
])

ROLLOUTS = _schema("rollouts", _ID_FIELDS + [
    _f("prompt_id", pa.string(), "prompt this trajectory answers"),
    _f("dataset", pa.string(), "data set name of the prompt"),
    _f("sample_index", pa.int32(), "index in the group, 0..group_size-1"),
    _f("group_size", pa.int32(), "G: samples requested for this group"),
    _f("prompt_ids", pa.list_(pa.int32()), "prompt token ids after the chat template", unit="tokens"),
    _f("response_ids", pa.list_(pa.int32()),
       "every token after the prompt: model tokens and (multi-turn) environment tokens", unit="tokens"),
    _f("loss_mask", pa.list_(pa.int8()), "1 on model-generated tokens, 0 elsewhere; len = response_ids"),
    _f("logprobs", pa.list_(pa.float32()),
       "rollout log-probs of response_ids from temperature-scaled logits; 0 where loss_mask = 0",
       unit="nats"),
    _f("token_policy_versions", pa.list_(pa.int64()),
       "policy_version that produced each response token (partial rollouts only)", nullable=True),
    _f("policy_version_start", pa.int64(), "policy_version of the weights at the first sampled token"),
    _f("policy_version_end", pa.int64(), "policy_version of the weights at the last sampled token"),
    _f("finish_reason", pa.string(), "one of " + ", ".join(FINISH_REASONS)),
    _f("turns", pa.list_(TURN), "spans of response_ids per turn (single turn: one assistant span)"),
    _f("prompt_text", pa.string(), "prompt as the user wrote it (not the rendered template)"),
    _f("response_text", pa.string(), "decoded model output (all assistant turns joined)"),
    _f("label", pa.string(), "reference answer copied from the prompt", nullable=True),
    _f("metadata", pa.string(), "JSON object copied from the prompt"),
    _f("media", MEDIA, "media accumulated across turns", nullable=True),
    _f("temperature", pa.float32(), "sampling temperature; logprobs are of logits / temperature"),
    _f("top_p", pa.float32(), "nucleus sampling mass (1.0 = off)"),
    _f("top_k", pa.int32(), "top-k sampling (0 = off)"),
    _f("engine_id", pa.string(), "rollout engine instance that produced it"),
    _f("started_at", TS, "generation start", unit="ms since epoch, UTC"),
    _f("finished_at", TS, "generation end", unit="ms since epoch, UTC"),
])

REWARDS = _schema("rewards", _ID_FIELDS + [
    _f("reward_name", pa.string(), "reward function name (its consumer group is <run>.reward.<name>)"),
    _f("value", pa.float32(), "reward value; null = abstain or error", nullable=True),
    _f("details", pa.string(), "JSON object: extracted answer, parts of the score, ..."),
    _f("error", pa.string(), "exception or timeout text when value is null because of an error",
       nullable=True),
    _f("elapsed_s", pa.float32(), "scoring time", unit="seconds"),
])

REF_LOGPROBS = _schema("ref_logprobs", _ID_FIELDS + [
    _f("ref_logprobs", pa.list_(pa.float32()),
       "reference-model log-probs of response_ids (temperature-scaled as the rollout); len = response_ids",
       unit="nats"),
    _f("ref_policy_version", pa.int64(), "policy_version of the reference weights (0 = frozen initial model)"),
])

TEACHER_LOGPROBS = _schema("teacher_logprobs", _ID_FIELDS + [
    _f("teacher_logprobs", pa.list_(pa.float32()),
       "teacher-model log-probs of response_ids (temperature-scaled as the rollout); len = "
       "response_ids", unit="nats"),
    _f("teacher_model", pa.string(), "the teacher model (name or folder)"),
])

TRAIN_SAMPLES = _schema("train_samples", _ID_FIELDS + [
    _f("prompt_id", pa.string(), "prompt this trajectory answers"),
    _f("dataset", pa.string(), "data set name of the prompt"),
    _f("sample_index", pa.int32(), "index in the group"),
    _f("group_size", pa.int32(), "samples the group was emitted with (after timeouts)"),
    _f("prompt_ids", pa.list_(pa.int32()), "prompt token ids", unit="tokens"),
    _f("response_ids", pa.list_(pa.int32()), "response token ids", unit="tokens"),
    _f("loss_mask", pa.list_(pa.int8()), "1 on trained tokens (after overlong filtering)"),
    _f("logprobs", pa.list_(pa.float32()), "rollout log-probs", unit="nats"),
    _f("ref_logprobs", pa.list_(pa.float32()), "reference log-probs (null when KL is off)",
       unit="nats", nullable=True),
    _f("teacher_logprobs", pa.list_(pa.float32()),
       "teacher log-probs (on-policy distillation; null when it is off)", unit="nats",
       nullable=True),
    _f("advantages", pa.list_(pa.float32()), "per-token advantages; len = response_ids"),
    _f("reward", pa.float32(), "final scalar reward (weighted sum of the counted rewards, shaping applied)"),
    _f("reward_components", pa.map_(pa.string(), pa.float32()), "each counted reward by name"),
    _f("token_policy_versions", pa.list_(pa.int64()), "per-token policy_version (partial rollouts)",
       nullable=True),
    _f("policy_version_start", pa.int64(), "see rollouts"),
    _f("policy_version_end", pa.int64(), "see rollouts"),
    _f("finish_reason", pa.string(), "see rollouts"),
    _f("temperature", pa.float32(), "sampling temperature of the rollout"),
    _f("top_p", pa.float32(), "see rollouts"),
    _f("top_k", pa.int32(), "see rollouts"),
    _f("drop_reason", pa.string(),
       "null = train on it; otherwise one of " + ", ".join(DROP_REASONS) +
       " (emitted so the trainer's ledger accounts for every rollout)", nullable=True),
    _f("finished_at", TS, "rollout generation end", unit="ms since epoch, UTC"),
    _f("media", MEDIA, "the rollout's images/audio, by reference (the trainer feeds them "
       "to the model as the rollout did)", nullable=True),
])

TENSOR_ENTRY = pa.struct([
    pa.field("name", pa.string(), nullable=False),
    pa.field("shape", pa.list_(pa.int64()), nullable=False),
    pa.field("dtype", pa.string(), nullable=False, metadata={"doc": "torch dtype name, e.g. float32"}),
    pa.field("offset", pa.int64(), nullable=False,
             metadata={"doc": "byte offset in the flat stream of buckets", "unit": "bytes"}),
    pa.field("nbytes", pa.int64(), nullable=False, metadata={"unit": "bytes"}),
])

WEIGHTS = _schema("weights", [
    _f("policy_version", pa.int64(), "optimizer steps applied to these weights"),
    _f("manifest", pa.list_(TENSOR_ENTRY), "every tensor in broadcast order"),
    _f("total_bytes", pa.int64(), "sum of nbytes", unit="bytes"),
    _f("bucket_bytes", pa.int64(), "flat bucket size of the broadcast", unit="bytes"),
    _f("checksum", pa.string(), "<algorithm>:<hex> over the flat bytes in manifest order"),
    _f("transport", pa.string(),
       "nccl | gloo | checkpoint | shm (a same-host file, its folder in checkpoint_uri) | "
       "version (the version only, no bytes: a colocated trainer with no weight subscriber)"),
    _f("rendezvous", pa.string(), "tcp://host:port of the broadcast group (null for checkpoint only)",
       nullable=True),
    _f("group_name", pa.string(), "process-group name of the broadcast"),
    _f("checkpoint_uri", pa.string(), "safetensors folder holding this version, for late joiners",
       nullable=True),
    _f("published_at", TS, "announcement time", unit="ms since epoch, UTC"),
])

METRICS = _schema("metrics", [
    _f("ts", TS, "measurement time", unit="ms since epoch, UTC"),
    _f("component", pa.string(), "emitting stage, e.g. trainer, rollout-0, reward.gsm8k; the Kafka key"),
    _f("name", pa.string(), "metric name; the unit is its suffix (_s, _bytes, _tokens, ...)"),
    _f("value", pa.float64(), "metric value"),
    _f("policy_version", pa.int64(), "policy_version the value refers to", nullable=True),
])

PROGRESS = _schema("progress", [
    _f("ts", TS, "when the trainer wrote it", unit="ms since epoch, UTC"),
    _f("policy_version", pa.int64(), "the trainer's policy_version when it wrote this row"),
    _f("groups_consumed", pa.int64(), "groups the trainer decided (trained, stale, filtered or "
       "error) since the run began, as of its last checkpoint or later", unit="groups"),
    _f("groups_needed", pa.int64(), "groups the remaining steps still need "
       "((steps - policy_version) x batch_groups)", unit="groups"),
])

REWARD_CHANGES = _schema("reward_changes", [
    _f("ts", TS, "when it was announced", unit="ms since epoch, UTC"),
    _f("action", pa.string(), "attach (count reward_name with weight) or detach (stop counting it)"),
    _f("reward_name", pa.string(), "reward_name on <run>.rewards"),
    _f("weight", pa.float64(), "its weight in the final reward (0 for detach)"),
    _f("from_policy_version", pa.int64(),
       "the change counts for a group whose rollouts were all sampled with policy_version >= "
       "this (min policy_version_start); older groups are untouched"),
])

HEADER = pa.struct([pa.field("key", pa.string(), nullable=False), pa.field("value", pa.binary())])

ERRORS = _schema("errors", [
    _f("ts", TS, "when the error was routed", unit="ms since epoch, UTC"),
    _f("source_topic", pa.string(), "topic of the bad record (or the input file for publish)"),
    _f("source_partition", pa.int32(), "partition of the bad record", nullable=True),
    _f("source_offset", pa.int64(), "offset of the bad record (or line number for publish)", nullable=True),
    _f("row", pa.int64(), "row within the record batch, when one row is at fault", nullable=True),
    _f("stage", pa.string(), "stage that rejected it, e.g. decode, reward.gsm8k, publish"),
    _f("error", pa.string(), "error text: what was wrong and what was expected"),
    _f("key", pa.binary(), "Kafka key of the bad record", nullable=True),
    _f("value", pa.binary(), "original bytes (or the bad row as JSON)", nullable=True, unit="bytes"),
    _f("headers", pa.list_(HEADER), "original Kafka headers", nullable=True),
])

SCHEMAS: dict[str, pa.Schema] = {
    "prompts": PROMPTS,
    "rollouts": ROLLOUTS,
    "rewards": REWARDS,
    "ref_logprobs": REF_LOGPROBS,
    "teacher_logprobs": TEACHER_LOGPROBS,
    "train_samples": TRAIN_SAMPLES,
    "weights": WEIGHTS,
    "metrics": METRICS,
    "progress": PROGRESS,
    "reward_changes": REWARD_CHANGES,
    "errors": ERRORS,
}
"""Every v1 schema by name (the value of the ``relax-schema`` Kafka header)."""


def get_schema(name: str) -> pa.Schema:
    """The v1 schema called ``name``.

    Raises:
        KeyError: listing the valid names.
    """
    try:
        return SCHEMAS[name]
    except KeyError:
        raise KeyError(f"unknown schema {name!r}; valid: {', '.join(SCHEMAS)}") from None


def schema_name(schema: pa.Schema) -> str | None:
    """The ``relax.schema`` name stored in a schema's metadata, or None."""
    meta = schema.metadata or {}
    raw = meta.get(b"relax.schema")
    return raw.decode() if raw else None
