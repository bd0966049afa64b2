"""The largest model that RL-trains on this machine's memory: relax against TRL's
GRPOTrainer, Qwen2-architecture models with random weights at Qwen2.5's shapes.

    python -m relax.benchmarks.memory                     # the sweep (~45 min on 2 cores)
    python -m relax.benchmarks.memory --configs lora_ckpt --systems trl --sizes 0.5b,1.5b

A try is one system, one configuration and one model size: 3 GRPO steps of one prompt
each (group 4, ``--new-tokens`` sampled tokens a response, 32 by default: a random model
all but never samples its EOS), AdamW, no KL (no reference model), reward = the response's character count / 100
(:func:`length_reward`: a random model's group always has variance, so every step trains).

Configurations (:data:`CONFIGS`):

* ``full``: full fine-tune, float32, no checkpointing;
* ``lora_ckpt``: LoRA (r 16, alpha 32, every linear layer of the decoder) + gradient
  checkpointing, float32;
* ``colocate_lora_ckpt_bf16``: the same in bfloat16 (weights bf16, adapters float32 as
  peft keeps them) and, for relax, ``mode: colocate``.

Systems: ``trl`` is TRL 1.16's ``GRPOTrainer`` in one process (generation with the
training model, ``peft_config``, ``gradient_checkpointing``, the model built in the
configuration's dtype). ``relax`` for ``full`` and ``lora_ckpt`` is relax's trainer
back end and HF engine on one model in one process (what the colocated stage runs,
without the bus: the least memory relax's parts need); for the colocate configuration
it is ``relax train`` on a colocate recipe (:func:`colocate_recipe`): the driver, the
run's Kafka broker, the reward and aggregate stages and the colocated trainer + engine,
every process of the run.

Each try runs in a child process that first writes 1000 to its
``/proc/self/oom_score_adj`` (if memory runs out, the kernel kills the benchmark, not
other work on the machine). The parent samples the resident set (``/proc/<pid>/statm``)
of every process of the child's tree (and of any process carrying the try's
environment tag, so daemonised ones count) every 0.25 s: ``peak_rss_gb`` is the peak of
that sum (GiB; libraries mapped by several processes are counted once per process), and
``hwm_sum_gb`` the sum of each process's own ``VmHWM`` (an upper bound). A try that is
OOM-killed, raises MemoryError, or brings the machine's ``MemAvailable`` under
:data:`FLOOR_GIB` (the parent then kills it) "does not fit"; a configuration stops at
its first size that does not fit (sizes go up for every configuration together: each
configuration's 0.5B first; ``--out``'s earlier tries are kept, those of unknown result
tried again, ``--redo`` measures all again). A size whose weights alone (with gradients and AdamW
state for a full fine-tune) exceed the machine's MemTotal is not tried
(:func:`lower_bound_gib`: recorded as not fitting, with why). A try killed at the floor while it held well under
what was available at its start (others grew) is run again (:func:`crowded_out`). Sizes
of 3B and up wait for :data:`WAIT_GIB` GiB available first, smaller ones for
:data:`SMALL_WAIT_GIB`. ``--new-tokens`` sets the response length (the run of record's is
in ``workload``: on a CPU-starved shared machine a 3B step at 32 tokens did not fit the
time; weights, gradients and AdamW state, not the activations of a few hundred tokens,
make the peak at these sizes). Results: ``benchmarks/results/memory.json``, rewritten after every try.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from relax.benchmarks.harness import RESULTS, ROOT, write_result

OUT = RESULTS / "memory.json"
GIB = 1 << 30
FLOOR_GIB = 0.25
"""MemAvailable (GiB) under which the parent kills a try: it does not fit, and the
machine's other work keeps its memory."""
WAIT_GIB = 20.0
"""MemAvailable (GiB) a try of 3B parameters or more waits for before it starts."""
SMALL_WAIT_GIB = {"0.5b": 5.0, "1.5b": 10.0}
"""MemAvailable (GiB) a smaller try waits for, by size."""
THREADS = 1
"""torch threads of every try (``OMP_NUM_THREADS``; the colocated stage's
``resources.trainer.torch_threads``): on a shared, oversubscribed 2-core machine a second
spinning thread costs more than it gives, and both systems get the same."""
ATTEMPTS = 4
"""Tries of one size while others' processes take the memory it had (:func:`crowded_out`);
after that its result is unknown (``fits`` None) and its configuration stops."""
TAG = "RELAX_MEMORY_BENCH_TRY"

SIZES = {
    # Qwen2.5-{0.5B,1.5B,3B,7B}'s config.json shapes (vocabulary, layers, widths, heads)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
               tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
               tie_word_embeddings=False),
}
CONFIGS = {
    "full": dict(lora=False, ckpt=False, dtype="float32", colocate=False),
    "lora_ckpt": dict(lora=True, ckpt=True, dtype="float32", colocate=False),
    "colocate_lora_ckpt_bf16": dict(lora=True, ckpt=True, dtype="bfloat16", colocate=True),
}
LORA = dict(r=16, alpha=32.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                              "gate_proj", "up_proj", "down_proj"])
WORK = dict(steps=3, group_size=4, max_new_tokens=32, prompts_per_step=1, lr=1e-6,
            temperature=1.0)
PROMPTS = ["What is 17 + 25? Reply with just the number.",
           "What is 38 + 46? Reply with just the number.",
           "What is 52 + 19? Reply with just the number."]


def length_reward(responses, labels, metadata, **options):
    """The benchmark's reward: each response's character count / 100 (a random model's
    responses differ in length, so every group has variance and every step trains).
    Loaded by a recipe as ``relax.benchmarks.memory:length_reward``."""
    return [len(r) / 100 for r in responses]


def qwen2_config(size: str):
    """A transformers ``Qwen2Config`` of Qwen2.5-``size``'s shapes (:data:`SIZES`) with
    the SmolLM2 tokenizer's special ids (bos 1, eos and pad 2)."""
    from transformers import Qwen2Config

    return Qwen2Config(**SIZES[size], max_position_embeddings=32768, rope_theta=1e6,
                       rms_norm_eps=1e-6, use_sliding_window=False, bos_token_id=1,
                       eos_token_id=2, pad_token_id=2)


POOL = 1_000_003
"""Length (a prime) of the pool of N(0, 0.02) values the random weights repeat."""


def build_model(size: str, dtype: str):
    """A random Qwen2ForCausalLM of ``size`` built in ``dtype``, no Hub: ``(model,
    tokenizer)`` with the SmolLM2 tokenizer (ids past its 49,152 decode to nothing).

    The matrices are filled from one seeded pool of :data:`POOL` N(0, 0.02) values laid
    end to end (a copy, not a draw per weight: a 7B model is built in seconds on a loaded
    CPU; the prime period keeps rows apart), norms 1, biases 0; tied embeddings tied.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights

    from relax.trainer.models import smollm2_tokenizer_dir

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(qwen2_config(size), dtype=getattr(torch, dtype))
    model.tie_weights()
    pool = torch.randn(POOL, generator=torch.Generator().manual_seed(0)) * 0.02
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                flat = p.view(-1)
                for i in range(0, flat.numel(), POOL):
                    n = min(POOL, flat.numel() - i)
                    flat[i:i + n].copy_(pool[:n])
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    tok.pad_token = tok.eos_token
    return model, tok


def n_params(size: str) -> int:
    """Parameters of ``size`` (tied embeddings counted once), without building it."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(qwen2_config(size))
    return sum(p.numel() for p in m.parameters())


# ------------------------------------------------------------------ one try each
def run_trl(config: dict, size: str) -> dict:
    """3 GRPO steps of TRL's GRPOTrainer on the model of ``size``."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model, tok = build_model(size, config["dtype"])
    tok.padding_side = "left"
    steps: list[float] = []
    t0 = time.perf_counter()

    class Steps(TrainerCallback):
        def on_step_end(self, *a, **k):
            steps.append(round(time.perf_counter() - t0, 1))

    def reward(prompts, completions, **_):
        return length_reward(completions, None, None)

    g = WORK["group_size"]
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-memory-"), use_cpu=True, report_to=[],
        per_device_train_batch_size=g * WORK["prompts_per_step"], gradient_accumulation_steps=1,
        num_generations=g, max_completion_length=WORK["max_new_tokens"],
        temperature=WORK["temperature"], top_p=1.0, top_k=0, learning_rate=WORK["lr"],
        lr_scheduler_type="constant", beta=0.0, loss_type="dapo", num_iterations=1,
        max_steps=WORK["steps"], shuffle_dataset=False, seed=0, logging_steps=1,
        save_strategy="no", bf16=config["dtype"] == "bfloat16",
        gradient_checkpointing=config["ckpt"], disable_tqdm=True)
    peft = (LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"],
                       target_modules=LORA["target_modules"], task_type="CAUSAL_LM")
            if config["lora"] else None)
    ds = Dataset.from_list([{"prompt": p} for p in PROMPTS])
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=reward, args=args,
                          train_dataset=ds, callbacks=[Steps()], peft_config=peft)
    trainer.train()
    return {"step_end_s": steps}


def run_relax_loop(config: dict, size: str) -> dict:
    """3 GRPO steps of relax's parts in one process: the torch back end
    (:class:`relax.trainer.backends.torch_backend.TorchBackend`) and the HF engine on its
    model, rollouts made into train samples by the rollout and aggregate stages'
    functions, one optimizer step each."""
    import pyarrow as pa

    from relax.consumers.aggregate_config import AdvantageConfig
    from relax.consumers.engines.base import SamplingParams
    from relax.consumers.engines.hf import HFEngine
    from relax.consumers.rollout.config import RolloutConfig
    from relax.consumers.rollout.sampling import rollout_batch, sample_groups
    from relax.consumers.samples import build_train_samples
    from relax.trainer.backends.torch_backend import TorchBackend
    from relax.trainer.batching import informative_rows, loss_counts, micro_batches
    from relax.trainer.config import TrainerConfig

    model, tok = build_model(size, config["dtype"])
    tcfg = TrainerConfig(
        batch_groups=WORK["prompts_per_step"], steps=WORK["steps"], optim={"lr": WORK["lr"]},
        loss={"policy_loss": "ppo_clip", "loss_agg_mode": "token-mean"},
        max_tokens_per_microbatch=4096, gradient_checkpointing=config["ckpt"],
        lora=LORA if config["lora"] else None, dtype=config["dtype"])
    backend = TorchBackend(tcfg, device="cpu", model=model)
    engine = HFEngine(backend.model, tok, engine_id="memory")
    rcfg = RolloutConfig(run="memory",
                         dataset="memory", model="memory", group_size=WORK["group_size"],
                         max_new_tokens=WORK["max_new_tokens"])
    acfg = AdvantageConfig(estimator="grpo", rewards={"length": 1.0})
    steps, trained = [], []
    t0 = time.perf_counter()
    for step in range(WORK["steps"]):
        prompt = PROMPTS[step % len(PROMPTS)]
        params = SamplingParams(max_new_tokens=WORK["max_new_tokens"],
                                temperature=WORK["temperature"], seed=step)
        eps = sample_groups(engine, [tok.encode(prompt)], WORK["group_size"], params)[0]
        prow = {"prompt_id": f"p{step}", "dataset": "memory", "prompt": prompt, "label": "",
                "metadata": "{}"}
        table = pa.Table.from_batches([rollout_batch(prow, f"g{step}", eps, rcfg, "memory",
                                                     0, 0)])
        rewards = length_reward([e.response_text for e in eps], None, None)
        cells = {f"g{step}/{k}": {"length": (v, None)} for k, v in enumerate(rewards)}
        groups = [build_train_samples(table, cells, None, acfg)]
        stats = backend.train_step(micro_batches(informative_rows(groups), 4096),
                                   counts=loss_counts(groups))
        trained.append(int(stats.get("rows_computed", 0)))
        steps.append(round(time.perf_counter() - t0, 1))
    return {"step_end_s": steps, "rows_trained": trained,
            "response_tokens": [len(e.response_ids) for e in eps]}


def save_model_folder(size: str, dtype: str, folder: Path) -> None:
    """The random model of ``size`` in ``dtype`` and its tokenizer as a transformers
    folder (what ``relax train``'s ``model:`` names)."""
    model, tok = build_model(size, dtype)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)


def colocate_recipe(model_dir: Path, run_root: Path, config: dict) -> dict:
    """The colocate try's recipe tree: ``mode: colocate`` on ``model_dir``, the benchmark's
    workload (:data:`WORK`), the configuration's LoRA, checkpointing and dtype, rewards by
    :func:`length_reward`, no eval, one checkpoint (the final one)."""
    return {
        "mode": "colocate", "model": str(model_dir), "run": "memory",
        "run_root": str(run_root), "partitions": 1,
        "data": {"dataset": "memory", "partitions": 1, "prompt_field": "question",
                 "label_field": "answer", "source": (
                     "reasoning_gym:basic_arithmetic?size=16&seed=1&min_terms=2&max_terms=2"
                     "&min_digits=2&max_digits=2&operators=+&allow_parentheses=false"
                     "&allow_negation=false")},
        "rollout": {"epochs": 10, "group_size": WORK["group_size"], "groups_per_generate": 1,
                    "max_new_tokens": WORK["max_new_tokens"],
                    "temperature": WORK["temperature"], "seed": 0,
                    "prompt_template": "{prompt} Reply with just the number."},
        "rewards": [{"name": "length", "fn": "relax.benchmarks.memory:length_reward"}],
        "trainer": {"steps": WORK["steps"], "batch_groups": WORK["prompts_per_step"],
                    "optim": {"lr": WORK["lr"]}, "checkpoint_every": 0,
                    "max_tokens_per_microbatch": 4096,
                    "gradient_checkpointing": config["ckpt"], "dtype": config["dtype"],
                    **({"lora": LORA} if config["lora"] else {})},
        "telemetry": {"wandb": "off"},
        "resources": {"trainer": {"torch_threads": THREADS}},
    }


def run_relax_colocate(config: dict, size: str, raw: Path) -> list[str]:
    """The command of a colocate try: ``relax train`` on :func:`colocate_recipe` (written
    next to ``raw``; the model folder is made by :func:`save_model_folder` first)."""
    work = raw.parent / f"{raw.stem}-run"
    (work / "runs").mkdir(parents=True, exist_ok=True)
    import yaml

    recipe = work / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(colocate_recipe(work / "model", work / "runs", config)))
    return [str(Path(sys.executable).parent / "relax"), "train", str(recipe)]


def one(system: str, config_name: str, size: str, raw: Path) -> None:
    """Run one in-process try (this process is the child) and write its result to
    ``raw``; a MemoryError is written as ``{"memory_error": ...}``."""
    config = CONFIGS[config_name]
    t0 = time.perf_counter()
    try:
        res = run_trl(config, size) if system == "trl" else run_relax_loop(config, size)
    except MemoryError as e:
        res = {"memory_error": str(e)[:300]}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    raw.write_text(json.dumps(res))


# ------------------------------------------------------------------ the parent's side
def mem_available_gib() -> float:
    """The machine's MemAvailable (GiB) from /proc/meminfo."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1 << 20)
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def tree_pids(root: int, tag: str) -> set[int]:
    """``root`` and its descendants (by parent pid), and every process whose environment
    holds ``TAG=tag`` (a daemonised descendant)."""
    parents: dict[int, int] = {}
    tagged: set[int] = set()
    needle = f"{TAG}={tag}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            if needle in (d / "environ").read_bytes():
                tagged.add(int(d.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    pids = {root} | tagged
    grew = True
    while grew:
        new = {p for p, pp in parents.items() if pp in pids and p not in pids}
        pids |= new
        grew = bool(new)
    return pids


def rss_and_hwm(pid: int) -> tuple[int, int]:
    """``(VmRSS, VmHWM)`` of ``pid`` in bytes; ``(0, 0)`` when it is gone."""
    rss = hwm = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, hwm


def kill_tree(root: int, tag: str) -> None:
    """SIGKILL ``root``'s tree (:func:`tree_pids`), the try's processes only."""
    for pid in tree_pids(root, tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def measure(cmd: list[str], log: Path, timeout_s: float, env: dict | None = None) -> dict:
    """Run ``cmd`` (after it writes 1000 to its oom_score_adj) and sample its tree's
    memory every 0.25 s until it exits; kill it when MemAvailable falls under
    :data:`FLOOR_GIB` or past ``timeout_s``.

    Returns:
        ``{"rc", "peak_rss_gb", "hwm_sum_gb", "killed": None | "memory_floor" |
        "timeout", "wall_s", "processes"}`` (GiB; processes: how many were seen).
    """
    tag = uuid.uuid4().hex
    wrapped = ["sh", "-c", 'echo 1000 > /proc/self/oom_score_adj && exec "$@"', "sh", *cmd]
    env = {**(env or os.environ), TAG: tag, "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(THREADS)}
    peak, hwm, seen, killed = 0, {}, set(), None
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(wrapped, stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT)
        while proc.poll() is None:
            pids = tree_pids(proc.pid, tag)
            total = 0
            for pid in pids:
                rss, h = rss_and_hwm(pid)
                total += rss
                hwm[pid] = max(hwm.get(pid, 0), h)
            seen |= pids
            peak = max(peak, total)
            if mem_available_gib() < FLOOR_GIB:
                killed = "memory_floor"
            elif time.perf_counter() - t0 > timeout_s:
                killed = "timeout"
            if killed:
                kill_tree(proc.pid, tag)
                proc.wait()
                break
            time.sleep(0.25)
    # what outlived the child (a daemon of the run) goes too
    kill_tree(proc.pid, tag)
    return {"rc": proc.returncode, "peak_rss_gb": round(peak / GIB, 2),
            "hwm_sum_gb": round(sum(hwm.values()) / GIB, 2), "killed": killed,
            "wall_s": round(time.perf_counter() - t0, 1), "processes": len(seen)}


def wait_for_memory(gib: float, limit_s: float, say) -> float:
    """Wait (up to ``limit_s``) until MemAvailable >= ``gib``; the GiB available then."""
    t0 = time.perf_counter()
    avail = mem_available_gib()
    while avail < gib and time.perf_counter() - t0 < limit_s:
        say(f"   waiting for {gib} GiB available (now {avail:.1f})")
        time.sleep(15)
        avail = mem_available_gib()
    return avail


def try_one(system: str, config_name: str, size: str, workdir: Path, timeout_s: float,
            say) -> dict:
    """One try in child processes; its record (``fits``, ``peak_rss_gb``, ...)."""
    config = CONFIGS[config_name]
    raw = workdir / f"{system}-{config_name}-{size}.json"
    log = raw.with_suffix(".log")
    py = sys.executable
    rec: dict = {"available_gib_before": round(mem_available_gib(), 1)}
    if system == "relax" and config["colocate"]:
        script = ("import sys; from relax.benchmarks.memory import save_model_folder as s; "
                  "from pathlib import Path; s(sys.argv[1], sys.argv[2], Path(sys.argv[3]))")
        prep = measure([py, "-c", script, size,
                        config["dtype"], str(raw.parent / f"{raw.stem}-run" / "model")],
                       raw.with_suffix(".prep.log"), timeout_s)
        if prep["rc"] != 0:
            return {**rec, "fits": False, "why": f"building the model folder: {prep}"}
        cmd = run_relax_colocate(config, size, raw)
    else:
        cmd = [py, "-m", "relax.benchmarks.memory", "--one", system, "--configs", config_name,
               "--sizes", size, "--new-tokens", str(WORK["max_new_tokens"]), "--raw", str(raw)]
    m = measure(cmd, log, timeout_s)
    rec.update(m)
    out = json.loads(raw.read_text()) if raw.exists() else {}
    rec.update({k: v for k, v in out.items() if k != "wall_s"})
    tail = log.read_text()[-2500:] if log.exists() else ""
    if m["killed"] == "timeout":  # too slow here, which says nothing about memory
        rec.update(fits=None, why=f"timeout after {m['wall_s']} s (peak so far)")
    elif m["killed"]:
        rec.update(fits=False, why=m["killed"])
    elif m["rc"] == -signal.SIGKILL or m["rc"] == 137:
        rec.update(fits=False, why="killed (OOM killer)")
    elif "memory_error" in out or "MemoryError" in tail:
        rec.update(fits=False, why="MemoryError")
    elif m["rc"] != 0:
        rec.update(fits=False, why=f"failed (exit {m['rc']})", log_tail=tail[-1500:])
    else:
        rec["fits"] = True
        if system == "relax" and config["colocate"]:
            rec.update(colocate_summary(raw))
    if system == "relax" and config["colocate"]:
        subprocess.run(["rm", "-rf", str(raw.parent / f"{raw.stem}-run")], check=False)
    return rec


def colocate_summary(raw: Path) -> dict:
    """The colocate try's ``relax train`` figures from its summary.json: steps, samples,
    and ``peak_rss_mb`` (each process's own peak: where the memory went)."""
    runs = list((raw.parent / f"{raw.stem}-run" / "runs").glob("*/summary.json"))
    if not runs:
        return {}
    s = json.loads(runs[0].read_text())
    return {k: s.get(k) for k in ("steps", "sampled", "trained", "stale", "errors",
                                  "peak_rss_mb")}


def lower_bound_gib(config: dict, params: int) -> float:
    """GiB a try needs at the least: the weights (4 bytes a parameter in float32, 2 in
    bfloat16), and for a full fine-tune their gradients and AdamW's two moments too."""
    per = 4 if config["dtype"] == "float32" else 2
    return params * per * (1 if config["lora"] else 4) / GIB


def mem_total_gib() -> float:
    """The machine's MemTotal (GiB) from /proc/meminfo."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / (1 << 20)
    raise RuntimeError("/proc/meminfo has no MemTotal")


def crowded_out(rec: dict) -> bool:
    """Whether a try killed at the memory floor used well under what was available when it
    started (others' processes grew meanwhile): then it says nothing about fitting."""
    return (rec.get("why") == "memory_floor"
            and rec["peak_rss_gb"] < rec["available_gib_before"] - FLOOR_GIB - 1.5)


def measure_size(system: str, config_name: str, size: str, params: int, workdir: Path,
                 args, say) -> dict:
    """The record of one size: not tried when its lower bound exceeds the machine
    (:func:`lower_bound_gib`), else tried (up to :data:`ATTEMPTS` times while crowded out)
    after waiting for the memory its size needs."""
    bound = lower_bound_gib(CONFIGS[config_name], params)
    if bound > mem_total_gib():
        rec = {"fits": False, "params": params, "attempts": 0,
               "why": f"not tried: needs at least {bound:.1f} GiB (weights"
                      f"{'' if CONFIGS[config_name]['lora'] else ', grads, AdamW'})"
                      f" > the machine's {mem_total_gib():.1f} GiB"}
        say(f"== {system} {config_name} {size}: {rec['why']}")
        return rec
    for attempt in range(ATTEMPTS):
        wait_for_memory(WAIT_GIB if params >= 3e9 else SMALL_WAIT_GIB.get(size, WAIT_GIB),
                        args.wait_s, say)
        say(f"== {system} {config_name} {size} ({params / 1e9:.2f}B)")
        rec = try_one(system, config_name, size, workdir, args.timeout_s, say)
        if not crowded_out(rec):
            break
        say(f"   others took the memory (peak {rec['peak_rss_gb']} GiB of "
            f"{rec['available_gib_before']} available at the start): again")
    rec["attempts"] = attempt + 1
    if crowded_out(rec):  # never alone long enough: says nothing either way
        rec.update(fits=None, why=f"crowded out {ATTEMPTS} times (others' memory)")
    rec["params"] = params
    say(f"   fits={rec['fits']} peak_rss_gb={rec.get('peak_rss_gb')} "
        f"wall_s={rec.get('wall_s')} {rec.get('why', '')}")
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default="relax,trl")
    ap.add_argument("--configs", default="lora_ckpt,colocate_lora_ckpt_bf16,full")
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--timeout-s", type=float, default=1200, help="per try")
    ap.add_argument("--wait-s", type=float, default=900,
                    help="longest wait for WAIT_GIB available before a 3B+ try")
    ap.add_argument("--new-tokens", type=int, default=WORK["max_new_tokens"],
                    help="tokens sampled a response (the issue's workload: 32)")
    ap.add_argument("--redo", action="store_true",
                    help="measure again the tries --out already holds (default: keep them)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--raw", help=argparse.SUPPRESS)
    args = ap.parse_args()
    WORK["max_new_tokens"] = args.new_tokens
    if args.one:
        one(args.one, args.configs, args.sizes, Path(args.raw))
        return

    def say(s: str) -> None:
        print(s, flush=True)

    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc.pop("machine", None)
    tries = doc.get("tries", {})
    sizes = [s for s in args.sizes.split(",") if s]
    params = {s: n_params(s) for s in SIZES}
    workdir = Path(tempfile.mkdtemp(prefix="relax-memory-"))
    t_all = time.perf_counter()
    configs = [c for c in args.configs.split(",") if c]
    systems = [s for s in args.systems.split(",") if s]
    for size in sizes:  # every configuration's smaller size first
        for config_name in configs:
            for system in systems:
                done = tries.get(config_name, {}).get(system, {})
                smaller = [done[s] for s in SIZES if params[s] < params[size] and s in done]
                known = size in done and done[size]["fits"] is not None
                if any(not r["fits"] for r in smaller) or (known and not args.redo):
                    continue  # stopped at a smaller size, or measured by an earlier sweep
                rec = measure_size(system, config_name, size, params[size], workdir, args, say)
                tries.setdefault(config_name, {}).setdefault(system, {})[size] = rec
                write_result(out, summarise(tries, params, time.perf_counter() - t_all))
    say(f"wrote {out}")


def summarise(tries: dict, params: dict, total_s: float) -> dict:
    """The result document: the tries, and per configuration ``largest_params_relax``,
    ``largest_params_trl``, ``peak_rss_gb`` ``{system: {size: GiB}}`` and
    ``peak_rss_over_trl`` ``{size: relax / trl}`` where both fit."""
    configs = {}
    for name, systems in tries.items():
        def largest(system: str, systems=systems) -> int | None:
            fit = [params[s] for s, r in systems.get(system, {}).items() if r["fits"]]
            return max(fit) if fit else None

        peak = {sys_: {s: r.get("peak_rss_gb") for s, r in recs.items() if r["fits"]}
                for sys_, recs in systems.items()}
        both = set(peak.get("relax", {})) & set(peak.get("trl", {}))
        configs[name] = {
            "largest_params_relax": largest("relax"), "largest_params_trl": largest("trl"),
            "peak_rss_gb": peak,
            "peak_rss_over_trl": {s: round(peak["relax"][s] / peak["trl"][s], 3)
                                  for s in sorted(both, key=lambda s: params[s])},
        }
    return {"workload": {**WORK, "lora": LORA, "configs": CONFIGS,
                         "sizes": {s: {**SIZES[s], "params": params[s]} for s in SIZES},
                         "floor_gib": FLOOR_GIB, "wait_gib": WAIT_GIB, "torch_threads": THREADS},
            "largest_params_relax": {n: c["largest_params_relax"] for n, c in configs.items()},
            "largest_params_trl": {n: c["largest_params_trl"] for n, c in configs.items()},
            "configs": configs, "tries": tries, "total_s": round(total_s)}


if __name__ == "__main__":
    main()
