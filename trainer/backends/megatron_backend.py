"""The ``megatron`` trainer back end: megatron-core's GPTModel with tensor and pipeline
parallelism, the same policy loss, optimizer and published weights as the ``torch`` back
end.

``trainer.backend: megatron`` with ``trainer.megatron: {tp, pp}`` runs ``tp * pp``
trainer processes (``resources.trainer.processes``; :mod:`relax.trainer.ranks` starts
them, rank 0 reads the batches). Every rank builds the same HF model, keeps its TP shard
of its pipeline stage's layers in a megatron-core ``GPTModel`` (:mod:`.megatron_model`,
:mod:`.megatron_convert`) and gets the *whole* global batch (model parallelism splits
the model, not the data). Each step:

* the micro-batches pass through the pipeline stages in 1F1B order
  (:mod:`.megatron_pipeline`; with ``pp`` 1 simply one forward and backward after the
  other); the last stage takes the response log-probs from the vocab-parallel logits
  (megatron-core's ``vocab_parallel_cross_entropy``) and the same
  :func:`.step.micro_batch_loss` as the torch back end; backward runs through
  megatron-core's TP layers (their all-reduces are gloo on the CPU, nccl on GPUs);
* with ``pp > 1`` a tied model's embedding (first stage) and output layer copy (last
  stage) get their summed gradient (megatron-core's embedding group all-reduce);
* the global gradient norm counts each TP-split tensor once per shard (sum of squares
  all-reduced over the TP group, then over the pipeline group) and each replicated one
  (the RMSNorm weights) once, the tied copy not at all, and clips like
  ``torch.nn.utils.clip_grad_norm_``;
* torch's fused AdamW on each rank's shard (:func:`.step.adamw`; AdamW is element-wise,
  so the step is the one the torch back end takes on the whole tensor);
* rank 0 gathers the shards into HF names and shapes (vocabulary padding dropped):
  :meth:`named_tensors` is what the weight channel publishes, so an engine cannot tell
  which back end trained. With ``gather_optimizer`` the AdamW moments are gathered the
  same way: a checkpoint is the torch back end's format (HF safetensors + config) with
  the moments stored by HF name, loadable at any TP and PP size.

On the CPU, :func:`.megatron_cpu.redirect_cuda_to_cpu` is applied first. Megatron's
distributed optimizer is not built: each rank's AdamW steps its own shard.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from relax.trainer.backends.megatron_convert import (
    Layout,
    from_stages,
    hf_to_megatron,
    megatron_to_hf,
    replicated,
    stage_layers,
    to_stage,
)
from relax.trainer.backends.megatron_gather import gather_pp, gather_tp, stage_shapes
from relax.trainer.backends.megatron_pipeline import Link, forward_schedule, train_schedule
from relax.trainer.backends.step import (
    adamw,
    add_metrics,
    fill_missing_grads,
    micro_batch_loss,
    set_learning_rate,
    to_device,
)
from relax.trainer.batching import MicroBatch
from relax.trainer.config import TrainerConfig
from relax.trainer.losses.aggregate import mask_counts

MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW state tensors, each shaped like its parameter."""


class MegatronBackend:
    """Holds this rank's megatron-core model shard and its optimizer.

    Every rank calls :meth:`train_step` with the same micro-batches; only rank 0's
    :meth:`named_tensors` holds the gathered weights and only rank 0 should :meth:`save`.

    Args:
        cfg: trainer configuration (``cfg.megatron``: tp, pp).
        device: ignored on the CPU; with CUDA the rank's GPU (what
            :func:`relax.trainer.distributed.init_data_parallel` returns; default
            ``"cuda"``).
        model: an already loaded HF model (tests); default ``load_model(cfg.model)``
            (float32). The megatron-core model is built in this model's dtype.

    Raises:
        ValueError: a process count other than ``tp * pp``, a model family or setting
            the back end does not build (:func:`.megatron_model.transformer_config`), a TP
            size the query groups do not allow, a PP size the layers do not divide by.
        ImportError: megatron-core is not installed (``pip install .[megatron]``).
    """

    def __init__(self, cfg: TrainerConfig, device: str | None = None, model=None):
        from megatron.core import parallel_state

        from relax.streams.ports import free_port
        from relax.trainer.backends.megatron_cpu import redirect_cuda_to_cpu
        from relax.trainer.backends.megatron_model import build_gpt
        from relax.trainer.distributed import init_data_parallel
        from relax.trainer.models import load_model

        self.cfg = cfg
        tp, pp = cfg.megatron.tp, cfg.megatron.pp
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != tp * pp:
            raise ValueError(f"trainer.megatron tp={tp} x pp={pp} needs {tp * pp} trainer "
                             f"processes (resources.trainer.processes), got {world}")
        cpu = redirect_cuda_to_cpu()
        self.device = torch.device("cpu" if cpu else (device or "cuda"))
        if not dist.is_initialized():  # megatron-core needs a process group, even of one
            init_data_parallel(0, 1, master_port=free_port())
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                     pipeline_model_parallel_size=pp)
        if not cpu:  # the RNG streams megatron-core forks around attention dropout
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(cfg.seed)
        self.tp, self.pp, self.world_size = tp, pp, world
        self.rank = parallel_state.get_tensor_model_parallel_rank()
        self._group = parallel_state.get_tensor_model_parallel_group()
        self.link = Link(parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None,
                         self.device)
        torch.manual_seed(cfg.seed)
        hf = model if model is not None else load_model(cfg.model)
        self.layout = Layout.from_hf_config(hf.config)
        self.layout.check(tp)
        stage_layers(self.layout, pp, 0)
        self.dtype = next(hf.parameters()).dtype
        # megatron-core's parameters take the dtype of the model given (fp32 from
        # load_model; a bf16 model trains in bf16, as the torch back end does)
        self.gpt = build_gpt(hf.config, tp, self.dtype, pp, self.link.stage,
                             recompute=cfg.gradient_checkpointing).to(self.device)
        shards = hf_to_megatron({k: v.detach() for k, v in hf.state_dict().items()},
                                self.layout, tp)
        self._load_shard(to_stage(shards[self.rank], self.layout, pp, self.link.stage))
        self._stage_shapes = stage_shapes(shards, self.layout, pp)
        self._tied_copy = ({"output_layer.weight"} if self.layout.tied and pp > 1
                           and self.link.last else set())
        self._hf = hf if dist.get_rank() == 0 else None  # config and save_pretrained
        self.pad_id = hf.get_input_embeddings().padding_idx  # no gradient from its lookups
        self.gpt.train()
        self.optimizer = adamw(self.gpt.parameters(), cfg.optim)
        self.steps_done = 0
        self._params = dict(self.gpt.named_parameters())
        self._sharded = {n for n in self._params if not replicated(n)}
        self._full = self._gather({n: p.detach() for n, p in self._params.items()})
        self._full_optimizer: dict | None = None
        self._loaded: tuple[dict, dict] | None = None

    # ------------------------------------------------------------ shards <-> HF
    def _shard(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part (its TP shard of its pipeline stage) of an HF state dict."""
        return to_stage(hf_to_megatron(hf, self.layout, self.tp)[self.rank], self.layout,
                        self.pp, self.link.stage)

    def _load_shard(self, shard: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.gpt.load_state_dict(shard, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"megatron shard does not match the GPTModel: missing "
                             f"{missing[:5]}, unexpected {unexpected[:5]}")

    def _gather(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's ``{megatron name: tensor}`` -> rank 0 gets the HF dict of the whole
        model (:func:`megatron_to_hf`); the other ranks get ``{}``. A collective: over
        each stage's TP group to its TP rank 0, then over the pipeline group to rank 0."""
        shards = gather_tp(local, self._group, self.tp)
        if self.rank != 0:
            return {}
        parts = gather_pp(shards, self.link, self._stage_shapes, self.dtype)
        if dist.get_rank() != 0:
            return {}
        return megatron_to_hf([from_stages([p[r] for p in parts], self.layout)
                               for r in range(self.tp)], self.layout)

    def _moments(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{moment: {megatron name: this rank's tensor}}`` of the AdamW state."""
        out: dict[str, dict[str, torch.Tensor]] = {m: {} for m in MOMENTS}
        for name, p in self._params.items():
            st = self.optimizer.state.get(p)
            for m in MOMENTS:
                out[m][name] = st[m] if st else torch.zeros_like(p)
        return out

    # ------------------------------------------------------------------- step
    def logprobs(self, mb: MicroBatch, with_entropy: bool = False):
        """``([B, R] log-probs, [B, R] entropy or None)``, float32, of the response tokens
        under the current weights, on every rank (a collective). Differentiable with
        ``pp`` 1; with ``pp > 1`` a forward-only pass through the pipeline, the last
        stage's values broadcast over the pipeline group."""
        mb = to_device(mb, self.device)
        if self.pp == 1:
            return self._through(mb, None, with_entropy)
        got = forward_schedule(self.link, [self._shape(mb)], self.dtype,
                               lambda i, x: self._through(mb, x, with_entropy))
        b, r = mb.response_ids.shape
        out = got[0] if got else (torch.empty(b, r, device=self.device),
                                  torch.empty(b, r, device=self.device) if with_entropy else None)
        for t in out:
            if t is not None:
                dist.broadcast(t, self.link.ranks[-1], group=self.link.group)
        return out

    def _shape(self, mb: MicroBatch) -> tuple[int, int, int]:
        """``[S, B, H]`` of the activations micro-batch ``mb`` passes between stages."""
        b, s = mb.response_ids.shape[0], mb.prompt_ids.shape[1] + mb.response_ids.shape[1]
        return s, b, self.gpt.config.hidden_size

    def _through(self, mb: MicroBatch, x: torch.Tensor | None, with_entropy: bool):
        """This stage's forward of ``mb`` (``x``: the previous stage's ``[S, B, H]`` output,
        None on the first): the activations to send on, or on the last stage
        ``([B, R] log-probs, [B, R] entropy or None)``."""
        from relax.trainer.backends.megatron_model import (
            head_logits,
            row_sequences,
            stage_hidden,
            vocab_parallel_entropy,
            vocab_parallel_logprobs,
        )

        ids, p_len = row_sequences(mb)
        hidden = stage_hidden(self.gpt, ids, x, self.pad_id)
        if not self.link.last:
            return hidden
        logits = head_logits(self.gpt, hidden, p_len, mb.response_ids.shape[1],
                             self.layout.vocab)
        lp = vocab_parallel_logprobs(logits, mb.targets, mb.temperature)
        ent = vocab_parallel_entropy(logits, mb.temperature) if with_entropy else None
        return lp, ent

    def _clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient L2 norm (module docstring), gradients scaled by
        ``min(1, max_norm / (norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_`` does."""
        grads = {n: p.grad for n, p in self._params.items() if p.grad is not None}
        sq = [g.float().pow(2).sum() for n, g in grads.items()
              if n in self._sharded and n not in self._tied_copy]
        split = torch.stack(sq).sum() if sq else torch.zeros((), device=self.device)
        if self.tp > 1:
            dist.all_reduce(split, group=self._group)
        rep = [g.float().pow(2).sum() for n, g in grads.items() if n not in self._sharded]
        total = split + (torch.stack(rep).sum() if rep else 0.0)
        if self.pp > 1:
            dist.all_reduce(total, group=self.link.group)
        norm = total.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads.values():
            g.mul_(coef.to(g.dtype))
        return norm

    def train_step(self, mbs: list[MicroBatch], counts: tuple[int, int] | None = None,
                   gather_optimizer: bool = False) -> dict[str, float]:
        """One optimizer step over the micro-batches of a global batch (the same on every
        TP rank).

        Args:
            mbs: the global batch's micro-batches.
            counts: ``(tokens, sequences)`` the loss is normalised by (the largest over the
                ranks is used: rank 0 alone may be given them); default: those of ``mbs``.
            gather_optimizer: also gather the AdamW moments to rank 0 (a checkpoint
                follows; every rank passes the same).

        Returns:
            the torch back end's metrics (``loss``, ``grad_norm``, ``lr``, ``train_s``,
            ``tokens_trained``, ``rows_computed``, the loss metrics), the same on every rank.

        Raises:
            RuntimeError: the ranks were given different numbers of micro-batches.
        """
        t0 = time.perf_counter()
        if counts is None:
            per_mb = [mask_counts(mb.loss_mask) for mb in mbs]
            counts = (sum(c[0] for c in per_mb), sum(c[1] for c in per_mb))
        tokens, seqs = counts
        if self.world_size > 1:
            t = torch.tensor([tokens, seqs, len(mbs), -len(mbs)], dtype=torch.float64,
                             device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            tokens, seqs = int(t[0]), int(t[1])
            if int(t[2]) != len(mbs) or -int(t[3]) != len(mbs):
                raise RuntimeError(f"model-parallel ranks hold different batches: "
                                   f"{len(mbs)} micro-batches here, {int(t[2])} elsewhere")
        lr = set_learning_rate(self.optimizer, self.cfg.optim, self.steps_done)
        dmbs = [to_device(mb, self.device) for mb in mbs]
        shapes = [self._shape(mb) for mb in dmbs]
        old = None
        if self.cfg.old_logprobs == "recompute":
            old = [lp for lp, _ in forward_schedule(
                self.link, shapes, self.dtype, lambda i, x: self._through(dmbs[i], x, False))]
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"loss": 0.0, "policy_loss": 0.0}
        want_entropy = self.cfg.loss.entropy_coef != 0

        def forward(i: int, x: torch.Tensor | None) -> torch.Tensor:
            out = self._through(dmbs[i], x, want_entropy)
            if not self.link.last:
                return out
            lp, ent = out
            loss, metrics = micro_batch_loss(self.cfg, dmbs[i], lp, ent,
                                             None if old is None else old[i], tokens, seqs)
            add_metrics(sums, loss, metrics)
            return loss

        train_schedule(self.link, shapes, self.dtype, forward)
        fill_missing_grads(self.gpt.parameters())
        if self.pp > 1:
            sums = self._end_pipeline_step(sums)
        clip = self.cfg.optim.grad_clip
        norm = self._clip_grad_norm(clip if clip > 0 else math.inf)
        self.optimizer.step()
        self.steps_done += 1
        self._full = self._gather({n: p.detach() for n, p in self._params.items()})
        self._full_optimizer = ({m: self._gather(d) for m, d in self._moments().items()}
                                if gather_optimizer else None)
        sums.update(grad_norm=float(norm), lr=lr, tokens_trained=float(tokens),
                    rows_computed=float(sum(mb.response_ids.shape[0] for mb in mbs)),
                    train_s=time.perf_counter() - t0)
        return sums

    def _end_pipeline_step(self, sums: dict[str, float]) -> dict[str, float]:
        """With ``pp > 1``: a tied model's embedding and its last-stage copy get their
        summed gradient (over megatron-core's embedding group); the last stage's metric
        sums, returned on every rank of the pipeline group."""
        from megatron.core import parallel_state

        if self.layout.tied and (self.link.first or self.link.last):
            name = "embedding.word_embeddings.weight" if self.link.first else \
                "output_layer.weight"
            dist.all_reduce(self._params[name].grad, group=parallel_state.get_embedding_group())
        box = [sums]
        dist.broadcast_object_list(box, self.link.ranks[-1], group=self.link.group,
                                   device=self.device)
        return box[0]

    # ------------------------------------------------------ weights and checkpoints
    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The weights to publish in HF names and shapes, ``{name: tensor}`` (rank 0's
        gathered copy from the last step; ``{}`` on the other ranks)."""
        return self._full

    def save_model(self, folder: Path) -> None:
        """The model as HF safetensors + config in ``folder`` (rank 0)."""
        self._hf.load_state_dict(self._full, strict=False)
        self._hf.save_pretrained(folder, safe_serialization=True)

    def save(self, folder: Path) -> None:
        """HF model + ``optimizer.pt`` (AdamW moments by HF name, ``steps_done``) in
        ``folder``. Rank 0 only.

        Raises:
            RuntimeError: with more than one rank, the last step did not gather the moments
                (``train_step(..., gather_optimizer=True)``).
        """
        folder.mkdir(parents=True, exist_ok=True)
        self.save_model(folder)
        moments = self._full_optimizer
        if moments is None and self.world_size == 1:
            moments = {m: self._gather(d) for m, d in self._moments().items()}
        if moments is None:
            raise RuntimeError("megatron: the optimizer state was not gathered by the last "
                               "step (train_step(gather_optimizer=True) before a checkpoint)")
        torch.save({"optimizer": {"by_hf_name": moments}, "steps_done": self.steps_done},
                   folder / "optimizer.pt")

    def load(self, folder: Path) -> None:
        """Read a checkpoint saved by :meth:`save` (rank 0; :meth:`broadcast_state`
        gives every rank its shards; with tp 1 it is applied at once).

        Raises:
            ValueError: the checkpoint's tensors are not the model's, or its optimizer
                state is not in this back end's format (names what differs).
        """
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            state.update(load_file(f, device="cpu"))
        if self.layout.tied:
            state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
        missing, unexpected = set(self._full) - set(state), set(state) - set(self._full)
        if missing or unexpected:
            raise ValueError(f"checkpoint {folder} does not match the model: missing "
                             f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        opt = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
        if "by_hf_name" not in opt["optimizer"]:
            raise ValueError(f"{folder}/optimizer.pt: not a megatron back end checkpoint "
                             f"(AdamW moments by HF name); it was saved by another back end")
        self._loaded = (state, opt)
        if self.world_size == 1:
            self.broadcast_state()

    def broadcast_state(self, src: int = 0) -> None:
        """Give every TP rank its shards of rank 0's loaded checkpoint (if any): weights,
        AdamW moments, step count. A collective: every rank calls it."""
        loaded = [self._loaded]
        if self.world_size > 1:
            dist.broadcast_object_list(loaded, src, device=self.device)
        if loaded[0] is None:
            return
        state, opt = loaded[0]
        self._load_shard(self._shard(state))
        steps = int(opt["steps_done"])
        moments = {m: self._shard(d) for m, d in opt["optimizer"]["by_hf_name"].items()}
        for name, p in self._params.items():
            self.optimizer.state[p] = {"step": torch.tensor(float(steps), device=p.device),
                                       **{m: moments[m][name].to(p.device, copy=True)
                                          for m in MOMENTS}}
        self.steps_done, self._loaded = steps, None
        self._full = self._gather({n: p.detach() for n, p in self._params.items()})
