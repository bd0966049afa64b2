"""The trainer's side of the weight channel: :class:`WeightPublisher`.

Publisher (trainer), per policy_version ``v`` (:meth:`WeightPublisher.publish`):

1. *caller's thread*: wait for the previous broadcast to finish (one in flight), copy
   the tensors (a tied alias once) into the flat send buffer, checksummed as they are
   copied on the CPU, so the trainer may change its weights as soon as ``publish``
   returns; hand the rest to a background thread. The broadcast thus overlaps the next
   training step.
2. *background thread*: checksum a device's buffer (``crc32c`` over the flat bytes);
   (re)form the process group if membership changed; announce ``v`` on
   ``<run>.weights`` (WEIGHTS schema: manifest of names, shapes, dtypes, byte offsets
   and sizes, bucket size, checksum, transport ``gloo``/``nccl``, rendezvous
   ``tcp://host:port``, group name); broadcast the flat bytes in buckets of whole
   tensors (default 512 MiB; a tensor larger than a bucket travels alone) from rank 0;
   then, every ``checkpoint_every`` versions, write the flat bytes as one safetensors
   file into the snapshot store (:mod:`relax.streams.weights.store`: a local folder or
   a ``pyarrow.fs`` URI such as ``s3://...``) and announce it again with
   ``transport=checkpoint`` and its ``checkpoint_uri``.

Same host (``shm_root``, CPU buffers only): the send buffer is two files in
``/dev/shm`` used in turn; subscribers that share that tmpfs are left out of the
broadcast group and copy each version out of its file, announced with
``transport=shm`` before the broadcast (:mod:`relax.streams.weights.shm`).

Device and backend: buffers on CPU use gloo, buffers on CUDA use nccl (imported
lazily; only gloo is exercised on the CPU machines relax is tested on). Checksums are
computed on host bytes (a device-to-host copy on CUDA).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import torch

from relax.schemas.v1 import WEIGHTS
from relax.schemas.validate import validate
from relax.streams.client import BusConfig
from relax.streams.weights.announce import VERSION_ONLY, ensure_weights_topic
from relax.streams.weights.layout import (
    DEFAULT_BUCKET_BYTES,
    TensorEntry,
    build_manifest,
    checksum,
    distinct_tensors,
    flatten_into,
    manifest_rows,
    plan_buckets,
    total_bytes,
)
from relax.streams.weights.shm import SHM_KEY, ShmOffer, member_key, shm_root_usable
from relax.streams.weights.store import SnapshotStore
from relax.streams.weights.rendezvous import (
    MEMBERSHIP_KEY,
    broadcast,
    make_group,
    replay_membership,
)

log = logging.getLogger(__name__)


@dataclass
class PublishStats:
    """One publish: ``policy_version``, ``bytes``, seconds the caller was blocked
    (``blocked_s``: waiting for the previous broadcast + copy), seconds of the
    broadcast (``broadcast_s``), of the whole background part (``publish_s``: from the
    call to the last bucket sent), members that received it (``local``: those of them
    that read the same-host file), checkpoint path."""

    policy_version: int
    bytes: int
    blocked_s: float = 0.0
    copy_s: float = 0.0
    broadcast_s: float = 0.0
    publish_s: float = 0.0
    members: list[str] = field(default_factory=list)
    local: list[str] = field(default_factory=list)
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
        checkpoint_dir: the snapshot store, a folder or a ``pyarrow.fs`` URI
            (:class:`relax.streams.weights.store.SnapshotStore`; None = no snapshots:
            late joiners must wait for a broadcast).
        checkpoint_every: write a checkpoint every K versions (version % K == 0, and the
            first published version).
        keep_checkpoints: how many of the newest checkpoints stay on disk (older ones
            are deleted after each write: a late joiner needs only the newest, and a
            full-precision 135M model is 0.5 GB a version).
        bucket_bytes: broadcast bucket size (bytes).
        join_timeout_s: how long a new group waits for its members (seconds).
        producer: a :class:`~relax.streams.producer.BatchProducer` to announce with
            (default: its own).
        shm_root: a tmpfs folder (``/dev/shm``) for the same-host transport
            (:mod:`relax.streams.weights.shm`); None, or a folder that is not writable:
            every subscriber gets the broadcast.

    Raises:
        ValueError: ``checkpoint_every``, ``keep_checkpoints`` or ``bucket_bytes`` < 1.
    """

    def __init__(self, cfg: BusConfig, run: str, *, host: str = "127.0.0.1", port: int = 0,
                 checkpoint_dir: str | Path | None = None, checkpoint_every: int = 1,
                 keep_checkpoints: int = 3, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 join_timeout_s: float = 60.0, producer=None,
                 shm_root: str | Path | None = None):
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
        self.snapshots = (SnapshotStore(checkpoint_dir, keep_checkpoints) if checkpoint_dir
                          else None)
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
        self._incarnation = uuid.uuid4().hex[:6]  # a restarted publisher never reuses names
        self._shm = None
        if shm_root is not None and shm_root_usable(shm_root):
            self._shm = ShmOffer(shm_root, run, self._incarnation)
            self.store.set(SHM_KEY, self._shm.offer)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relax-weights-pub")
        self._pending: Future | None = None
        self._flat: torch.Tensor | None = None
        self._manifest: list[TensorEntry] | None = None
        self._group_index = 0
        self._group_name: str | None = None
        self._members: list[str] = []  # registered when the current group was formed
        self._gloo: list[str] = []  # those of them in the broadcast group
        self._local: list[str] = []  # those that read the same-host file instead
        self._bufs: list[torch.Tensor] | None = None  # the two same-host send buffers
        self._slot = 0  # which of them holds the newest version
        self._shm_version: int | None = None  # newest version announced as a same-host file
        self._pg = None
        self._first_version: int | None = None
        self._digest: str | None = None  # checksum of the version in the send buffer
        self._snapshot_version: int | None = None  # newest version written to the store
        self._log_seen = 0  # bytes of the membership log when the current group was formed
        self._late: Future | None = None
        self._closed = threading.Event()
        self.history: list[PublishStats] = []
        if self.snapshots is not None or self._shm is not None:
            threading.Thread(target=self._watch_late_joiners, name="relax-weights-late",
                             daemon=True).start()

    def members(self) -> list[str]:
        """Subscribers registered now (joined and not left), in join order."""
        return replay_membership(self._membership_log())

    def _membership_log(self) -> bytes:
        return self.store.get(MEMBERSHIP_KEY) if self.store.check([MEMBERSHIP_KEY]) else b""

    def _rejoined(self, log_bytes: bytes) -> list[str]:
        """Members of the current group that registered again since it was formed: a
        restarted subscriber under its predecessor's id, which missed what the group
        received and must not be taken for the dead process."""
        new = log_bytes[self._log_seen:].decode().split("\n")
        return [m for m in self._members if f"+{m}" in new]

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
            named_tensors: ``{name: tensor}`` (e.g. ``model.state_dict()``); every call
                must have the same names, shapes and dtypes. A tied alias (a later name
                of the same tensor) is not sent (:func:`.layout.distinct_tensors`).
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
        named_tensors = distinct_tensors(named_tensors)
        manifest = build_manifest(named_tensors)
        if self._manifest is None:
            device = next(iter(named_tensors.values())).device
            if self._shm is not None and device.type == "cpu":
                self._bufs = self._shm.buffers(total_bytes(manifest))
            self._flat = self._bufs[0] if self._bufs else torch.empty(
                total_bytes(manifest), dtype=torch.uint8, device=device)
            self._manifest = manifest
        elif manifest != self._manifest:
            raise ValueError("the tensors differ (names, shapes or dtypes) from the first publish")
        elif self._bufs:  # the other file: the one just announced may still be read
            self._slot ^= 1
            self._flat = self._bufs[self._slot]
        t1 = time.perf_counter()
        digest = flatten_into(self._flat, named_tensors, manifest)
        if self._flat.device.type == "cuda":
            torch.cuda.current_stream(self._flat.device).synchronize()
        stats = PublishStats(policy_version, total_bytes(manifest))
        stats.copy_s = time.perf_counter() - t1
        stats.blocked_s = time.perf_counter() - t0
        self.history.append(stats)
        if self._first_version is None:
            self._first_version = policy_version
            self._drop_dead_snapshots(policy_version)
        self._pending = self._pool.submit(self._background, stats, t0, digest)
        return self._pending

    def announce_version(self, policy_version: int) -> None:
        """Announce ``policy_version`` with no weights (transport
        :data:`~relax.streams.weights.announce.VERSION_ONLY`): for a trainer whose weights
        no other process takes (a colocated one, whose engine shares its parameters,
        in a run with no following reference and no eval stage). The stages that read the
        trainer's version from ``<run>.weights`` (the rollout's credit) still see it; no
        send buffer, same-host file or snapshot is made, and a subscriber skips the row.

        Raises:
            ValueError: a policy_version below 0.
        """
        if policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        row = {"policy_version": policy_version, "manifest": [], "total_bytes": 0,
               "bucket_bytes": self.bucket_bytes, "checksum": "", "transport": VERSION_ONLY,
               "rendezvous": self.rendezvous, "group_name": "", "checkpoint_uri": None,
               "published_at": int(time.time() * 1000)}
        self._send_row(row)

    def _drop_dead_snapshots(self, first: int) -> None:
        """Before the first write: delete the store's snapshots from ``first`` on (a
        restarted trainer's versions count again from its checkpoint; those are the dead
        trainer's, for version numbers this one will publish with other weights)."""
        if self.snapshots is None:
            return
        dropped = self.snapshots.drop_from(first)
        if dropped:
            log.warning("the snapshot store held %s of a previous trainer; this one "
                        "publishes from v%d: those snapshots are deleted (the versions after "
                        "its checkpoint are trained again)",
                        ", ".join(f"v{v}" for v in dropped), first)

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
        self._send_row(row)

    def _send_row(self, row: dict) -> None:
        batch = pa.RecordBatch.from_pylist([row], schema=WEIGHTS)
        validate(batch, "weights")
        self._producer.send(self.topic, batch)
        self._producer.flush()

    def _sees_shm(self, member: str) -> bool:
        """Whether ``member`` said it shares this publisher's ``/dev/shm``."""
        key = member_key(member)
        return self._shm is not None and self.store.check([key]) \
            and self.store.get(key) == b"1"

    def _regroup(self) -> None:
        raw = self._membership_log()
        members = replay_membership(raw)
        local = [m for m in members if self._bufs and self._sees_shm(m)]
        if self._group_name is not None and members == self._members \
                and local == self._local and not self._rejoined(raw):
            return
        self._log_seen = len(raw)
        self._group_index += 1
        self._group_name = f"{self.run}.weights.{self._incarnation}.g{self._group_index}"
        self._members, self._local = members, local
        self._gloo = [m for m in members if m not in local]
        self._pg = None
        self.store.set(f"{self._group_name}/members", "\n".join(self._gloo))

    def _form(self) -> None:
        """Create the process group of the broadcast's members (rank 0 = this publisher)."""
        if self._pg is not None or not self._gloo:
            return
        self._pg = make_group(
            self.store,
            self._group_name,
            0,
            len(self._gloo) + 1,
            self._flat.device,
            self.host,
            self.join_timeout_s,
        )

    def _drop_absent(self) -> None:
        ready = [m for m in self._gloo if self.store.check([f"{self._group_name}/ready/{m}"])]
        for m in self._gloo:
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

    def _background(self, stats: PublishStats, t0: float, digest: str | None) -> PublishStats:
        digest = self._digest = digest or checksum(self._flat)
        self._regroup()
        stats.group_name = self._group_name
        t1 = time.perf_counter()
        if self._local:
            self._announce_shm(stats.policy_version, digest)
            stats.members, stats.local = list(self._local), list(self._local)
        backend = "nccl" if self._flat.device.type == "cuda" else "gloo"
        self._announce(stats.policy_version, digest, backend, stats.group_name, None)
        if self._gloo:
            try:
                self._form()
                for a, b, _ in plan_buckets(self._manifest, self.bucket_bytes):
                    broadcast(self._pg, self._flat[a:b])
                stats.members += self._gloo
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
                stats.error is not None and self.snapshots is not None):
            stats.checkpoint_uri = self._snapshot(stats.policy_version, digest, stats.group_name)
        return stats

    def _announce_shm(self, version: int, digest: str) -> None:
        """Announce the send buffer's file as ``version``'s same-host copy."""
        self._announce(version, digest, "shm", self._group_name, self._shm.path(self._slot))
        self._shm_version = version

    def _snapshot(self, version: int, digest: str, group_name: str) -> str:
        """Write the send buffer to the checkpoint store and announce it (pool thread)."""
        uri = self._write_checkpoint(version, digest)
        self._snapshot_version = version
        self._announce(version, digest, "checkpoint", group_name, uri)
        return uri

    def _late_joiners(self) -> None:
        """Write the newest version for subscribers that registered after its group was
        formed (a restarted engine, a new one) where they can read it: the same-host
        file for those on this host, a snapshot in the store for the others. They would
        otherwise wait for the next version, which may never come while the trainer
        waits for their samples."""
        if not self.history or self._digest is None:
            return
        version = self.history[-1].policy_version
        raw = self._membership_log()
        late = [m for m in replay_membership(raw) if m not in self._members]
        late += self._rejoined(raw)
        local = [m for m in late if self._bufs and self._sees_shm(m)]
        if local and self._shm_version != version:
            log.info("weight subscribers %s on this host joined after v%d was published: "
                     "its same-host file for them", local, version)
            self._announce_shm(version, self._digest)
        late = [m for m in late if m not in local]
        if late and self.snapshots is not None and self._snapshot_version != version:
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
        return self.snapshots is not None and (
            version % self.checkpoint_every == 0 or version == self._first_version
        )

    def _write_checkpoint(self, version: int, digest: str) -> str:
        return self.snapshots.write(version, self._flat, self._manifest,
                                    {"policy_version": str(version), "checksum": digest})

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
            if self._shm is not None:
                self._shm.close()
            if self._own_producer:
                self._producer.close()
