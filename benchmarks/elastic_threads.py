"""A trainer that takes the second core only while no other process wants it, against
one that keeps one torch thread, beside a bursty co-runner (issue 19: "keep the elastic
threads only if they earn their keep").

The co-runner stands for the rollout of an async run on 2 cores: it computes with one
thread for ``--busy-s`` seconds, then sleeps ``--idle-s``. The trainer runs forward and
backward of SmolLM2-135M on one group of 8 rows, over and over, for ``--seconds``.

* ``fixed1``: the trainer at one torch thread.
* ``fixed2`` (alone, no co-runner, for reference): two torch threads.
* ``elastic``: the trainer checks, before every leaf module's forward and after every
  parameter's gradient (at most every ``--interval-ms``), whether another thread wants
  a core (:func:`want_threads`), and sets torch's threads to 1 or 2.

Why not the busy flags of the removed ``trainer/cores.py`` (2026-12-04): they marked only
the rollout's generate calls, not its weight staging, nor the reward and aggregate stages
and the broker, which compute in the windows the flags called idle. And the run queue
alone (``/proc/loadavg``) does not see them while the trainer holds both cores: between
two OpenMP regions its second thread is asleep, so another process's thread makes the
count 2, as the trainer's own two would. The thread's own run delay does see them.

    .venv/bin/python benchmarks/elastic_threads.py --seconds 60 --pairs 3
    .venv/bin/python benchmarks/elastic_threads.py --seconds 60 --pairs 2 --corunner-nice 19 \
        --out benchmarks/results/elastic_threads_nice19.json   # the co-runner yields

Writes ``benchmarks/results/elastic_threads.json``: each run's trainer iterations a
second, its share of time at 2 threads, and the co-runner's work a busy second; the
ratio elastic / fixed1 of each pair, run one after the other in turn; and what a perfect
switch would give (1 thread while the co-runner computes, 2 threads alone while it
sleeps). Results and the end-to-end trial: RESULTS.md, "2026-12-06 (afternoon)".
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def want_threads(current: int, low: int, high: int, running: int, delay_s: float,
                 interval_s: float, quiet: int) -> tuple[int, int]:
    """The torch threads to use next, from what the scheduler says now.

    At ``high``: drop to ``low`` when more threads are runnable on the host than
    ``high``, or when this thread waited on a run queue since the last check for more
    than a tenth of ``interval_s`` (another process's thread took its core). At ``low``:
    go to ``high`` after two checks in a row where no thread but this one was runnable.

    Args:
        current: threads now (``low`` or ``high``).
        low, high: the two settings (1 <= low <= high).
        running: runnable threads on the host now (``/proc/loadavg``'s fourth field,
            this thread included).
        delay_s: seconds this thread waited on a run queue since the last check
            (``/proc/thread-self/schedstat``'s second field, a difference).
        interval_s: seconds between checks.
        quiet: checks in a row at ``low`` with nothing else runnable, before this one.

    Returns:
        ``(threads, quiet)``: the setting to use and the new count of quiet checks.

    Raises:
        ValueError: not ``1 <= low <= high``, or ``current`` is neither.
    """
    if not 1 <= low <= high or current not in (low, high):
        raise ValueError(f"need 1 <= low <= high and current in them, got {low}, {high}, "
                         f"{current}")
    if current == high:
        busy = running > high or delay_s > 0.1 * interval_s
        return (low, 0) if busy and high != low else (high, 0)
    quiet = quiet + 1 if running <= low else 0
    return (high, 0) if quiet >= 2 else (low, quiet)


def _read_running() -> int:
    with open("/proc/loadavg", "rb") as f:
        return int(f.read().split()[3].split(b"/")[0])


def _read_delay_s() -> float:
    with open("/proc/thread-self/schedstat", "rb") as f:
        return int(f.read().split()[1]) / 1e9


class _Elastic:
    """Hooks that apply :func:`want_threads` to torch, and the time spent at ``high``."""

    def __init__(self, interval_s: float, low: int = 1, high: int = 2):
        import torch

        self.torch, self.low, self.high, self.interval_s = torch, low, high, interval_s
        self.current, self.quiet, self.switches = low, 0, 0
        self.high_s, self._since, self._next = 0.0, time.monotonic(), 0.0
        self._delay = _read_delay_s()
        torch.set_num_threads(low)

    def update(self, *_) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        delay = _read_delay_s()
        want, self.quiet = want_threads(self.current, self.low, self.high, _read_running(),
                                        delay - self._delay, self.interval_s, self.quiet)
        self._delay = delay
        if want != self.current:
            if self.current == self.high:
                self.high_s += now - self._since
            self._since, self.current = now, want
            self.switches += 1
            self.torch.set_num_threads(want)

    def seconds_high(self) -> float:
        """Seconds spent at ``high`` so far, the current stretch included."""
        now = time.monotonic()
        return self.high_s + (now - self._since if self.current == self.high else 0.0)

    def install(self, model) -> None:
        for m in model.modules():
            if next(m.children(), None) is None:
                m.register_forward_pre_hook(self.update)  # returns None: input unchanged
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.update)


def _trainer(mode: str, seconds: float, interval_s: float, q) -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from testdata import train_sample_table

    from relax.streams.codec import group_by_key
    from relax.trainer.backends.torch_backend import TorchBackend
    from relax.trainer.batching import micro_batches
    from relax.trainer.config import TrainerConfig

    table = train_sample_table(1, 8, (40, 40), (6, 12), vocab=30000)
    backend = TorchBackend(TrainerConfig(model="smollm2-135m"))
    mb = micro_batches([g for _, g in group_by_key(table, "group_id")], 1 << 30)[0]
    elastic = _Elastic(interval_s) if mode == "elastic" else None
    if mode == "fixed2":
        torch.set_num_threads(2)
    if elastic:
        elastic.install(backend.model)
    q.put("ready")
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        lp, _ = backend.logprobs(mb)
        (lp * mb.response_mask).sum().backward()
        backend.model.zero_grad()
        n += 1
    wall = time.perf_counter() - t0
    q.put(dict(mode=mode, iters=n, iters_per_s=n / wall,
               cores=(time.process_time() - c0) / wall,
               high_frac=elastic.seconds_high() / wall if elastic else 0.0,
               switches=elastic.switches if elastic else 0))


def _corunner(seconds: float, busy_s: float, idle_s: float, nice: int, q) -> None:
    import torch

    os.nice(nice)
    torch.set_num_threads(1)
    x, w1, w2 = torch.randn(64, 576), torch.randn(576, 1536), torch.randn(1536, 576)
    q.put("ready")
    work, busy, t0 = 0, 0.0, time.perf_counter()
    end = t0 + seconds  # busy_frac counts this window only: the last phase stops at its end
    while time.perf_counter() < end:
        s = time.perf_counter()
        while time.perf_counter() - s < busy_s and time.perf_counter() < end:
            for _ in range(20):
                (x @ w1).relu_() @ w2
            work += 1
        busy += time.perf_counter() - s
        time.sleep(max(0.0, min(idle_s, end - time.perf_counter())))
    q.put(dict(corunner_work_per_busy_s=work / busy, corunner_busy_frac=busy / seconds))


def run_one(mode: str, args, alone: bool = False) -> dict:
    """One trainer run of ``mode`` beside a fresh co-runner (both spawned), or alone."""
    ctx = mp.get_context("spawn")
    qt = ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(mode, args.seconds, args.interval_ms / 1e3, qt))
    trainer.start()
    qt.get()  # the model is loaded: start the co-runner
    if alone:
        out = dict(qt.get(), alone=True)
        trainer.join()
        return out
    qc = ctx.Queue()
    co = ctx.Process(target=_corunner, args=(args.seconds, args.busy_s, args.idle_s,
                                             args.corunner_nice, qc))
    co.start()
    qc.get()
    out = qt.get()
    out.update(qc.get())
    trainer.join(), co.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--busy-s", type=float, default=5.0)
    ap.add_argument("--idle-s", type=float, default=2.0)
    ap.add_argument("--interval-ms", type=float, default=5.0)
    ap.add_argument("--corunner-nice", type=int, default=0,
                    help="the co-runner's niceness (19: it preempts the trainer less)")
    ap.add_argument("--out", type=Path, default=RESULTS / "elastic_threads.json")
    args = ap.parse_args()
    alone = {m: run_one(m, args, alone=True) for m in ("fixed1", "fixed2")}
    for r in alone.values():
        print(json.dumps(r), flush=True)
    runs, ratios = [], []
    for i in range(args.pairs):  # the order turns each pair, against the VM's drift
        pair = {}
        for mode in (("elastic", "fixed1") if i % 2 == 0 else ("fixed1", "elastic")):
            pair[mode] = run_one(mode, args)
            runs.append(pair[mode])
            print(json.dumps(pair[mode]), flush=True)
        ratios.append(pair["elastic"]["iters_per_s"] / pair["fixed1"]["iters_per_s"])
    # a perfect switch: one thread beside the co-runner while it computes, two alone while
    # it sleeps
    idle = statistics.mean(1 - r["corunner_busy_frac"] for r in runs)
    fixed = statistics.mean(r["iters_per_s"] for r in runs if r["mode"] == "fixed1")
    perfect = (1 - idle) * fixed + idle * alone["fixed2"]["iters_per_s"]
    result = dict(config=vars(args) | {"out": str(args.out)}, alone=alone, runs=runs,
                  elastic_over_fixed=ratios,
                  elastic_over_fixed_median=statistics.median(ratios),
                  two_over_one_alone=alone["fixed2"]["iters_per_s"]
                  / alone["fixed1"]["iters_per_s"],
                  perfect_over_fixed=perfect / fixed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"elastic / fixed1 per pair: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {result['elastic_over_fixed_median']:.3f}; a perfect switch "
          f"{result['perfect_over_fixed']:.3f}")


if __name__ == "__main__":
    main()
