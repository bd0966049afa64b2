"""Read-after-write latency on the bus: how long a record takes to reach a reader.

    python -m relax.benchmarks.bus_latency                 # a local Apache Kafka
    python -m relax.benchmarks.bus_latency --bootstrap HOST:PORT --json /tmp/out.json
    python -m relax.benchmarks.bus_latency --waits 200,250,10 --records 40

Two readers, at each fetch wait of ``--waits`` (default: ``relax.streams.client.
FETCH_WAIT_MS`` and a short one), one wait after the other in one run:

* ``hop``: a reader looping on ``poll`` (as every stage's consumer does) and a producer
  writing one record at random moments 0.3-0.6 s apart; the seconds from the producer's
  ``send`` (its ``flush`` included) to the record's arrival (min / median / max of
  ``--records``);
* ``claim``: the rollout's claim round trip (:class:`relax.consumers.rollout.claims.
  ClaimLog`): a poll of the claim log (``allowance()``), then a claim written and read
  back; the seconds of the read-back.

Last line: ``hop_median_ms=.. hop_max_ms=.. claim_median_ms=..`` for each wait.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
import uuid
from pathlib import Path

from relax.benchmarks.harness import RESULTS, broker, write_result


def hop(bus, wait_ms: int, records: int) -> list[float]:
    """Arrival delays (s) of ``records`` records at a reader looping on ``poll``."""
    from relax.streams.client import ensure_topics
    from relax.streams.producer import BatchProducer
    from relax.streams.read import TopicReader

    topic = f"latency-{uuid.uuid4().hex[:8]}"
    ensure_topics(bus, {topic: 1})
    reader = TopicReader(bus, "latency", fetch_wait_ms=wait_ms)
    reader.follow(topic, 1)
    producer = BatchProducer(bus)
    sent: dict[int, float] = {}

    def produce():
        for i in range(records):
            time.sleep(random.uniform(0.3, 0.6))
            sent[i] = time.perf_counter()
            producer.send_value(topic, str(i).encode())
            producer.flush()

    t = threading.Thread(target=produce)
    t.start()
    delays: list[float] = []
    deadline = time.monotonic() + records + 10
    while len(delays) < records and time.monotonic() < deadline:
        for m in reader.poll(0.5):
            delays.append(time.perf_counter() - sent[int(m.value)])
    t.join()
    reader.close()
    producer.close()
    return delays


def claims(bus, wait_ms: int, records: int) -> list[float]:
    """Read-back delays (s) of ``records`` claims, each after an ``allowance()`` poll."""
    from relax.consumers.rollout.claims import ClaimLog
    from relax.streams.producer import BatchProducer

    producer = BatchProducer(bus)
    log = ClaimLog(bus, f"latency-{uuid.uuid4().hex[:8]}", "rollout-0", producer,
                   fetch_wait_ms=wait_ms)
    delays = []
    for i in range(records):
        time.sleep(0.3)
        log.poll(0.0)
        t = time.perf_counter()
        log.claim([f"g{i}"], 10 * records)
        delays.append(time.perf_counter() - t)
    log.close()
    producer.close()
    return delays


def summary(delays: list[float]) -> dict:
    ms = sorted(d * 1e3 for d in delays)
    return {"n": len(ms), "min_ms": round(ms[0], 1), "median_ms": round(statistics.median(ms), 1),
            "max_ms": round(ms[-1], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", help="an existing cluster (default: a local Kafka "
                    "started for the run)")
    ap.add_argument("--records", type=int, default=20)
    ap.add_argument("--waits", help="fetch waits to measure, ms, comma-separated "
                    "(default: FETCH_WAIT_MS,10)")
    ap.add_argument("--json", type=Path, default=RESULTS / "bus_latency.json")
    a = ap.parse_args()
    from relax.streams.client import FETCH_WAIT_MS, BusConfig

    waits = [int(x) for x in a.waits.split(",")] if a.waits else [FETCH_WAIT_MS, 10]
    res = {}
    with broker(a.bootstrap) as (bootstrap, _):
        bus = BusConfig(bootstrap_servers=bootstrap)
        for wait in waits:
            res[f"wait_{wait}ms"] = {"hop": summary(hop(bus, wait, a.records)),
                                     "claim": summary(claims(bus, wait, a.records))}
            r = res[f"wait_{wait}ms"]
            print(f"fetch_wait={wait}ms hop_median_ms={r['hop']['median_ms']} "
                  f"hop_max_ms={r['hop']['max_ms']} claim_median_ms={r['claim']['median_ms']}",
                  flush=True)
    settings = {"bootstrap": a.bootstrap, "records": a.records, "waits": waits}
    print(f"wrote {write_result(a.json, {'settings': settings, **res})}")

if __name__ == "__main__":
    main()
