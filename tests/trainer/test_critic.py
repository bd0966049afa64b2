"""PPO's critic in the trainer (trainer/critic.py): values, GAE advantages fed to the
policy loss, the critic's update, its checkpoint; and the recipe keys that turn it on."""

from __future__ import annotations

import copy

import numpy as np
import pyarrow as pa
import pytest
import torch
from testdata import RECIPES, tiny_model, train_sample_table

from relax.infra.recipe.recipe import RecipeError, load_recipe
from relax.schemas import metric_names as M
from relax.trainer import checkpoint
from relax.trainer.advantage.gae import gae_advantages, masked_whiten, outcome_token_rewards
from relax.trainer.backends.torch_backend import TorchBackend
from relax.trainer.batching import collate, micro_batches
from relax.trainer.config import CriticConfig, OptimConfig, TrainerConfig
from relax.trainer.critic import Critic, load_value_model, value_head
from relax.trainer.ledger import Ledger
from relax.trainer.step_batch import step_batch


def value_model():
    """A tiny random ``LlamaForTokenClassification`` (num_labels 1), head 0, the trunk of
    :func:`testdata.tiny_model`."""
    from transformers import LlamaForTokenClassification

    config = copy.deepcopy(tiny_model().config)
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        m = LlamaForTokenClassification(config).to(torch.float32)
    with torch.no_grad():
        for p in value_head(m).parameters():
            p.zero_()
    return m


def config(**critic) -> TrainerConfig:
    return TrainerConfig(model="tiny-llama", max_tokens_per_microbatch=40, critic=CriticConfig(
        **{"optim": OptimConfig(lr=2e-3), **critic}))


def batch(holes: bool = True) -> list[pa.Table]:
    """3 groups of 4 rows of random lengths, rewards 0/1; with ``holes`` a loss_mask with a
    masked token inside some responses (tool output) and one fully masked row."""
    t = train_sample_table(3, response_len=(2, 7), seed=3)
    if holes:
        masks = t.column("loss_mask").to_pylist()
        for i, m in enumerate(masks):
            if len(m) > 3 and i % 2:
                m[1] = 0
        masks[5] = [0] * len(masks[5])
        i = t.schema.get_field_index("loss_mask")
        t = t.set_column(i, t.schema.field(i), pa.array(masks, t.schema.field(i).type))
    gids = t.column("group_id").to_pylist()
    return [t.filter(pa.array([g == x for g in gids])) for x in dict.fromkeys(gids)]


def test_values_are_per_response_token_and_zero_at_padding():
    critic = Critic(config(), model=value_model())
    with torch.no_grad():
        value_head(critic.model).weight.fill_(0.3)  # nonzero values
    mb = micro_batches(batch(), 4096)[0]
    v = critic.values(mb)
    assert v.shape == mb.response_ids.shape and v.dtype == torch.float32
    pad = ~mb.response_mask.bool()
    assert pad.any() and (v[pad] == 0).all()
    assert (v[~pad] != 0).all()


def test_value_model_starts_from_the_policy_weights_with_a_zero_head():
    from relax.trainer.models import load_model

    critic_model = load_value_model("tiny-llama")
    policy = load_model("tiny-llama")
    trunk = critic_model.base_model.state_dict()
    for k, v in policy.get_decoder().state_dict().items():
        assert torch.equal(trunk[k], v), k
    assert all((p == 0).all() for p in value_head(critic_model).parameters())


def test_one_critic_step_lowers_the_value_loss_on_a_fixed_batch():
    critic = Critic(config(), model=value_model())
    groups = batch()
    losses = [critic.step(groups)[1][M.VALUE_LOSS] for _ in range(3)]
    # zero head: the first loss is 0.5 * mean(return^2) over loss tokens (gamma = lam = 1:
    # the row's reward on each of its loss tokens)
    rows = pa.concat_tables(groups)
    mask = np.concatenate([np.asarray(m, bool) for m in rows.column("loss_mask").to_pylist()])
    rew = np.concatenate([np.full(len(m), r) for m, r in zip(
        rows.column("loss_mask").to_pylist(), rows.column("reward").to_pylist())])
    assert losses[0] == pytest.approx(0.5 * float(np.mean(rew[mask] ** 2)), rel=1e-5)
    assert losses[1] < losses[0] and losses[2] < losses[1], losses


def test_gae_advantages_fed_to_the_policy_loss_equal_gae_py_on_the_same_values():
    cfg = config(gamma=0.9, lam=0.8)
    critic = Critic(cfg, model=value_model())
    groups = batch()
    critic.step(groups)  # a nonzero head: values differ per token
    before = copy.deepcopy(critic.model)
    prepared = step_batch(groups, cfg, critic)
    assert prepared.metrics[M.VALUE_LOSS] > 0 and M.VF_CLIP_FRAC in prepared.metrics
    # expected: gae.py on the values of the critic as it was before this step
    ref = Critic(cfg, model=before)
    mbs = micro_batches(groups, cfg.max_tokens_per_microbatch)
    assert len(mbs) > 1  # whitening spans micro-batches
    reward = {r: x for g in groups for r, x in zip(g.column("rollout_id").to_pylist(),
                                                     g.column("reward").to_pylist())}
    adv, masks, ids = [], [], []
    with torch.no_grad():
        for mb in mbs:
            mask = mb.loss_mask.bool()
            rows = torch.tensor([reward[r] for r in mb.rollout_ids])
            a, _ = gae_advantages(outcome_token_rewards(rows, mask), ref.values(mb), mask,
                                  gamma=0.9, lam=0.8)
            adv.append(a[mask])
            masks.append(mask)
            ids.append(mb.rollout_ids)
    white = masked_whiten(torch.cat(adv)[None], torch.ones(1, sum(len(a) for a in adv)))[0]
    expected, start = {}, 0
    for mask, rids in zip(masks, ids):
        full = torch.zeros(mask.shape)
        full[mask] = white[start:start + int(mask.sum())]
        start += int(mask.sum())
        for b, rid in enumerate(rids):
            expected[rid] = full[b]
    # what the policy loss reads: the micro-batches of the trained rows
    trained = collate(pa.concat_tables(prepared.trained))
    assert len(trained.rollout_ids) == sum(g.num_rows for g in groups) - 1  # all-masked row
    for b, rid in enumerate(trained.rollout_ids):
        n = int(trained.response_mask[b].sum())
        torch.testing.assert_close(trained.advantages[b, :n], expected[rid][:n],
                                   atol=1e-5, rtol=1e-5)
    got = torch.cat([trained.advantages[trained.loss_mask.bool()]])
    assert abs(float(got.mean())) < 0.2 and float(got.std()) > 0.5  # whitened


def test_kl_in_reward_is_per_token_on_the_loss_tokens():
    critic = Critic(config(kl_coef=0.5, kl_estimator="k1"), model=value_model())
    t = batch()[0]
    ref = [[x - 0.25 for x in lp] for lp in t.column("logprobs").to_pylist()]
    i = t.schema.get_field_index("ref_logprobs")
    t = t.set_column(i, t.schema.field(i), pa.array(ref, t.schema.field(i).type))
    mb = collate(t)
    rewards = torch.tensor(t.column("reward").to_pylist())
    got = critic.token_rewards(mb, rewards)
    mask = mb.loss_mask.bool()
    want = outcome_token_rewards(rewards, mask) - torch.where(mask, 0.5 * 0.25, 0.0)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        critic.token_rewards(collate(batch()[0]), rewards)


def test_checkpoint_round_trip_restores_the_critic_and_its_optimizer(tmp_path):
    cfg = config(updates=2)
    backend = TorchBackend(cfg, device="cpu", model=tiny_model())
    critic = Critic(cfg, model=value_model())
    groups = batch()
    critic.step(groups)
    folder = checkpoint.save(tmp_path, backend, checkpoint.TrainerState(1), Ledger(),
                             critic=critic)
    assert (folder / checkpoint.CRITIC_DIR / "optimizer.pt").exists()
    other = Critic(cfg, model=value_model())
    checkpoint.load(folder, TorchBackend(cfg, device="cpu", model=tiny_model()), other)
    assert other.steps_done == 1
    for (k, a), b in zip(critic.model.state_dict().items(), other.model.state_dict().values()):
        assert torch.equal(a, b), k
    # the same next step: weights, Adam moments and the lr schedule all came back
    m1, m2 = critic.step(groups)[1], other.step(groups)[1]
    assert m1[M.VALUE_LOSS] == m2[M.VALUE_LOSS] and m1[M.VF_CLIP_FRAC] == m2[M.VF_CLIP_FRAC]
    for a, b in zip(critic.model.parameters(), other.model.parameters()):
        assert torch.equal(a, b)
    # a checkpoint without a critic says so
    plain = checkpoint.save(tmp_path / "plain", backend, checkpoint.TrainerState(1), Ledger())
    with pytest.raises(FileNotFoundError, match="no critic"):
        checkpoint.load(plain, backend, other)


def test_step_batch_with_a_critic_config_needs_the_critic():
    with pytest.raises(ValueError, match="needs the critic's values"):
        step_batch(batch(), config())


def test_recipe_gae_turns_the_critic_on_and_routes_its_keys():
    base = [f"run=x", "advantage.estimator=gae"]
    r = load_recipe(RECIPES / "tiny_ci.yaml", [*base, "advantage.estimator_options={gamma: 0.99, lam: 0.95}",
                                               "trainer.critic.optim.lr=3e-5"])
    c = r.trainer.critic
    assert (c.gamma, c.lam, c.optim.lr, c.loss.clip_range) == (0.99, 0.95, 3e-5, 0.5)
    r = load_recipe(RECIPES / "tiny_ci.yaml", [*base, "kl={coef: 0.01, in: reward, estimator: k3}"])
    assert (r.trainer.critic.kl_coef, r.trainer.critic.kl_estimator) == (0.01, "k3")
    assert r.advantage.kl_in_reward_coef == 0 and r.advantage.ref_logprobs
    assert r.reference.enabled
    assert load_recipe(RECIPES / "tiny_ci.yaml", ["run=x"]).trainer.critic is None
    with pytest.raises(RecipeError, match="not options of gae"):
        load_recipe(RECIPES / "tiny_ci.yaml", [*base, "advantage.estimator_options={eps: 1}"])
    with pytest.raises(RecipeError, match="on exactly when advantage.estimator is gae"):
        load_recipe(RECIPES / "tiny_ci.yaml", ["run=x", "trainer.critic={updates: 2}"])


def test_gradient_checkpointing_gives_the_critic_the_same_values_and_gradients():
    model = value_model()
    with torch.no_grad():
        value_head(model).weight.fill_(0.3)
    plain = Critic(config(), model=copy.deepcopy(model))
    cfg = config().model_copy(update={"gradient_checkpointing": True})
    ckpt = Critic(cfg, model=copy.deepcopy(model))
    mb = micro_batches(batch(), 4096)[0]
    va, vb = plain.values(mb), ckpt.values(mb)
    assert torch.equal(va, vb)
    va.sum().backward()
    vb.sum().backward()
    for (name, p), q in zip(plain.model.named_parameters(), ckpt.model.parameters()):
        assert torch.equal(p.grad, q.grad), name
