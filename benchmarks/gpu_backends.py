"""The megatron back end against the torch back end on one GPU (issue 18), and the
trainer, generation and weight-refit figures of one GPU (issue 19), in one prepared run.

    python benchmarks/gpu_backends.py --json /tmp/gpu_backends.json             # on a GPU
    python benchmarks/gpu_backends.py --model tiny-llama --steps 2 --groups 2 \\
        --max-new-tokens 8 --sections tiny,parity,train --json /tmp/g.json     # CPU smoke run

Sections, each printed as one line per figure and written to ``--json``:

* ``tiny``, ``arch`` and ``parity``: the same global batch and the same initial weights
  through the torch and the megatron back end (TP=1, ``trainer.backend: megatron`` on
  one device), in float32 and in bfloat16 (both models held in that dtype, AdamW on
  them): max |diff| of the response log-probs and entropies before the step, of the
  loss, of the clipped gradients (``grad_rel_diff``: over the largest gradient element)
  and of every updated weight after one AdamW step (HF names). AdamW's first step moves
  a weight by about ``lr * g / (|g| + eps)``, so gradients near ``eps`` (1e-8) that
  differ by float noise can move it by up to ``lr`` either way: on a deep model
  ``weights_max_diff`` is bounded by ``2 * lr``, and ``grad_rel_diff`` is the figure
  that shows agreement. ``tiny``: the tests' tiny Llama (grouped-query attention, odd
  vocabulary 1003, tied) and Qwen2 (QKV bias, untied) on random token batches;
  ``arch``: SmolLM2-135M's architecture with random weights on a random batch (no
  weights file needed); ``parity``: ``--model`` on the first real batch. With the deep
  models, ``floor_*``: the same figures between HF's ``sdpa`` and ``eager`` attention in
  the torch back end alone (the noise of a change of kernel order).
* ``train``: ``--steps`` GRPO steps of ``--model`` with each back end (float32 and
  bfloat16) on the same batches, sampled once up front by relax's HF engine from the
  initial weights (float32) on 2-digit additions asked to show their
  working: per step the loss and gradient norm (the loss curves), and steady
  tokens/s (steps 2..N): ``tokens_per_s`` counts prompt + response tokens of the rows
  trained (NeMo-RL's per-GPU figure: one GPU here), ``loss_tokens_per_s`` their
  response tokens under the loss (rows of groups without reward variance are not
  computed, as in the trainer stage). ``final_weights_max_diff``: torch vs megatron
  after all steps.
* ``generation``: response tokens/s of the HF engine (float32, one call per step of
  ``groups x group_size`` rows).
* ``refit``: what moving one version of the weights costs on this device: the back
  end's gathered weights flattened into one host buffer (``flatten_into``, the weight
  channel's layout), its crc32c checksum, and the install into a second model on the
  device (``install_weights``), in seconds and GB/s.

Only the back ends' own code is timed (``torch.cuda.synchronize`` around each step).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from relax.benchmarks import e2e_vs_trl as e2e
from relax.benchmarks.harness import write_result

STEP = {"optim": {"lr": 1e-4, "grad_clip": 0.5}, "old_logprobs": "recompute",
        "loss": {"entropy_coef": 0.01}, "seed": 3}
"""The parity step of ``tests/trainer/test_megatron.py``: clipping on, recomputed
pi_old, an entropy term."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def backend(kind: str, model_dir: str, dtype: torch.dtype, **cfg):
    """A ``kind`` (torch | megatron) back end on ``model_dir`` held in ``dtype``."""
    from relax.trainer.backends.megatron_backend import MegatronBackend
    from relax.trainer.backends.torch_backend import TorchBackend
    from relax.trainer.config import TrainerConfig
    from relax.trainer.models import load_model

    model = load_model(model_dir, dtype=dtype)
    tcfg = TrainerConfig(model=model_dir, backend=kind, **cfg)
    return (MegatronBackend if kind == "megatron" else TorchBackend)(tcfg, model=model)


def host(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu() for k, v in named.items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise ValueError(f"different weight names: {sorted(a.keys() ^ b.keys())[:5]}")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def grads(b) -> dict[str, torch.Tensor]:
    """The last step's clipped gradients by HF name, on the host (one process)."""
    if hasattr(b, "gpt"):  # megatron: the shards mapped to HF names as its weights are
        return host(b._gather({n: p.grad for n, p in b._params.items()}))
    return host({n: p.grad for n, p in b.model.named_parameters()})


def response_values(b, mbs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N], [N])`` float32 log-probs and entropies of the N real response tokens of
    ``mbs`` under back end ``b``'s current weights."""
    with torch.no_grad():
        pairs = [b.logprobs(mb, with_entropy=True) for mb in mbs]
    mask = [mb.response_mask.bool() for mb in mbs]
    return (torch.cat([p[0].float().cpu()[m] for p, m in zip(pairs, mask)]),
            torch.cat([p[1].float().cpu()[m] for p, m in zip(pairs, mask)]))


def floor(model_dir: str, mbs: list, dtype: torch.dtype) -> dict:
    """Max |diff| of the torch back end's log-probs and entropies under HF's two
    attention implementations (``sdpa``, ``eager``): what a mere change of kernel order
    costs in ``dtype``, the yardstick for :func:`parity`'s figures."""
    got = []
    for impl in ("sdpa", "eager"):
        b = backend("torch", model_dir, dtype, **STEP)
        b.model.set_attn_implementation(impl)
        got.append(response_values(b, mbs))
        del b
    (la, ea), (lb, eb) = got
    return {"floor_logprobs_max_diff": float((la - lb).abs().max()),
            "floor_entropy_max_diff": float((ea - eb).abs().max())}


def parity(model_dir: str, mbs: list, dtype: torch.dtype) -> dict:
    """Max |diff| torch vs megatron of one batch's log-probs, entropies, loss and the
    weights after one step (module docstring), and the :func:`floor`."""
    out, dtypes = {}, {}
    for kind in ("torch", "megatron"):
        b = backend(kind, model_dir, dtype, **STEP)
        lp, ent = response_values(b, mbs)
        stats = b.train_step(mbs)
        out[kind] = (lp, ent, stats["loss"], host(b.named_tensors()), grads(b))
        dtypes[kind] = {k: str(v.dtype) for k, v in b.named_tensors().items()}
        del b
    (lt, et, st, wt, gt), (lm, em, sm, wm, gm) = out["torch"], out["megatron"]
    both = gt.keys() & gm.keys()
    return {"logprobs_max_diff": float((lt - lm).abs().max()),
            "entropy_max_diff": float((et - em).abs().max()),
            "loss_diff": abs(st - sm), "loss": st,
            "grad_rel_diff": max_diff({k: gt[k] for k in both}, {k: gm[k] for k in both})
            / max(float(gt[k].abs().max()) for k in both),
            "weights_max_diff": max_diff(wt, wm), "tokens": int(lt.numel()),
            "same_published_dtypes": float(dtypes["torch"] == dtypes["megatron"]),
            **floor(model_dir, mbs, dtype)}


def tiny_parity(tmp: Path, dtype: torch.dtype) -> dict:
    """:func:`parity` on the tests' tiny Llama and Qwen2 with random token batches."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from relax.streams.codec import group_by_key
    from relax.tests.testdata import train_sample_table
    from relax.trainer.batching import micro_batches

    t = train_sample_table(4, group_size=3, seed=5)
    mbs = micro_batches([g for _, g in group_by_key(t, "group_id")], 40)
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=1003)
    res = {}
    for name, cls, c in (("tiny-llama-gqa-tied", LlamaForCausalLM, LlamaConfig(
            tie_word_embeddings=True, **kw)), ("tiny-qwen2", Qwen2ForCausalLM, Qwen2Config(
            tie_word_embeddings=False, **kw))):
        torch.manual_seed(0)
        d = tmp / name
        cls(c).save_pretrained(d)
        res[name] = parity(str(d), mbs, dtype)
    return res


SMOLLM2_ARCH = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                    bos_token_id=1, eos_token_id=2, pad_token_id=2)
"""SmolLM2-135M's ``LlamaConfig`` (its GGUF's, as ``relax.trainer.models`` converts it)."""


def arch_parity(tmp: Path, dtype: torch.dtype, groups: int = 8) -> dict:
    """:func:`parity` on SmolLM2-135M's architecture with random weights (no weights
    file needed) and a random batch of ``groups`` groups x 8 rows, prompts of 20-40
    tokens and responses of 60-120 (ids < 200, so the pad id 2 occurs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from relax.streams.codec import group_by_key
    from relax.tests.testdata import train_sample_table
    from relax.trainer.batching import micro_batches

    d = tmp / "smollm2-arch"
    if not d.exists():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SMOLLM2_ARCH)).save_pretrained(d)
    t = train_sample_table(groups, group_size=8, prompt_len=(20, 40), response_len=(60, 120),
                           seed=7)
    return parity(str(d), micro_batches([g for _, g in group_by_key(t, "group_id")],
                                        65536), dtype)


def additions(n: int, seed: int) -> list[dict]:
    """``n`` 2-digit addition questions with their sums (the demo's task)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    return out


def sample_batches(w: dict) -> tuple[list, dict]:
    """``w["steps"]`` batches of train samples sampled by the HF engine from the initial
    float32 weights; the engine's timing."""
    from relax.consumers.engines.hf import HFEngine
    from relax.trainer.models import load_model, load_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, rcfg, acfg = e2e.loop_configs(w)
    tok = load_tokenizer(w["model"])
    engine = HFEngine(load_model(w["model"], device=device), tok, engine_id="bench")
    rows = additions(w["steps"] * w["batch_groups"], w["seed"])
    batches, gen_s, gen_tokens, rewards = [], [], [], []
    for step in range(w["steps"]):
        batch = rows[step * w["batch_groups"]:(step + 1) * w["batch_groups"]]
        groups, timing = e2e.grpo_groups(engine, tok, batch, step, w, rcfg, acfg)
        batches.append(groups)
        gen_s.append(timing["gen_s"])
        gen_tokens.append(timing["gen_tokens"])
        rewards += [x for g in groups for x in g.column("reward").to_pylist()]
        print(f"sampled step {step}: {timing['gen_tokens']} tokens in {timing['gen_s']:.2f} s",
              flush=True)
    steady = slice(1, None) if len(gen_s) > 1 else slice(None)  # steps 2..N
    del engine
    return batches, {"gen_s": gen_s, "gen_tokens": gen_tokens,
                     "tokens_per_s": sum(gen_tokens[steady]) / sum(gen_s[steady]),
                     "reward_mean": sum(rewards) / len(rewards)}


def seq_tokens(mbs: list) -> int:
    """Prompt + response tokens of the rows of ``mbs`` (no padding)."""
    return sum(int(mb.prompt_mask.sum(-1)[mb.prompt_of_row].sum() + mb.response_mask.sum())
               for mb in mbs)


def train_run(kind: str, dtype: torch.dtype, w: dict, batches: list) -> tuple[dict, dict]:
    """``len(batches)`` steps of one back end; its per-step figures and final weights."""
    from relax.trainer.batching import informative_rows, loss_counts, micro_batches

    trainer, _, _ = e2e.loop_configs(w, budget=w["budget"])
    b = backend(kind, w["model"], dtype, **{k: v for k, v in trainer.items() if k != "model"})
    steps = []
    for groups in batches:
        # a batch with no reward variance (a random tiny model) still runs the step
        mbs = micro_batches(informative_rows(groups) or groups, w["budget"])
        sync()
        t = time.perf_counter()
        stats = b.train_step(mbs, counts=loss_counts(groups))
        sync()
        steps.append({"s": time.perf_counter() - t, "loss": stats["loss"],
                      "grad_norm": stats["grad_norm"], "tokens": seq_tokens(mbs),
                      "loss_tokens": sum(int(mb.loss_mask.sum()) for mb in mbs),
                      "rows": stats["rows_computed"]})
    final = host(b.named_tensors())
    refit = weight_refit(b.named_tensors(), w["model"], dtype)
    del b
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    steady = steps[1:] or steps
    secs = sum(s["s"] for s in steady)
    return {"steps": steps, "tokens_per_s": sum(s["tokens"] for s in steady) / secs,
            "loss_tokens_per_s": sum(s["loss_tokens"] for s in steady) / secs,
            "step_s": secs / len(steady), "refit": refit,
            "peak_gib": (torch.cuda.max_memory_allocated() / 2**30
                         if torch.cuda.is_available() else None)}, final


def weight_refit(named: dict[str, torch.Tensor], model: str, dtype: torch.dtype) -> dict:
    """Seconds of the weight channel's trainer side (flatten into a host buffer, crc32c)
    and of the install into a second model on the device (module docstring)."""
    from relax.streams.weights.install import install_weights
    from relax.streams.weights.layout import (
        build_manifest,
        checksum,
        flatten_into,
        total_bytes,
        views,
    )
    from relax.trainer.models import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_model(model, dtype=dtype, device=device)
    manifest = build_manifest(named)
    nbytes = total_bytes(manifest)
    flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    out = {"bytes": nbytes}
    for _ in range(2):  # the second pass is reported (the first pays for allocation)
        sync()
        t0 = time.perf_counter()
        flatten_into(flat, named, manifest)
        sync()
        t1 = time.perf_counter()
        digest = checksum(flat)
        t2 = time.perf_counter()
        install_weights(target, views(flat, manifest), 1)
        sync()
        t3 = time.perf_counter()
        out.update(flatten_s=t1 - t0, checksum_s=t2 - t1, install_s=t3 - t2,
                   total_s=t3 - t0, GBps=nbytes / (t3 - t0) / 1e9, checksum=digest)
    del target
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--groups", type=int, default=16, help="groups per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=65536,
                    help="max_tokens_per_microbatch (padded tokens)")
    ap.add_argument("--sections", default="tiny,parity,train",
                    help="tiny: parity of the tests' tiny models; arch: of SmolLM2-135M's "
                         "architecture, random weights; parity: of --model on a real "
                         "batch; train: the --steps runs")
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    import tempfile

    import megatron.core
    import transformers

    res: dict = {"env": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "megatron_core": megatron.core.__version__,
                         "device": (torch.cuda.get_device_name() if torch.cuda.is_available()
                                    else "cpu")}}
    print("env", json.dumps(res["env"]), flush=True)

    def save():
        write_result(a.json, res, transformers=transformers.__version__,
                     megatron_core=megatron.core.__version__)

    w = {**e2e.workload(a.steps), "model": a.model, "batch_groups": a.groups,
         "group_size": a.group_size, "max_new_tokens": a.max_new_tokens, "budget": a.budget,
         "prompt_field": "question", "label_field": "answer",
         "prompt_template": "{prompt} Show your working, then give the answer."}
    res["workload"] = {k: v for k, v in w.items() if k != "source"}
    sections = a.sections.split(",")
    batches = None
    if "tiny" in sections:
        res["parity"] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for dn, dt in DTYPES.items():
                res["parity"][dn] = got = tiny_parity(Path(tmp), dt)
                for m, r in got.items():
                    print(f"parity {dn} {m} " + " ".join(f"{k}={v:.3g}" for k, v in r.items()),
                          flush=True)
                save()
    if "arch" in sections:
        with tempfile.TemporaryDirectory() as tmp:
            for dn, dt in DTYPES.items():
                r = arch_parity(Path(tmp), dt)
                res.setdefault("parity", {}).setdefault(dn, {})["smollm2-arch-random"] = r
                print(f"parity {dn} smollm2-arch-random "
                      + " ".join(f"{k}={v:.3g}" for k, v in r.items()), flush=True)
                save()
    if "train" in sections or "parity" in sections:
        batches, res["generation"] = sample_batches(w)
        g = res["generation"]
        print(f"generation tokens_per_s={g['tokens_per_s']:.0f} reward={g['reward_mean']:.3f}",
              flush=True)
        save()
    if "parity" in sections:
        from relax.trainer.batching import micro_batches

        for dn, dt in DTYPES.items():
            r = parity(a.model, micro_batches(batches[0], a.budget), dt)
            res.setdefault("parity", {}).setdefault(dn, {})[a.model] = r
            print(f"parity {dn} {a.model} " + " ".join(f"{k}={v:.3g}" for k, v in r.items()),
                  flush=True)
            save()
    if "train" in sections:
        res["train"] = {}
        for dn, dt in DTYPES.items():
            finals = {}
            for kind in ("torch", "megatron"):
                r, finals[kind] = train_run(kind, dt, w, batches)
                res["train"][f"{kind}_{dn}"] = r
                f = r["refit"]
                print(f"train {kind} {dn} tokens_per_s={r['tokens_per_s']:.0f} "
                      f"loss_tokens_per_s={r['loss_tokens_per_s']:.0f} step_s={r['step_s']:.3f} "
                      f"loss={[round(s['loss'], 4) for s in r['steps']]} "
                      f"refit_s={f['total_s']:.3f} (flatten {f['flatten_s']:.3f}, checksum "
                      f"{f['checksum_s']:.3f}, install {f['install_s']:.3f}) "
                      f"GBps={f['GBps']:.2f}", flush=True)
                save()
            d = max_diff(finals["torch"], finals["megatron"])
            res["train"][f"final_weights_max_diff_{dn}"] = d
            t, m = res["train"][f"torch_{dn}"], res["train"][f"megatron_{dn}"]
            res["train"][f"megatron_over_torch_{dn}"] = m["tokens_per_s"] / t["tokens_per_s"]
            print(f"train {dn} final_weights_max_diff={d:.3g} megatron_over_torch="
                  f"{m['tokens_per_s'] / t['tokens_per_s']:.3f}", flush=True)
            save()
    save()


if __name__ == "__main__":
    main()
