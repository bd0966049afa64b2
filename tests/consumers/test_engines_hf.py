"""HF engine: sampling, finish reasons, log-probs equal to the trainer's (C12), masks from
lengths (C24), stop reasons for overlong filtering (C23), double-buffered weight swaps."""

from __future__ import annotations

import math

import pytest
import torch
from testdata import StubTokenizer, scripted_lm

from relax.trainer.advantage.filters import overlong_filter
from relax.consumers.engines.base import Engine, SamplingParams
from relax.consumers.engines.hf import HFEngine
from relax.consumers.engines.next_token import filter_logits, sample
from relax.trainer.logprobs import token_logprobs, top_p_log_mass
from relax.trainer.masks import completion_mask


@pytest.fixture(scope="module")
def tiny():
    return HFEngine("tiny-llama", device="cpu")


def _chat(tok, text: str) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def _trainer_logprobs(model, prompt: list[int], response: list[int], temperature: float):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor([response]), temperature)[0]


def test_engine_satisfies_interface(tiny):
    assert isinstance(tiny, Engine)
    assert tiny.policy_version == 0
    assert tiny.tokenizer.eos_token_id in tiny.stop_token_ids


@pytest.mark.parametrize(
    "temperature,top_p,top_k", [(0.5, 1.0, 0), (0.7, 0.9, 0), (1.0, 1.0, 50), (1.3, 0.95, 20)]
)
def test_c12_engine_logprobs_equal_trainer_logprobs(tiny, temperature, top_p, top_k):
    """Ratio exp(engine - trainer) is 1.000 within 1e-5 on every token, for prompts of
    different lengths in one left-padded batch (same weights)."""
    tok = tiny.tokenizer
    prompts = [_chat(tok, q) for q in ("hi", "What is 12 + 30? Answer with a number only.", "ok")]
    gens = tiny.generate(
        prompts,
        SamplingParams(
            max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k, seed=3
        ),
    )
    for p, g in zip(prompts, gens):
        assert len(g.token_ids) == len(g.logprobs) >= 1
        trainer = _trainer_logprobs(tiny.model, p, g.token_ids, temperature)
        ratio = torch.exp(torch.tensor(g.logprobs) - trainer)
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5), ratio
        raw = _trainer_logprobs(tiny.model, p, g.token_ids, 1.0)  # the C12 fault: T = 1 on one side
        assert not torch.allclose(torch.tensor(g.logprobs), raw, atol=1e-3) or temperature == 1.0


def test_c12_three_token_vocabulary_through_engine():
    """Logits [2, 1, 0], T = 0.5: the engine reports log softmax(logits / T), i.e.
    -0.142932 for token 0 (raw -0.407606 and raw / T -0.815212 are the known wrong values);
    with top_p = 0.95 the kept mass is S = 0.984124 and relax keeps full-vocab log-probs."""

    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([2.0, 1.0, 0.0]))
            self.generation_config = None

        def forward(
            self,
            input_ids,
            attention_mask,
            position_ids,
            past_key_values=None,
            use_cache=True,
            logits_to_keep=1,
        ):
            from types import SimpleNamespace

            logits = self.w.expand(input_ids.shape[0], 1, 3)
            return SimpleNamespace(logits=logits, past_key_values=past_key_values)

    engine = HFEngine(Fixed(), StubTokenizer(eos=99), use_default_stop_ids=False)
    gens = engine.generate(
        [[0, 1]] * 64, SamplingParams(max_new_tokens=4, temperature=0.5, top_p=0.95, seed=0)
    )
    expected = {
        t: v for t, v in enumerate(torch.log_softmax(torch.tensor([4.0, 2.0, 0.0]), 0).tolist())
    }
    assert expected[0] == pytest.approx(-0.142932, abs=1e-6)
    seen = set()
    for g in gens:
        for t, lp in zip(g.token_ids, g.logprobs):
            seen.add(t)
            assert lp == pytest.approx(expected[t], abs=1e-6)
            assert lp != pytest.approx(-0.407606, abs=1e-4) and lp != pytest.approx(
                -0.815212, abs=1e-4
            )
    assert seen == {0, 1}  # top_p = 0.95 drops token 2 (mass before it 0.984 >= 0.95)
    log_s = top_p_log_mass(torch.tensor([[[2.0, 1.0, 0.0]]]), 0.5, 0.95)
    assert math.exp(log_s.item()) == pytest.approx(0.984124, abs=1e-6)


def test_c24_pad_equals_eos_masks_from_lengths():
    """pad id == EOS id == 9: the prompt's chat marker 9 stays attended ([1, 1, 1]), and the
    completion [5, 6, 9] keeps its terminating EOS in the mask ([1, 1, 1, 0, 0])."""
    model = scripted_lm({3: [5, 6, 9], 6: [7, 9]}, vocab=12, eos=None)
    engine = HFEngine(model, StubTokenizer(eos=9))
    assert engine.pad_token_id == engine.tokenizer.eos_token_id == 9
    gens = engine.generate(
        [[1, 9, 3], [4, 4, 4, 4, 4, 4]], SamplingParams(max_new_tokens=5, temperature=0.1)
    )
    assert gens[0].token_ids == [5, 6, 9] and gens[0].finish_reason == "stop"
    assert gens[1].token_ids == [7, 9] and gens[1].finish_reason == "stop"
    prefill = model.masks[0]
    assert prefill[0].tolist() == [0, 0, 0, 1, 1, 1]  # left padding, marker 9 attended
    assert prefill[1].tolist() == [1, 1, 1, 1, 1, 1]
    right_padded = gens[0].token_ids + [9, 9]
    lengths = torch.tensor([len(gens[0].token_ids)])
    assert completion_mask(lengths, 5)[0].long().tolist() == [1, 1, 1, 0, 0]
    wrong = [int(t != 9) for t in right_padded]  # the C24 fault
    assert wrong == [1, 1, 0, 0, 0]


def test_c23_finish_reason_from_engine_drives_overlong_filter():
    """Tokenizer EOS 2, end-of-turn 9 (the model's generation_config eos): A = [5, 6, 9]
    stops ("stop"), B = [5, 6, 7] hits max_new_tokens ("length"); overlong filtering on
    finish_reason keeps A's mask [1, 1, 1] and zeroes B's."""
    model = scripted_lm({2: [5, 6, 9], 3: [5, 6, 7, 8]}, vocab=12, eos=9)
    engine = HFEngine(model, StubTokenizer(eos=2))
    assert {2, 9} <= engine.stop_token_ids
    a, b = engine.generate([[1, 1], [1, 1, 1]], SamplingParams(max_new_tokens=3, temperature=0.1))
    assert (a.token_ids, a.finish_reason) == ([5, 6, 9], "stop")
    assert (b.token_ids, b.finish_reason) == ([5, 6, 7], "length")
    mask = torch.ones(2, 3, dtype=torch.int8)
    kept = overlong_filter(mask, [a.finish_reason, b.finish_reason])
    assert kept.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert a.token_ids[-1] != engine.tokenizer.eos_token_id  # an EOS-id rule would drop A


def test_stop_strings_and_length():
    model = scripted_lm([1, 2, 3, 4, 5, 6], vocab=12)
    engine = HFEngine(model, StubTokenizer(eos=11))
    (g,) = engine.generate(
        [[0, 0]], SamplingParams(max_new_tokens=6, temperature=0.1, stop=("cd",))
    )
    assert g.token_ids == [1, 2, 3] and g.finish_reason == "stop" and g.text == "bcd"
    (g,) = engine.generate(
        [[0, 0]], SamplingParams(max_new_tokens=4, temperature=0.1, stop=("zz",))
    )
    assert g.token_ids == [1, 2, 3, 4] and g.finish_reason == "length"


def test_sampler_matches_the_distribution_and_filters():
    torch.manual_seed(0)
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)
    gen = torch.Generator().manual_seed(1)
    draws = torch.cat([sample(probs.expand(4000, 5), gen) for _ in range(5)])[:, 0]
    freq = torch.bincount(draws, minlength=5).double() / draws.numel()
    assert torch.allclose(freq, probs[0].double(), atol=0.01)
    kept_k = torch.isfinite(filter_logits(logits, 2, 1.0))[0].tolist()
    assert kept_k == [True, True, False, False, False]
    kept_p = torch.isfinite(filter_logits(logits, 0, 0.8))[0]
    s = probs[0][kept_p].sum()
    assert kept_p.tolist() == [True, True, False, False, False]
    assert math.log(s) == pytest.approx(top_p_log_mass(logits[None], 1.0, 0.8).item(), abs=1e-6)


def test_seeded_sampling_is_reproducible(tiny):
    tok = tiny.tokenizer
    p = [_chat(tok, "hello")] * 2
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=11)
    a, b = tiny.generate(p, params), tiny.generate(p, params)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]


def _shifted(engine: HFEngine, delta: float) -> dict[str, torch.Tensor]:
    return {n: p.detach() + delta for n, p in engine.model.named_parameters()}


def test_update_weights_double_buffered_swap_between_generate_calls():
    engine = HFEngine("tiny-llama", device="cpu")
    tok = engine.tokenizer
    prompt = _chat(tok, "hi")
    new = _shifted(engine, 0.01)
    live_before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    with engine.hold():
        engine.update_weights(new, 1)
        assert engine.pending_version == 1
        for n, p in engine.model.named_parameters():  # staged, live weights untouched
            assert torch.equal(p, live_before[n])
        (g,) = engine.generate([prompt], SamplingParams(max_new_tokens=3, seed=0))
        assert (g.policy_version_start, g.policy_version_end) == (0, 0)
        assert engine.policy_version == 0 and engine.pending_version == 1
    assert engine.policy_version == 1  # swapped in at the end of the hold
    (g,) = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.8, seed=0))
    assert (g.policy_version_start, g.policy_version_end, g.token_policy_versions) == (1, 1, None)
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, new[n])
    trainer = _trainer_logprobs(engine.model, prompt, g.token_ids, 0.8)
    assert torch.allclose(torch.tensor(g.logprobs), trainer, atol=1e-5)
    assert engine.stats.swaps == 1 and engine.stats.swap_blocked_s < 0.5
    with pytest.raises(KeyError, match="not a parameter"):
        engine.update_weights({"nope": torch.zeros(1)}, 2)
    with pytest.raises(ValueError, match="does not cover"):
        engine.update_weights({"model.norm.weight": engine.model.model.norm.weight.detach()}, 2)
    engine.update_weights(new, 0)  # a restarted trainer's older version is staged too
    assert engine.pending_version == 0


def test_partial_rollout_swaps_between_chunks_with_per_token_versions():
    """A swap staged at the 2nd safe point of a generate call takes effect there: the
    first 2 chunks are v0, the rest v1, and the v1 tokens' log-probs are the trainer's
    under the new weights with the whole prefix (the KV cache is rebuilt)."""
    engine = HFEngine(
        "tiny-llama",
        device="cpu",
        partial_rollout=True,
        chunk_tokens=4,
        stop_token_ids=(),
        use_default_stop_ids=False,
    )
    new = _shifted(engine, -0.02)
    calls = []

    def hook(e):
        calls.append(1)
        if len(calls) == 3:  # 1 = start of generate, 2 = after chunk 1, 3 = after chunk 2
            e.update_weights(new, 1)

    engine.safe_point_hook = hook
    prompt = _chat(engine.tokenizer, "count")
    (g,) = engine.generate([prompt], SamplingParams(max_new_tokens=14, temperature=0.9, seed=5))
    assert len(g.token_ids) == 14 and g.finish_reason == "length"
    assert g.token_policy_versions == [0] * 8 + [1] * 6
    assert (g.policy_version_start, g.policy_version_end) == (0, 1)
    trainer_v1 = _trainer_logprobs(engine.model, prompt, g.token_ids, 0.9)
    assert torch.allclose(torch.tensor(g.logprobs[8:]), trainer_v1[8:], atol=1e-5)
    assert not torch.allclose(torch.tensor(g.logprobs[:8]), trainer_v1[:8], atol=1e-4)


def test_a_swap_back_to_an_older_version_samples_the_rows_in_flight_again():
    """A restarted trainer counts policy_versions again from its checkpoint: the engine at
    v5 gets v2 at the 2nd safe point of a partial rollout. The 8 tokens of v5 are of a
    lost branch (a row of both would have policy_version_end < start, which the trainer
    cannot admit): the row is sampled again, all 14 tokens by v2."""
    engine = HFEngine("tiny-llama", device="cpu", partial_rollout=True, chunk_tokens=4,
                      stop_token_ids=(), use_default_stop_ids=False, policy_version=5)
    new = _shifted(engine, -0.02)
    calls = []

    def hook(e):
        calls.append(1)
        if len(calls) == 3:
            e.update_weights(new, 2)

    engine.safe_point_hook = hook
    prompt = _chat(engine.tokenizer, "count")
    (g,) = engine.generate([prompt], SamplingParams(max_new_tokens=14, temperature=0.9, seed=5))
    assert g.token_policy_versions == [2] * 14 and len(g.token_ids) == 14
    assert (g.policy_version_start, g.policy_version_end) == (2, 2)
    trainer_v2 = _trainer_logprobs(engine.model, prompt, g.token_ids, 0.9)
    assert torch.allclose(torch.tensor(g.logprobs), trainer_v2, atol=1e-5)


def test_empty_prompt_is_rejected(tiny):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        tiny.generate([[1, 2], []], SamplingParams(max_new_tokens=2))


def test_shared_prefill_equals_separate_generation():
    """Identical prompts are prefilled once: the continuations and log-probs are those
    each prompt gets alone (greedy, so deterministic)."""
    from relax.consumers.engines.base import SamplingParams
    from relax.consumers.engines.hf import HFEngine

    eng = HFEngine("tiny-llama", engine_id="t")
    a, b = [1, 17, 23, 99, 5], [1, 42, 7]
    params = SamplingParams(max_new_tokens=6, top_k=1)
    together = eng.generate([a, a, b, a], params)
    alone = {tuple(p): eng.generate([p], params)[0] for p in (a, b)}
    for p, g in zip([a, a, b, a], together):
        ref = alone[tuple(p)]
        assert g.token_ids == ref.token_ids
        assert g.logprobs == pytest.approx(ref.logprobs, abs=1e-5)


def test_no_update_writes_into_pages_the_loader_mapped():
    """The loader maps the checkpoint copy-on-write; the swap makes the loaded tensors the
    spare buffers of the second update. The engine gives its parameters memory of their
    own when it is built, so the second and later updates fault no page in (a 538 MB model
    took 1.7 s instead of 0.07 s for its second update without it)."""
    import resource

    engine = HFEngine("smollm2-135m", device="cpu")  # big enough for faults to be counted
    named = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    pages = sum(t.nbytes for t in named.values()) // resource.getpagesize()
    faults = []
    for version in (1, 2, 3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        engine.update_weights(named, version)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        assert engine.apply_pending() and engine.policy_version == version
    assert faults[0] > pages // 2  # the first update's new buffers: counted, so the check can fail
    assert faults[1] < pages // 100 and faults[2] < pages // 100, (faults, pages)
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, named[n])
