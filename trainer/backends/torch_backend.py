"""The ``torch`` trainer back end: a Hugging Face causal LM, AdamW, gradient
accumulation over micro-batches, gradient clipping, DDP when several processes.

Log-probs of the response tokens come from :func:`relax.trainer.logprobs.head_logprobs`
(the same temperature-scaled computation the rollout engines use, public case
C12). Only real response tokens go through the LM head, ``trainer.logits_chunk_tokens``
at a time (checkpointed, so the backward too holds one chunk's logits): the ``[B, R,
vocab]`` logits, on a 135M model with a 49k vocabulary most of the memory of a step,
are never whole. With ``trainer.packing`` a micro-batch's rows run packed end to end in
one row (:func:`packed_hidden`) instead of padded.
``trainer.gradient_checkpointing`` recomputes each decoder layer in the backward
(:mod:`relax.trainer.checkpointing`: the shared prompt's key/value cache is a
``PrefixCache``, safe to replay); ``trainer.lora`` trains peft adapters only and publishes
and saves merged weights (:mod:`relax.trainer.lora`).

Each micro-batch loss is normalised by the global token/sequence counts of the
step, so gradients are summed over micro-batches (no division by the number of
accumulation steps, public case C06); with DDP (which averages) the loss is
multiplied by the world size to keep the sum.

Data parallelism (``torch.distributed`` initialised, see
:mod:`relax.trainer.distributed`): each rank trains on its own rows of the global
batch. The differentiable forward goes through a ``DistributedDataParallel``
wrapper of :class:`ResponseLogprobs` (DDP only all-reduces after a backward whose
forward it ran), inside ``no_sync()`` for every micro-batch but the last, so the
gradients are all-reduced once per optimizer step. Ranks may hold different numbers
of micro-batches (or none): they first agree on the largest count and a rank that
runs out does zero-weight passes on a one-token :func:`idle_batch` (loss mask 0:
exact zero gradient), so every rank takes part in the same collectives. Metrics are
summed over the ranks, so every rank reports the figures of the whole batch.
With ``data_parallel: fsdp2`` the module is sharded instead of wrapped
(:mod:`relax.trainer.backends.fsdp`): same steps, a fraction of the memory per rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

import relax.trainer.backends.fsdp as fsdp
from relax.trainer.backends.step import (
    adamw,
    add_metrics,
    fill_missing_grads,
    freeze,
    micro_batch_loss,
    set_learning_rate,
    to_device,
)
from relax.trainer.batching import MicroBatch, packed_row
from relax.trainer import checkpointing, lora
from relax.trainer.checkpointing import PrefixCache
from relax.trainer.families import family_of
from relax.trainer.multimodal import cache_arg, media_inputs_of
from relax.trainer.config import TrainerConfig
from relax.trainer.logprobs import CHUNK_TOKENS, head_logprobs
from relax.trainer.losses.aggregate import mask_counts

log = logging.getLogger(__name__)


def response_hidden(model, mb: MicroBatch) -> torch.Tensor:
    """``[B, R, H]`` hidden states that predict each response token (before the LM head),
    the prompt computed once per group.

    The U distinct prompts (left-padded) go through the decoder once with a key/value
    cache; the cache is expanded to the B rows (``prompt_of_row``) and the responses run
    on top of it. Response token 0 is predicted by the prompt's last hidden state, token
    t by the response's position t-1. Gradients flow through the shared cache into the
    prompt pass, summed over the group's rows: the same values and gradients as a full
    forward of every (prompt, response) row, for ``~U x P + B x R`` instead of
    ``B x (P + R)`` tokens. Only response positions go through the LM head. With
    ``mb.media_inputs`` (a multimodal model) the prompt pass runs the model's multimodal
    trunk with them, so the shared cache holds the image or audio features as the
    rollout's prefill did; ``mb.response_media_inputs`` (media a multi-turn environment
    returned) go through the response pass the same way.
    """
    if mb.media_inputs or mb.response_media_inputs:  # the multimodal trunk: media
        base = model.model                              # features replace placeholders
    else:
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    family = family_of(model.config)
    if mb.response_media_inputs and not family.later_media:
        raise ValueError(f"{family.name}: the response pass does not take media a later turn "
                         "added (multimodal RoPE positions over the whole row are not built)")
    # [U, P] (or [3, U, P] multimodal RoPE) and the [U, 1] offset of later tokens
    ppos, delta = family.positions(model, mb.prompt_ids, mb.prompt_mask, mb.media_inputs or {})
    cache = PrefixCache(model.config)  # replay-safe: see relax.trainer.checkpointing
    out = base(input_ids=mb.prompt_ids, attention_mask=mb.prompt_mask, position_ids=ppos,
               use_cache=True, **{cache_arg(base): cache}, **(mb.media_inputs or {}))
    last = out.last_hidden_state[:, -1]                       # [U, H] (left padding)
    rows = mb.prompt_of_row
    cache = cache.selected(rows)
    p_len = mb.prompt_mask.sum(-1)[rows]                      # [B]
    r = mb.response_ids.shape[1]
    rpos = (p_len + delta[rows, 0])[:, None] + torch.arange(r, device=p_len.device)[None, :]
    attn = torch.cat([mb.prompt_mask[rows], mb.response_mask], dim=1)
    hr = base(input_ids=mb.response_ids, attention_mask=attn, position_ids=rpos,
              use_cache=True, **{cache_arg(base): cache},
              **(mb.response_media_inputs or {})).last_hidden_state  # [B, R, H]
    return torch.cat([last[rows][:, None, :], hr[:, :-1]], dim=1)


def response_logits(model, mb: MicroBatch) -> torch.Tensor:
    """``[B, R, V]`` logits that predict each response token: the LM head over
    :func:`response_hidden` at once (the unchunked reference of :class:`ResponseLogprobs`)."""
    return model.get_output_embeddings()(response_hidden(model, mb))


def packed_hidden(model, mb: MicroBatch) -> torch.Tensor:
    """``[n, H]`` hidden states that predict the real response tokens of ``mb`` (row-major
    over ``response_mask``), from one forward of its rows packed end to end
    (:func:`relax.trainer.batching.packed_row`): no attention mask and no cache, so
    transformers derives a block-diagonal causal mask from the restarting position ids
    and no token attends across rows. Text models only (no media inputs)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    row = packed_row(mb)
    h = base(input_ids=row.input_ids, position_ids=row.position_ids, attention_mask=None,
             use_cache=False).last_hidden_state[0]          # [N, H]
    return h[row.predict_at]


class ResponseLogprobs(torch.nn.Module):
    """The differentiable forward of a micro-batch as a module, so that a
    ``DistributedDataParallel`` (or FSDP2) wrapper runs it: ``forward(mb, with_entropy)``
    -> ``([B, R] float32 log-probs, [B, R] float32 entropy or None)`` of the response
    tokens, 0 at padding. Hidden states come from :func:`response_hidden` (padded rows,
    shared prompts) or, with ``packing``, :func:`packed_hidden` (a micro-batch with media
    keeps the padded path); only the real response tokens go through the LM head,
    ``chunk_tokens`` at a time (:func:`relax.trainer.logprobs.head_logprobs`)."""

    def __init__(self, model: torch.nn.Module, chunk_tokens: int = CHUNK_TOKENS,
                 packing: bool = False):
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.packing = packing

    def forward(self, mb: MicroBatch, with_entropy: bool = False):
        valid = mb.response_mask.bool()
        if self.packing and not (mb.media_inputs or mb.response_media_inputs):
            h = packed_hidden(self.model, mb)
        else:
            h = response_hidden(self.model, mb)[valid]
        lp, ent = head_logprobs(h, self.model.get_output_embeddings(), mb.targets[valid],
                                mb.temperature, chunk_tokens=self.chunk_tokens,
                                with_entropy=with_entropy)

        def padded(x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(valid.shape, dtype=x.dtype, device=x.device).masked_scatter(
                valid, x)

        return padded(lp), padded(ent) if ent is not None else None


def idle_batch(temperature: float = 1.0) -> MicroBatch:
    """A one-row micro-batch (one prompt token, one response token) with loss mask 0: the
    pass a rank runs when it has no micro-batch left, so that it takes part in the step's
    collectives. Its loss is exactly 0 and so is its gradient (masked values are selected
    out with ``torch.where``, never multiplied)."""
    one = torch.ones((1, 1), dtype=torch.int64)
    zero = torch.zeros((1, 1), dtype=torch.float32)
    return MicroBatch(prompt_ids=one.clone(), prompt_mask=one.clone(),
                      prompt_of_row=torch.zeros(1, dtype=torch.int64),
                      response_ids=one.clone(), response_mask=one.clone(),
                      loss_mask=zero.clone(), advantages=zero.clone(),
                      rollout_logprobs=zero.clone(), ref_logprobs=zero.clone(),
                      temperature=temperature, rollout_ids=[])


class TorchBackend:
    """Holds the model and optimizer of the trainer.

    With a ``torch.distributed`` process group initialised before it is built
    (:func:`relax.trainer.distributed.init_data_parallel`), the back end is one
    data-parallel rank: DDP broadcasts rank 0's weights at construction, every rank
    must call :meth:`train_step` for every step (with its own micro-batches, possibly
    none) and ends the step with the same weights; only rank 0 should :meth:`save`.

    Args:
        cfg: trainer configuration.
        device: torch device (default: cuda if available, else cpu); with nccl, the
            rank's GPU (what ``init_data_parallel`` returns).
        model: an already loaded model (tests); default: ``load_model(cfg.model)`` with
            ``cfg.dtype`` parameters.
    """

    def __init__(self, cfg: TrainerConfig, device: str | None = None, model=None):
        from relax.trainer.models import load_model, load_processor

        self.cfg = cfg
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch.manual_seed(cfg.seed)
        self.model = (model if model is not None
                      else load_model(cfg.model, dtype=getattr(torch, cfg.dtype))).to(self.device)
        self.model.train()
        if cfg.freeze:
            left = freeze(self.model, cfg.freeze)
            log.info("trainer.freeze %s: %d parameters left to train", list(cfg.freeze), left)
        self.lora = lora.apply(self.model, cfg.lora) if cfg.lora is not None else None
        self._lora_scales = lora.scales(self.model) if self.lora is not None else {}
        if cfg.gradient_checkpointing:
            checkpointing.enable(self.model)
        self.processor = load_processor(cfg.model)
        if getattr(self.model.config, "final_logit_softcapping", None):
            raise ValueError(f"{cfg.model}: final logit soft-capping is not supported by "
                             f"response_logits")
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.module: torch.nn.Module = ResponseLogprobs(self.model, cfg.logits_chunk_tokens,
                                                        cfg.packing)
        self.fsdp = self.world_size > 1 and cfg.data_parallel == "fsdp2"
        if self.fsdp:
            self._broadcast_tensors(0)  # FSDP2 shards what each rank holds
            fsdp.shard(self.module, fsdp.decoder_layers(self.model), self.device)
        elif self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            # buffers (rotary inv_freq) are deterministic: no broadcast at every forward
            self.module = DistributedDataParallel(self.module, broadcast_buffers=False)
        self.optimizer = adamw([p for p in self.model.parameters() if p.requires_grad],
                               cfg.optim)
        self.steps_done = 0
        # FSDP2: rank 0's unsharded weights (and optimizer state when gathered), refreshed
        # by collectives every rank takes part in
        self._full = fsdp.full_model_state(self.module) if self.fsdp else None
        self._full_optimizer: dict | None = None
        self._loaded: tuple[dict, dict] | None = None

    def logprobs(self, mb: MicroBatch, with_entropy: bool = False):
        """``([B, R] log-probs, [B, R] entropy or None)`` of the response tokens under the
        current weights (differentiable; float32 for a float32 model). With DDP, a
        forward with grad enabled must be followed by a backward on every rank."""
        if mb.media and mb.media_inputs is None:
            of = functools.partial(media_inputs_of, self.processor, mb.media, self.cfg.model)
            mb = dataclasses.replace(mb, media_inputs=of(),
                                     response_media_inputs=of(mb.prompt_of_row))
        return self.module(to_device(mb, self.device), with_entropy=with_entropy)

    def train_step(self, mbs: list[MicroBatch], counts: tuple[int, int] | None = None,
                   gather_optimizer: bool = False) -> dict[str, float]:
        """One optimizer step over the micro-batches of a global batch.

        Args:
            mbs: this rank's micro-batches to run forward/backward on (may be empty).
            counts: ``(tokens, sequences)`` of this rank's rows the loss is normalised by
                (summed over ranks: the global counts); default: those of ``mbs``. Given
                when rows that cannot contribute were left out
                (:func:`relax.trainer.batching.informative_rows`).
            gather_optimizer: with FSDP2, also gather the optimizer state to rank 0
                after the step (every rank passes the same; a checkpoint follows).

        Returns:
            metrics: ``loss``, ``grad_norm``, ``lr``, ``train_s``, ``tokens_trained``,
            ``rows_computed`` and the loss metrics (``policy_loss``, ``ppo_kl``,
            ``clip_frac_*``, ``entropy``, ...), of the whole global batch (summed over
            ranks; ``train_s`` is this rank's).
        """
        t0 = time.perf_counter()
        if counts is None:
            per_mb = [mask_counts(mb.loss_mask) for mb in mbs]
            counts = (sum(c[0] for c in per_mb), sum(c[1] for c in per_mb))
        tokens, seqs = counts
        rows = sum(mb.response_ids.shape[0] for mb in mbs)
        passes = len(mbs)
        if self.world_size > 1:  # one collective: global counts and the longest rank
            mine = torch.tensor([tokens, seqs, rows, passes], dtype=torch.float64,
                                device=self.device)
            every = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(every, mine)
            every = torch.stack(every)
            tokens, seqs, rows = (int(x) for x in every[:, :3].sum(0))
            passes = int(every[:, 3].max())
        lr = set_learning_rate(self.optimizer, self.cfg.optim, self.steps_done)
        old = None
        if self.cfg.old_logprobs == "recompute":
            with torch.no_grad():
                old = [self.logprobs(mb)[0].detach() for mb in mbs]
                for _ in range(len(mbs), passes if self.fsdp else 0):  # same gathers
                    self.logprobs(idle_batch())
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"loss": 0.0, "policy_loss": 0.0}
        want_entropy = self.cfg.loss.entropy_coef != 0
        for i in range(passes):
            dmb = to_device(mbs[i] if i < len(mbs) else idle_batch(), self.device)
            last = i == passes - 1  # DDP all-reduces in the last backward only
            sync = self.module.no_sync() if self.world_size > 1 and not last and \
                not self.fsdp else contextlib.nullcontext()
            if self.fsdp:
                fsdp.set_gradient_sync(self.module, last)
            with sync:
                lp, ent = self.logprobs(dmb, with_entropy=want_entropy)
                loss, metrics = micro_batch_loss(
                    self.cfg, dmb, lp, ent, old[i] if old is not None and i < len(old) else None,
                    tokens, seqs)
                (loss * self.world_size).backward()
            add_metrics(sums, loss, metrics)
        if self.world_size > 1:  # same keys on every rank: same config, same pass count
            keys = sorted(sums)
            t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            sums = dict(zip(keys, t.tolist()))
        fill_missing_grads(self.model.parameters())  # rows left out contribute exact zeros
        clip = self.cfg.optim.grad_clip  # of the global (all-reduced) gradient
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              clip if clip > 0 else math.inf)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        self.optimizer.step()
        self.steps_done += 1
        if self.fsdp:
            self._full = fsdp.full_model_state(self.module)
            self._full_optimizer = (fsdp.full_optimizer_state(self.module, self.optimizer)
                                    if gather_optimizer else None)
        sums.update(grad_norm=float(norm), lr=lr, tokens_trained=float(tokens),
                    rows_computed=float(rows), train_s=time.perf_counter() - t0)
        return sums

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The weights to publish, ``{name: tensor}`` (detached views, no copy; with
        FSDP2 rank 0's unsharded copy from the last step, ``{}`` on the other ranks). With
        LoRA the merged weights under the base model's names (:func:`.lora.merged`: new
        tensors for the adapted layers)."""
        state = self._state()
        return lora.merged(state, self._lora_scales) if self.lora is not None and state \
            else state

    def _state(self) -> dict[str, torch.Tensor]:
        """The model's state dict (with LoRA: base layers and adapters), detached; with
        FSDP2 rank 0's unsharded copy."""
        if self.fsdp:
            return self._full
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save_model(self, folder: Path) -> None:
        """The model as HF safetensors + config in ``folder`` (rank 0). With FSDP2, from
        the unsharded copy, less tied duplicates (a tied LM head), as HF saves them. With
        LoRA, the merged model, one shard's layers merged at a time
        (:func:`~relax.trainer.lora.save_merged`), its config and generation config, and
        the adapter as peft saves it in ``folder/adapter``."""
        state = None
        if self.lora is not None:
            self._save_adapter(folder / lora.ADAPTER_DIR)
            state = self._state()
            if state:  # rank 0 (FSDP2's other ranks hold no unsharded copy)
                lora.save_merged(state, self._lora_scales, folder)
                self.model.config.architectures = [type(self.model).__name__]
                self.model.config.save_pretrained(folder)
                if self.model.can_generate():
                    self.model.generation_config.save_pretrained(folder)
            return
        if self.fsdp:
            own = {n for n, _ in self.model.named_parameters()}  # one name per tensor
            own |= {n for n, _ in self.model.named_buffers()}
            state = {k: v for k, v in self._full.items() if k in own}
        self.model.save_pretrained(folder, safe_serialization=True, state_dict=state)

    def _save_adapter(self, folder: Path) -> None:
        """The LoRA adapter as peft saves it (``adapter_model.safetensors``,
        ``adapter_config.json``) in ``folder`` (rank 0)."""
        self.lora.save_pretrained(folder, state_dict=lora.to_peft_names(self._state()))

    def save(self, folder: Path) -> None:
        """Model as HF safetensors + config (with LoRA only the adapter, in
        ``folder/adapter``), optimizer state as a torch file (local only, never on the
        bus), in ``folder``. Rank 0 only.

        Raises:
            RuntimeError: with FSDP2, the last step did not gather the optimizer state
                (``train_step(..., gather_optimizer=True)``).
        """
        folder.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            self._save_adapter(folder / lora.ADAPTER_DIR)
        else:
            self.save_model(folder)
        if self.fsdp and self._full_optimizer is None:
            raise RuntimeError("FSDP2: the optimizer state was not gathered by the last step "
                               "(train_step(gather_optimizer=True) before a checkpoint)")
        opt = self._full_optimizer if self.fsdp else self.optimizer.state_dict()
        torch.save({"optimizer": opt, "steps_done": self.steps_done}, folder / "optimizer.pt")

    def broadcast_state(self, src: int = 0) -> None:
        """Give every data-parallel rank rank ``src``'s weights, optimizer state and step
        count (after ``src`` alone restored a checkpoint). A collective: every rank calls
        it; a no-op without a process group of more than one rank."""
        if self.world_size == 1:
            return
        if self.fsdp:
            self._broadcast_fsdp_state()
            return
        self._broadcast_tensors(src)
        state = [{"optimizer": self.optimizer.state_dict(), "steps_done": self.steps_done}]
        dist.broadcast_object_list(state, src, device=self.device)
        if self.rank != src:
            self.optimizer.load_state_dict(state[0]["optimizer"])
            self.steps_done = int(state[0]["steps_done"])

    def _broadcast_tensors(self, src: int) -> None:
        with torch.no_grad():
            for t in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(t.data, src)

    def _broadcast_fsdp_state(self) -> None:
        """FSDP2's :meth:`broadcast_state`: rank 0's loaded checkpoint (if any) sharded to
        every rank, then the unsharded copy refreshed."""
        loaded = [self._loaded is not None]
        dist.broadcast_object_list(loaded, 0, device=self.device)
        if not loaded[0]:
            return
        model_state, opt = self._loaded if self.rank == 0 else (None, None)
        fsdp.load_full_state(self.module, self.optimizer, model_state,
                             None if opt is None else opt["optimizer"])
        steps = [None if opt is None else int(opt["steps_done"])]
        dist.broadcast_object_list(steps, 0, device=self.device)
        self.steps_done, self._loaded = steps[0], None
        self._full = fsdp.full_model_state(self.module)

    def load(self, folder: Path) -> None:
        """Restore model weights (with LoRA the adapter: the base weights are the model's
        own) and optimizer state saved by :meth:`save` (with FSDP2, rank 0 reads them and
        :meth:`broadcast_state` hands every rank its shards).

        Raises:
            ValueError: the checkpoint's tensors are not the model's (names them).
        """
        from safetensors.torch import load_file

        state = {}
        where = folder / lora.ADAPTER_DIR if self.lora is not None else folder
        for f in sorted(where.glob("*.safetensors")):
            state.update(load_file(f, device="cpu" if self.fsdp else str(self.device)))
        names = set(self.model.state_dict())
        if self.lora is not None:
            state = lora.from_peft_names(state)
            names = {k for k in names if lora.is_adapter(k)}
        missing, unexpected = names - set(state), set(state) - names
        tied = {k for k in missing if "lm_head" in k}
        if missing - tied or unexpected:
            raise ValueError(f"checkpoint {folder} does not match the model: missing "
                             f"{sorted(missing - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
        opt = torch.load(folder / "optimizer.pt", map_location="cpu" if self.fsdp else
                         self.device, weights_only=True)
        if self.fsdp:
            self._loaded = (state, opt)
            return
        self.model.load_state_dict(state, strict=False)
        self.optimizer.load_state_dict(opt["optimizer"])
        self.steps_done = int(opt["steps_done"])
