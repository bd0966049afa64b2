"""Reward throughput: rows/s of reward functions through the worker pool.

Builds responses from the GSM8K test split (``/work/shared/data/gsm8k/test.jsonl``):
for ``gsm8k`` the gold solution text (``... #### N``) against its answer; for
``math`` a ``<think>`` block with the solution, then ``\\boxed{N}`` (every 4th row
boxes N+1, so both outcomes are graded), against N. Each reward runs with each
worker count on the same rows; pool start-up (spawn, imports, warm-up) is timed
apart from scoring.

Output: one line per (reward, workers):
``reward=R workers=W rows=N startup_s=X score_s=Y rows_per_s=Z mean=M errors=E``;
``--json`` writes them all.

    python benchmarks/reward_throughput.py                       # math, gsm8k x 1, 2 workers
    python benchmarks/reward_throughput.py --rewards math --workers 1 2 4 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from relax.benchmarks.harness import RESULTS, write_result
from relax.consumers.reward.pool import RewardPool

GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")


def rows_for(reward: str, repeat: int) -> tuple[list[str], list[str]]:
    """``(responses, labels)`` for ``reward`` from GSM8K, the split repeated ``repeat``x."""
    data = [json.loads(line) for line in GSM8K_TEST.open()] * repeat
    finals = [d["answer"].rpartition("####")[2].strip().replace(",", "") for d in data]
    if reward == "gsm8k":
        return [d["answer"] for d in data], finals
    responses = []
    for i, (d, n) in enumerate(zip(data, finals)):
        boxed = str(int(n) + 1) if i % 4 == 3 else n
        responses.append(f"<think>{d['answer'].rpartition('####')[0]}</think> "
                         f"The answer is $\\boxed{{{boxed}}}$.")
    return responses, finals


def measure(reward: str, workers: int, responses: list[str], labels: list[str],
            batch_rows: int) -> dict:
    """Score the rows once with a fresh pool; returns the timings and the mean."""
    t0 = time.perf_counter()
    with RewardPool(reward, workers=workers, batch_rows=batch_rows, timeout_s=120) as pool:
        t1 = time.perf_counter()
        res = pool.score(responses, labels, [{}] * len(responses))
        t2 = time.perf_counter()
    values = [r.value for r in res if r.value is not None]
    return {"reward": reward, "workers": workers, "rows": len(res),
            "startup_s": round(t1 - t0, 2), "score_s": round(t2 - t1, 3),
            "rows_per_s": round(len(res) / (t2 - t1), 1),
            "mean": round(sum(values) / max(1, len(values)), 4),
            "errors": sum(1 for r in res if r.error)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rewards", nargs="+", default=["math", "gsm8k"])
    ap.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeat", type=int, default=1, help="repeat the 1,319 rows this many times")
    ap.add_argument("--batch-rows", type=int, default=64)
    ap.add_argument("--json", default=str(RESULTS / "reward_throughput.json"))
    args = ap.parse_args()
    runs = []
    for reward in args.rewards:
        responses, labels = rows_for(reward, args.repeat)
        for w in args.workers:
            runs.append(measure(reward, w, responses, labels, args.batch_rows))
            print(" ".join(f"{k}={v}" for k, v in runs[-1].items()), flush=True)
    write_result(args.json, {"settings": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
