"""``trainer.gradient_checkpointing``: the torch back end's gradients equal the run without
it (fp32, max |diff| <= 1e-6) on tiny random Llama and Qwen2 models built from their
config classes, the decoder layers really are recomputed in the backward (the shared
prompt's key/value cache kept), less is saved for the backward, and a whole step runs."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from testdata import policy_grads, tiny_model, train_sample_table

from relax.streams.codec import group_by_key
from relax.trainer.backends.torch_backend import TorchBackend
from relax.trainer.batching import micro_batches
from relax.trainer.config import TrainerConfig


def batch(seed: int = 3):
    t = train_sample_table(4, group_size=3, prompt_len=(4, 12), response_len=(2, 9), seed=seed,
                           vocab=256)
    return micro_batches([g for _, g in group_by_key(t, "group_id")], 60)


@pytest.mark.parametrize(("family", "packing"),
                         [("llama", False), ("qwen2", False), ("llama", True)])
def test_gradients_equal_the_run_without_checkpointing(family, packing):
    """Padded rows sharing each group's prompt (2 passes per micro-batch), or packed rows
    (``trainer.packing``: 1 pass)."""
    model = tiny_model(family)
    mbs = batch()
    assert len(mbs) >= 2  # several micro-batches, each with shared prompts
    plain = TorchBackend(TrainerConfig(packing=packing), model=copy.deepcopy(model))
    ckpt = TorchBackend(TrainerConfig(gradient_checkpointing=True, packing=packing),
                        model=copy.deepcopy(model))
    assert ckpt.model.model.layers[0].gradient_checkpointing
    assert not plain.model.model.layers[0].gradient_checkpointing

    calls = []  # the first layer's MLP: the prompt pass, the response pass, and recomputes
    mlp = ckpt.model.model.layers[0].mlp  # (module hooks do not run in a recompute)
    forward = mlp.forward
    mlp.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    l_plain, g_plain = policy_grads(plain, mbs)
    l_ckpt, g_ckpt = policy_grads(ckpt, mbs)
    passes = 1 if packing else 2
    assert len(calls) == 2 * passes * len(mbs)  # each pass recomputed once
    assert l_ckpt == l_plain
    assert g_plain.keys() == g_ckpt.keys() and len(g_plain) == len(list(model.parameters()))
    worst = max(float((g_plain[n] - g_ckpt[n]).abs().max()) for n in g_plain)
    print(f"{family} packing={packing}: max |grad diff| {worst:.2e} over {len(g_plain)} "
          f"tensors")
    assert worst <= 1e-6, worst
    assert max(float(g.abs().max()) for g in g_plain.values()) > 1e-3  # not all ~0


def test_a_sliding_window_model_keeps_its_window():
    """Qwen2 with sliding-window layers (window 5, prompts and responses longer): the
    shared-prompt cache replays them too; log-probs equal each row's own full forward, and
    gradients with checkpointing equal those without."""
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

    from relax.trainer.logprobs import token_logprobs

    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1)
    kinds = [type(layer) for layer in DynamicCache(config=model.config).layers]
    assert kinds[0] is not DynamicSlidingWindowLayer and kinds[1] is DynamicSlidingWindowLayer
    t = train_sample_table(3, group_size=3, prompt_len=(6, 10), response_len=(5, 9), seed=2,
                           vocab=256)
    groups = [g for _, g in group_by_key(t, "group_id")]
    mbs = [micro_batches([g], 10_000)[0] for g in groups]  # one prompt each: no left padding
    plain = TorchBackend(TrainerConfig(), model=copy.deepcopy(model))
    ckpt = TorchBackend(TrainerConfig(gradient_checkpointing=True), model=copy.deepcopy(model))
    for g, mb in zip(groups, mbs):
        with torch.no_grad():
            lp, _ = plain.logprobs(mb)
        for i, r in enumerate(g.to_pylist()):
            p, n = len(r["prompt_ids"]), len(r["response_ids"])
            ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
            with torch.no_grad():
                logits = plain.model(input_ids=ids).logits[:, p - 1:p - 1 + n]
            want = token_logprobs(logits, torch.tensor([r["response_ids"]]), 1.0)[0]
            assert torch.allclose(lp[i, :n], want, atol=1e-5), (i, lp[i, :n], want)
    _, g_plain = policy_grads(plain, mbs)
    _, g_ckpt = policy_grads(ckpt, mbs)
    assert max(float((g_plain[n] - g_ckpt[n]).abs().max()) for n in g_plain) <= 1e-6


def saved_bytes(backend: TorchBackend, mb) -> int:
    """Bytes of the tensors the forward of ``mb`` keeps for the backward."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = backend.logprobs(mb)
    lp.sum().backward()
    return total


def test_checkpointing_keeps_less_for_the_backward():
    model = tiny_model("llama")
    mb = batch(seed=5)[0]
    plain = saved_bytes(TorchBackend(TrainerConfig(), model=copy.deepcopy(model)), mb)
    ckpt = saved_bytes(TorchBackend(TrainerConfig(gradient_checkpointing=True),
                                    model=copy.deepcopy(model)), mb)
    print(f"saved for backward: {plain} B plain, {ckpt} B checkpointed")
    assert ckpt < plain / 2


def test_a_step_with_checkpointing_and_recomputed_old_logprobs():
    """``old_logprobs: recompute`` runs a no-grad forward first (no checkpoint, cache kept);
    the step then trains and moves the weights as the step without checkpointing does."""
    model = tiny_model("llama")
    mbs = batch(seed=6)
    stats = {}
    for on in (False, True):
        cfg = TrainerConfig(gradient_checkpointing=on, old_logprobs="recompute",
                            optim={"lr": 1e-3})
        b = TorchBackend(cfg, model=copy.deepcopy(model))
        stats[on] = b.train_step(mbs)
    assert stats[True]["loss"] == pytest.approx(stats[False]["loss"], abs=1e-7)
    assert stats[True]["grad_norm"] == pytest.approx(stats[False]["grad_norm"], rel=1e-6)
    assert stats[True]["ppo_kl"] == pytest.approx(0.0, abs=1e-7)  # pi_old is this policy


def _megatron_grads(out: Path) -> None:
    """The megatron back end (tp 1, on this process's own group of one) takes one step of
    the same batch without and with recompute; writes the gradients, the number of calls
    of the first layer's MLP and the metrics to ``out``."""
    torch.set_num_threads(1)
    from relax.trainer.backends.megatron_backend import MegatronBackend

    model, mbs, res = tiny_model("llama", layers=2), batch(seed=8), {}
    for on in (False, True):
        b = MegatronBackend(TrainerConfig(backend="megatron", gradient_checkpointing=on),
                            model=copy.deepcopy(model))
        calls = []
        mlp = b.gpt.decoder.layers[0].mlp
        forward = mlp.forward
        mlp.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
        stats = b.train_step(mbs)
        res[on] = ({n: p.grad.clone() for n, p in b.gpt.named_parameters()
                    if p.grad is not None}, len(calls), stats)
    res["micro_batches"] = len(mbs)
    torch.save(res, out)


def test_megatron_recomputes_activations_with_the_same_gradients(tmp_path):
    """``trainer.gradient_checkpointing`` with ``backend: megatron``: megatron-core's full
    recompute (on the CPU through relax's CUDA redirect), the same gradients."""
    pytest.importorskip("megatron.core")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "megatron.pt"
    p = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = torch.load(out, weights_only=False)
    (g_plain, n_plain, s_plain), (g_ckpt, n_ckpt, s_ckpt) = r[False], r[True]
    assert n_ckpt == 2 * n_plain == 2 * r["micro_batches"]  # each forward run again
    assert g_plain.keys() == g_ckpt.keys() and g_plain
    assert max(float((g_plain[n] - g_ckpt[n]).abs().max()) for n in g_plain) <= 1e-6
    assert s_ckpt["loss"] == s_plain["loss"]


if __name__ == "__main__":
    _megatron_grads(Path(sys.argv[1]))
