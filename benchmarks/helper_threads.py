"""Do a stage's idle bus clients cost its computing thread more in its own process than
in another one? (issue 19: "the reader-ahead thread holding the GIL")

A stage process computes in one thread while its helper threads (kafka-python consumers
polling their topics, the producer's sender) wake several times a second, each time
taking the GIL. Generation is a decode loop with much Python per token, so a helper that
takes the GIL between two torch calls could stall it, where the same work in another
process would run on the free core. Here one half of the e2e workload (``e2e_vs_trl``'s
``loop_parts`` at one torch thread) runs call after call in three contexts:

* ``alone``: no bus client anywhere (the broker runs, with no client);
* ``inproc``: ``--clients`` consumers polling an empty topic (``BusConfig`` defaults:
  the 200-ms fetch wait) in threads of this process, as a stage's helpers do;
* ``outproc``: the same consumers in a second process.

The helpers of both kinds are started once and paused between calls (in-process threads
block on an event; the second process is ``SIGSTOP``ped), so that the three contexts
alternate call by call: call ``i`` of each triple runs the same batch in each context,
the triple's order rotating. A triple's ratios, ``inproc / alone`` and ``outproc /
alone``, compare calls a few seconds apart, which this VM's drift (up to 10 % within
minutes) does not reach.

    .venv/bin/python benchmarks/helper_threads.py --part gen --triples 30
    .venv/bin/python benchmarks/helper_threads.py --part train --triples 30

Writes ``benchmarks/results/helper_threads_<part>.json``: every call, and the medians of
the per-triple ratios. Results: RESULTS.md, "2026-12-07: a stage's helper threads and the
GIL".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import e2e_vs_trl as bench  # noqa: E402

CONTEXTS = ("alone", "inproc", "outproc")

class Clients:
    """``n`` consumers polling ``topic`` in threads of this process, run only while
    :attr:`on` is set."""

    def __init__(self, bootstrap: str, topic: str, n: int):
        from kafka import KafkaConsumer, TopicPartition

        from relax.streams.client import BusConfig, consumer_kwargs

        self.on, self._stop = threading.Event(), False
        kw = consumer_kwargs(BusConfig(bootstrap_servers=bootstrap), None)
        self._consumers = [KafkaConsumer(**kw) for _ in range(n)]
        for c in self._consumers:
            c.assign([TopicPartition(topic, 0)])
        self._threads = [threading.Thread(target=self._poll, args=(c,), daemon=True)
                         for c in self._consumers]
        for t in self._threads:
            t.start()

    def _poll(self, consumer) -> None:
        while not self._stop:
            self.on.wait()
            consumer.poll(timeout_ms=200)

    def close(self) -> None:
        self._stop = True
        self.on.set()
        for t in self._threads:
            t.join()
        for c in self._consumers:
            c.close()


def ratios(calls: list[dict]) -> dict:
    """Medians over the triples of ``<context> / alone`` (wall seconds of a triple's
    calls, which ran the same batch), and each context's median call seconds.

    Args:
        calls: ``{"triple": k, "context": c, "s": seconds}`` per call, each triple holding
            one call of every context of :data:`CONTEXTS`.

    Raises:
        KeyError: a triple lacks one of the contexts.
    """
    by: dict[int, dict[str, float]] = {}
    for c in calls:
        by.setdefault(c["triple"], {})[c["context"]] = c["s"]
    out = {f"{k}_s": round(statistics.median(t[k] for t in by.values()), 3)
           for k in CONTEXTS}
    for k in CONTEXTS[1:]:
        out[f"{k}_over_alone"] = round(statistics.median(t[k] / t["alone"]
                                                         for t in by.values()), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("gen", "train"))
    ap.add_argument("--triples", type=int, default=12)
    ap.add_argument("--clients", type=int, default=4, help="consumers in each context")
    ap.add_argument("--settle-s", type=float, default=1.0,
                    help="after switching the helpers on, before the call")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--serve-clients", metavar="BOOTSTRAP", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_clients:  # the second process: the same clients, never paused by an event
        Clients(a.serve_clients, "idle", a.clients).on.set()
        while True:
            time.sleep(1)
    if a.part is None:
        ap.error("--part gen or --part train is required")
    from relax.infra.broker import start_broker, stop_broker
    from relax.streams.client import BusConfig, ensure_topics

    broker = start_broker()
    other = None
    try:
        ensure_topics(BusConfig(bootstrap_servers=broker.bootstrap), {"idle": 1})
        inproc = Clients(broker.bootstrap, "idle", a.clients)
        other = subprocess.Popen([sys.executable, __file__, "--serve-clients",
                                  broker.bootstrap, "--clients", str(a.clients)])
        p = bench.loop_parts(bench.workload(steps=8, seed=1), 1, a.part)
        made = [p.sample(i) for i in range(2)] if a.part == "train" else []

        def call(i: int) -> None:
            if a.part == "train":
                p.train(made[i % 2])
            else:
                p.sample(i % 8)

        call(0)  # the heap and the optimizer state settle
        os.kill(other.pid, signal.SIGSTOP)
        calls = []
        for k in range(a.triples):
            order = CONTEXTS[k % 3:] + CONTEXTS[:k % 3]
            for ctx in order:
                if ctx == "inproc":
                    inproc.on.set()
                if ctx == "outproc":
                    if other.poll() is not None:
                        raise RuntimeError(f"the clients' process exited {other.returncode}")
                    os.kill(other.pid, signal.SIGCONT)
                time.sleep(a.settle_s)
                t0 = time.perf_counter()
                call(k)
                calls.append({"triple": k, "context": ctx, "s": time.perf_counter() - t0})
                inproc.on.clear()
                os.kill(other.pid, signal.SIGSTOP)
                print(json.dumps(calls[-1]), flush=True)
        inproc.close()
    finally:
        if other is not None:
            other.kill()
            other.wait()
        stop_broker(broker)
    res = ratios(calls)
    out = a.out or HERE / "results" / f"helper_threads_{a.part}.json"
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "part": a.part,
                               "clients": a.clients, "calls": calls, **res}, indent=1) + "\n")
    print("wrote", out)
    print(" ".join(f"{k}={v}" for k, v in res.items()))


if __name__ == "__main__":
    main()
