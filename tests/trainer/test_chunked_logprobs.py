"""Chunked log-probs (``trainer.logits_chunk_tokens``): the LM head applied a chunk of
tokens at a time, checkpointed, gives the values and gradients of the whole ``[B, R, V]``
logits at once (<= 1e-6, float32), in the function, the torch back end and the reference
stage; and the peak memory it allocates, counted tensor by tensor, is lower."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

from relax.consumers.reference import response_logprobs
from relax.streams.codec import group_by_key
from relax.trainer.backends.step import micro_batch_loss
from relax.trainer.backends.torch_backend import TorchBackend, response_logits
from relax.trainer.batching import micro_batches
from relax.trainer.config import TrainerConfig
from relax.trainer.logprobs import head_logprobs, token_logprobs
from relax.trainer.losses.aggregate import mask_counts
from relax.trainer.losses.entropy import token_entropy

from testdata import train_sample_table

VOCAB = 4096


class LiveBytes(TorchDispatchMode):
    """Counts the CPU tensor storages the ops inside it allocate, while they live:
    ``peak`` (bytes live at once) and ``largest`` (the biggest single storage). A
    storage is counted once (views and in-place outputs share it) and uncounted when it
    is freed (a finalizer on its storage object, which lives as long as the memory)."""

    def __init__(self):
        super().__init__()
        self.live: set[int] = set()
        self.now = self.peak = self.largest = 0

    def _freed(self, key: int, n: int) -> None:
        self.live.discard(key)
        self.now -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            key, n = st.data_ptr(), st.nbytes()
            if n == 0 or key in self.live:
                continue
            self.live.add(key)
            self.now += n
            self.peak = max(self.peak, self.now)
            self.largest = max(self.largest, n)
            weakref.finalize(st, self._freed, key, n)
        return out


def tiny_model(arch: str = "llama", vocab: int = VOCAB):
    """A random 2-layer model built from a transformers config class (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                      "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    cfg = cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=False, attn_implementation="sdpa")
    return model_cls(cfg).float()


def _micro_batches(seed=1, groups=3, response_len=(1, 40)):
    t = train_sample_table(groups, group_size=3, prompt_len=(2, 9), response_len=response_len,
                           seed=seed, vocab=VOCAB)
    return micro_batches([g for _, g in group_by_key(t, "group_id")], 100_000)


def _pass(backend, mbs):
    """Log-probs, entropies, loss and parameter gradients of one step's backward; the
    entropy is computed when the loss uses it, as in ``TorchBackend.train_step``."""
    backend.optimizer.zero_grad(set_to_none=True)
    counts = [mask_counts(mb.loss_mask) for mb in mbs]
    tokens, seqs = sum(c[0] for c in counts), sum(c[1] for c in counts)
    lps, ents, total = [], [], 0.0
    with_entropy = backend.cfg.loss.entropy_coef != 0
    for mb in mbs:
        lp, ent = backend.logprobs(mb, with_entropy=with_entropy)
        loss, _ = micro_batch_loss(backend.cfg, mb, lp, ent, None, tokens, seqs)
        loss.backward()
        valid = mb.response_mask.bool()
        lps.append(lp.detach()[valid])
        ents.append(ent.detach()[valid] if with_entropy else lp.new_zeros(0))
        total += float(loss.detach())
    grads = {n: p.grad.clone() for n, p in backend.model.named_parameters()}
    return torch.cat(lps), torch.cat(ents), total, grads


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("chunk", [1, 7, 64, 0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_logprobs_equal_whole_logits_values_and_gradients(chunk, temperature):
    torch.manual_seed(0)
    n, h = 150, 16
    head = torch.nn.Linear(h, 1000, bias=False)
    hidden = torch.randn(n, h, requires_grad=True)
    ids = torch.randint(0, 1000, (n,))
    # a loss that weights every token differently, normalised by the token count as the
    # trainer's is (a sum over 150 tokens would give ~6 gradients, equal to ~6e-7 relative)
    w = torch.randn(n) / n

    logits = head(hidden)[None]
    ref_lp = token_logprobs(logits, ids[None], temperature)[0]
    ref_ent = token_entropy(logits, temperature=temperature)[0]
    ((ref_lp * w).sum() + (ref_ent * w).sum()).backward()
    ref_grads = (hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad = head.weight.grad = None

    lp, ent = head_logprobs(hidden, head, ids, temperature, chunk_tokens=chunk,
                            with_entropy=True)
    ((lp * w).sum() + (ent * w).sum()).backward()
    assert float((lp - ref_lp).detach().abs().max()) <= 1e-6
    assert float((ent - ref_ent).detach().abs().max()) <= 1e-6
    assert float((hidden.grad - ref_grads[0]).abs().max()) <= 1e-6
    assert float((head.weight.grad - ref_grads[1]).abs().max()) <= 1e-6
    assert head_logprobs(hidden, head, ids, temperature, chunk_tokens=chunk)[1] is None


def test_head_logprobs_bad_input_fails_loudly():
    head = torch.nn.Linear(4, 10)
    with pytest.raises(ValueError, match="hidden must be"):
        head_logprobs(torch.zeros(2, 3, 4), head, torch.zeros(2, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        head_logprobs(torch.zeros(3, 4), head, torch.zeros(3, dtype=torch.long), 1.0,
                      chunk_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        head_logprobs(torch.zeros(3, 4), head, torch.zeros(3, dtype=torch.long), 0.0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_backend_chunked_equals_unchunked_values_loss_and_gradients(arch):
    model = tiny_model(arch)
    # pi_old = the current policy (ratio 1): the random rollout log-probs of the test
    # data would clip every ratio and leave ~1e-5 gradients to compare
    opts = dict(loss={"entropy_coef": 0.01}, old_logprobs="detached")
    whole = TorchBackend(TrainerConfig(logits_chunk_tokens=0, **opts), model=model)
    chunked = TorchBackend(TrainerConfig(logits_chunk_tokens=16, **opts), model=model)
    mbs = _micro_batches()
    assert sum(int(mb.response_mask.sum()) for mb in mbs) > 16 * 3  # several chunks
    lp0, ent0, loss0, g0 = _pass(whole, mbs)
    lp1, ent1, loss1, g1 = _pass(chunked, mbs)
    assert float((lp1 - lp0).abs().max()) <= 1e-6
    assert float((ent1 - ent0).abs().max()) <= 1e-6
    assert abs(loss1 - loss0) <= 1e-6
    assert _max_diff(g1, g0) <= 1e-6
    assert max(float(g.abs().max()) for g in g0.values()) > 1e-3  # gradients not ~0

    # and equal to the old path: the whole [B, R, V] logits of every position
    with torch.no_grad():
        for mb in mbs:
            valid = mb.response_mask.bool()
            full = token_logprobs(response_logits(model, mb), mb.targets, mb.temperature)
            got, _ = chunked.logprobs(mb)
            assert float((got - full)[valid].abs().max()) <= 1e-6
            assert not got[~valid].any()  # padding: exactly 0


def _peak_of(backend, mbs) -> LiveBytes:
    gc.collect()
    meter = LiveBytes()
    with meter:
        _pass(backend, mbs)
    gc.collect()
    return meter


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_chunked_peak_memory_is_lower_measured(entropy_coef):
    """The storages a forward + backward allocates, counted while they live: chunking
    removes the ``[tokens, V]`` logits (and their float32 softmax temporaries and
    gradient) as the largest allocation and lowers the step's peak."""
    model = tiny_model(vocab=16384)
    mbs = _micro_batches(seed=3, groups=2, response_len=(60, 120))
    assert len(mbs) == 1
    tokens = int(mbs[0].response_mask.sum())
    logits_bytes = tokens * 16384 * 4
    loss = {"entropy_coef": entropy_coef}
    whole = _peak_of(TorchBackend(TrainerConfig(logits_chunk_tokens=0, loss=loss),
                                  model=model), mbs)
    chunked = _peak_of(TorchBackend(TrainerConfig(logits_chunk_tokens=64, loss=loss),
                                    model=model), mbs)
    print(f"\nentropy_coef {entropy_coef}, response tokens {tokens}, V 16384: logits "
          f"{logits_bytes / 1e6:.1f} MB; peak unchunked {whole.peak / 1e6:.1f} MB (largest "
          f"{whole.largest / 1e6:.1f} MB), chunked 64 {chunked.peak / 1e6:.1f} MB (largest "
          f"{chunked.largest / 1e6:.1f} MB)")
    assert whole.largest >= logits_bytes  # the meter sees the whole logits
    assert chunked.largest <= 64 * 16384 * 4 < logits_bytes
    assert chunked.peak < whole.peak / 3
    assert whole.now < whole.peak / 10  # frees are counted: the meter is not a sum


def test_reference_chunked_equals_unchunked():
    model = tiny_model().eval()
    rng = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=rng).tolist() for n in (3, 9, 5, 1)]
    responses = [torch.randint(3, VOCAB, (n,), generator=rng).tolist() for n in (12, 1, 30, 0)]
    whole = response_logprobs(model, prompts, responses, 0.8, chunk_tokens=0)
    chunked = response_logprobs(model, prompts, responses, 0.8, chunk_tokens=5)
    assert [len(x) for x in chunked] == [12, 1, 30, 0]
    assert max(abs(a - b) for w, c in zip(whole, chunked) for a, b in zip(w, c)) <= 1e-6
    # the old path: the model's own logits of each row alone
    for p, r, got in zip(prompts, responses, chunked):
        if r:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([p + r])).logits[:, len(p) - 1:-1]
            alone = token_logprobs(logits, torch.tensor([r]), 0.8)[0]
            assert float((torch.tensor(got) - alone).abs().max()) <= 1e-5
