"""An engine's (or reference model's) side of the weight channel: :class:`WeightSubscriber`.

Subscribers (one background thread each) register in the rendezvous store (``+id`` /
``-id`` lines appended to one log, replayed in order); at the next version boundary the
publisher forms a new group that includes them. For each announcement they belong to,
they receive every bucket into a *receive buffer* (never into live weights), verify the
checksum, and hand the tensors to the engine's ``update_weights`` (staged in its second
buffer, swapped at a safe point between generation steps) or keep them for
:meth:`WeightSubscriber.apply`. A late subscriber first loads the newest ``checkpoint``
announcement's safetensors. One that shares the publisher's ``/dev/shm`` reads each
version from the file announced with ``transport=shm`` instead, straight into the
engine's second buffer (:mod:`relax.streams.weights.shm`). A server that receives the
broadcast itself (SGLang) has its own subscriber,
:class:`relax.streams.weights.server.ServerSubscriber`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from relax.streams.client import BusConfig
from relax.streams.follow import Follower
from relax.streams.weights.announce import VERSION_ONLY, AnnouncementReader, newest_rows
from relax.streams.weights.shm import SHM_KEY, ShmFiles, member_key, sees_offer
from relax.streams.weights.install import install_weights
from relax.streams.weights.layout import (ChecksumError, TensorEntry, checksum,
                                          manifest_from_rows, plan_buckets, views)
from relax.streams.weights.store import read_snapshot, snapshot_exists
from relax.streams.weights.rendezvous import (CONNECT_S, MEMBERSHIP_KEY, broadcast,
                                              local_ip_towards, make_group, member_lines,
                                              parse_rendezvous)

log = logging.getLogger(__name__)


@dataclass
class SubscriberStats:
    """Counters of one subscriber: versions received (by broadcast or from a same-host
    file) / loaded from a checkpoint, bytes received, seconds receiving, checksum
    failures, versions skipped."""

    received: int = 0
    from_checkpoint: int = 0
    bytes: int = 0
    receive_s: float = 0.0
    checksum_failures: int = 0
    skipped: int = 0
    history: list[tuple[int, str]] = field(default_factory=list)


class WeightSubscriber:
    """An engine's (or reference model's) side of the weight channel.

    Args:
        cfg: bus settings.
        run: run name.
        member_id: unique id of this subscriber in the group (e.g. ``rollout-0``).
        target: an engine (``update_weights(named_tensors, policy_version)``, and
            ``staging`` for same-host files): every verified version is staged into it
            from the background thread; it swaps at its own safe point. None: keep the
            newest version for :meth:`apply`.
        device: where the receive buffer lives (``cpu`` -> gloo, ``cuda`` -> nccl).
        catch_up: load the newest checkpoint on start (late joiner), and any newer
            checkpoint announced while this subscriber is in no group.
        rendezvous: ``tcp://host:port`` of the publisher, to register before the first
            announcement (default: learnt from the first announcement, which then is
            missed unless a checkpoint of it exists).
        join_timeout_s: how long to wait to form a group (seconds).
        follower: the process's shared :class:`~relax.streams.follow.Follower` to read
            the announcements on (None: a Kafka client of its own).

    The background thread starts with :meth:`start` (or ``with``); :meth:`close`
    leaves the group at the next version boundary.
    """

    reads_shm = True
    """Whether it may read versions from the publisher's same-host files."""

    def __init__(self, cfg: BusConfig, run: str, *, member_id: str, target=None,
                 device: str | torch.device = "cpu", catch_up: bool = True,
                 rendezvous: str | None = None, join_timeout_s: float = 60.0,
                 follower: Follower | None = None):
        if "\n" in member_id or not member_id:
            raise ValueError(f"member_id must be a non-empty single line, got {member_id!r}")
        self.cfg, self.run, self.member_id = cfg, run, member_id
        self.target, self.device = target, torch.device(device)
        self.catch_up, self.join_timeout_s = catch_up, join_timeout_s
        self._ids = [member_id]  # its member ids (a server's: one per TP rank)
        self._initial_rendezvous = rendezvous
        if rendezvous is not None:
            parse_rendezvous(rendezvous)
        self.stats = SubscriberStats()
        self.version: int | None = None
        self._reader = AnnouncementReader(cfg, run, follower)
        self._store = None
        self._rendezvous: str | None = None
        self._group: str | None = None
        self._pg = None
        self._same_host = False  # shares the connected publisher's /dev/shm
        self._version_from: str | None = None  # rendezvous of the publisher of .version
        self._gone: set[tuple[str, str]] = set()  # (rendezvous, group) of publishers gone
        self._flat: torch.Tensor | None = None
        self._shm_files = ShmFiles()  # mappings of the same-host files, kept between versions
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
                raise TimeoutError(f"{self.member_id}: policy_version {policy_version} not "
                                   f"received in {timeout_s}s (have {self.version})")
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
            install_weights(target, views(self._flat, self._manifest), version)
            self._applied = version
            return version

    def close(self) -> None:
        """Leave the group (effective at the next version boundary), stop the thread."""
        self._stop.set()
        if self._store is not None:
            self._store.append(MEMBERSHIP_KEY, self._log_lines("-"))
        if self._thread is not None:
            self._thread.join(timeout=self.join_timeout_s + 5)
        self._reader.close()
        self._shm_files.close()
        self._pg = None

    # --- background
    def _log_lines(self, op: str) -> str:
        """Membership log lines joining (``+``) or leaving (``-``) all this subscriber's
        ids, appended at once so a server's TP ranks stay consecutive."""
        return "".join(f"{op}{m}\n" for m in self._ids)

    def _raise_if_dead(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"weight subscriber {self.member_id} stopped") from self.error

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
        offer = self._store.get(SHM_KEY) if self._store.check([SHM_KEY]) else None
        self._same_host = self.reads_shm and self.device.type == "cpu" and sees_offer(offer)
        for m in self._ids:
            self._store.set(member_key(m), "1" if self._same_host else "0")
        self._store.append(MEMBERSHIP_KEY, self._log_lines("+"))

    def _run(self) -> None:
        if self._initial_rendezvous is not None:
            self._connect(self._initial_rendezvous)
        rows = self._reader.poll_backlog(2.0)  # all of a long run's history, not one fetch
        while not rows and not self._stop.is_set() and self._reader.latest_version is None:
            # nothing published yet: register at the first announcement's rendezvous
            rows = self._reader.poll(0.5)
        live = [r for r in rows if r["transport"] not in ("checkpoint", VERSION_ONLY)]
        if live:  # register first, so the next version's group includes us
            try:
                self._connect(live[-1]["rendezvous"])
            except torch.distributed.DistNetworkError as e:  # a dead trainer's (a resumed run)
                self._publisher_gone(live[-1], e)
        if self.catch_up:
            self._catch_up(rows)
        while True:
            for r in newest_rows(rows):
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
        self._gone.add((row["rendezvous"], row["group_name"]))
        self.stats.skipped += 1

    def _catch_up(self, rows: list[dict]) -> None:
        ckpts = [r for r in rows if r["transport"] == "checkpoint" and r["checkpoint_uri"]]
        if not ckpts:
            return
        newest = ckpts[-1]  # the last one: see newest_rows
        if not self._newer(newest):
            return
        shm = [r for r in rows if r["transport"] == "shm"]
        if self._same_host and shm and shm[-1]["rendezvous"] == newest["rendezvous"] \
                and shm[-1]["policy_version"] >= newest["policy_version"]:
            return  # the same-host file of a version as new is read next, from RAM
        self._load_kept(newest)

    def _load_kept(self, row: dict) -> int | None:
        """:meth:`load_checkpoint` of ``row`` unless the snapshot store's retention has
        deleted its snapshot (only ever for a newer one, whose announcement follows:
        then nothing changes, and the newer one is loaded when it is read). Returns the
        version loaded, or None."""
        if not snapshot_exists(row["checkpoint_uri"]):
            self.stats.skipped += 1
            log.warning("%s: the snapshot of v%d (%s) was deleted by the store's retention; "
                        "waiting for a newer one", self.member_id, row["policy_version"],
                        row["checkpoint_uri"])
            return None
        try:
            return self.load_checkpoint(row)
        except FileNotFoundError:  # deleted between the look and the read
            self.stats.skipped += 1
            log.warning("%s: the snapshot of v%d was deleted while it was read; waiting "
                        "for a newer one", self.member_id, row["policy_version"])
            return None

    def load_checkpoint(self, row: dict) -> int:
        """Load the safetensors of a ``checkpoint`` announcement into the receive buffer,
        verify its checksum, and deliver it like a broadcast.

        Raises:
            ChecksumError: the file's bytes do not match the announcement.
            ValueError: the file's tensors differ from the announced manifest.
            Either leaves the weights received before as they were.
        """
        path = row["checkpoint_uri"]
        flat, manifest = read_snapshot(path)
        if checksum(flat) != row["checksum"]:
            self.stats.checksum_failures += 1
            raise ChecksumError(f"{path}: checksum differs from the announcement {row['checksum']}")
        if manifest != manifest_from_rows(row["manifest"]):
            raise ValueError(f"{path}: its tensors differ from the announced manifest")
        with self._buf_lock:
            self._flat, self._manifest = flat.to(self.device), manifest
            self._flat_version = row["policy_version"]
        self.stats.from_checkpoint += 1
        self._deliver(row, "checkpoint")
        return row["policy_version"]

    def load_shm(self, row: dict) -> int | None:
        """Copy a ``shm`` announcement's same-host file into the receive buffer, or into
        the spare buffers of a target that stages (:meth:`HFEngine.staging`: one copy, not
        two; the receive buffer and :meth:`latest` stay as they were), verify its checksum
        as it is copied, and deliver it like a broadcast.

        Returns:
            the version; None when the file is gone (its publisher closed: nothing
            changes) or no longer holds that version (a version two newer is being
            written there: the checksum differs, and the receive buffer or the target's
            staged weights hold no whole version; a newer announcement follows).

        Raises:
            ValueError: the file is shorter than the announcement says.
        """
        t0 = time.perf_counter()
        path = row["checkpoint_uri"]
        staging = getattr(self.target, "staging", None)
        with self._buf_lock:
            before = self._flat_version
            try:
                if staging is not None:
                    same = self._shm_files.stage(path, row, staging)
                else:
                    self._flat_version = None  # overwritten from here on
                    self._flat, digest = self._shm_files.copy_out(
                        path, row["total_bytes"], self._flat)
                    self._manifest = manifest_from_rows(row["manifest"])
                    same = digest == row["checksum"]
            except FileNotFoundError:
                self._flat_version = before  # nothing was copied
                self.stats.skipped += 1
                return None
            if not same:
                self.stats.skipped += 1
                log.warning("%s: %s no longer holds v%d (a newer version is being written "
                            "there); waiting for the next", self.member_id, path,
                            row["policy_version"])
                return None
            if staging is None:
                self._flat_version = row["policy_version"]
        self.stats.received += 1
        self.stats.bytes += row["total_bytes"]
        self.stats.receive_s += time.perf_counter() - t0
        self._deliver(row, "shm", staged=staging is not None)
        return row["policy_version"]

    def _newer(self, row: dict) -> bool:
        """Whether ``row`` announces weights newer than those held: a higher
        policy_version, or any version of another publisher (a restarted trainer's
        versions count again from its checkpoint)."""
        return (self.version is None or row["policy_version"] > self.version
                or row["rendezvous"] != self._version_from)

    def _handle(self, row: dict) -> None:
        if row["transport"] == VERSION_ONLY:
            return  # no weights to take (newest_rows leaves them out: defensive)
        gone = (row["rendezvous"], row["group_name"]) in self._gone
        if gone and row["transport"] != "checkpoint":
            return  # a publisher found gone (a trainer at that address again has new groups)
        if row["transport"] == "shm":  # a file that is absent was pruned, or is on another host
            if self._newer(row) and os.path.exists(row["checkpoint_uri"]):
                self._connect(row["rendezvous"])
                if self._same_host:
                    self.load_shm(row)
            return
        if row["transport"] == "checkpoint":
            if (self.catch_up and self._newer(row) and self._group is None
                    and row["checkpoint_uri"]):
                self._load_kept(row)
            return
        self._connect(row["rendezvous"])
        version, group = row["policy_version"], row["group_name"]
        key = f"{group}/members"
        if not self._store.check([key]):
            self._store.wait([key], timedelta(seconds=self.join_timeout_s))
        members = member_lines(self._store.get(key))
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
                self._pg = make_group(
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
                    broadcast(self._pg, self._flat[a:b])
            except RuntimeError:
                self._group, self._pg = None, None  # the publisher forms a new group
                self.stats.skipped += 1
                log.warning("%s: broadcast of v%d failed; waiting for the next version",
                            self.member_id, row["policy_version"])
                self._store.append(MEMBERSHIP_KEY, self._log_lines("+"))
                return
            if checksum(self._flat) != row["checksum"]:
                self.stats.checksum_failures += 1
                raise ChecksumError(f"{self.member_id}: v{row['policy_version']} received "
                                    f"bytes do not match checksum {row['checksum']}")
            self._flat_version = row["policy_version"]
        self.stats.received += 1
        self.stats.bytes += size
        self.stats.receive_s += time.perf_counter() - t0
        self._deliver(row, "broadcast")

    def _deliver(self, row: dict, how: str, staged: bool = False) -> None:
        version = row["policy_version"]
        if self.target is not None and not staged:
            with self._buf_lock:
                install_weights(self.target, views(self._flat, self._manifest), version)
                self._applied = version
        self.version, self._version_from = version, row.get("rendezvous")
        self.stats.history.append((version, how))
        self._events.put(version)
