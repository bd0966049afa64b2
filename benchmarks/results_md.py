"""Render ``benchmarks/RESULTS.md`` from ``benchmarks/results/*.json``: the current figures
of every benchmark, one table each, every file beside the machine, date and commit it
was measured on (its ``machine`` key, :func:`relax.benchmarks.harness.machine`).

    python -m relax.benchmarks.results_md            # writes benchmarks/RESULTS.md
    python -m relax.benchmarks.results_md --check    # exit 1 if RESULTS.md is stale

A benchmark's files are ``results/<name>*.json``; one a benchmark does not know is listed
at the end, not dropped. The dated history of the figures is ``JOURNAL.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from relax.benchmarks.harness import RESULTS

OUT = RESULTS.parent / "RESULTS.md"


def table(head: list[str], rows: list[list]) -> list[str]:
    """A markdown table; floats to 3 significant digits, None as ``-``."""
    def cell(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(cell(v) for v in r) + " |" for r in rows)]


def provenance(doc: dict) -> dict:
    """``{"machine", "date", "commit", "note"}`` strings of a result document."""
    m = doc.get("machine") or {}
    what = [f"{m['cpus']} CPUs" if m.get("cpus") else None, m.get("cpu"), m.get("gpu"),
            f"load {m['load'][0]}" if m.get("load") else None]
    return {"machine": ", ".join(w for w in what if w) or "not recorded",
            "date": str(m.get("date") or doc.get("date") or "?")[:16],
            "commit": m.get("commit") or doc.get("commit") or "?",
            "note": m.get("note") or ""}


def e2e(d: dict) -> tuple[str, list[str]]:
    rows = [[k, d.get("threads", {}).get(k), s["steady_samples_per_s"], s["samples_per_s"],
             s["step_s_mean"], s["data_wait_pct"], s["rollout_idle_pct"], s["reward_mean"],
             s.get("first_step_s"),
             ", ".join(f"{n} {v:.1f}" for n, v in (s.get("startup_laps_s") or {}).items()
                       if v >= 0.05) or None]
            for k, s in d["systems"].items()]
    ratios = [[k, d[k]] for k in ("async_over_sync", "async_over_loop", "sync_over_loop",
                                  "relax_over_trl", "loop_over_trl", "colocate_over_loop",
                                  "startup_over_loop_s", "startup_colocate_over_loop_s",
                                  "trainer_data_wait", "trainer_data_wait_floor")
              if d.get(k) is not None]
    w = d["workload"]
    lines = [(f"{w['model']}, {w['steps']} steps of {w['batch_groups']} groups x "
              f"{w['group_size']}, {w['max_new_tokens']} new tokens, seed {w['seed']}."), "",
             *table(["system", "torch threads", "steady samples/s", "e2e samples/s",
                     "step s", "data-wait %", "rollout idle %", "reward",
                     "first step s", "start-up laps s"], rows)]
    if ratios:
        lines += ["", *table(["ratio of steady samples/s (*_s: seconds)", "value"], ratios)]
    return (", ".join(f"{k} {v}" for k, v in ratios[:4])
            or ", ".join(f"{r[0]} {r[2]} samples/s" for r in rows), lines)


def bus_throughput(d: dict) -> tuple[str, list[str]]:
    rows = [[r["kind"], r["bus"]["MBps"], r["raw"]["MBps"], r["bus_over_raw"],
             r["latency"]["p50_ms"], r["latency"]["p99_ms"], r["latency"].get("ack_p50_ms"),
             (r.get("rss") or {}).get("peak_mib"), (r.get("e2e") or {}).get("wall_s"),
             f"{r['bus']['rows_ok']}/{d['settings']['rows']}"] for r in d["results"]]
    s = d["settings"]
    return (", ".join(f"{r[0]} {r[1]:.0f} MB/s p50 {r[4]:.0f} ms" for r in rows),
            [(f"{s['rows']} rollout rows of {s['tokens']} tokens, {s['group_size']} a message; "
             f"{s['latency_messages']} latency messages."), "",
             *table(["broker", "bus MB/s", "raw MB/s", "bus/raw", "p50 ms", "p99 ms",
                     "ack p50 ms", "RSS peak MiB", "tiny e2e s", "rows ok"], rows)])


def bus_latency(d: dict) -> tuple[str, list[str]]:
    rows = [[k.removeprefix("wait_"), v["hop"]["min_ms"], v["hop"]["median_ms"],
             v["hop"]["max_ms"], v["claim"]["median_ms"], v["claim"]["max_ms"]]
            for k, v in d.items() if k.startswith("wait_")]
    return (", ".join(f"hop median {r[2]} ms at {r[0]}" for r in rows),
            table(["fetch wait", "hop min ms", "hop median ms", "hop max ms",
                   "claim median ms", "claim max ms"], rows))


def chaos(d: dict) -> tuple[str, list[str]]:
    row = [d["runs"], d["finished"], d["sampled"], d["trained"], d["stale"], d["lost"],
           d["trained_twice"], d["broker_kills"], d["late_kills"], d["wall_s_mean"],
           d["undisturbed_wall_s"], d["wall_over_undisturbed"]]
    return ((f"{d['finished']}/{d['runs']} finished, {d['lost']} lost, "
            f"{d['trained_twice']} trained twice"),
            [(f"{d['steps']} steps a run, faults after steps 1-{d['plan_steps'] - 1}, seed "
             f"{d['seed']}, complete: {d['complete']}."), "",
             *table(["runs", "finished", "sampled", "trained", "stale", "lost",
                     "trained twice", "broker faults", "late kills", "wall s mean",
                     "undisturbed s", "ratio"], [row])])


def gpu_backends(d: dict) -> tuple[str, list[str]]:
    parts = [c["result"] for c in d["calls"]] if "calls" in d else [d]
    parity: dict = {}
    for p in parts:
        for dtype, models in p.get("parity", {}).items():
            for model, r in models.items():
                parity[(model, dtype)] = r
    prow = [[m, dt, r["logprobs_max_diff"], r.get("floor_logprobs_max_diff"),
             r["entropy_max_diff"], r["loss_diff"], r["grad_rel_diff"], r["weights_max_diff"]]
            for (m, dt), r in parity.items()]
    train = next((p for p in reversed(parts) if "train" in p), {})
    trow = [[k, v["tokens_per_s"], v["step_s"], v["refit"]["total_s"], v["refit"]["GBps"]]
            for k, v in train.get("train", {}).items() if isinstance(v, dict)]
    ratio = {k: v for k, v in train.get("train", {}).items() if k.startswith("megatron_over")}
    gen = (train.get("generation") or {}).get("tokens_per_s")
    lines = table(["model", "dtype", "log-probs diff", "floor", "entropy diff", "loss diff",
                   "grad rel diff", "weights diff"], prow)
    if trow:
        lines += ["", *table(["back end", "tokens/s", "step s", "refit s", "refit GB/s"], trow),
                  "", (f"megatron / torch: {', '.join(f'{k[-4:]} {v:.2f}' for k, v in ratio.items())}"
                  f"; HF engine generation {gen:,.0f} tokens/s.")]
    return (", ".join(f"{k} {v:.2f}" for k, v in ratio.items()) or "parity only", lines)


def rollout_scaling(d: dict) -> tuple[str, list[str]]:
    rows = [[r["instances"], r["samples_per_s"], r["ratio"], f"{r['trainer_wait_frac']:.0%}",
             f"{r['trainer_train_frac']:.0%}", f"{r['trained']}/{r['sampled']}"]
            for r in d["runs"]]
    return (" ".join(f"x{r[0]}={r[2]:.2f}" for r in rows),
            table(["rollout instances", "trained samples/s", "ratio", "trainer waiting",
                   "trainer training", "trained/sampled"], rows))


def weight_sync(d: dict) -> tuple[str, list[str]]:
    rows = [[k, v["bytes"], v["publish_s"], v["delivered_s"], v["delivered_median_s"],
             v["GBps"], v["blocked_ms"], v["pub_cpu_s"], v["sub_cpu_s"]]
            for k, v in d.items() if isinstance(v, dict) and "transport" in v]
    ratios = [[k, *(round(v[x], 3) for x in ("delivered", "sub_cpu", "pub_cpu"))]
              for k, v in d.items() if k.endswith(("_over_gloo", "_over_buffered"))]
    a = d.get("args") or {}
    lines = [(f"{a.get('model')}, {a.get('subscribers')} subscriber(s), {a.get('versions')} "
             f"versions, batch {a.get('batch')}."), "",
             *table(["transport", "bytes", "publish s", "delivered s", "median s", "GB/s",
                     "blocked ms", "publisher CPU s", "subscriber CPU s"], rows)]
    if ratios:
        lines += ["", *table(["ratio", "delivered", "subscriber CPU", "publisher CPU"], ratios)]
    return ", ".join(f"{r[0]} {r[3]:.3f} s" for r in rows), lines


def flat(keys: list[str], title: str) -> Callable[[dict], tuple[str, list[str]]]:
    """A renderer of a document with one row of figures (``keys``) at its top level."""
    def render(d: dict) -> tuple[str, list[str]]:
        return (f"{title} {d.get(title)}", table(keys, [[d.get(k) for k in keys]]))
    return render


def reward_throughput(d: dict) -> tuple[str, list[str]]:
    keys = ["reward", "workers", "rows", "startup_s", "score_s", "rows_per_s", "errors"]
    return (", ".join(f"{r['reward']} x{r['workers']} {r['rows_per_s']:,.0f} rows/s"
                      for r in d["runs"]),
            table(keys, [[r[k] for k in keys] for r in d["runs"]]))


def sandbox(d: dict) -> tuple[str, list[str]]:
    rows = [[k, d[k]["calls"], d[k]["min_ms"], d[k]["median_ms"], d[k]["max_ms"]]
            for k in ("floor", "humaneval")]
    return (f"median {rows[0][3]} ms (floor), {rows[1][3]} ms (HumanEval)",
            table(["program", "calls", "min ms", "median ms", "max ms"], rows))


def memory(d: dict) -> tuple[str, list[str]]:
    sizes = d["workload"]["sizes"]
    rows = []
    for name, systems in d["tries"].items():
        for system, recs in systems.items():
            for size, r in recs.items():
                rows.append([name, system, size, sizes[size]["params"] / 1e9,
                             {True: "yes", False: "no", None: "unknown"}[r["fits"]]
                             + ("" if r["fits"] else f" ({r.get('why')})"), r.get("peak_rss_gb"),
                             r.get("hwm_sum_gb"), r.get("processes"), r.get("wall_s"),
                             d["configs"][name]["peak_rss_over_trl"].get(size)])
    big = [[n, c["largest_params_relax"], c["largest_params_trl"]]
           for n, c in d["configs"].items()]
    w = d["workload"]
    return (", ".join(f"{n}: relax {r and f'{r / 1e9:.2f}B'} / TRL {t and f'{t / 1e9:.2f}B'}"
                      for n, r, t in big),
            [(f"Qwen2 shapes of Qwen2.5 (random weights), {w['steps']} GRPO steps of "
              f"{w['prompts_per_step']} prompt x group {w['group_size']}, "
              f"{w['max_new_tokens']} new tokens; peak RSS of every process of the try "
              f"(GiB, sampled every 0.25 s); a try killed under {w['floor_gib']} GiB "
              f"available does not fit."), "",
             *table(["configuration", "largest relax (B params)", "largest TRL (B params)"],
                    [[n, r and r / 1e9, t and t / 1e9] for n, r, t in big]), "",
             *table(["configuration", "system", "size", "params (B)", "fits",
                     "peak RSS GiB", "sum of VmHWM GiB", "processes", "wall s",
                     "relax / TRL"], rows)])


def staleness(d: dict) -> tuple[str, list[str]]:
    s, base = d["settings"], d["base"]
    rows = [[c["loss"], c["max_staleness"], len(c["seeds"]), c["accuracy_after_mean"],
             c["accuracy_after_std"], ", ".join(f"{a:.2f}" for a in c["accuracy_after"]),
             c["staleness_mean"], c["staleness_max"],
             None if c["masked_token_share"] is None else f"{c['masked_token_share']:.2%}",
             c["wall_s_mean"]] for c in d["cells"]]
    done = [c for c in d["cells"] if c["accuracy_after_mean"] is not None]
    return (", ".join(f"{c['loss']} s={c['max_staleness']} {c['accuracy_after_mean']:.2f}"
                      for c in done),
            [(f"{s['recipe']}: {s['steps']} steps of {s['batch_groups']} groups x "
              f"{s['group_size']} ({s['trained_samples']} trained samples a run); greedy "
              f"held-out accuracy on {s['eval_size']} prompts, base model "
              f"{base['accuracy']:.2f}; masked: the loss tokens PPO-clip clipped "
              f"(clip_frac_low + clip_frac_high) or M2PO dropped (m2po_masked_frac)."), "",
             *table(["loss", "max staleness", "seeds", "accuracy after", "std", "per seed",
                     "staleness reached (mean)", "max", "masked tokens", "wall s"], rows)])


BENCHMARKS: list[tuple[str, str, str, Callable]] = [
    ("e2e_", "End to end: relax async / sync, a plain loop, TRL", "e2e_vs_trl.py", e2e),
    ("bus_throughput", "Bus throughput, latency and broker memory", "bus_throughput.py",
     bus_throughput),
    ("bus_latency", "Bus read-after-write latency and the claim round trip", "bus_latency.py",
     bus_latency),
    ("weight_", "Weight sync: trainer to rollout engines", "weight_sync.py", weight_sync),
    ("train_step", "Trainer step: shared prompt vs full rows", "train_step.py",
     flat(["rows", "tokens_full", "tokens_shared", "full_s", "shared_s", "speedup",
           "packing_speedup"], "speedup")),
    ("generation", "Generation throughput (HF engine)", "generation.py",
     flat(["model", "batch", "new_tokens", "seconds", "tokens_per_s", "threads"],
          "tokens_per_s")),
    ("reward_throughput", "Reward throughput (worker pool)", "reward_throughput.py",
     reward_throughput),
    ("sandbox_cost", "Code sandbox cost per call", "sandbox_cost.py", sandbox),
    ("rollout_scaling", "Rollout instances", "rollout_scaling.py", rollout_scaling),
    ("gpu_backends", "GPU: megatron against torch back end, generation, refit",
     "gpu_backends.py", gpu_backends),
    ("chaos", "Chaos: stages and the broker failed at random moments", "chaos.py", chaos),
    ("staleness", "Far off-policy: GRPO against M2PO at max_staleness 0, 4, 16",
     "staleness.py", staleness),
    ("memory", "Memory: the largest model that RL-trains, relax against TRL", "memory.py",
     memory),
]
"""``(file prefix, title, script, renderer)``: a renderer takes a result document and
returns ``(headline, markdown lines)``."""


def render(results: Path = RESULTS) -> str:
    """RESULTS.md's text for the JSON documents in ``results``.

    Raises:
        KeyError, json.JSONDecodeError: a document without a figure its renderer reads,
            or not JSON (the message names neither: run ``--check`` on one file's folder).
    """
    files = sorted(results.glob("*.json"))
    seen: set[Path] = set()
    overview, body = [], []
    for prefix, title, script, fn in BENCHMARKS:
        mine = [f for f in files if f.stem.startswith(prefix)]
        seen.update(mine)
        body += ["", f"## {title} (`{script}`)", ""]
        if not mine:
            body.append(f"No results yet: `python benchmarks/{script}`.")
            overview.append([title, "-", "not run yet", "-", "-", "-"])
        for f in mine:
            doc = json.loads(f.read_text())
            try:
                headline, lines = fn(doc)
            except (KeyError, TypeError) as e:
                raise KeyError(f"{f.name}: {script}'s figures lack {e}") from e
            p = provenance(doc)
            body += [f"`results/{f.name}`: {p['machine']}, {p['date']}, commit {p['commit']}"
                     + (f" ({p['note']})" if p["note"] else "") + ".", "", *lines, ""]
            overview.append([title, f"`{f.name}`", headline, p["machine"], p["date"],
                             p["commit"]])
    rest = [f.name for f in files if f not in seen]
    if rest:
        body += ["", "## Files no benchmark here renders", "", *(f"- `{n}`" for n in rest)]
    head = ["# Benchmark results", "",
            ("Generated by `python -m relax.benchmarks.results_md` from `results/*.json`: edit "
            "those, not this file. Each figure is the latest file of its benchmark, measured "
            "on the machine, date and commit given (`+`: with uncommitted changes); shared "
             "2-core VMs are noisy, so the "
            "ratios within one file count more than absolute times. The dated history and "
            "the conclusions of retired studies are in `JOURNAL.md`."), "",
            *table(["benchmark", "file", "headline", "machine", "date", "commit"], overview)]
    return "\n".join(head + body).rstrip() + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md is stale")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    text = render()
    if a.check:
        if not a.out.exists() or a.out.read_text() != text:
            sys.exit(f"{a.out} is stale: run python -m relax.benchmarks.results_md")
        return
    a.out.write_text(text)
    print(f"wrote {a.out} ({text.count(chr(10))} lines)")


if __name__ == "__main__":
    main()
