"""Weight sync: trainer -> N rollout engines over the weight channel, while they generate.

The publisher (this process) loads ``--model`` and publishes ``--versions`` versions
(each a perturbed copy of the weights) with :class:`relax.streams.weights.WeightPublisher`
(gloo on CPU). ``--subscribers`` processes each run an HF engine in partial-rollout
mode, generating continuously, with a :class:`WeightSubscriber` staging every
received version into the engine's second buffer; the engine swaps at its next
safe point. Each subscriber checks that its live weights at the end have the
checksum of the last announcement.

Figures (versions after the first, whose time includes forming the group):

* ``bytes``: flat bytes per version; ``publish_s``: mean seconds from ``publish()`` to
  the last bucket broadcast; ``GBps`` = bytes / publish_s / 1e9;
* ``memcpy_GBps``: a plain in-process copy of the same bytes (best of 3);
  ``ratio`` = GBps / memcpy_GBps;
* ``blocked_ms``: the most any subscriber's generation waited per swap (engine
  ``swap_blocked_s / swaps``), i.e. what double buffering leaves of the transfer.

Last line: ``bytes=B publish_s=T GBps=X memcpy_GBps=Y ratio=R blocked_ms=Z``

    python benchmarks/weight_sync.py --model smollm2-135m --subscribers 2
    python benchmarks/weight_sync.py --model tiny-llama --subscribers 2 --bootstrap 127.0.0.1:9092
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch


def subscriber(args) -> None:
    """One rollout engine: generate until told to stop, receiving weights meanwhile."""
    from relax.consumers.engines.base import SamplingParams
    from relax.consumers.engines.hf import HFEngine
    from relax.streams.client import BusConfig
    from relax.streams.weights import (
        WeightSubscriber,
        build_manifest,
        checksum,
        flatten_into,
        total_bytes,
    )

    torch.set_num_threads(1)
    out = Path(args.out)
    engine = HFEngine(args.model, device="cpu", partial_rollout=True, chunk_tokens=8)
    sub = WeightSubscriber(
        BusConfig(bootstrap_servers=args.bootstrap),
        args.run,
        member_id=args.member,
        target=engine,
        rendezvous=args.rendezvous,
    ).start()
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a long story about a lighthouse."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    params = SamplingParams(max_new_tokens=32, temperature=0.8)
    (out / f"{args.member}.ready").touch()
    generated = 0
    while not (out / "stop").exists():
        if args.batch == 0:  # transport only: no generation competing for the CPU
            time.sleep(0.05)
            engine.apply_pending()
            continue
        gens = engine.generate([prompt] * args.batch, params)
        generated += sum(len(g.token_ids) for g in gens)
        sub.poll(0)
    sub.wait_for(args.versions, 300)
    engine.apply_pending()
    named = {n: p.detach() for n, p in engine.model.named_parameters()}
    m = build_manifest(named)
    flat = torch.empty(total_bytes(m), dtype=torch.uint8)
    flatten_into(flat, named, m)
    result = dict(
        version=engine.policy_version,
        checksum=checksum(flat),
        swaps=engine.stats.swaps,
        swap_blocked_s=engine.stats.swap_blocked_s,
        received=sub.stats.received,
        receive_s=sub.stats.receive_s,
        checksum_failures=sub.stats.checksum_failures,
        tokens=generated,
        generate_s=engine.stats.generate_s,
    )
    sub.close()
    (out / f"{args.member}.json").write_text(json.dumps(result))


def memcpy_gbps(nbytes: int) -> float:
    """Best-of-3 GB/s of ``dst.copy_(src)`` for ``nbytes`` uint8 in this process."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def publisher(args) -> None:
    from relax.infra.broker import LocalBroker
    from relax.streams.client import BusConfig
    from relax.streams.weights import AnnouncementReader, WeightPublisher
    from relax.trainer.models import load_model

    ctx = LocalBroker() if not args.bootstrap else contextlib.nullcontext()
    with ctx as broker, tempfile.TemporaryDirectory() as tmp:
        bootstrap = args.bootstrap or broker.bootstrap
        cfg = BusConfig(bootstrap_servers=bootstrap)
        run = f"wsync{uuid.uuid4().hex[:6]}"
        model = load_model(args.model)
        named = dict(model.named_parameters())
        pub = WeightPublisher(cfg, run, bucket_bytes=args.bucket_bytes, join_timeout_s=300)
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--role",
                    "subscriber",
                    "--model",
                    args.model,
                    "--bootstrap",
                    bootstrap,
                    "--run",
                    run,
                    "--member",
                    f"engine-{i}",
                    "--rendezvous",
                    pub.rendezvous,
                    "--out",
                    tmp,
                    "--versions",
                    str(args.versions),
                    "--batch",
                    str(args.batch),
                ]
            )
            for i in range(args.subscribers)
        ]
        try:
            pub.wait_for_members(args.subscribers, 300)
            for i in range(args.subscribers):
                while not (Path(tmp) / f"engine-{i}.ready").exists():
                    if procs[i].poll() is not None:
                        raise RuntimeError(f"subscriber {i} exited {procs[i].returncode}")
                    time.sleep(0.1)
            time.sleep(args.warmup_s)  # let generation run before the first version
            history = []
            for v in range(1, args.versions + 1):
                with torch.no_grad():
                    for p in named.values():
                        p.mul_(1.0 + 1e-3)
                stats = pub.publish(named, v).result()
                if stats.error:
                    raise RuntimeError(stats.error)
                history.append(stats)
                print(
                    f"v{v}: bytes={stats.bytes} blocked_s={stats.blocked_s:.3f} "
                    f"broadcast_s={stats.broadcast_s:.3f} publish_s={stats.publish_s:.3f} "
                    f"members={len(stats.members)}",
                    flush=True,
                )
                time.sleep(args.gap_s)
            (Path(tmp) / "stop").touch()
            for p in procs:
                if p.wait(timeout=600) != 0:
                    raise RuntimeError(f"a subscriber exited {p.returncode}")
            results = [
                json.loads((Path(tmp) / f"engine-{i}.json").read_text())
                for i in range(args.subscribers)
            ]
        finally:
            (Path(tmp) / "stop").touch()
            for p in procs:
                if p.poll() is None:
                    p.kill()
            pub.close()
        reader = AnnouncementReader(cfg, run)
        last = [r for r in reader.poll(5.0) if r["policy_version"] == args.versions][0]
        reader.close()
        for i, r in enumerate(results):
            ok = r["checksum"] == last["checksum"] and r["version"] == args.versions
            print(
                f"engine-{i}: version={r['version']} checksum_ok={ok} received={r['received']} "
                f"swaps={r['swaps']} swap_blocked_ms={1000 * r['swap_blocked_s']:.3f} "
                f"receive_s={r['receive_s']:.2f} gen_tokens_per_s="
                f"{r['tokens'] / max(r['generate_s'], 1e-9):.1f}",
                flush=True,
            )
            if not ok or r["checksum_failures"]:
                raise SystemExit(f"engine-{i} did not end on the published weights")
        steady = history[1:] or history
        nbytes = steady[0].bytes
        publish_s = sum(s.publish_s for s in steady) / len(steady)
        gbps = nbytes / publish_s / 1e9
        mgbps = memcpy_gbps(nbytes)
        blocked_ms = max(1000 * r["swap_blocked_s"] / max(r["swaps"], 1) for r in results)
        print(
            f"bytes={nbytes} publish_s={publish_s:.3f} GBps={gbps:.3f} memcpy_GBps={mgbps:.2f} "
            f"ratio={gbps / mgbps:.4f} blocked_ms={blocked_ms:.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--subscribers", type=int, default=2)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--bucket-bytes", type=int, default=512 << 20)
    ap.add_argument(
        "--batch",
        type=int,
        default=2,
        help="prompts per generate call in each engine (0 = no generation)",
    )
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--gap-s", type=float, default=1.0, help="seconds between versions")
    ap.add_argument("--bootstrap", default=None, help="Kafka bootstrap (default: a local broker)")
    ap.add_argument("--role", default="publisher", choices=["publisher", "subscriber"])
    ap.add_argument("--run", default="")
    ap.add_argument("--member", default="")
    ap.add_argument("--rendezvous", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    subscriber(args) if args.role == "subscriber" else publisher(args)


if __name__ == "__main__":
    main()
