"""Bus throughput, latency and broker memory on Apache Kafka.

One run measures a local Apache Kafka started for it (KRaft, ``--kafka-nodes`` nodes,
data in a temporary folder; kind ``kafka``) or the cluster at ``--bootstrap`` (kind
``external``: no RSS):

* **bus**: ``--rows`` rollout rows (``--tokens`` response tokens each) through relax's
  BatchProducer and BatchConsumer (decode + full validation); every row must come back
  equal and in order within its group, and ``--garbage`` non-Arrow values must land in
  the errors topic. Rows are keyed by group_id and a group is one message (split under
  ``--max-message-bytes``): the default 104 rows x 1024 tokens is a ~1.0 MB message per
  group (mean and largest message size are reported). MB/s = Arrow value bytes
  (1 MB = 1e6 bytes, before Kafka's zstd) over first send to last row consumed.
* **raw**: the same values through plain kafka-python (no Arrow, no validation); MB/s.
* **latency**: ``--latency-messages`` single ~1 MB messages (one group each), one at a
  time, so no queue builds up: send, flush (acknowledged, acks=all), wait until the
  consumer has it, next. The consumer (a BatchConsumer) polls in a thread of this
  process, so both ends read one clock (``time.perf_counter``): a message's latency runs
  from just before ``send`` (encoding included) to when the consumer's ``poll``
  returned it decoded and validated. The first ``WARMUP`` messages are not counted.
  p50 and p99 in ms; ``ack_p50_ms`` is the median time from send to acknowledgement.
* **broker RSS** (MiB, summed over the nodes' JVMs) from /proc/<pid>/status after those
  three phases: peak = VmHWM, end = VmRSS, sampled = the largest VmRSS sum read every
  0.2 s (``rss_after_e2e``: the same after the e2e run). Kafka's RSS is mostly its JVM
  heap (at most 512 MiB), its log being on disk.
* **tiny e2e** (``--no-e2e`` skips): ``recipes/tiny_ci.yaml`` trained on that broker
  (:func:`relax.infra.control.launch.train` in this process, a temporary run_root): wall
  seconds of the call, and the summary's steps, sampled, trained and balanced.

Writes ``--out`` (JSON: machine, commit, settings, every figure) and prints a table.

    python -m relax.benchmarks.bus_throughput --rows 10000     # e2e included, ~3 min
    python -m relax.benchmarks.bus_throughput --rows 500 --latency-messages 20 --no-e2e \
        --out /tmp/bus.json                                      # a quick look
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import queue
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa

from relax.benchmarks.harness import RESULTS, ROOT, broker, write_result
from relax.infra.broker.kafka import KAFKA_VERSION
from relax.schemas import topics
from relax.schemas.v1 import ROLLOUTS
from relax.streams.client import BusConfig, consumer_kwargs, ensure_topics, producer_kwargs
from relax.streams.codec import decode, encode_messages, group_by_key
from relax.streams.consumer import BatchConsumer
from relax.streams.producer import BatchProducer
from relax.streams.read import read_table

WARMUP = 5
"""Latency messages sent first and not counted (group join, JIT, connection set-up)."""


def make_batch(rows: int, tokens: int, group_size: int, seed: int = 0) -> pa.RecordBatch:
    """``rows`` valid rollout rows with random token ids and log-probs."""
    rng = np.random.default_rng(seed)
    resp = rng.integers(0, 49152, size=(rows, tokens), dtype=np.int32)
    logp = -rng.random((rows, tokens), dtype=np.float32)
    prompt = rng.integers(0, 49152, size=(rows, 64), dtype=np.int32)

    def lists(a: np.ndarray, typ) -> pa.Array:
        offs = np.arange(0, a.size + 1, a.shape[1], dtype=np.int32)
        return pa.ListArray.from_arrays(pa.array(offs), pa.array(a.ravel(), typ))

    gid = [f"g{i // group_size:06d}" for i in range(rows)]
    idx = np.arange(rows, dtype=np.int32) % group_size
    const = {"dataset": "bench", "finish_reason": "stop", "prompt_text": "What is 2 + 2?",
             "response_text": "4", "label": "4", "metadata": "{}", "engine_id": "bench"}
    zero, one = pa.array(np.zeros(rows, np.int64)), pa.array(np.ones(rows, np.float32))
    when = zero.cast(pa.timestamp("ms", tz="UTC"))
    cols = {k: pa.array([v] * rows) for k, v in const.items()} | {
        "rollout_id": pa.array([f"{g}/{i}" for g, i in zip(gid, idx)]),
        "group_id": pa.array(gid),
        "prompt_id": pa.array([f"p{i // group_size}" for i in range(rows)]),
        "sample_index": pa.array(idx), "group_size": pa.array(np.full(rows, group_size, np.int32)),
        "prompt_ids": lists(prompt, pa.int32()), "response_ids": lists(resp, pa.int32()),
        "loss_mask": lists(np.ones((rows, tokens), np.int8), pa.int8()),
        "logprobs": lists(logp, pa.float32()),
        "token_policy_versions": pa.array([None] * rows, pa.list_(pa.int64())),
        "policy_version_start": zero, "policy_version_end": zero,
        "turns": pa.array([[{"role": "assistant", "start": 0, "end": tokens}]] * rows,
                          ROLLOUTS.field("turns").type),
        "media": pa.array([None] * rows, ROLLOUTS.field("media").type),
        "temperature": one, "top_p": one, "top_k": pa.array(np.zeros(rows, np.int32)),
        "started_at": when, "finished_at": when,
    }
    return pa.RecordBatch.from_arrays([cols[f.name] for f in ROLLOUTS], schema=ROLLOUTS)


def codec_mbps(batch: pa.RecordBatch, max_bytes: int) -> tuple[float, list[tuple[str, list]]]:
    """Encode (group by key + split) and decode the batch in-process; MB/s and the values."""
    t0 = time.perf_counter()
    msgs = [(k, encode_messages(part, max_bytes)) for k, part in group_by_key(batch, "group_id")]
    n = sum(decode(v, "rollouts").num_rows for _, vals in msgs for v in vals)
    dt = time.perf_counter() - t0
    assert n == batch.num_rows
    return sum(len(v) for _, vals in msgs for v in vals) / dt / 1e6, msgs


def bus_roundtrip(cfg: BusConfig, batch: pa.RecordBatch, run: str, garbage: int) -> dict:
    """Through relax's producer/consumer: rows_ok, errors_routed, MB/s, bytes, messages."""
    topic = topics.run_topic(run, "rollouts")
    etopic = topics.errors_topic(topic)
    ensure_topics(cfg, {topic: 4, etopic: 1})
    prod = BatchProducer(cfg, "bench")
    cons = BatchConsumer(cfg, topics.group(run, "bench"), [topic], stage="bench")
    cons.poll(0.5)  # join the group before timing
    t0 = time.perf_counter()
    prod.send(topic, batch)
    for i in range(garbage):
        prod.send_value(topic, b"not arrow %d" % i, key=f"garbage{i}".encode())
    prod.flush()
    got: dict[str, list[pa.Table]] = {}
    rows, deadline = 0, time.monotonic() + 300
    while rows < batch.num_rows or cons.routed_errors < garbage:
        if time.monotonic() > deadline:
            raise TimeoutError(f"got {rows}/{batch.num_rows} rows, "
                               f"{cons.routed_errors}/{garbage} errors")
        for d in cons.poll(1.0):
            got.setdefault(d.key.decode(), []).append(d.table)
            rows += d.table.num_rows
            cons.done(d)
    cons.commit()
    dt = time.perf_counter() - t0
    ok = sum(part.num_rows for key, part in group_by_key(batch, "group_id")
             if pa.concat_tables(got[key]).equals(part))  # equal and in order per group
    routed = sum(1 for r in read_table(cfg, etopic).to_pylist() if r["source_topic"] == topic)
    cons.close()
    prod.close()
    s = prod.stats
    return {"rows_ok": ok, "errors_routed": routed, "MBps": s.bytes / dt / 1e6,
            "MB": s.bytes / 1e6, "messages": s.messages, "seconds": dt}


def raw_roundtrip(cfg: BusConfig, msgs: list[tuple[str, list[bytes]]], run: str) -> dict:
    """The same message values through plain kafka-python (no Arrow); MB/s."""
    from kafka import KafkaConsumer, KafkaProducer

    topic = f"{run}.raw"
    ensure_topics(cfg, {topic: 4})
    prod = KafkaProducer(**producer_kwargs(cfg))
    cons = KafkaConsumer(topic, **consumer_kwargs(cfg, f"{run}.raw"))
    cons.poll(500)
    values = [(k.encode(), v) for k, vals in msgs for v in vals]
    t0 = time.perf_counter()
    for k, v in values:
        prod.send(topic, key=k, value=v)
    prod.flush()
    n = 0
    while n < len(values):
        n += sum(len(recs) for recs in cons.poll(1000).values())
    cons.commit()
    dt = time.perf_counter() - t0
    prod.close()
    cons.close()
    return {"MBps": sum(len(v) for _, v in values) / dt / 1e6, "seconds": dt}


def latency(cfg: BusConfig, batch: pa.RecordBatch, run: str, n: int) -> dict:
    """Produce-to-consume latency of ``n`` single messages sent one at a time (module
    docstring); p50/p99/max in ms and the message size in bytes."""
    topic = topics.run_topic(run + "lat", "rollouts")
    ensure_topics(cfg, {topic: 1})
    prod = BatchProducer(cfg, "bench-latency")
    cons = BatchConsumer(cfg, topics.group(run, "latency"), [topic], stage="bench")
    arrived: queue.Queue[tuple[bytes, float]] = queue.Queue()
    joined, stop = threading.Event(), threading.Event()

    def consume() -> None:  # the only user of `cons` until reader.join() below
        while not stop.is_set():
            for d in cons.poll(0.2):
                arrived.put((d.key, time.perf_counter()))
                cons.done(d)
            if cons.kafka.assignment():
                joined.set()

    reader = threading.Thread(target=consume, name="latency-consumer", daemon=True)
    reader.start()
    if not joined.wait(60):
        raise TimeoutError(f"the latency consumer got no partition of {topic} in 60 s")
    ms, ack_ms = [], []
    for i in range(WARMUP + n):
        key = b"lat%d" % i
        t0 = time.perf_counter()
        assert prod.send(topic, batch, key=key) == 1, "latency batch is over one message"
        prod.flush()
        t_ack = time.perf_counter()
        k, t1 = arrived.get(timeout=60)
        assert k == key, f"expected message {key!r}, got {k!r}"
        if i >= WARMUP:
            ms.append((t1 - t0) * 1e3)
            ack_ms.append((t_ack - t0) * 1e3)
    stop.set()
    reader.join()
    cons.commit()
    cons.close()
    prod.close()
    p50, p99 = np.percentile(ms, [50, 99])
    return {"messages": n, "message_bytes": prod.stats.bytes // (WARMUP + n),
            "p50_ms": float(p50), "p99_ms": float(p99), "max_ms": max(ms),
            "ack_p50_ms": float(np.median(ack_ms))}


def proc_mib(pids: list[int], field: str) -> float:
    """``field`` (a kB line of /proc/<pid>/status: VmRSS, VmHWM) summed over ``pids``; MiB."""
    kb = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                kb += int(line.split()[1])
    return kb / 1024


class RssSampler(threading.Thread):
    """Keeps the largest summed VmRSS of ``pids`` (MiB), read every ``interval_s`` seconds."""

    def __init__(self, pids: list[int], interval_s: float = 0.2):
        super().__init__(name="rss-sampler", daemon=True)
        self.pids, self.interval_s, self.sampled_mib = pids, interval_s, 0.0
        self.stopped = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self.sampled_mib = max(self.sampled_mib, proc_mib(self.pids, "VmRSS"))

    def snapshot(self) -> dict:
        """``peak_mib`` (VmHWM), ``end_mib`` (VmRSS now), ``sampled_mib`` (largest sample)."""
        end = proc_mib(self.pids, "VmRSS")
        return {"peak_mib": proc_mib(self.pids, "VmHWM"), "end_mib": end,
                "sampled_mib": max(self.sampled_mib, end)}


def tiny_e2e(bootstrap: str, kind: str, timeout_s: float) -> dict:
    """``relax train recipes/tiny_ci.yaml --bootstrap BOOTSTRAP`` in this process, in a
    temporary run_root: wall seconds and the summary's counts."""
    from relax.infra.control.launch import train
    from relax.infra.recipe.recipe import load_recipe

    with tempfile.TemporaryDirectory(prefix="relax-bench-e2e-") as root:
        recipe = load_recipe(ROOT / "recipes" / "tiny_ci.yaml", [
            f"bootstrap_servers={bootstrap}", f"run_root={root}",
            f"run=benche2e{uuid.uuid4().hex[:8]}"])
        t0 = time.perf_counter()
        summary = train(recipe, say=lambda line: print(f"  [{kind} e2e] {line}"),
                        timeout_s=timeout_s)
        wall = time.perf_counter() - t0
    keys = ("steps", "sampled", "trained", "balanced", "train_s")
    return {"wall_s": wall, **{k: summary.get(k) for k in keys}}


def measure(kind: str, bootstrap: str, pids: list[int], args) -> dict:
    """Every phase on one broker (see the module docstring)."""
    rss = RssSampler(pids) if pids else None
    cfg = BusConfig(bootstrap_servers=bootstrap, max_message_bytes=args.max_message_bytes)
    run = "bench" + uuid.uuid4().hex[:8]
    batch = make_batch(args.rows, args.tokens, args.group_size)
    codec, msgs = codec_mbps(batch, args.max_message_bytes)
    sizes = [len(v) for _, vals in msgs for v in vals]
    out = {"kind": kind, "bootstrap": bootstrap, "codec_MBps": codec,
           "message_bytes_mean": float(np.mean(sizes)), "message_bytes_max": max(sizes)}
    out["bus"] = bus_roundtrip(cfg, batch, run, args.garbage)
    out["raw"] = raw_roundtrip(cfg, msgs, run)
    out["bus_over_raw"] = out["bus"]["MBps"] / out["raw"]["MBps"]
    out["latency"] = latency(cfg, batch.slice(0, args.group_size), run, args.latency_messages)
    out["rss"] = rss.snapshot() if rss else None
    print(f"{kind}: rows_ok={out['bus']['rows_ok']}/{args.rows} errors_routed="
          f"{out['bus']['errors_routed']}/{args.garbage} messages={out['bus']['messages']} "
          f"mean_message_MB={out['message_bytes_mean'] / 1e6:.3f} codec_MBps={codec:.0f}")
    if args.e2e:
        out["e2e"] = tiny_e2e(bootstrap, kind, args.e2e_timeout_s)
        out["rss_after_e2e"] = rss.snapshot() if rss else None
    if rss:
        rss.stopped.set()
    return out


def table(results: list[dict]) -> str:
    """One row per broker measured (``-`` where not measured)."""
    head = ["kind", "bus MB/s", "raw MB/s", "bus/raw", "p50 ms", "p99 ms",
            "broker RSS peak MiB", "tiny e2e wall s"]
    rows = [[r["kind"], f"{r['bus']['MBps']:.1f}", f"{r['raw']['MBps']:.1f}",
             f"{r['bus_over_raw']:.2f}", f"{r['latency']['p50_ms']:.1f}",
             f"{r['latency']['p99_ms']:.1f}",
             f"{r['rss']['peak_mib']:.0f}" if r["rss"] else "-",
             f"{r['e2e']['wall_s']:.1f}" if "e2e" in r else "-"] for r in results]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(line, widths))
                     for line in [head, *rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", help="host:port of a running cluster (kind external; "
                    "default: a local Kafka started for the run)")
    ap.add_argument("--kafka-nodes", type=int, default=1, help="nodes of the local Kafka")
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--tokens", type=int, default=1024, help="response tokens per row")
    ap.add_argument("--group-size", type=int, default=104, help="rows per key (one message)")
    ap.add_argument("--max-message-bytes", type=int, default=1 << 20)
    ap.add_argument("--garbage", type=int, default=5, help="non-Arrow values to route")
    ap.add_argument("--latency-messages", type=int, default=200)
    ap.add_argument("--e2e", action=argparse.BooleanOptionalAction, default=True,
                    help="train recipes/tiny_ci.yaml on the broker")
    ap.add_argument("--e2e-timeout-s", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "bus_throughput.json")
    args = ap.parse_args()
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # as `relax train`: closed sockets
    logging.getLogger("relax.streams.consumer").setLevel(logging.ERROR)  # the garbage routed
    kind = "external" if args.bootstrap else "kafka"
    with broker(args.bootstrap, args.kafka_nodes) as (bootstrap, pids):
        results = [measure(kind, bootstrap, pids, args)]
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_result(args.out, {"settings": settings, "results": results}, kafka=KAFKA_VERSION,
                 kafka_python=importlib.metadata.version("kafka-python"),
                 pyarrow=pa.__version__)
    print(table(results))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
