"""One half of a relax step outside the pipeline, in the contexts a stage runs in: does
the place cost anything? (issue 19)

``--part train``: ``TorchBackend.train_step`` on one fixed batch (8 groups x 8 rows,
prompts of 40 tokens, responses of 6-12; the workload's row count). ``--part generate``:
the HF engine samples 8 groups x 8 of ``e2e_vs_trl.py``'s prompts (12 new tokens, T=0.7);
``--swap`` first stages and swaps in a copy of the weights through the rollout's double
buffer (``HFEngine.update_weights`` / ``apply_pending``), as every sync step does.

Contexts: ``main`` (this process's main thread, as the plain loop runs), ``thread`` (a
second Python thread, as a Ray actor method runs), ``ray`` (an actor with
``max_concurrency=4``, like :class:`relax.infra.controller` StageActor, in a local Ray
started by :func:`relax.infra.controller.start_local_ray`, so with
:mod:`relax.infra.allocator`'s settings). For ``main`` / ``thread`` with those settings,
start this script with them in the environment (glibc reads them at process start).

One JSON line per thread count, the counts run in order in one process (so the heap of
the later ones has settled): wall seconds of each call after a warm-up, and the
process's user / kernel CPU seconds and minor page faults of the median call.

    python benchmarks/stage_context.py --part train --context ray --threads 1,2
    python benchmarks/stage_context.py --part generate --context main --swap
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _timed(fn) -> tuple[float, float, float, int]:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return dt, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt


def _train_calls(model: str):
    sys.path.insert(0, str(HERE.parent / "tests"))
    from testdata import train_sample_table

    from relax.streams.codec import group_by_key
    from relax.trainer.backends.torch_backend import TorchBackend
    from relax.trainer.batching import micro_batches
    from relax.trainer.config import TrainerConfig

    t = train_sample_table(8, 8, (40, 40), (6, 12), vocab=30000, seed=3)
    groups = [g for _, g in group_by_key(t, "group_id")]
    b = TorchBackend(TrainerConfig(model=model, optim={"lr": 1e-9}))
    return lambda i: b.train_step(micro_batches(groups, 8192))


def _generate_calls(model: str, swap: bool):
    sys.path.insert(0, str(HERE))
    import e2e_vs_trl as bench

    from relax.consumers.engines.base import SamplingParams
    from relax.consumers.engines.hf import HFEngine
    from relax.consumers.multiturn import render_ids
    from relax.consumers.rollout import sample_groups
    from relax.trainer.models import load_tokenizer

    w = bench.workload(8)
    tok = load_tokenizer(model)
    engine = HFEngine(model, engine_id="bench")
    if swap:
        engine.update_weights({n: p.detach().clone() for n, p in engine.model.named_parameters()},
                              1)
        engine.apply_pending()
    rows = bench.prompt_rows(w)

    def call(i: int) -> None:
        batch = rows[i * 8:(i + 1) * 8]
        ids = [render_ids(tok, [{"role": "user", "content": w["prompt_template"].format(
            prompt=r[w["prompt_field"]])}]) for r in batch]
        sample_groups(engine, ids, 8, SamplingParams(max_new_tokens=12, temperature=0.7,
                                                     seed=1 + i))
    return call


def measure(part: str, threads: int, reps: int, model: str, swap: bool, context: str) -> dict:
    """``reps`` timed calls after one warm-up, at ``threads`` torch threads (set in the
    calling thread, as the stages do)."""
    import torch

    torch.set_num_threads(threads)
    call = _train_calls(model) if part == "train" else _generate_calls(model, swap)
    call(0)
    runs = [_timed(lambda i=i: call(i)) for i in range(1, reps + 1)]
    med = sorted(runs)[len(runs) // 2]
    return {"part": part, "context": context, "threads": threads, "swap": swap,
            "wall_s": [round(r[0], 2) for r in runs], "user_s": round(med[1], 2),
            "sys_s": round(med[2], 2), "minor_faults": med[3]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("train", "generate"), default="train")
    ap.add_argument("--context", choices=("main", "thread", "ray"), default="main")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--swap", action="store_true", help="generate after a weight swap")
    a = ap.parse_args()
    args = (a.part, a.reps, a.model, a.swap, a.context)
    actor = None
    for n in map(int, a.threads.split(",")):
        if a.context == "main":
            res = measure(a.part, n, *args[1:])
        elif a.context == "thread":
            box: dict = {}
            th = threading.Thread(target=lambda: box.update(r=measure(a.part, n, *args[1:])))
            th.start()
            th.join()
            res = box["r"]
        else:
            import ray

            from relax.infra.controller import start_local_ray

            if actor is None:  # one actor (one process) for every thread count
                start_local_ray(2)
                actor = ray.remote(max_concurrency=4)(_Actor).options(num_cpus=1).remote()
            res = ray.get(actor.measure.remote(a.part, n, *args[1:]))
        print(json.dumps(res), flush=True)


class _Actor:
    def measure(self, *args):
        sys.path.insert(0, str(HERE))
        return measure(*args)


if __name__ == "__main__":
    main()
