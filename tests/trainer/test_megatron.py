"""The megatron back end's weight conversion (``relax.trainer.backends.megatron_convert``):
HF -> Megatron TP shards -> HF is exact, and the shards hold what megatron-core expects
(query groups interleaved and kept whole per TP rank, [gate; up] per rank, vocabulary
padding as zero rows). Tiny models built from transformers configs, random weights:
grouped-query attention, an odd vocabulary, tied and untied heads, Qwen2's QKV bias."""

from __future__ import annotations

import pytest
import torch

from relax.trainer.backends.megatron_convert import (
    Layout,
    hf_to_megatron,
    interleave_qkv,
    megatron_to_hf,
    split_qkv,
)


def _model(family: str, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=1003, tie_word_embeddings=tied)
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw))
    return Qwen2ForCausalLM(Qwen2Config(**kw))


CASES = [("llama", True), ("llama", False), ("qwen2", False)]


@pytest.mark.parametrize("te", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(("family", "tied"), CASES)
def test_hf_megatron_hf_round_trip_is_exact(family, tied, tp, te):
    model = _model(family, tied)
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    lay = Layout.from_hf_config(model.config, te=te)
    shards = hf_to_megatron(hf, lay, tp)
    back = megatron_to_hf(shards, lay)
    assert back.keys() == hf.keys()
    for k in hf:
        assert back[k].shape == hf[k].shape and torch.equal(back[k], hf[k]), k
    # vocabulary padded to a multiple of 128 * tp, with zero rows, split over the ranks
    emb = [s["embedding.word_embeddings.weight"] for s in shards]
    assert sum(e.shape[0] for e in emb) == lay.padded_vocab(tp) == (1024 if tp == 1 else 1024)
    assert torch.count_nonzero(torch.cat(emb)[1003:]) == 0
    assert ("output_layer.weight" in shards[0]) == (not tied)
    norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
    assert f"decoder.layers.0.{norm}" in shards[-1]


@pytest.mark.parametrize("tp", [1, 2])
def test_each_rank_holds_whole_query_groups_and_its_gate_and_up_rows(tp):
    """Megatron's meaning, not just a round trip: rank r's linear_qkv rows are, group by
    group, the group's 2 query heads, its key head, its value head (head_dim 16 rows
    each), for the groups r * G/tp ..; its linear_fc1 is gate rows then up rows of the
    r-th chunk."""
    model = _model("qwen2", False)
    hf = {k: v.detach() for k, v in model.state_dict().items()}
    lay = Layout.from_hf_config(model.config)
    shards = hf_to_megatron(hf, lay, tp)
    a, d = "model.layers.1.self_attn.", 16
    q, k, v = hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]
    per_rank = lay.groups // tp
    for r, s in enumerate(shards):
        qkv = s["decoder.layers.1.self_attention.linear_qkv.weight"]
        assert qkv.shape == (per_rank * (2 + 2) * d, 64)
        for j in range(per_rank):
            g = r * per_rank + j
            block = qkv[j * 4 * d:(j + 1) * 4 * d]
            assert torch.equal(block[:2 * d], q[g * 2 * d:(g + 1) * 2 * d])  # heads 2g, 2g+1
            assert torch.equal(block[2 * d:3 * d], k[g * d:(g + 1) * d])
            assert torch.equal(block[3 * d:], v[g * d:(g + 1) * d])
        bias = s["decoder.layers.1.self_attention.linear_qkv.bias"]
        assert torch.equal(bias[:2 * d], hf[a + "q_proj.bias"][r * per_rank * 2 * d:][:2 * d])
        fc1 = s["decoder.layers.1.mlp.linear_fc1.weight"]
        rows = 96 // tp
        assert torch.equal(fc1[:rows], hf["model.layers.1.mlp.gate_proj.weight"][r * rows:][:rows])
        assert torch.equal(fc1[rows:], hf["model.layers.1.mlp.up_proj.weight"][r * rows:][:rows])
        proj = s["decoder.layers.1.self_attention.linear_proj.weight"]
        assert torch.equal(proj, hf[a + "o_proj.weight"][:, r * 64 // tp:(r + 1) * 64 // tp])


def test_interleave_and_split_are_inverse_for_weights_and_biases():
    lay = Layout(layers=1, heads=6, groups=3, head_dim=4, vocab=10, tied=True)
    q, k, v = torch.randn(24, 5), torch.randn(12, 5), torch.randn(12, 5)
    qkv = interleave_qkv(q, k, v, lay)
    assert qkv.shape == (3 * (2 + 2) * 4, 5)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(qkv, lay), (q, k, v)))
    qb, kb, vb = torch.randn(24), torch.randn(12), torch.randn(12)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(interleave_qkv(qb, kb, vb, lay), lay),
                                                 (qb, kb, vb)))


def test_a_tp_size_that_splits_a_query_group_is_refused():
    lay = Layout(layers=1, heads=4, groups=2, head_dim=16, vocab=10, tied=True)
    with pytest.raises(ValueError, match="groups % tp == 0"):
        hf_to_megatron({}, lay, 4)
    assert Layout(1, 4, 4, 16, 1003, True, divisible_by=128).padded_vocab(4) == 1024
    assert Layout(1, 4, 4, 16, 1025, True, divisible_by=128).padded_vocab(2) == 1280


def _mcore_shapes(tp: int, rank: int, port: int, out: str) -> None:
    """One TP rank: build megatron-core's GPTModel (local spec, CPU initialisation, gloo)
    for the qwen2 test model's shapes and save ``{name: shape}`` of its state dict."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=96, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=True,
        use_cpu_initialization=True, tensor_model_parallel_size=tp, params_dtype=torch.float32)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=1024,
                     max_sequence_length=64, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope")
    torch.save({k: tuple(v.shape) for k, v in model.state_dict().items()
                if not k.endswith("_extra_state")}, f"{out}/tp{tp}_rank{rank}.pt")


@pytest.mark.parametrize("tp", [1, 2])
def test_the_shards_have_megatron_cores_names_and_shapes(tmp_path, tp):
    """Against megatron-core itself (the ``megatron`` extra; skipped without it): every
    tensor of each rank's GPTModel, by name and shape, and nothing else."""
    pytest.importorskip("megatron.core")
    import subprocess
    import sys

    from relax.trainer.distributed import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, str(tp), str(r), str(port),
                               str(tmp_path)], stderr=subprocess.PIPE, text=True)
             for r in range(tp)]
    for p in procs:
        assert p.wait(timeout=240) == 0, p.stderr.read()[-3000:]
    model = _model("qwen2", False)
    lay = Layout.from_hf_config(model.config)
    shards = hf_to_megatron({k: v.detach() for k, v in model.state_dict().items()}, lay, tp)
    for r, shard in enumerate(shards):
        want = torch.load(tmp_path / f"tp{tp}_rank{r}.pt")
        assert {k: tuple(v.shape) for k, v in shard.items()} == want


if __name__ == "__main__":
    import sys

    _mcore_shapes(*(int(a) for a in sys.argv[1:4]), sys.argv[4])
