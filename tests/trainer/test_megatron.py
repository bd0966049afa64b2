"""The megatron back end (issue 18).

Weight conversion (``relax.trainer.backends.megatron_convert``): HF -> Megatron TP shards
-> HF is exact, and the shards hold what megatron-core expects (query groups interleaved
and kept whole per TP rank, [gate; up] per rank, vocabulary padding as zero rows). Tiny
models built from transformers configs, random weights: grouped-query attention, an odd
vocabulary, tied and untied heads, Qwen2's QKV bias; pipeline stages split and join.

The back end (``relax.trainer.backends.megatron_backend``): its ranks run as
subprocesses (this file as a script) over gloo on loopback, load the shards into
megatron-core 0.16.1's own GPTModel (``load_state_dict``: every name and shape must be
megatron-core's) and take two AdamW steps on the same batches as the torch back end:
log-probs, entropy, losses and the updated weights in HF names within 1e-5 (fp32), at
TP x PP 1x1, 2x1, 1x2 and 2x2 (relax's 1F1B schedule); in bfloat16, PP 2 equal to PP 1
(a tied embedding within 2 bf16 steps); a TP-2 checkpoint resumes at
TP 1 and at PP 2; and TP-2 and PP-2 ``relax train`` runs through the broker. Skipped
without the ``megatron`` extra."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax.trainer.backends.megatron_convert import (
    Layout,
    hf_to_megatron,
    interleave_qkv,
    from_stages,
    megatron_to_hf,
    split_qkv,
    stage_layers,
    to_stage,
)


def _model(family: str, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=1003, tie_word_embeddings=tied)
    torch.manual_seed(0)
    if family == "llama":  # a pad id that the batches' prompts hold, as relax's models do
        return LlamaForCausalLM(LlamaConfig(pad_token_id=PAD_ID, **kw))
    return Qwen2ForCausalLM(Qwen2Config(**kw))


CASES = [("llama", True), ("llama", False), ("qwen2", False)]
PAD_ID = 88
"""The Llama models' ``pad_token_id``: a token of both step batches' prompts. HF's
embedding never updates the pad row from its lookups (``nn.Embedding(padding_idx)``;
relax's SmolLM2 models pad with ``<|im_end|>``, id 2, which ends every prompt turn), so
the megatron back end must not either."""


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


@pytest.mark.parametrize(("family", "tied"), CASES)
def test_pipeline_stages_split_the_layers_and_join_back_exactly(family, tied):
    """tp 2 x pp 2: stage 0 holds the embedding and layer 0, stage 1 layer 1 (named 0, as
    megatron-core's TransformerBlock numbers a stage's layers), the final norm and the
    output layer (a tied model: a copy of the embedding); joined back, the shards equal
    hf_to_megatron's and the HF dict is exact."""
    model = _model(family, tied)
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    lay = Layout.from_hf_config(model.config)
    shards = hf_to_megatron(hf, lay, 2)
    for shard in shards:
        first, last = (to_stage(shard, lay, 2, s) for s in (0, 1))
        assert "embedding.word_embeddings.weight" in first and "output_layer.weight" in last
        assert "decoder.final_layernorm.weight" in last
        assert not any(k.startswith("decoder.layers.1.") for k in (*first, *last))
        qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
        assert torch.equal(last[qkv], shard[qkv.replace(".0.", ".1.")])
        if tied:
            assert torch.equal(last["output_layer.weight"],
                               shard["embedding.word_embeddings.weight"])
        joined = from_stages([first, last], lay)
        assert joined.keys() == shard.keys()
        assert all(torch.equal(joined[k], shard[k]) for k in shard)
    back = megatron_to_hf([from_stages([to_stage(sh, lay, 2, s) for s in (0, 1)], lay)
                           for sh in shards], lay)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


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


def test_the_1f1b_order_keeps_at_most_p_minus_s_micro_batches_alive():
    """Stage s of p: p - s - 1 warm-up forwards, then one forward and one backward in
    turn; every micro-batch once forward, then once backward; at most p - s alive."""
    from relax.trainer.backends.megatron_pipeline import one_f_one_b

    assert one_f_one_b(3, 0, 1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert one_f_one_b(4, 0, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3),
                                    ("B", 1), ("B", 2), ("B", 3)]
    for p, n in ((2, 1), (3, 2), (4, 7)):
        for stage in range(p):
            order = one_f_one_b(n, stage, p)
            assert sorted(order) == sorted([("F", i) for i in range(n)] +
                                           [("B", i) for i in range(n)])
            alive = peak = 0
            for kind, i in order:
                assert kind == "F" or ("F", i) in order[:order.index((kind, i))]
                alive += 1 if kind == "F" else -1
                peak = max(peak, alive)
            assert peak == min(p - stage, n), (p, n, stage)


# ---------------------------------------------------------------------------- the back end
STEP_CFG = {"optim": {"lr": 1e-4, "grad_clip": 0.5}, "old_logprobs": "recompute",
            "loss": {"entropy_coef": 0.01}, "seed": 3}
"""Clipping on (the norm is ~1.9), recomputed pi_old, an entropy term: every path of a
step. lr 1e-4: AdamW's first steps move each weight by ~lr whatever its gradient's size,
so a wrong gradient (sign, layout) shows as ~1e-4, 10x the tolerance, while fp32 noise
on gradients near AdamW's eps (1e-8) stays ~1e-6 (at lr 1e-3 it reaches 1e-5)."""
BUDGET, TEMPERATURE, TOL = 40, 0.7, 1e-5


def _step_batches() -> list[list]:
    """Two global batches of 4 groups x 3 rows (token ids < 200, temperature 0.7)."""
    import pyarrow as pa
    from testdata import train_sample_table

    from relax.streams.codec import group_by_key

    out = []
    for seed in (5, 6):
        t = train_sample_table(4, group_size=3, seed=seed)
        t = t.set_column(t.schema.get_field_index("temperature"), "temperature",
                         pa.array([TEMPERATURE] * t.num_rows))
        out.append([g for _, g in group_by_key(t, "group_id")])
    return out


def _steps(backend, load: str | None, save: str | None) -> dict:
    """Log-probs/entropy of the first batch before any step, then the two steps (or the
    second only, after loading ``load``); a checkpoint after step 1 goes to ``save``."""
    from relax.trainer.batching import micro_batches

    batches = [micro_batches(g, BUDGET) for g in _step_batches()]
    out: dict = {"stats": [], "weights": []}
    if load:
        if dist_rank() == 0:
            backend.load(Path(load))
        backend.broadcast_state()
        batches = batches[1:]
    else:
        with torch.no_grad():
            pairs = [backend.logprobs(mb, with_entropy=True) for mb in batches[0]]
        out["logprobs"] = [lp for lp, _ in pairs]
        out["entropy"] = [e for _, e in pairs]
    for i, mbs in enumerate(batches):
        out["stats"].append(backend.train_step(mbs, gather_optimizer=bool(save) and i == 0))
        out["weights"].append({k: v.clone() for k, v in backend.named_tensors().items()})
        if save and i == 0 and dist_rank() == 0:
            backend.save(Path(save))
    return out


def dist_rank() -> int:
    from relax.trainer.distributed import rank_and_world

    return rank_and_world()[0]


def _megatron_worker(tp: int, pp: int, rank: int, port: int, jobs: str) -> None:
    """One rank of the megatron back end (``tp * pp`` of them) running each job of the
    JSON list ``jobs`` (``[model_dir, out, load, save, dtype]``; :func:`_steps`; dtype
    ``bf16`` trains the model in bfloat16) in turn on one process group; rank 0 writes
    each ``out``."""
    import json

    from relax.trainer.backends.megatron_backend import MegatronBackend
    from relax.trainer.config import TrainerConfig
    from relax.trainer.distributed import init_data_parallel
    from relax.trainer.models import load_model

    if tp * pp > 1:
        init_data_parallel(rank, tp * pp, master_port=port)
    for model_dir, out, load, save, dtype in json.loads(jobs):
        model = load_model(model_dir).to(torch.bfloat16) if dtype == "bf16" else None
        b = MegatronBackend(TrainerConfig(model=model_dir, backend="megatron",
                                          megatron={"tp": tp, "pp": pp}, **STEP_CFG),
                            model=model)
        res = _steps(b, load or None, save or None)
        if rank == 0:
            torch.save(res, out)


def _run_megatron(tp: int, pp: int, jobs: list[tuple]) -> list[dict]:
    """``jobs`` (model folder, output file, checkpoint to load, checkpoint to save, dtype) run
    one after another by one launch of ``tp * pp`` rank processes (the ~13 s import of
    megatron-core paid once); their results in order."""
    import json
    import subprocess
    import sys

    from relax.streams.ports import free_port

    port = free_port()
    spec = json.dumps([[str(x) for x in job] for job in jobs])
    procs = [subprocess.Popen([sys.executable, __file__, str(tp), str(pp), str(r), str(port),
                               spec], stderr=subprocess.PIPE, text=True)
             for r in range(tp * pp)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    failed = [f"rank {r}: {err[-3000:]}" for r, (p, err) in enumerate(zip(procs, errs))
              if p.returncode != 0]
    assert not failed, "\n".join(failed)
    return [torch.load(job[1]) for job in jobs]


def _reference(model_dir: Path) -> dict:
    from relax.trainer.backends.torch_backend import TorchBackend
    from relax.trainer.config import TrainerConfig

    return _steps(TorchBackend(TrainerConfig(model=str(model_dir), **STEP_CFG)), None, None)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(float((a[k] - b[k]).abs().max()) for k in a)


CASES_STEP = [(1, 1, "llama", True), (2, 1, "llama", True), (2, 1, "qwen2", False),
              (1, 2, "llama", True), (2, 2, "qwen2", False)]
"""(tp, pp, family, tied): grouped-query attention (4 heads, 2 groups) and a vocabulary of
1003 (padded to 1024) in all; Qwen2 adds the QKV bias and an untied LM head. At pp 2
each stage holds one of the two layers; the tied Llama's last stage a copy of the
embedding."""


@pytest.fixture(scope="module")
def step_runs(tmp_path_factory):
    """Each case of ``CASES_STEP`` run by the megatron back end (its TP ranks in
    subprocesses; a checkpoint after step 1) and by the torch back end, on the same
    model and batches; the tp=2 Llama checkpoint resumed at tp=1 and at pp=2; both models
    in bfloat16 at pp 1 and 2."""
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("megatron")
    runs = {}
    for family, tied in {(f, t) for _, _, f, t in CASES_STEP}:
        _model(family, tied).save_pretrained(root / family)
        runs[family] = _reference(root / family)
    launches: dict[tuple[int, int], list] = {}
    for tp, pp, family, _ in CASES_STEP:
        name = f"{family}{tp}{pp}"
        launches.setdefault((tp, pp), []).append(
            ((tp, pp, family), (root / family, root / f"{name}.pt", "", root / f"ckpt-{name}",
                                "fp32")))
    for key in ((1, 1), (1, 2)):
        launches[key].append((("resumed", *key), (root / "llama", root / f"resumed{key}.pt",
                                                  root / "ckpt-llama21", "", "fp32")))
        for family in ("llama", "qwen2"):
            launches[key].append((("bf16", *key, family),
                                  (root / family, root / f"bf16{key}{family}.pt", "", "", "bf16")))
    # tp 2 first: the other launches resume its checkpoint
    for tp, pp in sorted(launches, key=lambda k: (k != (2, 1), k)):
        keys, jobs = zip(*launches[(tp, pp)])
        runs.update(zip(keys, _run_megatron(tp, pp, list(jobs))))
    runs["initial"] = {k: v.detach() for k, v in _model("llama", True).state_dict().items()}
    return runs


def _real(values: list, masks: list) -> torch.Tensor:
    """The values at real response tokens (padding positions differ by design: the torch
    back end masks them out of attention, megatron's right-padded rows do not)."""
    return torch.cat([v[m.bool()] for v, m in zip(values, masks)])


@pytest.mark.parametrize(("tp", "pp", "family", "tied"), CASES_STEP)
def test_megatron_logprobs_loss_and_step_match_the_torch_back_end(step_runs, tp, pp, family,
                                                                  tied):
    from relax.trainer.batching import micro_batches

    got, ref = step_runs[(tp, pp, family)], step_runs[family]
    masks = [mb.response_mask for mb in micro_batches(_step_batches()[0], BUDGET)]
    for key in ("logprobs", "entropy"):
        diff = (_real(got[key], masks) - _real(ref[key], masks)).abs().max()
        assert diff <= TOL, (key, float(diff))
    for g, r in zip(got["stats"], ref["stats"]):
        for k in ("loss", "policy_loss", "entropy", "ppo_kl"):
            assert abs(g[k] - r[k]) <= TOL, (k, g[k], r[k])
        # torch's clip_grad_norm_ sums in float32 (~8e-6 relative off the float64 value)
        assert abs(g["grad_norm"] - r["grad_norm"]) <= 2e-5 * r["grad_norm"]
        assert g["tokens_trained"] == r["tokens_trained"] and g["lr"] == r["lr"]
    for w_got, w_ref in zip(got["weights"], ref["weights"]):  # HF names and shapes, all
        assert _max_diff(w_got, w_ref) <= TOL


def test_the_steps_moved_the_weights_by_far_more_than_the_tolerance(step_runs):
    """Against a test that cannot fail: two steps at lr 1e-4 move weights by ~2e-4."""
    assert _max_diff(step_runs["llama"]["weights"][1], step_runs["initial"]) > 10 * TOL


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 2)])
def test_a_tp2_checkpoint_resumes_at_another_split_with_the_same_second_step(step_runs, tp, pp):
    """The checkpoint holds HF weights and the AdamW moments by HF name: a tp=1 back end,
    and a pp=2 one, restored from the tp=2 one take the second step of the uninterrupted
    run."""
    resumed, ref = step_runs[("resumed", tp, pp)], step_runs["llama"]
    assert abs(resumed["stats"][0]["loss"] - ref["stats"][1]["loss"]) <= TOL
    assert _max_diff(resumed["weights"][0], ref["weights"][1]) <= TOL


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_bf16_pipeline_stages_train_as_one_stage(step_runs, family):
    """In bfloat16 the activations and their gradients cross the stages in the model's
    dtype: pp 2 gives pp 1's log-probs and updated weights exactly, except a tied
    embedding: its two gradients, bf16 each, are summed by the all-reduce, not
    accumulated in one tensor by autograd (measured: 22 of its 64,192 values differ
    after two steps, by at most 2 bf16 steps)."""
    one, two = step_runs[("bf16", 1, 1, family)], step_runs[("bf16", 1, 2, family)]
    for a, b in zip(one["logprobs"], two["logprobs"]):
        assert torch.equal(a, b)
    tied = {"model.embed_tokens.weight", "lm_head.weight"} if family == "llama" else set()
    for wa, wb in zip(one["weights"], two["weights"]):
        assert wa.keys() == wb.keys()
        for k in wa:
            assert wa[k].dtype == wb[k].dtype == torch.bfloat16, k
            if k not in tied:
                assert torch.equal(wa[k], wb[k]), k
                continue
            x, y = wa[k].float(), wb[k].float()
            ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(
                x.abs().clamp(min=1e-30))))
            assert ((x - y).abs() <= 2 * ulp).all(), k
            assert (x != y).float().mean() < 0.01, k


def test_settings_the_back_end_cannot_build_are_refused():
    from transformers import GPT2Config, LlamaConfig

    from relax.trainer.backends.megatron_model import transformer_config
    from relax.trainer.config import TrainerConfig

    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        transformer_config(GPT2Config(), 1)
    scaled = LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                          "rope_theta": 1e4})
    with pytest.raises(ValueError, match="RoPE type 'linear'"):
        transformer_config(scaled, 1)
    with pytest.raises(ValueError, match="pp"):
        TrainerConfig(backend="megatron", megatron={"tp": 1, "pp": 0})
    with pytest.raises(ValueError, match="pipeline parallel size 3: the model's 2 layers"):
        stage_layers(Layout.from_hf_config(_model("llama", True).config), 3, 0)
    pytest.importorskip("megatron.core")
    from relax.trainer.backends.megatron_backend import MegatronBackend

    with pytest.raises(ValueError, match=r"tp=2 x pp=1 needs 2 trainer processes.*got 1"):
        MegatronBackend(TrainerConfig(backend="megatron", megatron={"tp": 2}))


@pytest.mark.e2e
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_a_tp2_and_a_pp2_megatron_run_through_the_broker(broker, local_ray, tmp_path, tp, pp):
    """``relax train`` of the tiny recipe with ``trainer.backend=megatron``, tp=2 or pp=2
    (rank 0 the trainer stage, rank 1 its child, gloo on loopback): every rollout
    accounted, both ranks take every step, the rollout engine samples with the weights
    the megatron back end published (policy_version >= 1 on the rollouts), the final
    model is an HF model whose weights moved, and the step-3 checkpoint holds the AdamW
    moments by HF name (gathered over the TP or the pipeline group)."""
    pytest.importorskip("megatron.core")
    import uuid

    from testdata import tiny_recipe

    from relax.infra.control.launch import train
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table
    from relax.trainer.models import load_model

    run = f"mg{tp}{pp}" + uuid.uuid4().hex[:4]
    recipe = tiny_recipe(broker, tmp_path, run, "trainer.backend=megatron",
                         f"trainer.megatron.tp={tp}", f"trainer.megatron.pp={pp}",
                         "resources.trainer.processes=2")
    s = train(recipe, say=lambda _: None, timeout_s=500)
    assert s["steps"] == 3 and s["balanced"], s
    assert s["trained"] + s["stale"] + s["filtered"] + s["errors"] == s["sampled"] > 0, s
    logs = Path(s["run_dir"]) / "logs"
    assert "rank 1 done after 3 steps" in (logs / "trainer-rank1.log").read_text()
    assert f"megatron tp={tp} x pp={pp} trainer: 2 ranks" in (logs / "trainer.log").read_text()
    versions = read_table(BusConfig(bootstrap_servers=broker), f"{run}.rollouts"
                          ).column("policy_version_start").to_pylist()
    assert max(versions) >= 1, versions
    final = load_model(str(Path(s["run_dir"]) / "final_model")).state_dict()
    start = load_model("tiny-llama").state_dict()
    assert final.keys() == start.keys()
    assert max(float((final[k] - start[k]).abs().max()) for k in final) > 1e-5
    opt = torch.load(Path(s["run_dir"]) / "checkpoints" / "step_000003" / "optimizer.pt",
                     weights_only=True)
    assert opt["steps_done"] == 3 and set(opt["optimizer"]["by_hf_name"]) == {"exp_avg",
                                                                              "exp_avg_sq"}


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testdata
    _megatron_worker(*(int(a) for a in sys.argv[1:5]), sys.argv[5])
