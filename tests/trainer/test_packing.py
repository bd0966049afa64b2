"""Padding-free packing (``trainer.packing``): a micro-batch's (prompt, response) rows laid
end to end in one row with position ids restarting per row. transformers' packed-sequence
path keeps attention inside each row (SDPA and eager, Llama and Qwen2, on the CPU), so the
per-token log-probs, the loss and its gradients equal the padded path's (<= 1e-5, fp32),
through a whole optimizer step too; a micro-batch with media keeps the padded path."""

from __future__ import annotations

import pytest
import torch

from relax.streams.codec import group_by_key
from relax.trainer.backends.torch_backend import TorchBackend, packed_hidden
from relax.trainer.batching import MicroBatch, micro_batches, packed_row
from relax.trainer.config import TrainerConfig

from relax.trainer.backends.step import micro_batch_loss
from relax.trainer.losses.aggregate import mask_counts

from testdata import train_sample_table

TOL = 1e-5
VOCAB = 512


def tiny_model(arch: str = "llama"):
    """A random 2-layer fp32 model built from a transformers config class."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                      "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    cfg = cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=False, attn_implementation="sdpa")
    return model_cls(cfg).float()


def _pass(backend, mbs):
    """Log-probs and entropies (real tokens), loss and parameter gradients of one step's
    backward over ``mbs``, the loss normalised by their counts."""
    backend.optimizer.zero_grad(set_to_none=True)
    counts = [mask_counts(mb.loss_mask) for mb in mbs]
    tokens, seqs = sum(c[0] for c in counts), sum(c[1] for c in counts)
    lps, ents, total = [], [], 0.0
    for mb in mbs:
        lp, ent = backend.logprobs(mb, with_entropy=True)
        loss, _ = micro_batch_loss(backend.cfg, mb, lp, ent, None, tokens, seqs)
        loss.backward()
        valid = mb.response_mask.bool()
        lps.append(lp.detach()[valid])
        ents.append(ent.detach()[valid])
        total += float(loss.detach())
    grads = {n: p.grad.clone() for n, p in backend.model.named_parameters()
             if p.requires_grad}
    return torch.cat(lps), torch.cat(ents), total, grads


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _mb(prompts: list[list[int]], prompt_of_row: list[int],
        responses: list[list[int]]) -> MicroBatch:
    P, R = max(map(len, prompts)), max(map(len, responses))
    pid, pm = torch.zeros(len(prompts), P, dtype=torch.long), torch.zeros(len(prompts), P,
                                                                          dtype=torch.long)
    for u, p in enumerate(prompts):
        pid[u, P - len(p):] = torch.tensor(p)
        pm[u, P - len(p):] = 1
    rid, rm = torch.zeros(len(responses), R, dtype=torch.long), torch.zeros(
        len(responses), R, dtype=torch.long)
    for b, r in enumerate(responses):
        rid[b, :len(r)] = torch.tensor(r)
        rm[b, :len(r)] = 1
    zero = torch.zeros(len(responses), R)
    return MicroBatch(prompt_ids=pid, prompt_mask=pm, prompt_of_row=torch.tensor(prompt_of_row),
                      response_ids=rid, response_mask=rm, loss_mask=rm.float(),
                      advantages=zero, rollout_logprobs=zero, ref_logprobs=None,
                      temperature=1.0, rollout_ids=[str(b) for b in range(len(responses))])


def test_packed_row_lays_rows_end_to_end():
    mb = _mb([[11, 12, 13], [21]], [0, 1, 0], [[31, 32], [41, 42, 43], [51]])
    row = packed_row(mb)
    assert row.input_ids.tolist() == [[11, 12, 13, 31, 32, 21, 41, 42, 43, 11, 12, 13, 51]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3]]
    # the token before each response token: 13 -> 31, 31 -> 32, 21 -> 41, ... 13 -> 51
    assert row.predict_at.tolist() == [2, 3, 5, 6, 7, 11]
    assert row.input_ids[0, row.predict_at + 1].tolist() == \
        mb.response_ids[mb.response_mask.bool()].tolist()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_attention_stays_inside_each_packed_row(arch, attn):
    """Each row's hidden states in the packed forward equal the row's forward alone: no
    token attends to another row (a shared mask would change every row after the first)."""
    model = tiny_model(arch)
    model.config._attn_implementation = attn
    model.eval()
    mb = _mb([[5, 6, 7, 8], [9, 10]], [0, 1, 0, 1], [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10, 11]])
    with torch.no_grad():
        got = packed_hidden(model, mb)
        want = []
        for b in range(4):
            p = mb.prompt_ids[mb.prompt_of_row[b]][mb.prompt_mask[mb.prompt_of_row[b]].bool()]
            r = mb.response_ids[b][mb.response_mask[b].bool()]
            h = model.get_decoder()(input_ids=torch.cat([p, r])[None]).last_hidden_state[0]
            want.append(h[len(p) - 1:len(p) - 1 + len(r)])
    assert float((got - torch.cat(want)).abs().max()) <= TOL


def _groups(seed: int, response_len=(1, 40)):
    t = train_sample_table(4, group_size=3, prompt_len=(2, 12), response_len=response_len,
                           seed=seed, vocab=VOCAB)
    return [g for _, g in group_by_key(t, "group_id")]


@pytest.mark.parametrize("arch,lora", [("llama", None), ("qwen2", None), ("llama", {"r": 4})])
def test_packed_logprobs_loss_and_gradients_equal_the_padded_path(arch, lora):
    opts = dict(loss={"entropy_coef": 0.01}, old_logprobs="detached", lora=lora)
    # a model each: LoRA wraps the one it is given (same seeds: same weights and adapters)
    padded = TorchBackend(TrainerConfig(**opts), model=tiny_model(arch))
    packed = TorchBackend(TrainerConfig(packing=True, **opts), model=tiny_model(arch))
    mbs = micro_batches(_groups(1), 200)
    assert len(mbs) > 1 and max(mb.response_ids.shape[0] for mb in mbs) > 1
    lp0, ent0, loss0, g0 = _pass(padded, mbs)
    lp1, ent1, loss1, g1 = _pass(packed, mbs)
    assert lora is None or all("lora_" in n for n in g0)  # the adapters' gradients only
    assert float((lp1 - lp0).abs().max()) <= TOL
    assert float((ent1 - ent0).abs().max()) <= TOL
    assert abs(loss1 - loss0) <= TOL
    assert _max_diff(g1, g0) <= TOL
    assert max(float(g.abs().max()) for g in g0.values()) > 1e-3  # gradients not ~0


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_a_packed_optimizer_step_equals_the_padded_one(gradient_checkpointing):
    """Whole steps (recomputed pi_old, clipping, chunked head, with and without
    checkpointed decoder layers): the same metrics and the same weights after two steps."""
    cfg = dict(optim={"lr": 1e-3, "grad_clip": 0.5}, old_logprobs="recompute",
               loss={"entropy_coef": 0.01}, logits_chunk_tokens=16,
               gradient_checkpointing=gradient_checkpointing)
    runs = []
    for packing in (False, True):
        b = TorchBackend(TrainerConfig(packing=packing, **cfg), model=tiny_model())
        stats = [b.train_step(micro_batches(_groups(s), 300)) for s in (2, 3)]
        runs.append((stats, b.named_tensors()))
    (s0, w0), (s1, w1) = runs
    for a, b in zip(s0, s1):
        for k in ("loss", "policy_loss", "entropy", "grad_norm", "ppo_kl"):
            assert abs(a[k] - b[k]) <= TOL * max(1.0, abs(a[k])), (k, a[k], b[k])
    assert _max_diff(w0, w1) <= TOL
    assert _max_diff(w0, tiny_model().state_dict()) > 1e-4  # the steps moved the weights


def test_packing_needs_the_torch_back_end():
    with pytest.raises(ValueError, match="trainer.packing"):
        TrainerConfig(backend="megatron", packing=True)


def test_a_micro_batch_with_media_keeps_the_padded_path():
    """Rows with an image: the packed forward has no place for pixel values, so such a
    micro-batch runs the padded path; its log-probs are the padded ones."""
    from relax.producers.media import MediaOptions, media_item
    from relax.producers.sources import read_source
    from relax.trainer.batching import collate
    from relax.trainer.models import load_model, load_processor
    from relax.trainer.multimodal import encode_prompt

    import pyarrow as pa

    from relax.schemas.v1 import TRAIN_SAMPLES

    proc = load_processor("tiny-vlm")
    rows = []
    for i, r in enumerate(read_source("easy_vqa:test?size=2&seed=4")):
        from pathlib import Path

        items = [media_item("image", Path(r.record["image"]).read_bytes(), "image",
                            MediaOptions())]
        ids, _ = encode_prompt(proc, [{"role": "user", "content": r.record["question"]}], items)
        for k, n in enumerate((3, 9)):
            rows.append(dict(
                rollout_id=f"g{i}/{k}", group_id=f"g{i}", prompt_id=f"p{i}", dataset="vqa",
                sample_index=k, group_size=2, prompt_ids=ids, response_ids=[40 + k] * n,
                loss_mask=[1] * n, logprobs=[-1.0] * n, ref_logprobs=None,
                advantages=[1.0] * n, reward=1.0, reward_components=[("correct", 1.0)],
                token_policy_versions=None, policy_version_start=0, policy_version_end=0,
                finish_reason="stop", temperature=1.0, top_p=1.0, top_k=0, drop_reason=None,
                finished_at=0, media=items))
    mb = collate(pa.Table.from_pylist(rows, schema=TRAIN_SAMPLES))
    assert mb.media
    model = load_model("tiny-vlm")
    with torch.no_grad():
        lp0, _ = TorchBackend(TrainerConfig(model="tiny-vlm"), model=model,
                              device="cpu").logprobs(mb)
        lp1, _ = TorchBackend(TrainerConfig(model="tiny-vlm", packing=True), model=model,
                              device="cpu").logprobs(mb)
    assert torch.equal(lp0, lp1) and lp0[mb.response_mask.bool()].abs().min() > 0
