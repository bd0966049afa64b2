"""token_logprobs, shared by rollout engines and trainer (trainer/logprobs.py): public case C12."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.trainer.logprobs import token_logprobs, top_p_log_mass

C12_LOGITS = torch.tensor([[[2.0, 1.0, 0.0]]])
C12_TOKEN = torch.tensor([[0]])


def naive(logits, ids, temperature):
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, ids[..., None])[..., 0]


def test_c12_both_sides_use_temperature_scaled_logits():
    rollout_side = token_logprobs(C12_LOGITS, C12_TOKEN, temperature=0.5)
    trainer_side = token_logprobs(C12_LOGITS.clone(), C12_TOKEN, temperature=0.5)
    assert rollout_side.item() == pytest.approx(-0.142932, abs=1e-6)
    ratio = (trainer_side - rollout_side).exp().item()
    assert ratio == pytest.approx(1.0, abs=1e-7)
    raw = token_logprobs(C12_LOGITS, C12_TOKEN, temperature=1.0).item()
    assert raw == pytest.approx(-0.407606, abs=1e-6)
    # the typical wrong outputs: raw on one side (ratio 1.3030), raw / T (ratio 0.5105)
    assert math.exp(-0.142932 - raw) == pytest.approx(1.3030, abs=1e-4) != pytest.approx(ratio)
    assert math.exp(raw / 0.5 + 0.142932) == pytest.approx(0.5105, abs=1e-4)
    assert rollout_side.item() != pytest.approx(raw / 0.5, abs=1e-3)


def test_c12_top_p_sub_check_kept_mass_correction():
    log_s = top_p_log_mass(C12_LOGITS, temperature=0.5, top_p=0.95)
    assert math.exp(log_s.item()) == pytest.approx(0.984124, abs=1e-6)
    full = token_logprobs(C12_LOGITS, C12_TOKEN, temperature=0.5).item()
    truncated = full - log_s.item()  # what a renormalising engine reports
    assert truncated == pytest.approx(-0.126928, abs=1e-6)
    assert math.exp(full - truncated) == pytest.approx(0.984124, abs=1e-6)
    assert top_p_log_mass(C12_LOGITS, 0.5, 1.0).item() == 0.0
    assert top_p_log_mass(C12_LOGITS, 0.5, 0.5).exp().item() == pytest.approx(0.866813, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), temperature=st.sampled_from([0.3, 0.6, 1.0, 1.7]),
       chunk=st.integers(1, 24), b=st.integers(1, 3), tt=st.integers(1, 7))
def test_c12_family_matches_log_softmax_for_any_chunking(seed, temperature, chunk, b, tt):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, tt, 11, generator=g) * 3
    ids = torch.randint(0, 11, (b, tt), generator=g)
    got = token_logprobs(logits, ids, temperature, chunk_rows=chunk)
    assert got.dtype == torch.float32 and got.shape == (b, tt)
    torch.testing.assert_close(got.double(), naive(logits, ids, temperature), atol=1e-5, rtol=1e-5)


def test_gradient_matches_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 9, generator=g)
    ids = torch.randint(0, 9, (2, 5), generator=g)
    a = logits.clone().requires_grad_(True)
    token_logprobs(a, ids, 0.7, chunk_rows=4).sum().backward()
    b = logits.clone().requires_grad_(True)
    torch.log_softmax(b / 0.7, -1).gather(-1, ids[..., None]).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)


def test_non_contiguous_logits_slice():
    full = torch.randn(2, 6, 10, generator=torch.Generator().manual_seed(2))
    logits = full[:, 1:-1]  # the usual shifted view of a model's logits
    ids = torch.randint(0, 10, (2, 4))
    torch.testing.assert_close(token_logprobs(logits, ids, 0.9, chunk_rows=2).double(),
                               naive(logits, ids, 0.9), atol=1e-5, rtol=1e-5)


def test_low_precision_logits_are_upcast():
    logits = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ids = torch.randint(0, 16, (2, 4))
    got = token_logprobs(logits, ids, 0.8)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), naive(logits.float(), ids, 0.8), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [
    {"temperature": 0.0}, {"temperature": -1.0},
    {"token_ids": torch.zeros(1, 2, dtype=torch.long)},
    {"logits": torch.zeros(1, 3)},
])
def test_bad_inputs_fail_loudly(bad):
    kwargs = {"logits": C12_LOGITS, "token_ids": C12_TOKEN, "temperature": 0.5} | bad
    with pytest.raises(ValueError):
        token_logprobs(**kwargs)
