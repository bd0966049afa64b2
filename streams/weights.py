"""The weight channel: trainer -> rollout/reference engines, versioned (ARCHITECTURE section 5).

Weights never go through Kafka; only their announcements do.

Publisher (trainer), per policy_version ``v`` (:meth:`WeightPublisher.publish`):

1. *caller's thread*: wait for the previous broadcast to finish (one in flight), copy
   the tensors into the flat send buffer (so the trainer may change its weights as
   soon as ``publish`` returns), hand the rest to a background thread. The broadcast
   thus overlaps the next training step; ``publish`` blocks only for the copy (and
   for a previous broadcast still running).
2. *background thread*: checksum (``crc32c`` over the flat bytes); (re)form the process
   group if membership changed; announce ``v`` on ``<run>.weights`` (WEIGHTS schema:
   manifest of names, shapes, dtypes, byte offsets and sizes, bucket size, checksum,
   transport ``gloo``/``nccl``, rendezvous ``tcp://host:port``, group name); broadcast
   the flat bytes in buckets of whole tensors (default 512 MiB; a tensor larger than a
   bucket travels alone) from rank 0; then, every ``checkpoint_every`` versions, write
   the flat bytes as one safetensors file into ``checkpoint_dir/v<version>/`` (temp
   folder + atomic rename) and announce it again with ``transport=checkpoint`` and its
   ``checkpoint_uri``.

Flat layout: tensors in manifest order (sorted by element size, largest first, so
every offset is aligned for its dtype), each tensor's bytes contiguous, no padding.
This is also SGLang's ``FlattenedTensorBucket`` layout, and the data section of the
safetensors checkpoint, so one checksum covers all three.

Subscribers (:class:`WeightSubscriber`, one background thread each) register in the
rendezvous store (``+id`` / ``-id`` lines appended to one log, replayed in
order); at the next version boundary the publisher forms a new group that
includes them (membership changes only at version boundaries). For each announcement
they belong to, they receive every bucket into a *receive buffer* (never into live
weights), verify the checksum, and hand the tensors to the engine's
``update_weights`` (which stages them in its own second buffer and swaps at a safe
point between generation steps) or keep them for :meth:`WeightSubscriber.apply`.
A subscriber that starts late first loads the newest ``checkpoint`` announcement's
safetensors, then joins the broadcast at the next version.

Rendezvous: the publisher hosts a ``torch.distributed.TCPStore`` at ``host:port`` (the
announcement's ``rendezvous``), reachable across machines. Keys: ``relax/membership``
(the join/leave log), ``<group>/members`` (member ids, one per line; rank = line index
+ 1), ``<group>/ready/<member>``. Each group is a standalone
``ProcessGroupGloo``/``ProcessGroupNCCL`` on ``PrefixStore('<group>/pg/')``: it never
touches the process's default group (the trainer's DDP group stays its own). A member
that does not show up within ``join_timeout_s`` is dropped from the next group; that
version's broadcast is skipped for everyone in the failed group (they catch up at the
next version or from the checkpoint). A group is re-formed only when membership
changed; otherwise every version reuses it.

Device and backend: buffers on CPU use gloo, buffers on CUDA use nccl (imported
lazily; only gloo is exercised on the CPU machines relax is tested on). Checksums are
computed on host bytes (a device-to-host copy on CUDA).

Delivery: announcements are at-least-once records on a 1-partition topic (ordered);
subscribers read it group-less from the beginning (no commits).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import socket
import struct
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import torch

from relax.schemas import topics as topic_names
from relax.schemas.v1 import WEIGHTS
from relax.schemas.validate import validate
from relax.streams.client import BusConfig, ensure_topics

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 << 20
"""Default broadcast bucket size (bytes)."""

MEMBERSHIP_KEY = "relax/membership"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_SAFETENSORS_DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


# ------------------------------------------------------------------ pure helpers
@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the flat stream: ``offset``/``nbytes`` in bytes, ``dtype`` a torch
    dtype name (``float32``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32``.

    Raises:
        ValueError: for a dtype the channel does not carry (lists the valid ones).
    """
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(
            f"dtype {dtype} is not supported by the weight channel; valid: {', '.join(_DTYPES)}"
        )
    return name


def build_manifest(named_tensors: dict[str, torch.Tensor]) -> list[TensorEntry]:
    """Manifest of the flat stream: tensors sorted by element size (largest first,
    stable), offsets contiguous, so every tensor starts at a multiple of its element
    size. Raises ValueError for an empty dict or an unsupported dtype."""
    if not named_tensors:
        raise ValueError("named_tensors is empty: nothing to publish")
    items = sorted(named_tensors.items(), key=lambda kv: -kv[1].element_size())
    out, offset = [], 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        out.append(TensorEntry(name, tuple(t.shape), dtype_name(t.dtype), offset, nbytes))
        offset += nbytes
    return out


def total_bytes(manifest: list[TensorEntry]) -> int:
    """Bytes of the flat stream."""
    return manifest[-1].offset + manifest[-1].nbytes if manifest else 0


def plan_buckets(
    manifest: list[TensorEntry], bucket_bytes: int
) -> list[tuple[int, int, list[int]]]:
    """Split the flat stream into buckets of whole tensors.

    Returns:
        ``[(start_byte, end_byte, [manifest indices])]``; each bucket holds at most
        ``bucket_bytes`` unless a single tensor is larger (it travels alone).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[tuple[int, int, list[int]]] = []
    start, idx = 0, []
    for i, e in enumerate(manifest):
        if idx and e.offset + e.nbytes - start > bucket_bytes:
            buckets.append((start, e.offset, idx))
            start, idx = e.offset, []
        idx.append(i)
    if idx:
        buckets.append((start, total_bytes(manifest), idx))
    return buckets


def views(flat: torch.Tensor, manifest: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` views into ``flat`` (``[total_bytes]`` uint8), no copy."""
    out = {}
    for e in manifest:
        piece = flat[e.offset : e.offset + e.nbytes]
        out[e.name] = piece.view(_DTYPES[e.dtype]).view(e.shape)
    return out


def copy_tensor_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-shape, same-dtype tensors; between contiguous CPU
    tensors as one single-threaded ``memcpy`` (numpy on byte views): torch's copy runs
    on the intra-op thread pool, which on a busy machine (engines generating, a
    trainer stepping) can be 10x slower than one thread streaming memory."""
    if (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.shape == src.shape
    ):
        import numpy as np

        np.copyto(
            dst.view(-1).view(torch.uint8).numpy(), src.detach().view(-1).view(torch.uint8).numpy()
        )
        return
    dst.copy_(src)


def flatten_into(
    flat: torch.Tensor, named_tensors: dict[str, torch.Tensor], manifest: list[TensorEntry]
) -> None:
    """Copy ``named_tensors`` into ``flat`` at the manifest offsets.

    Raises:
        ValueError: a tensor's shape or dtype differs from its manifest entry.
    """
    targets = views(flat, manifest)
    with torch.no_grad():
        for e in manifest:
            t = named_tensors[e.name]
            if tuple(t.shape) != e.shape or dtype_name(t.dtype) != e.dtype:
                raise ValueError(
                    f"{e.name}: got {tuple(t.shape)} {t.dtype}, manifest says {e.shape} {e.dtype}"
                )
            copy_tensor_(targets[e.name], t.detach())


def checksum(flat: torch.Tensor) -> str:
    """``crc32c:<8 hex>`` over the bytes of ``flat`` (``[N]`` uint8; copied to host if on
    a device). crc32c runs at several GB/s with SSE4.2."""
    import crc32c

    host = flat if flat.device.type == "cpu" else flat.cpu()
    return f"crc32c:{crc32c.crc32c(memoryview(host.numpy())):08x}"


def manifest_rows(manifest: list[TensorEntry]) -> list[dict]:
    """The manifest as WEIGHTS ``manifest`` list items."""
    return [
        {
            "name": e.name,
            "shape": list(e.shape),
            "dtype": e.dtype,
            "offset": e.offset,
            "nbytes": e.nbytes,
        }
        for e in manifest
    ]


def manifest_from_rows(rows: list[dict]) -> list[TensorEntry]:
    """Inverse of :func:`manifest_rows`."""
    return [
        TensorEntry(r["name"], tuple(r["shape"]), r["dtype"], r["offset"], r["nbytes"])
        for r in rows
    ]


def write_safetensors(
    path: Path,
    flat: torch.Tensor,
    manifest: list[TensorEntry],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``flat`` as one safetensors file whose data section *is* the flat stream.

    Format (https://github.com/huggingface/safetensors, "Format"): 8-byte little-endian
    header length N, N bytes of JSON header (padded with spaces to a multiple of 8),
    then the data; each tensor's ``data_offsets`` are relative to the data start. One
    write of the flat bytes, no per-tensor copies; readable with
    ``safetensors.torch.load_file``.
    """
    header: dict = {"__metadata__": metadata or {}}
    for e in manifest:
        header[e.name] = {
            "dtype": _SAFETENSORS_DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [e.offset, e.offset + e.nbytes],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    host = flat if flat.device.type == "cpu" else flat.cpu()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.write(memoryview(host.numpy()))


def read_safetensors_flat(path: Path) -> tuple[torch.Tensor, list[TensorEntry]]:
    """Read a file written by :func:`write_safetensors` back as ``(flat, manifest)``.

    Raises:
        ValueError: the data section is not one contiguous stream in header order.
    """
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    inv = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
    entries = sorted(
        ((name, h) for name, h in header.items()), key=lambda x: x[1]["data_offsets"][0]
    )
    manifest, offset = [], 0
    for name, h in entries:
        a, b = h["data_offsets"]
        if a != offset:
            raise ValueError(f"{path}: tensor {name} starts at {a}, expected {offset}")
        manifest.append(TensorEntry(name, tuple(h["shape"]), inv[h["dtype"]], a, b - a))
        offset = b
    flat = torch.frombuffer(bytearray(data[8 + n :]), dtype=torch.uint8)
    return flat, manifest


def local_ip_towards(host: str, port: int) -> str:
    """The local address this machine uses to reach ``host:port`` (gloo binds its device
    to it, so the group works across machines); ``127.0.0.1`` for loopback."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def _make_group(
    store, group: str, rank: int, size: int, device: torch.device, host: str, timeout_s: float
):
    """A standalone process group (not the default one) over ``PrefixStore(group/)``."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"{group}/pg/", store)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, size, opts)


def _broadcast(pg, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()


def _members(raw: bytes) -> list[str]:
    return [m for m in raw.decode().split("\n") if m]


def replay_membership(log_bytes: bytes) -> list[str]:
    """Members after replaying a join/leave log (``+id`` / ``-id`` lines), in join order."""
    out: list[str] = []
    for line in _members(log_bytes):
        op, mid = line[0], line[1:]
        if op == "+" and mid not in out:
            out.append(mid)
        elif op == "-" and mid in out:
            out.remove(mid)
    return out


CONNECT_S = 10.0
"""Seconds a subscriber tries to reach a publisher's rendezvous store before it takes the
publisher for gone (a trainer that died; its successor announces a new rendezvous)."""


def _newest_live(rows: list[dict]) -> list[dict]:
    """``rows`` with only the last broadcast announcement among them (checkpoints kept):
    the publisher announces v+1 only after v's broadcast ended, and a restarted trainer
    announces from a new rendezvous, so every earlier one is history (joining a dead
    publisher's store would only time out)."""
    live = [i for i, r in enumerate(rows) if r["transport"] != "checkpoint"]
    last = live[-1] if live else None
    return [r for i, r in enumerate(rows) if r["transport"] == "checkpoint" or i == last]


def parse_rendezvous(uri: str) -> tuple[str, int]:
    """``tcp://host:port`` -> ``(host, port)``.

    Raises:
        ValueError: for any other form.
    """
    if not uri or not uri.startswith("tcp://") or ":" not in uri[6:]:
        raise ValueError(f"rendezvous must look like tcp://host:port, got {uri!r}")
    host, _, port = uri[6:].rpartition(":")
    return host, int(port)


def weights_topic(run: str) -> str:
    """``<run>.weights``."""
    return topic_names.run_topic(run, topic_names.WEIGHTS)


def ensure_weights_topic(cfg: BusConfig, run: str) -> str:
    """Create ``<run>.weights`` with one partition (announcements stay ordered)."""
    t = weights_topic(run)
    ensure_topics(cfg, {t: 1})
    return t


# ------------------------------------------------------------------ announcements
class AnnouncementReader:
    """Reads ``<run>.weights`` announcements group-less from the beginning (no commits).

    Used by subscribers and by the rollout stage to learn the trainer's policy_version.
    Fetches wait at most ``relax.streams.client.FETCH_WAIT_MS`` on the broker (the
    publisher's broadcast waits for subscribers to see its announcement, so its latency
    matters, but so does the CPU an idle reader burns). Records that are not a WEIGHTS
    batch (a null or empty value, a ``relax-schema`` header naming another schema, bytes
    that do not decode or fail validation) are logged with their ``topic[partition]@offset``
    and skipped, never raised (announcements are written by relax only).
    """

    def __init__(self, cfg: BusConfig, run: str):
        from kafka import KafkaConsumer, TopicPartition

        from relax.streams.client import consumer_kwargs

        self.topic = ensure_weights_topic(cfg, run)
        self._kc = KafkaConsumer(**consumer_kwargs(cfg, None))
        tp = TopicPartition(self.topic, 0)
        self._kc.assign([tp])
        self._kc.seek_to_beginning(tp)
        self.latest_version: int | None = None

    def poll(self, timeout_s: float = 0.0) -> list[dict]:
        """New announcement rows (dicts with the WEIGHTS fields), oldest first."""
        from relax.streams.codec import DecodeError, decode

        rows: list[dict] = []
        for msgs in self._kc.poll(timeout_ms=int(timeout_s * 1000)).values():
            for m in msgs:
                header = dict(m.headers or []).get("relax-schema")
                try:
                    if not m.value:  # decode(None) would raise TypeError and kill the reader
                        raise DecodeError("null value (a tombstone)" if m.value is None
                                          else "empty value")
                    if header and header != b"weights":
                        raise DecodeError(f"relax-schema header {header!r} is not 'weights'")
                    table = decode(m.value, "weights")
                    table.validate(full=True)
                    validate(table, "weights")
                except (DecodeError, ValueError, pa.ArrowException) as e:
                    log.warning("skipping unusable announcement at %s[%d]@%d: %s; expected a "
                                "'weights' batch", self.topic, m.partition, m.offset, e)
                    continue
                rows.extend(table.to_pylist())
        for r in rows:
            v = r["policy_version"]
            if self.latest_version is None or v > self.latest_version:
                self.latest_version = v
        return rows

    def close(self) -> None:
        """Close the Kafka client."""
        self._kc.close(autocommit=False)


# ------------------------------------------------------------------ publisher
@dataclass
class PublishStats:
    """One publish: ``policy_version``, ``bytes``, seconds the caller was blocked
    (``blocked_s``: waiting for the previous broadcast + copy), seconds of the
    broadcast (``broadcast_s``), of the whole background part (``publish_s``: from the
    call to the last bucket sent), members that received it, checkpoint path."""

    policy_version: int
    bytes: int
    blocked_s: float = 0.0
    copy_s: float = 0.0
    broadcast_s: float = 0.0
    publish_s: float = 0.0
    members: list[str] = field(default_factory=list)
    group_name: str = ""
    checkpoint_uri: str | None = None
    error: str | None = None


class WeightPublisher:
    """The trainer's side of the weight channel (see the module docstring).

    Args:
        cfg: bus settings (announcements go to ``<run>.weights``).
        run: run name.
        host: address subscribers use to reach the rendezvous store (and this process's
            gloo device); must be reachable from every subscriber's machine.
        port: rendezvous TCP port (0 = a free one; see :attr:`rendezvous`).
        checkpoint_dir: folder of the checkpoint store (None = no checkpoints: late
            joiners must wait for a broadcast).
        checkpoint_every: write a checkpoint every K versions (version % K == 0, and the
            first published version).
        keep_checkpoints: how many of the newest checkpoints stay on disk (older ones
            are deleted after each write: a late joiner needs only the newest, and a
            full-precision 135M model is 0.5 GB a version).
        bucket_bytes: broadcast bucket size (bytes).
        join_timeout_s: how long a new group waits for its members (seconds).
        producer: a :class:`~relax.streams.producer.BatchProducer` to announce with
            (default: its own).

    Raises:
        ValueError: ``checkpoint_every``, ``keep_checkpoints`` or ``bucket_bytes`` < 1.
    """

    def __init__(
        self,
        cfg: BusConfig,
        run: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 1,
        keep_checkpoints: int = 3,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        join_timeout_s: float = 60.0,
        producer=None,
    ):
        import torch.distributed as dist

        from relax.streams.producer import BatchProducer

        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        if keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep_checkpoints}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.cfg, self.run, self.host = cfg, run, host
        self.bucket_bytes, self.join_timeout_s = bucket_bytes, join_timeout_s
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.checkpoint_every, self.keep_checkpoints = checkpoint_every, keep_checkpoints
        self.topic = ensure_weights_topic(cfg, run)
        self._producer = producer or BatchProducer(cfg, producer_id=f"{run}-weights")
        self._own_producer = producer is None
        self.store = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=join_timeout_s),
            use_libuv=True,
        )
        self.rendezvous = f"tcp://{host}:{self.store.port}"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relax-weights-pub")
        self._pending: Future | None = None
        self._flat: torch.Tensor | None = None
        self._manifest: list[TensorEntry] | None = None
        self._group_index = 0
        self._incarnation = uuid.uuid4().hex[:6]  # a restarted publisher never reuses names
        self._group_name: str | None = None
        self._members: list[str] = []
        self._pg = None
        self._first_version: int | None = None
        self._digest: str | None = None  # checksum of the version in the send buffer
        self._snapshot_version: int | None = None  # newest version written to the store
        self._late: Future | None = None
        self._closed = threading.Event()
        self.history: list[PublishStats] = []
        if self.checkpoint_dir is not None:
            threading.Thread(target=self._watch_late_joiners, name="relax-weights-late",
                             daemon=True).start()

    def members(self) -> list[str]:
        """Subscribers registered now (joined and not left), in join order."""
        if not self.store.check([MEMBERSHIP_KEY]):
            return []
        return replay_membership(self.store.get(MEMBERSHIP_KEY))

    def wait_for_members(self, n: int, timeout_s: float = 60.0) -> list[str]:
        """Block until at least ``n`` subscribers registered (a launcher that knows how
        many engines it started calls this before the first publish).

        Raises:
            TimeoutError: fewer than ``n`` within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while len(m := self.members()) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(m)} of {n} weight subscribers registered in {timeout_s}s: {m}"
                )
            time.sleep(0.05)
        return m

    def publish(self, named_tensors: dict[str, torch.Tensor], policy_version: int) -> Future:
        """Publish ``named_tensors`` as ``policy_version``.

        Blocks only while a previous broadcast is still running and while the tensors
        are copied into the send buffer; announcing, broadcasting and checkpointing run
        in the background (see the module docstring).

        Args:
            named_tensors: ``{name: tensor}`` (e.g. ``dict(model.named_parameters())``);
                every call must have the same names, shapes and dtypes.
            policy_version: optimizer steps applied (increasing).

        Returns:
            a Future of :class:`PublishStats` (``.result()`` waits for the broadcast and
            raises what the background part raised).

        Raises:
            ValueError: a version not newer than the last one, or a changed manifest.
        """
        t0 = time.perf_counter()
        if self.history and policy_version <= self.history[-1].policy_version:
            raise ValueError(
                f"policy_version {policy_version} is not newer than "
                f"{self.history[-1].policy_version}"
            )
        if self._pending is not None:
            self._pending.result()
        if self._late is not None:  # a late joiner's snapshot reads the send buffer
            self._late.result()
        manifest = build_manifest(named_tensors)
        if self._manifest is None:
            device = next(iter(named_tensors.values())).device
            self._flat = torch.empty(total_bytes(manifest), dtype=torch.uint8, device=device)
            self._manifest = manifest
        elif manifest != self._manifest:
            raise ValueError("the tensors differ (names, shapes or dtypes) from the first publish")
        t1 = time.perf_counter()
        flatten_into(self._flat, named_tensors, manifest)
        if self._flat.device.type == "cuda":
            torch.cuda.current_stream(self._flat.device).synchronize()
        stats = PublishStats(policy_version, total_bytes(manifest))
        stats.copy_s = time.perf_counter() - t1
        stats.blocked_s = time.perf_counter() - t0
        self.history.append(stats)
        if self._first_version is None:
            self._first_version = policy_version
        self._pending = self._pool.submit(self._background, stats, t0)
        return self._pending

    def wait(self) -> PublishStats | None:
        """Wait for the last publish to finish; its stats (None if nothing published)."""
        return self._pending.result() if self._pending is not None else None

    # --- background part
    def _announce(
        self, version: int, digest: str, transport: str, group_name: str, checkpoint_uri: str | None
    ) -> None:
        row = {
            "policy_version": version,
            "manifest": manifest_rows(self._manifest),
            "total_bytes": total_bytes(self._manifest),
            "bucket_bytes": self.bucket_bytes,
            "checksum": digest,
            "transport": transport,
            "rendezvous": self.rendezvous,
            "group_name": group_name,
            "checkpoint_uri": checkpoint_uri,
            "published_at": int(time.time() * 1000),
        }
        batch = pa.RecordBatch.from_pylist([row], schema=WEIGHTS)
        validate(batch, "weights")
        self._producer.send(self.topic, batch)
        self._producer.flush()

    def _regroup(self) -> None:
        members = self.members()
        if self._group_name is not None and members == self._members:
            return
        self._group_index += 1
        self._group_name = f"{self.run}.weights.{self._incarnation}.g{self._group_index}"
        self._members = members
        self._pg = None
        self.store.set(f"{self._group_name}/members", "\n".join(members))

    def _form(self) -> None:
        """Create the process group of the current members (rank 0 = this publisher)."""
        if self._pg is not None or not self._members:
            return
        self._pg = _make_group(
            self.store,
            self._group_name,
            0,
            len(self._members) + 1,
            self._flat.device,
            self.host,
            self.join_timeout_s,
        )

    def _drop_absent(self) -> None:
        ready = [m for m in self._members if self.store.check([f"{self._group_name}/ready/{m}"])]
        for m in self._members:
            if m not in ready:
                log.warning(
                    "weight subscriber %s did not join %s within %.0fs: dropped",
                    m,
                    self._group_name,
                    self.join_timeout_s,
                )
                self.store.append(MEMBERSHIP_KEY, f"-{m}\n")
        self._pg = None
        self._group_name = None  # forces a new group at the next version

    def _background(self, stats: PublishStats, t0: float) -> PublishStats:
        digest = self._digest = checksum(self._flat)
        self._regroup()
        backend = "nccl" if self._flat.device.type == "cuda" else "gloo"
        self._announce(stats.policy_version, digest, backend, self._group_name, None)
        stats.group_name = self._group_name
        t1 = time.perf_counter()
        if self._members:
            try:
                self._form()
                for a, b, _ in plan_buckets(self._manifest, self.bucket_bytes):
                    _broadcast(self._pg, self._flat[a:b])
                stats.members = list(self._members)
            except RuntimeError as e:  # a member never came or died mid-broadcast
                stats.error = f"broadcast of v{stats.policy_version} failed: {e}"
                log.warning("%s", stats.error)
                group = self._group_name
                self._drop_absent()
                self.store.set(f"{group}/done/{stats.policy_version}", "failed")
            else:
                self.store.set(f"{self._group_name}/done/{stats.policy_version}", "ok")
        stats.broadcast_s = time.perf_counter() - t1
        stats.publish_s = time.perf_counter() - t0
        # a member that missed the broadcast catches up from the store, not at the next
        # version: the trainer may be waiting for samples only that member can make
        if self._checkpoint_due(stats.policy_version) or (
                stats.error is not None and self.checkpoint_dir is not None):
            stats.checkpoint_uri = self._snapshot(stats.policy_version, digest, stats.group_name)
        return stats

    def _snapshot(self, version: int, digest: str, group_name: str) -> str:
        """Write the send buffer to the checkpoint store and announce it (pool thread)."""
        uri = self._write_checkpoint(version, digest)
        self._snapshot_version = version
        self._announce(version, digest, "checkpoint", group_name, uri)
        return uri

    def _late_joiners(self) -> None:
        """Snapshot the newest version for subscribers that registered after its group
        was formed (a restarted engine, a new one): they would otherwise wait for the
        next version, which may never come while the trainer waits for their samples."""
        if not self.history or self._digest is None:
            return
        version = self.history[-1].policy_version
        if self._snapshot_version == version:
            return
        late = [m for m in self.members() if m not in self._members]
        if late:
            log.info("weight subscribers %s joined after v%d was broadcast: snapshot for them",
                     late, version)
            self._snapshot(version, self._digest, self._group_name or "")

    def _watch_late_joiners(self, every_s: float = 2.0) -> None:
        while not self._closed.wait(every_s):
            idle = self._pending is None or self._pending.done()
            if idle and (self._late is None or self._late.done()):
                try:
                    self._late = self._pool.submit(self._late_joiners)
                except RuntimeError:  # the pool was shut down: closing
                    return

    def _checkpoint_due(self, version: int) -> bool:
        return self.checkpoint_dir is not None and (
            version % self.checkpoint_every == 0 or version == self._first_version
        )

    def _write_checkpoint(self, version: int, digest: str) -> str:
        target = self.checkpoint_dir / f"v{version:08d}"
        if target.exists():
            return str(target.resolve())
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint_dir / f".v{version:08d}.tmp-{uuid.uuid4().hex[:6]}"
        tmp.mkdir()
        try:
            write_safetensors(
                tmp / "model.safetensors",
                self._flat,
                self._manifest,
                {"policy_version": str(version), "checksum": digest},
            )
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        for old in sorted(self.checkpoint_dir.glob("v*"))[:-self.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return str(target.resolve())

    def close(self) -> None:
        """Finish the last publish, stop the background thread, close the producer.
        The rendezvous store goes away with this object."""
        self._closed.set()
        try:
            if self._pending is not None:
                self._pending.result()
        finally:
            self._pool.shutdown(wait=True)
            self._pg = None
            if self._own_producer:
                self._producer.close()


# ------------------------------------------------------------------ subscriber
@dataclass
class SubscriberStats:
    """Counters of one subscriber: versions received by broadcast / loaded from a
    checkpoint, bytes received, seconds receiving, checksum failures, versions skipped."""

    received: int = 0
    from_checkpoint: int = 0
    bytes: int = 0
    receive_s: float = 0.0
    checksum_failures: int = 0
    skipped: int = 0
    history: list[tuple[int, str]] = field(default_factory=list)


class ChecksumError(RuntimeError):
    """Received bytes do not match the announced checksum."""


class WeightSubscriber:
    """An engine's (or reference model's) side of the weight channel.

    Args:
        cfg: bus settings.
        run: run name.
        member_id: unique id of this subscriber in the group (e.g. ``rollout-0``).
        target: an engine (has ``update_weights(named_tensors, policy_version)``): every
            verified version is staged into it from the background thread, and it swaps
            at its own safe point. None: keep the newest version for :meth:`apply`.
        device: where the receive buffer lives (``cpu`` -> gloo, ``cuda`` -> nccl).
        catch_up: load the newest checkpoint on start (late joiner), and any newer
            checkpoint announced while this subscriber is in no group.
        rendezvous: ``tcp://host:port`` of the publisher, to register before the first
            announcement (default: learnt from the first announcement, which then is
            missed unless a checkpoint of it exists).
        join_timeout_s: how long to wait to form a group (seconds).

    The background thread starts with :meth:`start` (or ``with``); :meth:`close`
    leaves the group at the next version boundary.
    """

    def __init__(
        self,
        cfg: BusConfig,
        run: str,
        *,
        member_id: str,
        target=None,
        device: str | torch.device = "cpu",
        catch_up: bool = True,
        rendezvous: str | None = None,
        join_timeout_s: float = 60.0,
    ):
        if "\n" in member_id or not member_id:
            raise ValueError(f"member_id must be a non-empty single line, got {member_id!r}")
        self.cfg, self.run, self.member_id = cfg, run, member_id
        self.target, self.device = target, torch.device(device)
        self.catch_up, self.join_timeout_s = catch_up, join_timeout_s
        self._initial_rendezvous = rendezvous
        if rendezvous is not None:
            parse_rendezvous(rendezvous)
        self.stats = SubscriberStats()
        self.version: int | None = None
        self._reader = AnnouncementReader(cfg, run)
        self._store = None
        self._rendezvous: str | None = None
        self._group: str | None = None
        self._pg = None
        self._flat: torch.Tensor | None = None
        self._manifest: list[TensorEntry] | None = None
        # the version whose verified bytes _flat holds; None while it is being written and
        # after a receive failed partway (then it holds no version's bytes)
        self._flat_version: int | None = None
        self._buf_lock = threading.Lock()
        self._applied: int | None = None
        self._events: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # --- public
    def start(self) -> WeightSubscriber:
        """Start the background thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._main, name=f"relax-weights-{self.member_id}", daemon=True
            )
            self._thread.start()
        return self

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def poll(self, timeout_s: float = 0.0) -> int | None:
        """Wait up to ``timeout_s`` for a newly verified version; returns it (the newest
        one if several arrived) or None.

        Raises:
            RuntimeError: the background thread died (its exception is chained).
        """
        self._raise_if_dead()
        got = None
        try:
            got = (
                self._events.get(timeout=timeout_s) if timeout_s > 0 else self._events.get_nowait()
            )
            while True:
                got = self._events.get_nowait()
        except queue.Empty:
            pass
        self._raise_if_dead()
        return got

    def wait_for(self, policy_version: int, timeout_s: float = 60.0) -> int:
        """Block until a version >= ``policy_version`` is verified; returns it.

        Raises:
            TimeoutError: not within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while self.version is None or self.version < policy_version:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{self.member_id}: policy_version {policy_version} not received "
                    f"in {timeout_s}s (have {self.version})"
                )
            self.poll(min(left, 0.5))
        return self.version

    def latest(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """``(policy_version, {name: tensor})`` of the newest verified weights (copies,
        safe to keep), or None before any and after a receive that failed partway (the
        receive buffer then holds no whole version)."""
        with self._buf_lock:
            if self._flat_version is None:
                return None
            return self._flat_version, {
                k: v.clone() for k, v in views(self._flat, self._manifest).items()
            }

    def apply(self, target) -> int | None:
        """Install the newest verified weights into ``target`` now (call it at a safe
        point): an engine gets ``update_weights`` (it swaps at its next safe point); a
        ``torch.nn.Module`` gets its parameters/buffers copied in place.

        Returns:
            the version applied, or None if there was nothing newer than the last apply
            (or the receive buffer holds no whole version: a receive failed partway).

        Raises:
            KeyError: a received name the module does not have (nothing is copied).
            ValueError: a received shape differs from the module's (nothing is copied).
        """
        with self._buf_lock:
            version = self._flat_version
            if version is None or version == self._applied:
                return None
            self._install(target, views(self._flat, self._manifest), version)
            self._applied = version
            return version

    def close(self) -> None:
        """Leave the group (effective at the next version boundary), stop the thread."""
        self._stop.set()
        if self._store is not None:
            self._store.append(MEMBERSHIP_KEY, f"-{self.member_id}\n")
        if self._thread is not None:
            self._thread.join(timeout=self.join_timeout_s + 5)
        self._reader.close()
        self._pg = None

    # --- background
    def _raise_if_dead(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"weight subscriber {self.member_id} stopped") from self.error

    @staticmethod
    def _install(target, named: dict[str, torch.Tensor], version: int) -> None:
        """Hand ``named`` to an engine, or copy it into a module's parameters/buffers in
        place once every name and shape is checked (a bad update changes nothing).

        Raises:
            KeyError: a name the module does not have. ValueError: a shape that differs.
        """
        if hasattr(target, "update_weights"):
            target.update_weights(named, version)
            return
        own = dict(target.named_parameters(remove_duplicate=False))
        own.update(dict(target.named_buffers(remove_duplicate=False)))
        for name, t in named.items():
            if name not in own:
                raise KeyError(f"{name!r} is not a parameter or buffer of the model")
            if t.shape != own[name].shape:
                raise ValueError(f"{name}: received shape {tuple(t.shape)}, "
                                 f"the model's is {tuple(own[name].shape)}")
        with torch.no_grad():
            for name, t in named.items():
                own[name].copy_(t)

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as e:  # surfaced by poll()/wait_for() in the caller's thread
            self.error = e
            log.exception("weight subscriber %s failed", self.member_id)

    def _connect(self, rendezvous: str) -> None:
        import torch.distributed as dist

        if self._rendezvous == rendezvous:
            return
        host, port = parse_rendezvous(rendezvous)
        self._store = dist.TCPStore(  # a dead publisher is given up on after CONNECT_S
            host,
            port,
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=min(CONNECT_S, self.join_timeout_s)),
            use_libuv=True,
        )
        self._store.set_timeout(timedelta(seconds=self.join_timeout_s))
        self._rendezvous, self._group, self._pg = rendezvous, None, None
        self._gloo_host = local_ip_towards(host, port)
        self._store.append(MEMBERSHIP_KEY, f"+{self.member_id}\n")

    def _run(self) -> None:
        if self._initial_rendezvous is not None:
            self._connect(self._initial_rendezvous)
        rows = self._reader.poll(2.0)
        while not rows and not self._stop.is_set() and self._reader.latest_version is None:
            # nothing published yet: register at the first announcement's rendezvous
            rows = self._reader.poll(0.5)
        live = [r for r in rows if r["transport"] != "checkpoint"]
        if live:  # register first, so the next version's group includes us
            self._connect(live[-1]["rendezvous"])
        if self.catch_up:
            self._catch_up(rows)
        while True:
            for r in _newest_live(rows):
                if self._stop.is_set():
                    return
                try:
                    self._handle(r)
                except torch.distributed.DistNetworkError as e:
                    self._publisher_gone(r, e)
            if self._stop.is_set():
                return
            rows = self._reader.poll(0.5)

    def _publisher_gone(self, row: dict, error: Exception) -> None:
        """The rendezvous store of ``row``'s publisher cannot be reached (the trainer died
        or restarted): forget it and wait for the next announcement, which carries the
        new trainer's rendezvous. The engine keeps the weights it has."""
        log.warning("%s: the publisher of v%d at %s is gone (%s); waiting for the next "
                    "announcement", self.member_id, row["policy_version"], row["rendezvous"],
                    error)
        self._rendezvous = self._store = self._group = self._pg = None
        self.stats.skipped += 1

    def _catch_up(self, rows: list[dict]) -> None:
        ckpts = [r for r in rows if r["transport"] == "checkpoint" and r["checkpoint_uri"]]
        if not ckpts:
            return
        newest = max(ckpts, key=lambda r: r["policy_version"])
        if self.version is not None and newest["policy_version"] <= self.version:
            return
        self.load_checkpoint(newest)

    def load_checkpoint(self, row: dict) -> int:
        """Load the safetensors of a ``checkpoint`` announcement into the receive buffer,
        verify its checksum, and deliver it like a broadcast.

        Raises:
            ChecksumError: the file's bytes do not match the announcement.
            ValueError: the file's tensors differ from the announced manifest.
            Either leaves the weights received before as they were.
        """
        path = Path(row["checkpoint_uri"].removeprefix("file://")) / "model.safetensors"
        flat, manifest = read_safetensors_flat(path)
        if checksum(flat) != row["checksum"]:
            self.stats.checksum_failures += 1
            raise ChecksumError(f"{path}: checksum differs from the announcement {row['checksum']}")
        if manifest != manifest_from_rows(row["manifest"]):
            raise ValueError(f"{path}: its tensors differ from the announced manifest")
        with self._buf_lock:
            self._flat, self._manifest = flat.to(self.device), manifest
            self._flat_version = row["policy_version"]
        self.stats.from_checkpoint += 1
        self._deliver(row["policy_version"], "checkpoint")
        return row["policy_version"]

    def _handle(self, row: dict) -> None:
        if row["transport"] == "checkpoint":
            newer = self.version is None or row["policy_version"] > self.version
            if self.catch_up and newer and self._group is None and row["checkpoint_uri"]:
                self.load_checkpoint(row)
            return
        self._connect(row["rendezvous"])
        version, group = row["policy_version"], row["group_name"]
        key = f"{group}/members"
        if not self._store.check([key]):
            self._store.wait([key], timedelta(seconds=self.join_timeout_s))
        members = _members(self._store.get(key))
        over = self._store.check([f"{group}/done/{version}"])  # history, or a failed group
        if self.member_id not in members or (over and group != self._group):
            self._group, self._pg = None, None
            if self.version is None or version > self.version:
                self.stats.skipped += 1
            return
        self._receive(row, group, members)  # a member always takes part, or the group waits

    def _receive(self, row: dict, group: str, members: list[str]) -> None:
        t0 = time.perf_counter()
        manifest = manifest_from_rows(row["manifest"])
        size = row["total_bytes"]
        with self._buf_lock:
            self._flat_version = None  # overwritten from here on: no whole version until verified
            if self._flat is None or self._flat.numel() != size or self._flat.device != self.device:
                self._flat = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._manifest = manifest
            if group != self._group:
                self._store.set(f"{group}/ready/{self.member_id}", "1")
                self._pg = _make_group(
                    self._store,
                    group,
                    members.index(self.member_id) + 1,
                    len(members) + 1,
                    self.device,
                    self._gloo_host,
                    self.join_timeout_s,
                )
                self._group = group
            try:
                for a, b, _ in plan_buckets(manifest, row["bucket_bytes"]):
                    _broadcast(self._pg, self._flat[a:b])
            except RuntimeError:
                self._group, self._pg = None, None  # the publisher forms a new group
                self.stats.skipped += 1
                log.warning(
                    "%s: broadcast of v%d failed; waiting for the next version",
                    self.member_id,
                    row["policy_version"],
                )
                self._store.append(MEMBERSHIP_KEY, f"+{self.member_id}\n")
                return
            if checksum(self._flat) != row["checksum"]:
                self.stats.checksum_failures += 1
                raise ChecksumError(
                    f"{self.member_id}: v{row['policy_version']} received bytes "
                    f"do not match checksum {row['checksum']}"
                )
            self._flat_version = row["policy_version"]
        self.stats.received += 1
        self.stats.bytes += size
        self.stats.receive_s += time.perf_counter() - t0
        self._deliver(row["policy_version"], "broadcast")

    def _deliver(self, version: int, how: str) -> None:
        if self.target is not None:
            with self._buf_lock:
                self._install(self.target, views(self._flat, self._manifest), version)
                self._applied = version
        self.version = version
        self.stats.history.append((version, how))
        self._events.put(version)
