"""``trainer.lora``: only the adapters are trained and checkpointed, the weight channel
gets merged weights under the base model's names that give the peft model's log-probs,
a checkpoint resumes the same training, ``final_model/`` loads with transformers and its
``adapter/`` with peft, and bad settings are refused by name."""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pydantic
import pytest
import torch
from testdata import policy_grads, tiny_model, tiny_recipe, train_sample_table

from relax.streams.codec import group_by_key
from relax.trainer import checkpoint
from relax.trainer.backends.torch_backend import TorchBackend, response_logits
from relax.trainer.batching import micro_batches
from relax.trainer.config import TrainerConfig
from relax.trainer.ledger import Ledger
from relax.trainer.logprobs import token_logprobs

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def lora_cfg(**kw) -> TrainerConfig:
    return TrainerConfig(lora=LORA, optim={"lr": 1e-2}, **kw)


def batch(seed: int = 3):
    t = train_sample_table(3, group_size=3, prompt_len=(4, 10), response_len=(2, 8), seed=seed,
                           vocab=256)
    return micro_batches([g for _, g in group_by_key(t, "group_id")], 10_000)


def logprobs_of(model, mb) -> torch.Tensor:
    """``[B, R]`` log-probs of ``mb``'s response tokens under a plain (or peft) model."""
    with torch.no_grad():
        return token_logprobs(response_logits(model, mb), mb.targets, mb.temperature)


def trained(seed: int = 3, **kw) -> tuple[TorchBackend, torch.nn.Module]:
    """A LoRA back end on a tiny Llama after two steps, and a copy of the base model."""
    base = tiny_model("llama")
    b = TorchBackend(lora_cfg(**kw), model=copy.deepcopy(base))
    for s in (seed, seed + 1):
        b.train_step(batch(s))
    return b, base


def test_only_the_adapters_are_trained():
    base = tiny_model("llama")
    b = TorchBackend(lora_cfg(), model=copy.deepcopy(base))
    in_optimizer = {id(p) for g in b.optimizer.param_groups for p in g["params"]}
    adapters = {n: p for n, p in b.model.named_parameters() if "lora_" in n}
    assert in_optimizer == {id(p) for p in adapters.values()}
    assert len(adapters) == 2 * 3 * 3  # A and B of 3 targets in each of 3 layers
    n_adapter = sum(p.numel() for p in adapters.values())
    n_base = sum(p.numel() for p in base.parameters())
    print(f"trained: {n_adapter} of {n_base + n_adapter} parameters")
    before = {k: v.clone() for k, v in b.model.state_dict().items()}
    b.train_step(batch())
    after = b.model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all("lora_" in k for k in moved)
    assert any(".lora_B." in k for k in moved)  # B leaves zero: the model changed
    assert set(b.optimizer.state) <= set(adapters.values())


def test_published_weights_are_merged_and_give_the_peft_logprobs():
    b, base = trained()
    published = b.named_tensors()
    plain = copy.deepcopy(base)
    assert published.keys() == plain.state_dict().keys()  # same manifest as a full fine-tune
    for k, v in plain.state_dict().items():
        assert published[k].shape == v.shape and published[k].dtype == v.dtype, k
    tied = published["lm_head.weight"], published["model.embed_tokens.weight"]
    assert tied[0].data_ptr() == tied[1].data_ptr()  # still one tensor: sent once
    plain.load_state_dict(published)
    moved = [k for k, v in base.state_dict().items() if not torch.equal(v, published[k])]
    assert sorted({k.split(".")[-2] for k in moved}) == ["down_proj", "q_proj", "v_proj"]
    # peft's own merge gives the same tensors
    peft_merged = copy.deepcopy(b.lora).merge_and_unload().state_dict()
    for k, v in peft_merged.items():
        assert torch.equal(v, published[k]), k
    worst = 0.0
    for mb in batch(seed=9):
        b.model.eval()
        diff = (logprobs_of(plain, mb) - logprobs_of(b.model, mb))[mb.response_mask.bool()]
        worst = max(worst, float(diff.abs().max()))
    print(f"merged vs peft log-probs: max |diff| {worst:.2e}")
    assert worst <= 1e-5


def test_the_first_published_weights_are_the_base_model():
    base = tiny_model("llama")
    b = TorchBackend(lora_cfg(), model=copy.deepcopy(base))
    for k, v in base.state_dict().items():
        assert torch.equal(b.named_tensors()[k], v), k


def test_checkpoint_holds_the_adapter_and_resumes_the_same_training(tmp_path):
    b, base = trained()
    folder = checkpoint.save(tmp_path, b, checkpoint.TrainerState(2), Ledger())
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert "adapter/adapter_model.safetensors" in files and "optimizer.pt" in files
    assert not [f for f in files if f.endswith(".safetensors") and not f.startswith("adapter/")]
    adapter_bytes = (folder / "adapter" / "adapter_model.safetensors").stat().st_size
    model_bytes = sum(v.numel() * v.element_size() for v in base.state_dict().values())
    print(f"checkpoint adapter {adapter_bytes} B, the model {model_bytes} B")
    assert adapter_bytes < model_bytes / 10

    resumed = TorchBackend(lora_cfg(seed=5), model=copy.deepcopy(base))  # other A init
    state, _ = checkpoint.load(folder, resumed)
    assert state.policy_version == 2 and resumed.steps_done == 2
    for k, v in b.named_tensors().items():
        assert torch.equal(v, resumed.named_tensors()[k]), k
    mbs = batch(seed=11)
    b.train_step(mbs)
    resumed.train_step(mbs)  # same Adam moments: the same next step
    for k, v in b.named_tensors().items():
        assert torch.equal(v, resumed.named_tensors()[k]), k


def test_a_checkpoint_of_another_adapter_is_refused(tmp_path):
    b, base = trained()
    folder = checkpoint.save(tmp_path, b, checkpoint.TrainerState(2), Ledger())
    other = TorchBackend(TrainerConfig(lora={**LORA, "target_modules": ["q_proj"]}),
                         model=copy.deepcopy(base))
    with pytest.raises(ValueError, match="does not match the model: missing .*unexpected "
                                         ".*v_proj"):
        checkpoint.load(folder, other)


def test_final_model_loads_with_transformers_and_its_adapter_with_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    b, base = trained()
    final = tmp_path / checkpoint.FINAL_MODEL
    b.save_model(final)
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert merged.config.model_type == "llama" and not hasattr(merged, "peft_config")
    for k, v in b.named_tensors().items():
        assert torch.equal(merged.state_dict()[k], v), k
    adapted = PeftModel.from_pretrained(copy.deepcopy(base), final / "adapter")
    b.model.eval()
    for mb in batch(seed=12):
        want = logprobs_of(b.model, mb)
        assert torch.allclose(logprobs_of(merged, mb), want, atol=1e-5)
        assert torch.allclose(logprobs_of(adapted.get_base_model(), mb), want, atol=1e-6)


def test_the_merged_model_written_in_shards_loads_with_transformers(tmp_path):
    """``lora.save_merged`` with shards far smaller than the model (one layer's merge in
    memory at a time): the index and every shard load with transformers, equal to
    :func:`lora.merged`, the tied LM head once."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from relax.trainer import lora

    b, _ = trained()
    state = {k: v.detach() for k, v in b.model.state_dict().items()}
    files = lora.save_merged(state, lora.scales(b.model), tmp_path, max_shard_bytes=20_000)
    b.model.config.save_pretrained(tmp_path)
    assert len(files) > 3 and (tmp_path / "model.safetensors.index.json").exists()
    names = [n for f in files for n in safe_open(str(tmp_path / f), "pt").keys()]
    assert len(names) == len(set(names)) and "lm_head.weight" not in names  # tied: once
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    want = lora.merged(state, lora.scales(b.model))
    assert set(want) <= set(loaded)
    for k, v in want.items():
        assert torch.equal(loaded[k], v), k


def test_checkpointing_with_lora_gives_the_same_adapter_gradients():
    base = tiny_model("llama")
    mbs = batch(seed=4)
    plain = TorchBackend(lora_cfg(), model=copy.deepcopy(base))
    ckpt = TorchBackend(lora_cfg(gradient_checkpointing=True), model=copy.deepcopy(base))
    for b in (plain, ckpt):  # B != 0, so every adapter gets a gradient
        with torch.no_grad():
            for n, p in b.model.named_parameters():
                if ".lora_B." in n:
                    p.copy_(torch.linspace(-0.1, 0.1, p.numel()).view_as(p))
    _, g_plain = policy_grads(plain, mbs)
    _, g_ckpt = policy_grads(ckpt, mbs)
    assert g_plain.keys() == g_ckpt.keys() and all("lora_" in n for n in g_plain)
    assert max(float((g_plain[n] - g_ckpt[n]).abs().max()) for n in g_plain) <= 1e-6


@pytest.mark.parametrize("lora, match", [
    ({"r": 0}, "lora.r"),
    ({"alpha": -1}, "lora.alpha"),
    ({"dropout": 1.0}, "lora.dropout"),
    ({"target_modules": []}, "lora.target_modules"),
    ({"rank": 8}, "lora.rank"),
])
def test_bad_lora_settings_are_refused_by_name(lora, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        TrainerConfig(lora=lora)


def test_a_target_that_is_no_linear_layer_is_refused():
    with pytest.raises(ValueError, match=r"target_modules \['qproj'\].*q_proj"):
        TorchBackend(TrainerConfig(lora={"target_modules": ["qproj"]}),
                     model=tiny_model("llama"))
    with pytest.raises(ValueError, match="lora: not supported by the megatron"):
        TrainerConfig(backend="megatron", lora={})
    with pytest.raises(ValueError, match="freeze with trainer.lora"):
        TrainerConfig(lora={}, freeze=("model.*",))


def _ranks_worker(out: Path, mode: str) -> None:
    """The trainer stage's 2-rank path with LoRA and gradient checkpointing (``ddp`` or
    ``fsdp2``) against 1 process:
    a 1-process adapter checkpoint after step 0, restored by rank 0 of 2 (the child gets
    it by ``broadcast_state``) and by 1 process; both train the same 2 steps, then save.
    Writes ``out/ranks.pt``."""
    from relax.trainer.batching import loss_counts, split_groups
    from relax.trainer.ranks import Ranks

    torch.set_num_threads(1)
    cfg = TrainerConfig(lora=LORA, optim={"lr": 1e-2}, max_tokens_per_microbatch=60,
                        data_parallel=mode, gradient_checkpointing=True)
    batches = [[g for _, g in group_by_key(train_sample_table(4, group_size=3, seed=20 + s),
                                           "group_id")] for s in range(3)]
    first = TorchBackend(cfg, device="cpu")
    first.train_step(micro_batches(batches[0], 60))
    first.save(out / "ckpt")
    ranks = Ranks(2, cfg, out, torch_threads=1)
    b = TorchBackend(cfg, device="cpu")
    b.load(out / "ckpt")
    b.broadcast_state()
    for i, groups in enumerate(batches[1:]):
        last = i == len(batches) - 2
        share, counts = ranks.scatter(split_groups(groups, 2), loss_counts(groups), last)
        b.train_step(micro_batches(share, 60), counts=counts, gather_optimizer=last)
    b.save(out / "after")
    ranks.close()
    ref = TorchBackend(cfg, device="cpu")
    ref.load(out / "ckpt")
    for groups in batches[1:]:
        ref.train_step(micro_batches(groups, 60))
    ref.save(out / "ref_after")
    torch.save({"weights": dict(b.named_tensors()), "ref_weights": ref.named_tensors(),
                "first": first.named_tensors()}, out / "ranks.pt")


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_with_lora_match_one_process(tmp_path, mode):
    """2 data-parallel ranks (the stage's own path; checkpointed layers) train the adapters
    as 1 process does: merged weights and the saved adapter within 1e-6, the same
    optimizer state (FSDP2 saved it keyed by the index of the trained parameters)."""
    from safetensors.torch import load_file

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, __file__, "--ranks-out", str(tmp_path), "--mode", mode],
                       env=env, capture_output=True, text=True, timeout=300)
    child = (tmp_path / "trainer-rank1.log").read_text(errors="replace")
    assert p.returncode == 0, f"{p.stdout[-2000:]}{p.stderr[-3000:]}\nrank 1:\n{child[-3000:]}"
    r = torch.load(tmp_path / "ranks.pt", weights_only=False)

    def worst(a, b):
        assert a.keys() == b.keys()
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    assert worst(r["weights"], r["ref_weights"]) <= 1e-6
    assert worst(r["ref_weights"], r["first"]) > 1e-4  # the steps moved the merged weights
    adapter = "adapter/adapter_model.safetensors"
    assert worst(load_file(tmp_path / "after" / adapter),
                 load_file(tmp_path / "ref_after" / adapter)) <= 1e-6
    opt, ref_opt = (torch.load(tmp_path / d / "optimizer.pt", weights_only=True)["optimizer"]
                    for d in ("after", "ref_after"))
    assert opt["param_groups"][0]["params"] == ref_opt["param_groups"][0]["params"]
    for i, st in ref_opt["state"].items():
        assert float((opt["state"][i]["exp_avg"] - st["exp_avg"]).abs().max()) <= 1e-6, i


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks-out", type=Path, required=True)
    ap.add_argument("--mode", choices=["ddp", "fsdp2"], required=True)
    a = ap.parse_args()
    _ranks_worker(a.ranks_out, a.mode)


@pytest.mark.e2e
def test_a_lora_run_through_the_broker(broker, local_ray, tmp_path):
    """recipes/tiny_ci.yaml with ``trainer.lora``, every stage its own process: the run
    finishes balanced, each checkpoint holds only the adapter, the rollout engine's
    log-probs equal the trainer's at the version that generated them (merged weights
    arrived), and ``final_model/`` loads with transformers and its adapter with peft."""
    import uuid

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from relax.infra.control.launch import train
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table
    from relax.trainer.models import load_model

    run = "lora" + uuid.uuid4().hex[:6]
    recipe = tiny_recipe(broker, tmp_path, run, "trainer.lora={r: 4, alpha: 8}",
                         "trainer.keep_checkpoints=10", "trainer.optim.lr=0.01")
    s = train(recipe, say=lambda line: None, timeout_s=400)
    assert s["steps"] == 3 and s["balanced"], s
    run_dir = Path(s["run_dir"])
    bus = BusConfig(bootstrap_servers=broker)
    weights = read_table(bus, f"{run}.weights")
    assert sorted(set(weights.column("policy_version").to_pylist())) == [0, 1, 2, 3]
    ckpts = sorted(checkpoint.checkpoints_dir(run_dir).glob("step_*"))
    assert [c.name for c in ckpts] == ["step_000001", "step_000002", "step_000003"]
    for c in ckpts:
        assert (c / "adapter" / "adapter_model.safetensors").exists()
        assert not list(c.glob("*.safetensors"))

    samples = read_table(bus, f"{run}.train_samples")
    by_version: dict[int, list] = {}
    for row in samples.to_pylist():
        if row["policy_version_start"] == row["policy_version_end"] and row["drop_reason"] is None:
            by_version.setdefault(row["policy_version_start"], []).append(row)
    assert len(by_version) >= 2, sorted(by_version)  # at least one version after 0
    base = TorchBackend(recipe.trainer)  # policy_version 0: the adapters' B is zero
    base.model.eval()
    worst, moved = 0.0, 0.0
    for version, rows in sorted(by_version.items()):
        b = TorchBackend(recipe.trainer)
        if version:
            b.load(checkpoint.checkpoints_dir(run_dir) / f"step_{version:06d}")
        b.model.eval()
        t = pa.Table.from_pylist(rows, schema=samples.schema)
        for mb in micro_batches([g for _, g in group_by_key(t, "group_id")], 10_000):
            mask = mb.loss_mask.bool()
            with torch.no_grad():
                lp, _ = b.logprobs(mb)
                lp0, _ = base.logprobs(mb)
            worst = max(worst, float((lp - mb.rollout_logprobs)[mask].abs().max()))
            if version:  # the engine's log-probs are not the base model's
                moved = max(moved, float((lp0 - mb.rollout_logprobs)[mask].abs().max()))
    print(f"rollout vs trainer log-probs, versions {sorted(by_version)}: max |diff| "
          f"{worst:.2e} (vs the base model {moved:.2e})")
    assert worst <= 1e-5 and moved > 1e-3

    final = run_dir / checkpoint.FINAL_MODEL
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(load_model("tiny-llama"), final / "adapter")
    ids = torch.tensor([[1, 17, 230, 5, 99]])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapted(input_ids=ids).logits,
                              atol=1e-5)
