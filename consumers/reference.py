"""The reference stage: per-token log-probs of each rollout's response under a reference model.

Consumes ``<run>.rollouts`` in consumer group ``<run>.reference`` and writes
``<run>.ref_logprobs`` (keyed by group_id, co-partitioned with the rollouts), one row
per rollout: ``ref_logprobs[t] = log softmax(logits_t / T)[response_ids[t]]`` with the
rollout's own temperature ``T``, computed by :func:`relax.trainer.logprobs.token_logprobs`
(the function the rollout engine and the trainer use: public case C12), for every
response token (environment tokens of multi-turn rollouts included; the loss mask
decides later which count).

Batching: rows of one delivery with the same temperature are packed with the prompt
left-padded and the response right-padded, so every response starts at the same
column, and only the real response tokens' hidden states go through the LM head, in
chunks (:func:`relax.trainer.logprobs.head_logprobs`). Attention mask and position ids come from the lengths, never
from token values (public case C24: pad id == EOS id). Batches are capped at
``max_batch_tokens`` padded tokens.

The model is frozen (``ref_policy_version`` 0) unless ``follow_every`` = N > 0: then
the stage subscribes to the weight broadcast and, between deliveries, installs the
newest received version once it is at least N versions newer than the one in use.

Delivery: :func:`relax.streams.stage.process_once` (at-least-once; a rollout whose token
ids fall outside the vocabulary goes to ``<run>.rollouts.errors``).

The same stage with ``role: teacher`` is the teacher of on-policy distillation: its own
model (frozen: it follows no weights), consumer group ``<run>.teacher``, and it writes
``<run>.teacher_logprobs`` (``teacher_logprobs``, ``teacher_model``). Its log-probs come
from the same function at the same positions as the student's (the logits that predict
each response token, with the rollout's temperature), so ``logprobs - teacher_logprobs``
is the per-token reverse-KL estimate the aggregator subtracts from the advantage
(:mod:`relax.trainer.advantage.distill`). The teacher must share the student's tokenizer
(token ids outside its vocabulary go to the error topic).
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa
import torch

from relax.consumers.reference_config import ReferenceConfig
from relax.schemas import topics
from relax.schemas.v1 import SCHEMAS
from relax.schemas.validate import validate
from relax.streams.client import BusConfig
from relax.streams.stage import RecordError, StageStats, process_once
from relax.streams.stage_contract import (Declaration, Hooks, Input, OutTopic, Stage, Wiring,
                                          run_stage)
from relax.trainer.families import family_of
from relax.trainer.logprobs import CHUNK_TOKENS, head_logprobs, token_logprobs
from relax.trainer.multimodal import media_inputs, stack_media


@torch.no_grad()
def response_logprobs(
    model, prompts: list[list[int]], responses: list[list[int]], temperature: float,
    media_inputs: dict[str, torch.Tensor] | None = None, chunk_tokens: int = CHUNK_TOKENS,
) -> list[list[float]]:
    """Log-probs of each response given its prompt, from ``logits / temperature``.

    Only the real response tokens go through the LM head, ``chunk_tokens`` at a time
    (:func:`relax.trainer.logprobs.head_logprobs`; 0 = all at once), so the ``[B, R,
    vocab]`` logits are never whole (a model with final logit soft-capping takes its
    own ``logits`` instead).

    Args:
        model: a causal LM (a transformers model; ``logits_to_keep`` used where taken).
        prompts: ``[B][P_b]`` prompt token ids (non-empty).
        responses: ``[B][R_b]`` response token ids.
        temperature: > 0.
        media_inputs: a multimodal model's inputs of every row's media, in the order they
            stand in the rows (:func:`relax.trainer.multimodal.stack_media`), or None.
        chunk_tokens: response tokens per LM-head chunk.

    Returns:
        ``[B][R_b]`` float log-probs (nats).

    Raises:
        ValueError: an empty prompt or a token id outside the vocabulary.
    """
    if not prompts:
        return []
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    for b, (p, r) in enumerate(zip(prompts, responses)):
        if not p:
            raise ValueError(f"row {b}: empty prompt")
        bad = [t for t in p + r if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"row {b}: token id {bad[0]} outside the vocabulary [0, {vocab})")
    p_len = torch.tensor([len(p) for p in prompts], device=device)
    r_len = torch.tensor([len(r) for r in responses], device=device)
    pmax, rmax = int(p_len.max()), int(r_len.max())
    if rmax == 0:
        return [[] for _ in prompts]
    width = pmax + rmax
    ids = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, pmax - len(p) : pmax] = torch.tensor(p, device=device)
        if r:
            ids[b, pmax : pmax + len(r)] = torch.tensor(r, device=device)
    col = torch.arange(width, device=device)[None, :]
    start = (pmax - p_len)[:, None]
    attn = ((col >= start) & (col < pmax + r_len[:, None])).long()  # from lengths (C24)
    # 1-D positions, or a multimodal-RoPE family's [3, B, T] (relax.trainer.families)
    pos, _ = family_of(model.config).positions(model, ids, attn, media_inputs or {})
    if getattr(model.config, "final_logit_softcapping", None):  # logits past the LM head
        logits = model(
            input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=rmax + 1,
            **(media_inputs or {}),
        ).logits[:, -(rmax + 1):-1]  # predicts cols pmax.. (all kept where not supported)
        lp = token_logprobs(logits, ids[:, pmax:], temperature)
        return [lp[b, : len(r)].tolist() for b, r in enumerate(responses)]
    base = model.model if media_inputs else model.get_decoder()
    hidden = base(input_ids=ids, attention_mask=attn, position_ids=pos,
                  **(media_inputs or {})).last_hidden_state[:, pmax - 1:-1]  # predicts pmax..
    valid = col[:, :rmax] < r_len[:, None]                    # [B, rmax] real responses
    lp, _ = head_logprobs(hidden[valid], model.get_output_embeddings(), ids[:, pmax:][valid],
                          temperature, chunk_tokens=chunk_tokens)
    lp = lp.tolist()
    out, at = [], 0
    for r in responses:
        out.append(lp[at:at + len(r)])
        at += len(r)
    return out


def _batches(rows: list[dict], max_batch_tokens: int):
    """Indices of rows grouped by temperature, each batch under ``max_batch_tokens``
    padded tokens (a longer row goes alone)."""
    by_t: dict[float, list[int]] = {}
    for i, r in enumerate(rows):
        by_t.setdefault(float(r["temperature"]), []).append(i)
    for t, idx in by_t.items():
        batch, pmax, rmax = [], 0, 0
        for i in idx:
            p, r = len(rows[i]["prompt_ids"]), len(rows[i]["response_ids"])
            np_, nr = max(pmax, p), max(rmax, r)
            if batch and (len(batch) + 1) * (np_ + nr) > max_batch_tokens:
                yield t, batch
                batch, np_, nr = [], p, r
            batch.append(i)
            pmax, rmax = np_, nr
        if batch:
            yield t, batch


def ref_batch(
    model, rows: list[dict], ref_policy_version: int, max_batch_tokens: int = 4096,
    processor=None,
) -> pa.RecordBatch:
    """REF_LOGPROBS rows for ROLLOUTS rows (validated); ``processor``: a multimodal
    model's, for rows with media.

    Raises:
        ValueError: see :func:`response_logprobs`; rows with media and no processor.
    """
    return _batch(rows, _logprobs(model, rows, max_batch_tokens, processor), "ref_logprobs",
                  {"ref_policy_version": ref_policy_version})


def teacher_batch(model, rows: list[dict], teacher_model: str,
                  max_batch_tokens: int = 4096, processor=None) -> pa.RecordBatch:
    """TEACHER_LOGPROBS rows for ROLLOUTS rows (validated): the teacher's log-probs of
    each response, ``[len(response_ids)]`` float32 nats per row (``processor`` as for
    :func:`ref_batch`).

    Raises:
        ValueError: see :func:`ref_batch`.
    """
    return _batch(rows, _logprobs(model, rows, max_batch_tokens, processor),
                  "teacher_logprobs",
                  {"teacher_model": teacher_model})


def _batch(rows: list[dict], logprobs: list[list[float]], schema: str,
           extra: dict) -> pa.RecordBatch:
    """Rows of ``schema`` (whose log-prob column has the schema's name), validated."""
    batch = pa.RecordBatch.from_pylist(
        [{"rollout_id": r["rollout_id"], "group_id": r["group_id"], schema: lp, **extra}
         for r, lp in zip(rows, logprobs)], schema=SCHEMAS[schema])
    validate(batch, schema)
    return batch


def _logprobs(model, rows: list[dict], max_batch_tokens: int, processor=None
              ) -> list[list[float]]:
    """:func:`response_logprobs` of every row, batched by temperature and size; rows
    with media get their inputs from ``processor`` (a multimodal model's).

    Raises:
        ValueError: rows with media and no ``processor``.
    """
    out: list[list[float] | None] = [None] * len(rows)
    for t, idx in _batches(rows, max_batch_tokens):
        media = [rows[i].get("media") for i in idx]
        inputs = None
        if any(media):
            if processor is None:
                raise ValueError("rows carry media but the model takes no images or audio")
            inputs = stack_media([media_inputs(processor, m) for m in media])
        lps = response_logprobs(
            model, [rows[i]["prompt_ids"] for i in idx], [rows[i]["response_ids"] for i in idx], t,
            inputs)
        for i, lp in zip(idx, lps):
            out[i] = lp
    return out


class ReferenceStage(Stage):
    """One reference instance on the stage contract
    (:mod:`relax.streams.stage_contract`): ``ReferenceStage(cfg, bus).run(should_stop)``.

    Args:
        cfg: the settings.
        bus: bus settings.
        model: a loaded model to use instead of loading ``cfg.model``.
    """

    kind = "reference"
    config_type = ReferenceConfig

    def __init__(self, cfg: ReferenceConfig, bus: BusConfig, model=None):
        from relax.trainer.models import load_model, load_processor

        self.cfg, self.bus = cfg, bus
        device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = model if model is not None else load_model(cfg.model, device=device)
        self.processor = load_processor(cfg.model)
        self.model.eval()
        self.version = 0
        self.rollouts = topics.run_topic(cfg.run, topics.ROLLOUTS)
        self.out_topic = topics.run_topic(
            cfg.run, topics.TEACHER_LOGPROBS if cfg.role == "teacher" else topics.REF_LOGPROBS)
        self.stats = StageStats()
        self.w: Wiring | None = None
        self._subscriber = None

    def declare(self) -> Declaration:
        """Reads ``<run>.rollouts`` (which must exist) in consumer group ``<run>.<role>``;
        writes ``<run>.ref_logprobs`` (or ``<run>.teacher_logprobs``) co-partitioned with
        it, and ``<run>.rollouts.errors``."""
        cfg = self.cfg
        return Declaration(
            run=cfg.run, component=cfg.member_id, producer_id=f"{cfg.run}-{cfg.member_id}",
            input=Input((self.rollouts,), topics.group(cfg.run, cfg.role),
                        stage=f"{cfg.role}/{cfg.member_id}", from_beginning=cfg.from_beginning,
                        must_exist=True),
            outputs=(OutTopic(self.out_topic),))

    def handle(self, delivery) -> list[tuple[str, pa.RecordBatch]]:
        """Stage function: ref log-probs of one delivery's rollouts.

        Raises:
            relax.streams.stage.RecordError: a row the model cannot score.
        """
        rows = delivery.table.to_pylist()
        try:
            if self.cfg.role == "teacher":
                batch = teacher_batch(self.model, rows, self.cfg.model,
                                      self.cfg.max_batch_tokens, self.processor)
            else:
                batch = ref_batch(self.model, rows, self.version, self.cfg.max_batch_tokens,
                                  self.processor)
        except ValueError as e:
            raise RecordError(f"{self.cfg.role}/{self.cfg.member_id}: {e}") from e
        return [(self.out_topic, batch)]

    def maybe_follow(self) -> bool:
        """Install the newest received policy weights if they are ``follow_every``
        versions newer than the ones in use, or older (a trainer restarted from an older
        checkpoint: the branch in use was lost); True if installed."""
        sub = self._subscriber
        if sub is None:
            return False
        sub.poll(0)
        if sub.version is None or 0 <= sub.version - self.version < self.cfg.follow_every:
            return False
        applied = sub.apply(self.model)
        if applied is None:
            return False
        self.version = applied
        return True

    def build(self, w: Wiring) -> None:
        """Join the weight broadcast when ``follow_every`` > 0."""
        from relax.streams.weights.subscriber import WeightSubscriber

        self.w = w
        if self.cfg.follow_every:
            self._subscriber = WeightSubscriber(
                self.bus, self.cfg.run, member_id=self.cfg.member_id,
                rendezvous=self.cfg.weights_rendezvous,
                device=next(self.model.parameters()).device).start()

    def turn(self) -> int:
        """One :func:`relax.streams.stage.process_once` turn with :meth:`handle`; returns
        the deliveries handled."""
        cfg = self.cfg
        return process_once(self.w.consumer, self.w.producer, self.handle,
                            stage=f"{cfg.role}/{cfg.member_id}",
                            poll_timeout_s=cfg.poll_timeout_s, stats=self.stats)

    def hooks(self) -> Hooks:
        """Before each turn, install newer weights (:meth:`maybe_follow`)."""
        return Hooks(before=self.maybe_follow)

    def close(self) -> None:
        """Leave the weight broadcast."""
        if self._subscriber is not None:
            self._subscriber.close()

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> StageStats:
        """Consume, score, produce and commit until ``should_stop()``
        (:func:`relax.streams.stage_contract.run_stage`); returns the counters.

        Raises:
            ValueError: ``<run>.rollouts`` does not exist.
        """
        return run_stage(self, should_stop)
