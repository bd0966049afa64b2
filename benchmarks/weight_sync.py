"""Weight sync: trainer -> N rollout engines over the weight channel, while they generate.

The publisher (this process) loads ``--model`` and publishes ``--versions`` versions
(each a perturbed copy of the weights) with
:class:`relax.streams.weights.publisher.WeightPublisher`, once per transport of
``--transports`` (side by side in one run): ``gloo`` (the
broadcast over TCP, what engines on other hosts get), ``shm`` (the same-host file in
``/dev/shm``, :mod:`relax.streams.weights.shm`, copied straight into the engine's second
buffer) and ``shm-buffered`` (the same file copied into the subscriber's receive buffer
first, then into the engine: the path before 2026-12-05, and still a module target's).
``--subscribers`` processes each run
an HF engine in partial-rollout mode, generating continuously, with a
:class:`WeightSubscriber` staging every received version into the engine's second
buffer; the engine swaps at its next safe point. Each subscriber checks that its live
weights at the end have the checksum of the last announcement.

Figures (versions after the first, whose time includes forming the group):

* ``bytes``: flat bytes per version; ``publish_s``: mean seconds from ``publish()`` to
  the last bucket broadcast; ``GBps`` = bytes / publish_s / 1e9;
* ``memcpy_GBps``: a plain in-process copy of the same bytes (best of 3);
  ``ratio`` = GBps / memcpy_GBps;
* ``blocked_ms``: the most any subscriber's generation waited per swap (engine
  ``swap_blocked_s / swaps``), i.e. what double buffering leaves of the transfer;
* ``delivered_s`` / ``delivered_median_s``: mean / median seconds from ``publish()``
  until the last subscriber has the version verified and staged in its engine (each
  subscriber notes the time it sees a new version, polling every 5 ms);
* ``pub_cpu_s`` / ``sub_cpu_s``: CPU seconds per version of the publisher process / of
  one subscriber process (mean; with ``--batch 0`` a subscriber does nothing else).

One line per transport: ``transport=T bytes=B publish_s=.. delivered_s=.. GBps=..
memcpy_GBps=.. ratio=.. blocked_ms=.. pub_cpu_s=.. sub_cpu_s=..``; with both transports a
line ``shm_over_gloo delivered=.. sub_cpu=..`` (ratios of the means), with ``shm`` and
``shm-buffered`` a line ``staged_over_buffered ...``, and ``--json PATH`` writes every
figure.

    python benchmarks/weight_sync.py --model smollm2-135m --subscribers 2
    python benchmarks/weight_sync.py --model smollm2-135m --subscribers 1 --batch 0 \
        --versions 6 --json benchmarks/results/weight_transports.json
    python benchmarks/weight_sync.py --subscribers 1 --batch 0 --versions 6 \
        --transports shm-buffered,shm --json benchmarks/results/weight_staging.json
    python benchmarks/weight_sync.py --model tiny-llama --subscribers 2 --bootstrap 127.0.0.1:9092
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import torch

from relax.benchmarks.harness import broker, write_result


def subscriber(args) -> None:
    """One rollout engine: generate until told to stop, receiving weights meanwhile."""
    from relax.consumers.engines.base import SamplingParams
    from relax.consumers.engines.hf import HFEngine
    from relax.streams.client import BusConfig
    from relax.streams.weights.layout import build_manifest, checksum, flatten_into, total_bytes
    from relax.streams.weights.subscriber import WeightSubscriber

    torch.set_num_threads(1)
    out = Path(args.out)
    engine = HFEngine(args.model, device="cpu", partial_rollout=True, chunk_tokens=8)
    sub = WeightSubscriber(
        BusConfig(bootstrap_servers=args.bootstrap),
        args.run,
        member_id=args.member,
        # an object with update_weights only: the receive buffer first, then the engine
        target=SimpleNamespace(update_weights=engine.update_weights) if args.buffered
        else engine,
        rendezvous=args.rendezvous,
    ).start()
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a long story about a lighthouse."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    params = SamplingParams(max_new_tokens=32, temperature=0.8)
    seen: dict[int, float] = {}

    def watch() -> None:  # when each version is verified and staged here
        while not (out / "stop").exists():
            if sub.version is not None and sub.version not in seen:
                seen[sub.version] = time.time()
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()
    cpu0 = _cpu_s()
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
    # the last version may land after "stop" ended the watch (a loaded machine): its time
    # is when it is seen here
    seen.setdefault(sub.version, time.time())
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
        seen=seen,
        cpu_s=_cpu_s() - cpu0,
    )
    sub.close()
    (out / f"{args.member}.json").write_text(json.dumps(result))


def _cpu_s() -> float:
    """User + system CPU seconds of this process so far (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


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
    """Each transport of ``--transports`` in turn, on one broker; prints and writes the
    figures (module docstring)."""
    from relax.trainer.models import load_model

    with broker(args.bootstrap) as (bootstrap, _):
        named = dict(load_model(args.model).named_parameters())
        out = {t: one_transport(args, bootstrap, named, t) for t in args.transports.split(",")}
    for name, new, old in (("shm_over_gloo", "shm", "gloo"),
                           ("staged_over_buffered", "shm", "shm-buffered")):
        if {new, old} <= out.keys():
            m, g = out[new], out[old]
            out[name] = {"delivered": m["delivered_s"] / g["delivered_s"],
                         "delivered_median": m["delivered_median_s"] / g["delivered_median_s"],
                         "sub_cpu": m["sub_cpu_s"] / g["sub_cpu_s"],
                         "pub_cpu": m["pub_cpu_s"] / g["pub_cpu_s"]}
            print(f"{name} " + " ".join(f"{k}={v:.3f}" for k, v in out[name].items()))
    if args.json:
        out["args"] = vars(args)
        write_result(args.json, out)


def one_transport(args, bootstrap: str, named: dict, transport: str) -> dict:
    """Publish ``--versions`` versions of ``named`` to ``--subscribers`` engine processes
    over ``transport`` (``gloo``, ``shm`` or ``shm-buffered``); the figures of the module
    docstring."""
    from relax.streams.client import BusConfig
    from relax.streams.weights.announce import AnnouncementReader
    from relax.streams.weights.publisher import WeightPublisher

    if transport not in ("gloo", "shm", "shm-buffered"):
        raise SystemExit(f"--transports: gloo, shm or shm-buffered, got {transport!r}")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = BusConfig(bootstrap_servers=bootstrap)
        run = f"wsync{uuid.uuid4().hex[:6]}"
        pub = WeightPublisher(cfg, run, bucket_bytes=args.bucket_bytes, join_timeout_s=300,
                              shm_root=None if transport == "gloo" else "/dev/shm")
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
                    *(["--buffered"] if transport == "shm-buffered" else []),
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
            history, published, cpu = [], {}, []
            for v in range(1, args.versions + 1):
                with torch.no_grad():
                    for p in named.values():
                        p.mul_(1.0 + 1e-3)
                c0 = _cpu_s()
                published[v] = time.time()
                stats = pub.publish(named, v).result()
                cpu.append(_cpu_s() - c0)
                if stats.error:
                    raise RuntimeError(stats.error)
                history.append(stats)
                print(
                    f"{transport} v{v}: bytes={stats.bytes} blocked_s={stats.blocked_s:.3f} "
                    f"broadcast_s={stats.broadcast_s:.3f} publish_s={stats.publish_s:.3f} "
                    f"members={len(stats.members)} local={len(stats.local)}",
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
        versions = range(2, args.versions + 1) if args.versions > 1 else range(1, 2)
        delivered = [max(r["seen"][str(v)] for r in results) - published[v] for v in versions]
        gbps = nbytes / publish_s / 1e9
        mgbps = memcpy_gbps(nbytes)
        blocked_ms = max(1000 * r["swap_blocked_s"] / max(r["swaps"], 1) for r in results)
        fig = dict(transport=transport, bytes=nbytes, publish_s=publish_s,
                   delivered_s=sum(delivered) / len(delivered),
                   delivered_median_s=statistics.median(delivered), GBps=gbps, memcpy_GBps=mgbps,
                   ratio=gbps / mgbps, blocked_ms=blocked_ms,
                   pub_cpu_s=sum(cpu[1:] or cpu) / len(cpu[1:] or cpu),
                   sub_cpu_s=sum(r["cpu_s"] for r in results) / len(results) / args.versions,
                   delivered_each_s=delivered)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in fig.items() if k != "delivered_each_s"), flush=True)
        return fig


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
    ap.add_argument("--transports", default="gloo,shm",
                    help="gloo, shm, shm-buffered: one or more, in that order")
    ap.add_argument("--buffered", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="", help="write every figure to this file")
    ap.add_argument("--role", default="publisher", choices=["publisher", "subscriber"])
    ap.add_argument("--run", default="")
    ap.add_argument("--member", default="")
    ap.add_argument("--rendezvous", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    subscriber(args) if args.role == "subscriber" else publisher(args)


if __name__ == "__main__":
    main()
