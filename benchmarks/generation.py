"""Generation throughput of the HF engine: ``--batch`` prompts x ``--tokens`` new tokens.

Stop tokens are disabled so every row generates exactly ``--tokens`` tokens; the
first call warms up and is not counted; the best of ``--repeats`` calls counts. Last
line: ``model=M batch=B new_tokens=T seconds=S tokens_per_s=X threads=N``; ``--json``
writes the same figures.

    python benchmarks/generation.py --model tiny-llama
    python benchmarks/generation.py --model smollm2-135m --batch 8 --tokens 64
"""

from __future__ import annotations

import argparse
import time

import torch

from relax.benchmarks.harness import RESULTS, write_result
from relax.consumers.engines.base import SamplingParams
from relax.consumers.engines.hf import HFEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=str(RESULTS / "generation.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = HFEngine(args.model, stop_token_ids=(), use_default_stop_ids=False)
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.7, seed=0)
    engine.generate([prompt] * args.batch, SamplingParams(max_new_tokens=2))
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        gens = engine.generate([prompt] * args.batch, params)
        best = min(best, time.perf_counter() - t0)
        assert all(len(g.token_ids) == args.tokens for g in gens)
    n = args.batch * args.tokens
    fig = {"model": args.model, "batch": args.batch, "new_tokens": args.tokens,
           "seconds": round(best, 3), "tokens_per_s": round(n / best, 1),
           "threads": torch.get_num_threads()}
    write_result(args.json, {"settings": vars(args), **fig})
    print(" ".join(f"{k}={v}" for k, v in fig.items()))


if __name__ == "__main__":
    main()
