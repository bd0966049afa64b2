"""The torch back end on the tiny model: logprobs as the shared function computes them,
gradients independent of the micro-batch split (C06), a step changes the weights,
save/load round trip."""

from __future__ import annotations

import pytest
import torch
from testdata import train_sample_table

from relax.streams.codec import group_by_key
from relax.trainer.backends.torch_backend import TorchBackend, response_logits
from relax.trainer.batching import micro_batches
from relax.trainer.config import TrainerConfig
from relax.trainer.logprobs import token_logprobs


@pytest.fixture(scope="module")
def tiny():
    from relax.trainer.models import load_model

    return load_model("tiny-llama")


def _grads(backend, mbs):
    backend.optimizer.zero_grad()
    from relax.trainer.losses.aggregate import mask_counts
    from relax.trainer.losses.registry import compute_policy_loss

    counts = [mask_counts(mb.loss_mask) for mb in mbs]
    tokens, seqs = sum(c[0] for c in counts), sum(c[1] for c in counts)
    total = 0.0
    for mb in mbs:
        lp, _ = backend.logprobs(mb)
        loss, _ = compute_policy_loss(backend.cfg.loss, lp, mb.rollout_logprobs, mb.advantages,
                                      mb.loss_mask, global_tokens=tokens, global_seqs=seqs)
        loss.backward()
        total += float(loss.detach())
    return total, [p.grad.clone() for p in backend.model.parameters() if p.grad is not None]


def _row_by_row(model, t, temperature=1.0):
    """Reference: each (prompt, response) row alone through the full model, no padding."""
    out = []
    for r in t.to_pylist():
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        p, n = len(r["prompt_ids"]), len(r["response_ids"])
        logits = model(input_ids=ids).logits[:, p - 1:p - 1 + n]
        out.append(token_logprobs(logits, torch.tensor([r["response_ids"]]), temperature)[0])
    return out


def test_shared_prefix_logprobs_and_grads_equal_row_by_row_forward(tiny):
    b = TorchBackend(TrainerConfig(), model=tiny)
    t = train_sample_table(3, group_size=3, prompt_len=(2, 9), response_len=(1, 6), seed=1)
    mb = micro_batches([g for _, g in group_by_key(t, "group_id")], 10_000)[0]
    assert mb.prompt_ids.shape[0] == 3 and mb.response_ids.shape[0] == 9
    assert response_logits(b.model, mb).shape[:2] == mb.targets.shape
    b.model.zero_grad()
    lp, _ = b.logprobs(mb)
    mask = mb.response_mask.bool()
    weights = torch.randn(lp.shape)
    (lp[mask] * weights[mask]).sum().backward()
    g_shared = [p.grad.clone() for p in b.model.parameters()]
    b.model.zero_grad()
    ref = _row_by_row(b.model, t)
    assert torch.allclose(lp[mask], torch.cat(ref), atol=1e-5)
    torch.cat([r * weights[i, :len(r)] for i, r in enumerate(ref)]).sum().backward()
    for a, c in zip(g_shared, (p.grad for p in b.model.parameters())):
        assert torch.allclose(a, c, atol=1e-5, rtol=1e-4)


def test_c06_gradient_does_not_depend_on_micro_batch_split(tiny):
    b = TorchBackend(TrainerConfig(), model=tiny)
    groups = [g for _, g in group_by_key(train_sample_table(6, group_size=3, seed=2), "group_id")]
    one = micro_batches(groups, 100_000)
    many = micro_batches(groups, 40)
    assert len(one) == 1 and len(many) >= 3
    l1, g1 = _grads(b, one)
    l2, g2 = _grads(b, many)
    assert l1 == pytest.approx(l2, rel=1e-5)
    for a, c in zip(g1, g2):
        assert torch.allclose(a, c, atol=1e-6, rtol=1e-4)


def test_train_step_changes_weights_and_reports(tmp_path):
    cfg = TrainerConfig(optim={"lr": 1e-3})
    b = TorchBackend(cfg)
    before = {k: v.clone() for k, v in b.named_tensors().items()}
    groups = [g for _, g in group_by_key(train_sample_table(2, seed=4), "group_id")]
    stats = b.train_step(micro_batches(groups, 512))
    assert stats["grad_norm"] > 0 and stats["tokens_trained"] > 0 and "clip_frac_high" in stats
    changed = [k for k, v in b.named_tensors().items() if not torch.equal(v, before[k])]
    assert changed
    b.save(tmp_path / "ck")
    b2 = TorchBackend(cfg)
    b2.load(tmp_path / "ck")
    for k, v in b.named_tensors().items():
        assert torch.equal(v, b2.named_tensors()[k])
    assert b2.steps_done == 1


def test_frozen_parameters_stay_and_the_rest_train():
    """``trainer.freeze``: the matched parameters keep their weights and get no optimizer
    state; the others move. A pattern that matches nothing, or freezes all, is refused."""
    cfg = TrainerConfig(optim={"lr": 1e-3}, freeze=("model.layers.0.*", "model.embed_tokens.*"))
    b = TorchBackend(cfg)
    before = {k: v.clone() for k, v in b.named_tensors().items()}
    groups = [g for _, g in group_by_key(train_sample_table(2, seed=4), "group_id")]
    b.train_step(micro_batches(groups, 512))
    frozen = {k for k in before if k.startswith(("model.layers.0.", "model.embed_tokens."))}
    moved = {k for k, v in b.named_tensors().items() if not torch.equal(v, before[k])}
    assert frozen and not moved & frozen
    assert {k for k in before if k.startswith("model.layers.1.")} <= moved
    held = {id(p) for p in b.optimizer.state}
    assert all(id(p) not in held for n, p in b.model.named_parameters() if n in frozen)
    with pytest.raises(ValueError, match="matches no parameter"):
        TorchBackend(TrainerConfig(freeze=("model.vision_tower.*",)))
    with pytest.raises(ValueError, match="freezes every parameter"):
        TorchBackend(TrainerConfig(freeze=("*",)))
    with pytest.raises(ValueError, match="freeze needs backend 'torch'"):
        TrainerConfig(backend="megatron", freeze=("model.*",))


def test_skipping_zero_advantage_rows_gives_the_same_step(tiny):
    """Rows whose advantages are all 0 are left out of forward/backward; with the whole
    batch's counts the updated weights are the same as computing every row."""
    import copy

    import pyarrow as pa

    from relax.trainer.batching import informative_rows, loss_counts

    t = train_sample_table(4, group_size=3, seed=5)
    rows = t.to_pylist()
    for r in rows[3:6] + rows[9:10]:  # one whole group and one row with zero advantage
        r["advantages"] = [0.0] * len(r["advantages"])
    t = pa.Table.from_pylist(rows, schema=t.schema)
    groups = [g for _, g in group_by_key(t, "group_id")]
    cfg = TrainerConfig(optim={"lr": 1e-3})
    full = TorchBackend(cfg, model=copy.deepcopy(tiny))
    skip = TorchBackend(cfg, model=copy.deepcopy(tiny))
    full.train_step(micro_batches(groups, 10_000))
    kept = informative_rows(groups)
    assert sum(g.num_rows for g in kept) == 8
    s = skip.train_step(micro_batches(kept, 10_000), counts=loss_counts(groups))
    assert s["rows_computed"] == 8
    for (k, a), b in zip(full.named_tensors().items(), skip.named_tensors().values()):
        assert torch.allclose(a, b, atol=1e-7), k
