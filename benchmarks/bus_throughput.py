"""Bus throughput: rollout rows through the real broker and back, against raw Kafka.

Sends ``--rows`` rollout rows (``--tokens`` response tokens each, keyed by
group_id, messages under ``--max-message-bytes``) with relax's producer, reads
them back with relax's consumer (decode + full validation), checks every row is
equal and in order within its group, sends some garbage values to the same topic
and checks they land in its errors topic. Then sends the same message values
through plain kafka-python (no Arrow) for comparison.

Last line: ``rows_ok=N errors_routed=N codec_MBps=X bus_MBps=Y raw_MBps=Z``
(MB = 1e6 bytes of Arrow message values; bus and raw include produce and
consume, run one after the other).

    python benchmarks/bus_throughput.py --bootstrap 127.0.0.1:PORT --rows 10000
    python benchmarks/bus_throughput.py --rows 10000      # starts a local broker
"""

from __future__ import annotations

import argparse
import contextlib
import time
import uuid

import numpy as np
import pyarrow as pa

from relax.infra.broker import LocalBroker
from relax.schemas import topics
from relax.schemas.v1 import ROLLOUTS
from relax.streams.client import BusConfig, consumer_kwargs, ensure_topics, producer_kwargs
from relax.streams.codec import decode, encode_messages, group_by_key
from relax.streams.consumer import BatchConsumer
from relax.streams.producer import BatchProducer


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
    cols = {
        "rollout_id": pa.array([f"{g}/{i}" for g, i in zip(gid, idx)]),
        "group_id": pa.array(gid),
        "prompt_id": pa.array([f"p{i // group_size}" for i in range(rows)]),
        "dataset": pa.array(["bench"] * rows),
        "sample_index": pa.array(idx),
        "group_size": pa.array(np.full(rows, group_size, np.int32)),
        "prompt_ids": lists(prompt, pa.int32()),
        "response_ids": lists(resp, pa.int32()),
        "loss_mask": lists(np.ones((rows, tokens), np.int8), pa.int8()),
        "logprobs": lists(logp, pa.float32()),
        "token_policy_versions": pa.array([None] * rows, pa.list_(pa.int64())),
        "policy_version_start": pa.array(np.zeros(rows, np.int64)),
        "policy_version_end": pa.array(np.zeros(rows, np.int64)),
        "finish_reason": pa.array(["stop"] * rows),
        "turns": pa.array([[{"role": "assistant", "start": 0, "end": tokens}]] * rows,
                          ROLLOUTS.field("turns").type),
        "prompt_text": pa.array(["What is 2 + 2?"] * rows),
        "response_text": pa.array(["4"] * rows),
        "label": pa.array(["4"] * rows),
        "metadata": pa.array(["{}"] * rows),
        "media": pa.array([None] * rows, ROLLOUTS.field("media").type),
        "temperature": pa.array(np.ones(rows, np.float32)),
        "top_p": pa.array(np.ones(rows, np.float32)),
        "top_k": pa.array(np.zeros(rows, np.int32)),
        "engine_id": pa.array(["bench"] * rows),
        "started_at": pa.array(np.zeros(rows, np.int64)).cast(pa.timestamp("ms", tz="UTC")),
        "finished_at": pa.array(np.zeros(rows, np.int64)).cast(pa.timestamp("ms", tz="UTC")),
    }
    return pa.RecordBatch.from_arrays([cols[f.name] for f in ROLLOUTS], schema=ROLLOUTS)


def codec_mbps(batch: pa.RecordBatch, max_bytes: int) -> tuple[float, list[tuple[str, list[bytes]]]]:
    """Encode (group by key + split) and decode the batch in-process; MB/s and the values."""
    t0 = time.perf_counter()
    msgs = [(k, encode_messages(part, max_bytes)) for k, part in group_by_key(batch, "group_id")]
    n = 0
    for _, vals in msgs:
        for v in vals:
            n += decode(v, "rollouts").num_rows
    dt = time.perf_counter() - t0
    assert n == batch.num_rows
    total = sum(len(v) for _, vals in msgs for v in vals)
    return total / dt / 1e6, msgs


def bus_roundtrip(cfg: BusConfig, batch: pa.RecordBatch, run: str, garbage: int) -> tuple[int, int, float, int]:
    """Through relax's producer/consumer; returns (rows_ok, errors_routed, MB/s, bytes)."""
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
    want = batch.num_rows
    got: dict[str, list[pa.Table]] = {}
    rows = 0
    deadline = time.monotonic() + 300
    while rows < want or cons.routed_errors < garbage:
        if time.monotonic() > deadline:
            raise TimeoutError(f"got {rows}/{want} rows, {cons.routed_errors}/{garbage} errors")
        for d in cons.poll(1.0):
            got.setdefault(d.key.decode(), []).append(d.table)
            rows += d.table.num_rows
            cons.done(d)
    cons.commit()
    dt = time.perf_counter() - t0
    nbytes = prod.stats.bytes
    # every row equal and in order within its group
    ok = 0
    for key, part in group_by_key(batch, "group_id"):
        back = pa.concat_tables(got[key])
        if back.equals(part):
            ok += back.num_rows
    # errors landed in the errors topic
    from relax.streams.read import read_table

    routed = sum(1 for r in read_table(cfg, etopic).to_pylist() if r["source_topic"] == topic)
    cons.close()
    prod.close()
    return ok, routed, nbytes / dt / 1e6, nbytes


def raw_roundtrip(cfg: BusConfig, msgs: list[tuple[str, list[bytes]]], run: str) -> float:
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
        for recs in cons.poll(1000).values():
            n += len(recs)
    cons.commit()
    dt = time.perf_counter() - t0
    prod.close()
    cons.close()
    return sum(len(v) for _, v in values) / dt / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", default=None, help="host:port; default: start a local broker")
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-message-bytes", type=int, default=1 << 20)
    ap.add_argument("--garbage", type=int, default=5)
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        bootstrap = args.bootstrap or stack.enter_context(LocalBroker()).bootstrap
        cfg = BusConfig(bootstrap_servers=bootstrap, max_message_bytes=args.max_message_bytes)
        run = "bench" + uuid.uuid4().hex[:8]
        batch = make_batch(args.rows, args.tokens, args.group_size)
        codec, msgs = codec_mbps(batch, args.max_message_bytes)
        ok, routed, bus, nbytes = bus_roundtrip(cfg, batch, run, args.garbage)
        raw = raw_roundtrip(cfg, msgs, run)
        print(f"payload_MB={nbytes / 1e6:.1f} messages={sum(len(v) for _, v in msgs)} "
              f"bus/raw={bus / raw:.2f}")
        print(f"rows_ok={ok} errors_routed={routed} codec_MBps={codec:.0f} "
              f"bus_MBps={bus:.1f} raw_MBps={raw:.1f}")


if __name__ == "__main__":
    main()
