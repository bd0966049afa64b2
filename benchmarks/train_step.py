"""Trainer step time: prompt shared per group (what relax does) vs every row's full
sequence (what a plain HF loss does), same batch, same model.

    python benchmarks/train_step.py --model smollm2-135m --groups 8 --group-size 8

Last line: ``rows=B tokens_full=N tokens_shared=M full_s=X shared_s=Y speedup=R``;
``--json`` writes the same figures (forward and backward seconds of one pass each).
"""

from __future__ import annotations

import argparse
import time

import torch

from relax.benchmarks.harness import RESULTS, write_result
from relax.streams.codec import group_by_key
from relax.trainer.backends.torch_backend import TorchBackend
from relax.trainer.batching import micro_batches
from relax.trainer.config import TrainerConfig
from relax.trainer.logprobs import token_logprobs


def full_logprobs(model, table) -> list[torch.Tensor]:
    """Every (prompt, response) row right-padded into one batch, full forward."""
    rows = table.to_pylist()
    L = max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        seq = r["prompt_ids"] + r["response_ids"]
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits
    out = []
    for i, r in enumerate(rows):
        p, n = len(r["prompt_ids"]), len(r["response_ids"])
        out.append(token_logprobs(logits[i:i + 1, p - 1:p - 1 + n],
                                  torch.tensor([r["response_ids"]]), 1.0)[0])
    return out


def main() -> None:
    from relax.tests.testdata import train_sample_table

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--response-len", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=str(RESULTS / "train_step.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t = train_sample_table(args.groups, args.group_size, (args.prompt_len, args.prompt_len),
                           (args.response_len // 2, args.response_len), vocab=30000)
    b = TorchBackend(TrainerConfig(model=args.model))
    mbs = micro_batches([g for _, g in group_by_key(t, "group_id")], 1 << 30)
    t0 = time.perf_counter()
    lp, _ = b.logprobs(mbs[0])
    (lp * mbs[0].response_mask).sum().backward()
    shared = time.perf_counter() - t0
    b.model.zero_grad()
    t0 = time.perf_counter()
    sum(x.sum() for x in full_logprobs(b.model, t)).backward()
    full = time.perf_counter() - t0
    rows = t.num_rows
    tok_full = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in t.to_pylist())
    fig = {"rows": rows, "tokens_full": tok_full, "tokens_shared": mbs[0].padded_tokens,
           "full_s": round(full, 3), "shared_s": round(shared, 3),
           "speedup": round(full / shared, 2)}
    write_result(args.json, {"settings": vars(args), **fig})
    print(" ".join(f"{k}={v}" for k, v in fig.items()))


if __name__ == "__main__":
    main()
