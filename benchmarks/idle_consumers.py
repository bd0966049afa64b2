"""What waiting costs: the CPU of idle Kafka consumers, and a training step beside them.

    python benchmarks/idle_consumers.py --json benchmarks/results/idle_consumers.json

A relax stage waiting for data loops on ``poll``; Tansu answers an empty fetch after the
whole ``fetch_max_wait_ms`` (``relax.streams.client.FETCH_WAIT_MS``: kafka-python's
``fetch-latency-avg`` is 203 ms at 200 ms), so each idle consumer is a fetch round trip
every ~0.2 s plus its group's heartbeats, in its process and in the broker. While the
trainer of a sync run trains, the other stages' consumers are such idle consumers. Two
measurements, side by side in one run, on the embedded broker (Tansu):

* ``idle``: CPU (cores: CPU seconds over wall seconds) of one idle consumer's process and
  of the broker, over ``--seconds``, at the default fetch wait and at ``--long-ms``;
* ``train``: SmolLM2-135M's forward and backward of a ``[34, 60]`` batch plus a fused
  AdamW step at 2 torch threads (the size of a workload step of ``e2e_vs_trl.py``), the
  seconds of each of ``--steps`` steps, alone and beside ``--consumers`` idle consumers
  (in 4 processes, like a sync run's rollout, reward, aggregate and driver), at both
  waits, alternating so that the machine's drift hits both alike.

Last line: ``alone_s=.. beside_s=.. slowdown=..`` (medians over the rounds).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

_IDLE = r"""
import sys
from kafka import KafkaConsumer, TopicPartition
from relax.streams.client import BusConfig, consumer_kwargs
bus = BusConfig(bootstrap_servers=sys.argv[1])
consumers = []
for _ in range(int(sys.argv[3])):
    kw = consumer_kwargs(bus, None)
    kw["fetch_max_wait_ms"] = int(sys.argv[2])
    c = KafkaConsumer(**kw)
    c.assign([TopicPartition(sys.argv[4], 0)])
    consumers.append(c)
while True:
    for c in consumers:
        c.poll(timeout_ms=500 // len(consumers))
"""


def _cpu_s(pid: int) -> float:
    """CPU seconds of a live process (all its threads), as the run's CPU timeline reads them."""
    from relax.infra.cpu_timeline import cpu_seconds

    return cpu_seconds(pid)[0]


def idle_cpu(bootstrap: str, topic: str, broker_pid: int, wait_ms: int, seconds: float) -> dict:
    """Cores used by one idle consumer's process and by the broker meanwhile."""
    p = subprocess.Popen([sys.executable, "-c", _IDLE, bootstrap, str(wait_ms), "1", topic])
    try:
        time.sleep(3)  # connected, first fetches done
        c0, b0, t0 = _cpu_s(p.pid), _cpu_s(broker_pid), time.monotonic()
        time.sleep(seconds)
        dt = time.monotonic() - t0
        return {"consumer_cores": round((_cpu_s(p.pid) - c0) / dt, 4),
                "broker_cores": round((_cpu_s(broker_pid) - b0) / dt, 4)}
    finally:
        p.kill()
        p.wait()


def train_steps(steps: int):
    """A function timing ``steps`` training steps: ``() -> (median s, cores)``."""
    import torch

    from relax.trainer.models import load_model

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = load_model("smollm2-135m")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (34, 60))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # the heap and the AdamW state settle

    def timed() -> tuple[float, float]:
        r0, t0, each = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            each.append(time.perf_counter() - t)
        r1, dt = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
        cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
        return statistics.median(each), cpu / dt

    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--long-ms", type=int, default=400)
    ap.add_argument("--consumers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from relax.infra.broker import start_broker, stop_broker
    from relax.streams.client import FETCH_WAIT_MS, BusConfig, ensure_topics

    handle = start_broker()
    bootstrap, topic = handle.bootstrap, "idle"
    try:
        ensure_topics(BusConfig(bootstrap_servers=bootstrap), {topic: 1})
        res: dict = {"fetch_wait_ms": [FETCH_WAIT_MS, a.long_ms], "idle": {}, "train": []}
        for wait in (FETCH_WAIT_MS, a.long_ms):
            res["idle"][f"{wait}ms"] = r = idle_cpu(bootstrap, topic, handle.pid, wait, a.seconds)
            print(f"one idle consumer at {wait} ms: {r}", flush=True)
        timed = train_steps(a.steps)
        per = a.consumers // 4
        for rnd in range(a.rounds):
            for label, wait in (("alone", None), (f"beside_{FETCH_WAIT_MS}ms", FETCH_WAIT_MS),
                                (f"beside_{a.long_ms}ms", a.long_ms)):
                procs = [] if wait is None else [
                    subprocess.Popen([sys.executable, "-c", _IDLE, bootstrap, str(wait),
                                      str(per), topic]) for _ in range(4)]
                try:
                    time.sleep(3 if procs else 0)
                    s, cores = timed()
                finally:
                    for p in procs:
                        p.kill()
                        p.wait()
                res["train"].append({"round": rnd, "context": label, "step_s": round(s, 3),
                                     "cores": round(cores, 3)})
                print(f"round {rnd} {label}: step {s:.3f} s at {cores:.2f} cores", flush=True)
    finally:
        stop_broker(handle)

    def med(label: str) -> float:
        return statistics.median(r["step_s"] for r in res["train"] if r["context"] == label)

    alone, beside = med("alone"), med(f"beside_{FETCH_WAIT_MS}ms")
    res["slowdown"] = round(beside / alone, 3)
    res["slowdown_long_wait"] = round(med(f"beside_{a.long_ms}ms") / alone, 3)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    print(f"alone_s={alone:.3f} beside_s={beside:.3f} slowdown={res['slowdown']} "
          f"slowdown_long_wait={res['slowdown_long_wait']}")


if __name__ == "__main__":
    main()
