"""PPO's critic: a value model trained in the trainer process, and the GAE advantages of
each step's batch (``advantage.estimator: gae``, ``trainer.critic``).

Design: the critic lives inside the trainer process, as in veRL (``RayPPOTrainer.fit``:
``compute_values`` on the batch right before the update, then ``compute_advantage``,
``update_critic``, ``update_actor``). Each step, on rank 0, before the policy's update
and over exactly the rows of the step's batch (like the batch estimators of
:mod:`relax.trainer.advantage.batch`):

1. the critic's forward gives ``V(s_t)`` for every response token (``[B, R]``, the
   hidden state that predicts token ``t`` through a one-output head);
2. per-token rewards: the row's final ``reward`` on its last loss token
   (:func:`~relax.trainer.advantage.gae.outcome_token_rewards`), minus ``kl_coef x KL``
   per loss token with ``kl: {in: reward}`` (:func:`~relax.trainer.losses.kl.kl_in_reward`,
   rollout against reference log-probs, veRL's ``apply_kl_penalty``);
3. GAE advantages and returns (:func:`~relax.trainer.advantage.gae.gae_advantages`,
   ``gamma``, ``lam``), the advantages whitened over the batch's loss tokens
   (:func:`~relax.trainer.advantage.gae.masked_whiten`) and written into the groups'
   ``advantages`` column, which the policy loss reads as it reads any estimator's;
4. the critic's update on the clipped value loss to the returns
   (:func:`~relax.trainer.losses.registry.compute_value_loss`, ``trainer.critic.loss``: token-mean
   over the batch's loss tokens by default), gradients accumulated over micro-batches,
   its own AdamW. The update's first forward is step 1's: one critic forward per
   micro-batch, not two. With
   ``updates > 1`` the later passes are clipped around step 1's values.

Why here and not a ``critic`` stage writing ``<run>.values`` (the issue's first
proposal): values come from the current critic (no staleness for values, whatever the
policy's staleness: GAE in async mode is GAE of stale rollouts with fresh values, as
veRL's async trainers do), there is no second weight channel, topic, join or restart
path to build, and on this machine (CPU, a few GiB per run) the critic's forward costs
what it would cost in another process while saving one process and one copy of the
batch on the bus. What a separate stage would add, left for later: its own devices
(the critic's forward and update overlapping the policy's step instead of adding to
it), scaling the critic apart from the policy, and values computed ahead
asynchronously (at the price of value staleness).

The value model is transformers' ``AutoModelForTokenClassification(num_labels=1)`` of the
policy's model (its backbone initialised from the same weights), its head set to 0 (the
first values are 0: the first step's returns are the rewards). It runs only on rank 0
of the trainer, over the whole batch before the batch is scattered to the ranks; it is
saved with every checkpoint (``critic/``: the model as transformers saves it, and
``optimizer.pt``) and next to the final model (``<run_dir>/critic``). With
``trainer.gradient_checkpointing`` its layers are checkpointed too; its gradients are freed
after its step, before the policy's. Text models only: the critic's forward has no media
inputs.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from relax.schemas import metric_names as M
from relax.trainer import checkpointing
from relax.trainer.advantage.gae import gae_advantages, masked_whiten, outcome_token_rewards
from relax.trainer.backends.step import adamw, set_learning_rate, to_device
from relax.trainer.backends.torch_backend import response_hidden
from relax.trainer.batching import MicroBatch, list_column, micro_batches
from relax.trainer.config import TrainerConfig
from relax.trainer.losses.aggregate import mask_counts
from relax.trainer.losses.kl import kl_in_reward
from relax.trainer.losses.registry import KL_ESTIMATORS, compute_value_loss

log = logging.getLogger(__name__)


def load_value_model(name_or_path: str) -> torch.nn.Module:
    """``AutoModelForTokenClassification(num_labels=1)`` of a built-in name, folder or Hub
    id, float32, its head's weight and bias 0 (a folder saved by :meth:`Critic.save` is
    loaded by :meth:`Critic.load`, not here).

    Raises:
        ValueError: from transformers, for a model type with no token-classification class.
    """
    from transformers import AutoModelForTokenClassification

    from relax.trainer.models import model_path

    model = AutoModelForTokenClassification.from_pretrained(
        model_path(name_or_path), num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        for p in value_head(model).parameters():
            p.zero_()
    return model


def value_head(model: torch.nn.Module) -> torch.nn.Module:
    """The one-output head of a token-classification model (``score`` for Llama, Qwen,
    Mistral; ``classifier`` for others)."""
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if head is None:
        raise ValueError(f"{type(model).__name__}: no score/classifier head")
    return head


class Critic:
    """The value model, its optimizer and the GAE of a batch (module docstring).

    Args:
        cfg: trainer configuration with ``cfg.critic`` set.
        device: torch device (default: cuda if available, else cpu).
        model: an already built value model (tests); default: :func:`load_value_model`
            of ``cfg.model``.

    Raises:
        ValueError: ``cfg.critic`` is None.
    """

    def __init__(self, cfg: TrainerConfig, device: str | None = None, model=None):
        if cfg.critic is None:
            raise ValueError("Critic needs trainer.critic (advantage.estimator: gae)")
        self.cfg, self.critic = cfg, cfg.critic
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = (model if model is not None else load_value_model(cfg.model)).to(self.device)
        self.model.train()
        if cfg.gradient_checkpointing:  # the policy's setting holds for its critic too
            checkpointing.enable(self.model)
        self.head = value_head(self.model)
        self.optimizer = adamw(list(self.model.parameters()), self.critic.optim)
        self.steps_done = 0

    def values(self, mb: MicroBatch) -> torch.Tensor:
        """``[B, R]`` float32 ``V(s_t)`` of each response token (the state before it), 0
        at padding; differentiable when grad is enabled."""
        mb = to_device(mb, self.device)
        v = self.head(response_hidden(self.model, mb)).squeeze(-1).float()
        return torch.where(mb.response_mask.bool(), v, torch.zeros_like(v))

    def token_rewards(self, mb: MicroBatch, rewards: torch.Tensor) -> torch.Tensor:
        """``[B, R]`` float32 rewards per token: ``rewards`` (``[B]``, the rows' final
        rewards) on each row's last loss token, minus ``kl_coef x KL`` on the loss tokens
        when ``kl_coef > 0``.

        Raises:
            ValueError: ``kl_coef > 0`` and the micro-batch has no ref_logprobs."""
        mask = mb.loss_mask.bool()
        out = outcome_token_rewards(rewards, mask)
        if self.critic.kl_coef > 0:
            if mb.ref_logprobs is None:
                raise ValueError("trainer.critic.kl_coef > 0 needs ref_logprobs on the train "
                                 "samples (advantage.ref_logprobs: true)")
            name = "k3" if self.critic.kl_estimator == "low_var_kl" else self.critic.kl_estimator
            kl = KL_ESTIMATORS[name](mb.rollout_logprobs, mb.ref_logprobs)
            out = kl_in_reward(out, torch.where(mask, kl, torch.zeros_like(kl)), mask,
                               self.critic.kl_coef)
        return out

    def step(self, groups: list[pa.Table]) -> tuple[list[pa.Table], dict[str, float]]:
        """Values, GAE and one critic update (``updates`` optimizer steps) on a batch.

        Args:
            groups: the step's batch, one ``train_samples`` table per group (``reward``
                float32, per-token ``loss_mask``, ``logprobs``, ``ref_logprobs``).

        Returns:
            ``(groups with their advantages column replaced by the (whitened) GAE
            advantages, metrics)``: ``value_loss`` (token-mean, before the update),
            ``vf_clip_frac`` (of the last pass), ``value_mean``, ``return_mean``,
            ``critic_grad_norm`` (first update), ``critic_lr``, ``critic_s``.
        """
        t0 = time.perf_counter()
        c = self.critic
        mbs = micro_batches(groups, self.cfg.max_tokens_per_microbatch)
        reward_of = {rid: r for g in groups for rid, r in zip(
            g.column("rollout_id").to_pylist(), g.column("reward").to_numpy())}
        tokens = sum(mask_counts(mb.loss_mask)[0] for mb in mbs)
        seqs = sum(mask_counts(mb.loss_mask)[1] for mb in mbs)
        lr = set_learning_rate(self.optimizer, c.optim, self.steps_done)
        old, adv, ret = [], [], []
        sums = {"value_loss": 0.0, "vf_clip_frac": 0.0, "value_mean": 0.0, "return_mean": 0.0}
        norm0 = 0.0
        for update in range(c.updates):
            self.optimizer.zero_grad(set_to_none=True)
            clip_sum = 0.0
            for i, mb in enumerate(mbs):
                v = self.values(mb)
                mask = mb.loss_mask.to(self.device).bool()
                if update == 0:
                    r = torch.as_tensor(np.asarray([reward_of[x] for x in mb.rollout_ids],
                                                   np.float32))
                    a, R = gae_advantages(self.token_rewards(mb, r).to(self.device),
                                          v.detach(), mask, gamma=c.gamma, lam=c.lam)
                    old.append(v.detach())
                    adv.append(a)
                    ret.append(R)
                    sums["value_mean"] += float(v.detach()[mask].sum())
                    sums["return_mean"] += float(R[mask].sum())
                loss, m = compute_value_loss(c.loss, v, old[i], ret[i], mask,
                                             global_tokens=tokens, global_seqs=seqs)
                loss.backward()
                clip_sum += float(m["vf_clip_frac"])
                if update == 0:
                    sums["value_loss"] += float(m["value_loss"])
            clip = c.optim.grad_clip
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                  clip if clip > 0 else math.inf)
            if update == 0:
                norm0 = float(norm)
            self.optimizer.step()
            sums["vf_clip_frac"] = clip_sum
        self.optimizer.zero_grad(set_to_none=True)  # not held through the policy's step
        self.steps_done += 1
        out = self._with_advantages(groups, mbs, adv)
        metrics = {M.VALUE_LOSS: sums["value_loss"], M.VF_CLIP_FRAC: sums["vf_clip_frac"],
                   M.VALUE_MEAN: sums["value_mean"] / max(1, tokens),
                   M.RETURN_MEAN: sums["return_mean"] / max(1, tokens),
                   M.CRITIC_GRAD_NORM: norm0, M.CRITIC_LR: lr,
                   M.CRITIC_S: time.perf_counter() - t0}
        return out, metrics

    def _with_advantages(self, groups: list[pa.Table], mbs: list[MicroBatch],
                         adv: list[torch.Tensor]) -> list[pa.Table]:
        """``groups`` with the advantages of ``adv`` (per micro-batch ``[B, R]``),
        whitened over every loss token of the batch when ``whiten``."""
        masks = [mb.loss_mask.to(self.device).bool() for mb in mbs]
        if self.critic.whiten and mbs:
            flat = torch.cat([a[m] for a, m in zip(adv, masks)])[None, :]
            white = masked_whiten(flat, torch.ones_like(flat, dtype=torch.bool))[0]
            adv = [torch.zeros_like(a) for a in adv]
            start = 0
            for a, m in zip(adv, masks):
                n = int(m.sum())
                a[m] = white[start:start + n]
                start += n
        row_adv = {}
        for mb, a in zip(mbs, adv):
            lengths = mb.response_mask.sum(-1).tolist()
            for b, rid in enumerate(mb.rollout_ids):
                row_adv[rid] = a[b, :lengths[b]].cpu().numpy()
        out = []
        for g in groups:
            ids = g.column("rollout_id").to_pylist()
            lengths = pc.list_value_length(g.column("response_ids")).to_numpy(
                zero_copy_only=False)
            values = np.concatenate([row_adv[x] for x in ids]) if ids else np.zeros(0)
            i = g.schema.get_field_index("advantages")
            out.append(g.set_column(i, g.schema.field(i),
                                    list_column(values.astype(np.float32), lengths,
                                                pa.float32())))
        return out

    def save(self, folder: Path) -> None:
        """The value model as transformers saves it (``AutoModelForTokenClassification``
        loads it) and ``optimizer.pt`` (AdamW state, steps done) in ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(folder, safe_serialization=True)
        torch.save({"optimizer": self.optimizer.state_dict(), "steps_done": self.steps_done},
                   folder / "optimizer.pt")

    def load(self, folder: Path) -> None:
        """Restore the weights and optimizer state :meth:`save` wrote.

        Raises:
            FileNotFoundError: ``folder`` holds no critic (a checkpoint of a run without
                ``trainer.critic``).
            RuntimeError: its tensors are not the value model's (torch's strict load).
        """
        from safetensors.torch import load_file

        folder = Path(folder)
        files = sorted(folder.glob("*.safetensors"))
        if not files or not (folder / "optimizer.pt").exists():
            raise FileNotFoundError(f"{folder}: no critic (model safetensors and optimizer.pt) "
                                    "in this checkpoint; was the run started without "
                                    "advantage.estimator: gae?")
        state = {}
        for f in files:
            state.update(load_file(f, device=str(self.device)))
        self.model.load_state_dict(state, strict=True)
        opt = torch.load(folder / "optimizer.pt", map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(opt["optimizer"])
        self.steps_done = int(opt["steps_done"])
