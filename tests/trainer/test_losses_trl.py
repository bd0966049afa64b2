"""Cross-check of relax's policy losses against TRL 1.16 ``GRPOTrainer._compute_loss``.

TRL is called without a model: a bare ``GRPOTrainer`` object (``object.__new__``)
gets the attributes ``_compute_loss`` reads and a stub
``_get_per_token_logps_and_entropies`` that returns our ``logprobs`` tensor, so
TRL's own loss code runs on exactly our inputs (one process, one accumulation
step). Values and gradients w.r.t. the log-probs must agree to 1e-6.

Convention mapping (TRL loss_type -> relax LossConfig):

* ``grpo``  -> ``ppo_clip`` + ``seq-mean-token-mean`` (global_seqs = B)
* ``bnpo``  -> ``ppo_clip`` + ``token-mean`` (global_tokens = tokens of this batch)
* ``dapo``  -> ``ppo_clip`` + ``token-mean`` (global_tokens = ``num_items_in_batch``)
* ``dr_grpo`` -> ``ppo_clip`` + ``seq-mean-token-sum-norm`` with divisor
  ``max_completion_length``
* ``sapo``  -> ``sapo`` + ``seq-mean-token-mean`` (same temperatures)
* ``cispo`` -> ``cispo`` with ``cispo_eps_high = epsilon_high - 1`` (TRL's
  epsilon_high is the absolute cap) and no floor, + ``token-mean``
* ``grpo`` with ``importance_sampling_level="sequence"`` (GSPO) -> ``gspo`` +
  ``seq-mean-token-mean``; ``luspo`` (sequence level) -> ``gspo`` + ``seq-mean-token-sum``
* ``beta > 0`` (TRL adds the unclamped k3 per token) -> ``kl_in="loss"``,
  ``kl_estimator="k3"``, ``kl_coef=beta`` (our verl clamps do not bind here)

TRL divides by ``current_gradient_accumulation_steps`` in the grpo/bnpo/dr_grpo
modes; relax instead divides by global counts, so the mapping holds with one
accumulation step (relax's micro-batch invariance is tested in test_losses.py).
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer

from relax.trainer.losses.aggregate import mask_counts
from relax.trainer.losses.config import LossConfig
from relax.trainer.losses.registry import compute_policy_loss

EPS_LOW, EPS_HIGH = 0.2, 0.28
CISPO_CAP = 1.2  # TRL epsilon_high for cispo (absolute cap); low enough to bind on these inputs
MAX_COMPLETION_LENGTH = 16


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(loss_type, level, logprobs, old, adv, mask, ref=None, beta=0.0,
             eps_high=EPS_HIGH):
    """TRL's loss and metrics on our tensors, with no model."""
    trainer = object.__new__(GRPOTrainer)
    trainer.loss_type, trainer.importance_sampling_level, trainer.beta = loss_type, level, beta
    trainer.epsilon_low, trainer.epsilon_high = EPS_LOW, eps_high
    trainer.args = SimpleNamespace(delta=None, sapo_temperature_pos=1.0,
                                   sapo_temperature_neg=1.05, use_bias_correction_kl=False,
                                   steps_per_generation=1)
    trainer.top_entropy_quantile = 1.0
    trainer.off_policy_mask_threshold = None
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = False
    trainer.model = SimpleNamespace(training=True)
    trainer._metrics = {"train": defaultdict(list)}
    trainer.current_gradient_accumulation_steps = 1
    trainer.accelerator = _Accelerator()
    trainer._entropy_bonus_enabled = trainer.aux_loss_enabled = False
    trainer.max_completion_length = MAX_COMPLETION_LENGTH
    trainer._get_per_token_logps_and_entropies = (
        lambda *args, **kwargs: (logprobs, torch.zeros_like(logprobs), None))
    b, tt = mask.shape
    inputs = {"prompt_ids": torch.zeros(b, 1, dtype=torch.long),
              "prompt_mask": torch.ones(b, 1, dtype=torch.long),
              "completion_ids": torch.zeros(b, tt, dtype=torch.long),
              "completion_mask": mask.long(), "advantages": adv, "old_per_token_logps": old,
              "num_items_in_batch": mask.sum().float()}
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    return trainer._compute_loss(None, inputs), trainer._metrics["train"]


def batch(seed, b=6, tt=9):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(b, tt, generator=g) * 3 - 0.01
    old = logprobs + torch.randn(b, tt, generator=g) * 0.3
    ref = logprobs + torch.randn(b, tt, generator=g) * 0.3
    adv = torch.randn(b, generator=g)
    lengths = torch.randint(1, tt + 1, (b,), generator=g)
    mask = (torch.arange(tt)[None, :] < lengths[:, None]).float()
    return logprobs, old, ref, adv, mask


CASES = {
    # id: (TRL loss_type, importance_sampling_level, beta, relax LossConfig fields)
    "grpo": ("grpo", "token", 0.0, {"loss_agg_mode": "seq-mean-token-mean"}),
    "bnpo": ("bnpo", "token", 0.0, {"loss_agg_mode": "token-mean"}),
    "dapo": ("dapo", "token", 0.0, {"loss_agg_mode": "token-mean"}),
    "dr_grpo": ("dr_grpo", "token", 0.0, {
        "loss_agg_mode": "seq-mean-token-sum-norm",
        "seq_mean_token_sum_norm_divisor": MAX_COMPLETION_LENGTH}),
    "sapo": ("sapo", "token", 0.0, {"policy_loss": "sapo", "loss_agg_mode": "seq-mean-token-mean",
                                    "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05}),
    "cispo": ("cispo", "token", 0.0, {"policy_loss": "cispo", "loss_agg_mode": "token-mean",
                                      "cispo_eps_high": CISPO_CAP - 1}),
    "gspo": ("grpo", "sequence", 0.0, {"policy_loss": "gspo",
                                       "loss_agg_mode": "seq-mean-token-mean"}),
    "luspo": ("luspo", "sequence", 0.0, {"policy_loss": "gspo",
                                         "loss_agg_mode": "seq-mean-token-sum"}),
    "grpo_kl": ("grpo", "token", 0.04, {"loss_agg_mode": "seq-mean-token-mean",
                                        "kl_in": "loss", "kl_estimator": "k3", "kl_coef": 0.04}),
    "dapo_kl": ("dapo", "token", 0.1, {"loss_agg_mode": "token-mean", "kl_in": "loss",
                                       "kl_estimator": "low_var_kl", "kl_coef": 0.1}),
}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_trl_value_and_gradient(case, seed):
    loss_type, level, beta, relax_cfg = CASES[case]
    logprobs, old, ref, adv, mask = batch(seed)
    eps_high = CISPO_CAP if loss_type == "cispo" else EPS_HIGH

    lp_trl = logprobs.clone().requires_grad_(True)
    trl_value, trl_metrics = trl_loss(loss_type, level, lp_trl, old, adv, mask,
                                      ref=ref if beta else None, beta=beta, eps_high=eps_high)
    trl_value.backward()

    cfg = LossConfig(clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, **relax_cfg)
    n_tok, n_seq = mask_counts(mask)
    lp = logprobs.clone().requires_grad_(True)
    value, metrics = compute_policy_loss(cfg, lp, old, adv, mask, ref_logprobs=ref,
                                         global_tokens=n_tok, global_seqs=n_seq)
    value.backward()

    assert value.item() == pytest.approx(trl_value.item(), abs=1e-6)
    torch.testing.assert_close(lp.grad, lp_trl.grad, atol=1e-6, rtol=1e-5)
    if level == "token" and loss_type in ("grpo", "bnpo", "dapo", "dr_grpo"):
        assert metrics["clip_frac_low"].item() == pytest.approx(
            trl_metrics["clip_ratio/low_mean"][-1], abs=1e-6)
        assert metrics["clip_frac_high"].item() == pytest.approx(
            trl_metrics["clip_ratio/high_mean"][-1], abs=1e-6)
    if loss_type == "cispo":
        assert metrics["is_clip_frac"].item() > 0  # the cap binds somewhere
    if beta and cfg.loss_agg_mode == "token-mean":  # TRL reports the KL as a token mean
        assert metrics["kl"].item() == pytest.approx(trl_metrics["kl"][-1], abs=1e-6)


def test_inputs_exercise_the_clip():
    logprobs, old, _, adv, mask = batch(0)
    _, metrics = trl_loss("bnpo", "token", logprobs, old, adv, mask)
    assert metrics["clip_ratio/low_mean"][-1] > 0 and metrics["clip_ratio/high_mean"][-1] > 0
