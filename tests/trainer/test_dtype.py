"""``trainer.dtype``: the torch back end loads and trains its model in bfloat16 (pure bf16,
LoRA adapters float32 as peft keeps them), log-probs stay float32, and the other back
end refuses the key by name."""

from __future__ import annotations

import pydantic
import pytest
import torch
from testdata import train_sample_table

from relax.streams.codec import group_by_key
from relax.trainer.backends.torch_backend import TorchBackend
from relax.trainer.batching import micro_batches
from relax.trainer.config import TrainerConfig


def batch(seed: int = 3):
    t = train_sample_table(3, group_size=3, prompt_len=(4, 10), response_len=(2, 8), seed=seed,
                           vocab=256)
    return micro_batches([g for _, g in group_by_key(t, "group_id")], 10_000)


def test_bfloat16_model_trains_and_its_logprobs_are_float32():
    b = TorchBackend(TrainerConfig(dtype="bfloat16", optim={"lr": 1e-2}))
    assert {p.dtype for p in b.model.parameters()} == {torch.bfloat16}
    before = {n: p.detach().clone() for n, p in b.model.named_parameters()}
    stats = b.train_step(batch())
    assert torch.isfinite(torch.tensor(stats["loss"])) and stats["grad_norm"] > 0
    assert any(not torch.equal(before[n], p) for n, p in b.model.named_parameters())
    lp, _ = b.logprobs(batch()[0])
    assert lp.dtype == torch.float32


def test_bfloat16_with_lora_trains_float32_adapters_on_a_bf16_base():
    b = TorchBackend(TrainerConfig(dtype="bfloat16", gradient_checkpointing=True,
                                   lora={"r": 4, "target_modules": ["q_proj", "v_proj"]},
                                   optim={"lr": 1e-2}))
    trained = {p.dtype for p in b.model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in b.model.parameters() if not p.requires_grad}
    assert trained == {torch.float32} and frozen == {torch.bfloat16}
    stats = b.train_step(batch())
    assert torch.isfinite(torch.tensor(stats["loss"])) and stats["grad_norm"] > 0
    assert {t.dtype for t in b.named_tensors().values()} == {torch.bfloat16}


def test_dtype_is_refused_by_the_megatron_back_end_and_checked():
    with pytest.raises(pydantic.ValidationError, match="trainer.dtype 'bfloat16'"):
        TrainerConfig(backend="megatron", dtype="bfloat16")
    with pytest.raises(pydantic.ValidationError, match="dtype"):
        TrainerConfig(dtype="float16")
