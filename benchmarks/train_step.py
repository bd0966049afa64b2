"""Trainer step time: prompt shared per group (what relax does) vs every row's full
sequence (what a plain HF loss does), same batch, same model; and padding-free packing
(``trainer.packing``) vs the padded rows on a batch with skewed response lengths.

    python benchmarks/train_step.py --model smollm2-135m --groups 8 --group-size 8

Last line: ``rows=B tokens_full=N tokens_shared=M full_s=X shared_s=Y speedup=R
packing_speedup=S``; ``--json`` writes the same figures (forward and backward seconds of
one pass each; the packing comparison's under ``packing``: the median of ``--repeats``
forward + backward passes over the same micro-batches, tokens/s of the rows' real
tokens, ``packing_speedup`` = packed tokens/s over padded, wall clock, and
``packing_speedup_cpu`` the same in this process's CPU seconds, steadier on a busy
machine).
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


def skewed_groups(groups: int, group_size: int, prompt_len: int, longest: int, seed: int = 0):
    """``groups`` group tables whose response lengths are skewed as sampled ones are: most
    short, a few long (log-normal around ``longest / 8``, clipped to ``[4, longest]``)."""
    import numpy as np
    import pyarrow as pa

    from relax.schemas.v1 import TRAIN_SAMPLES
    from relax.tests.testdata import train_sample_table

    rng = np.random.default_rng(seed)
    t = train_sample_table(groups, group_size, (prompt_len, prompt_len), (1, 1), seed=seed,
                           vocab=30000)
    rows = t.to_pylist()
    for r in rows:
        n = int(np.clip(rng.lognormal(np.log(longest / 8), 1.0), 4, longest))
        r["response_ids"] = rng.integers(3, 30000, n).tolist()
        r["loss_mask"], r["logprobs"] = [1] * n, [-1.0] * n
        r["advantages"] = [r["advantages"][0]] * n
    t = pa.Table.from_pylist(rows, schema=TRAIN_SAMPLES)
    return [g for _, g in group_by_key(t, "group_id")]


def packing_figures(args) -> dict:
    """Forward + backward of the same micro-batches (``--budget`` padded tokens each),
    padded then packed, ``--repeats`` times alternately; medians and tokens/s."""
    import statistics

    groups = skewed_groups(args.groups, args.group_size, args.prompt_len, args.longest)
    mbs = micro_batches(groups, args.budget)
    real = sum(int(mb.prompt_mask[mb.prompt_of_row].sum() + mb.response_mask.sum())
               for mb in mbs)
    backends = {p: TorchBackend(TrainerConfig(model=args.model, packing=p))
                for p in (False, True)}
    backends[True].model.load_state_dict(backends[False].model.state_dict())
    times: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for packing, b in backends.items():
            b.model.zero_grad(set_to_none=True)
            t0, c0 = time.perf_counter(), time.process_time()
            for mb in mbs:
                lp, _ = b.logprobs(mb)
                (lp * mb.loss_mask).sum().backward()
            times[packing].append(time.perf_counter() - t0)
            cpu[packing].append(time.process_time() - c0)
    padded_s, packed_s = (statistics.median(times[p]) for p in (False, True))
    padded_cpu, packed_cpu = (statistics.median(cpu[p]) for p in (False, True))
    return {"rows": sum(g.num_rows for g in groups), "micro_batches": len(mbs),
            "response_tokens": [min(r), max(r)] if (r := [
                len(x) for g in groups for x in g.column("response_ids").to_pylist()]) else [],
            "real_tokens": real, "padded_tokens": sum(mb.padded_tokens for mb in mbs),
            "padded_s": round(padded_s, 3), "packed_s": round(packed_s, 3),
            "padded_cpu_s": round(padded_cpu, 3), "packed_cpu_s": round(packed_cpu, 3),
            "padded_tokens_per_s": round(real / padded_s), "packed_tokens_per_s":
            round(real / packed_s), "packing_speedup": round(padded_s / packed_s, 2),
            "packing_speedup_cpu": round(padded_cpu / packed_cpu, 2)}


def main() -> None:
    from relax.tests.testdata import train_sample_table

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--response-len", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--longest", type=int, default=256,
                    help="packing: longest response of the skewed batch (tokens)")
    ap.add_argument("--budget", type=int, default=4096,
                    help="packing: max_tokens_per_microbatch (padded tokens)")
    ap.add_argument("--repeats", type=int, default=3, help="packing: timed passes of each")
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
    packing = packing_figures(args)
    fig["packing_speedup"] = packing["packing_speedup"]
    write_result(args.json, {"settings": vars(args), **fig, "packing": packing})
    print(" ".join(f"{k}={v}" for k, v in fig.items()))


if __name__ == "__main__":
    main()
