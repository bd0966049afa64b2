"""The weight channel's same-host transport: the publisher's send buffer lives in
``/dev/shm`` (RAM), and subscribers that share that tmpfs copy each version out of it.

Why: on one host the gloo broadcast pushes every byte through TCP on loopback, in
threads of both processes (538 MB a version for a 135M model in fp32). Here the
publisher's copy of the weights into its send buffer *is* the transfer, and a
subscriber pays one memcpy out of the mapped file (``benchmarks/weight_sync.py``).

How:

* The publisher (:class:`ShmOffer`) makes its own folder
  ``<root>/relax-weights-<run>-<incarnation>/`` holding a ``probe`` file with a random
  nonce, and puts ``<folder>\\n<nonce>`` in the rendezvous store under :data:`SHM_KEY`.
* A subscriber that reaches the store reads the probe (:func:`sees_offer`): the same
  nonce means the same ``/dev/shm``, so the same host (a network namespace with its own
  tmpfs, or another machine, does not see it). It says so under ``shm/<member_id>``
  (``1`` or ``0``, written before it registers), and the publisher leaves it out of the
  broadcast group.
* The send buffer is two files, ``buf0`` and ``buf1``, each the flat stream of one
  version (:mod:`relax.streams.weights.layout`, no header: the announcement carries the
  manifest), mapped shared and used in turn: version v is copied into one while the
  other still holds v-1. Their pages are reserved up front (``posix_fallocate``), so a
  full tmpfs is an error at the first publish, never a SIGBUS later.
* Each version is announced with ``transport=shm`` and its file in ``checkpoint_uri``
  before the broadcast. The subscriber copies it through a mapping it keeps
  (:class:`ShmFiles`) into its receive buffer, or into an engine's spare buffers
  straight away (one copy: :meth:`ShmFiles.stage`), and verifies the checksum of what
  it copied.
* There are no acknowledgements: the publisher never waits for a same-host subscriber,
  so a dead one can stall nothing. A subscriber more than one version behind may read a
  file the publisher is overwriting; the checksum then differs, the copy is dropped
  and the subscriber takes the next announcement.

Only CPU buffers use it (on a GPU the same-host path would be CUDA IPC). A publisher
that finds too little room in the tmpfs for two versions offers nothing and everyone
gets the broadcast. A publisher's folder is removed by :meth:`ShmOffer.close`, and
folders left by an earlier incarnation of the same run (a trainer that was killed) by
the next one and by ``relax train`` when the run ends
(:func:`relax.streams.weights.shm_folders.remove_run_files`).
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch

from relax.streams.weights.layout import (
    ChecksumError,
    copy_entries,
    copy_with_checksum,
    manifest_from_rows,
)
from relax.streams.weights.shm_folders import publisher_folder, remove_run_files

log = logging.getLogger(__name__)

SHM_KEY = "relax/shm"
"""Rendezvous-store key of the publisher's offer: ``<folder>\\n<nonce>``."""

_SPARE = 64 << 20
"""Bytes of the tmpfs left free beyond the two buffers."""


def member_key(member_id: str) -> str:
    """Rendezvous-store key where a subscriber says whether it sees the offer."""
    return f"shm/{member_id}"


class ShmOffer:
    """The publisher's same-host folder and send buffers (see the module docstring).

    Args:
        root: a tmpfs folder (``/dev/shm``).
        run: run name (folders of earlier incarnations of it are removed).
        incarnation: this publisher's unique tag (letters and digits).

    Raises:
        OSError: the folder cannot be made.
    """

    def __init__(self, root: str | Path, run: str, incarnation: str):
        self.root = Path(root)
        remove_run_files(self.root, run)  # left by a killed trainer of this run
        self.folder = publisher_folder(self.root, run, incarnation)
        self.folder.mkdir(parents=True)
        self.nonce = uuid.uuid4().hex
        (self.folder / "probe").write_text(self.nonce)
        self._maps: list[mmap.mmap] = []

    @property
    def offer(self) -> str:
        """The value published under :data:`SHM_KEY`."""
        return f"{self.folder}\n{self.nonce}"

    def path(self, slot: int) -> str:
        """The file of send buffer ``slot`` (0 or 1)."""
        return str(self.folder / f"buf{slot}")

    def buffers(self, nbytes: int) -> list[torch.Tensor] | None:
        """The two send buffers, uint8 ``[nbytes]`` each, mapped shared on
        :meth:`path` ``(0)`` and ``(1)`` with their pages reserved; None when the tmpfs
        lacks room for them (then nothing is left behind)."""
        if shutil.disk_usage(self.root).free < 2 * nbytes + _SPARE:
            return None
        out = []
        for slot in (0, 1):
            fd = os.open(self.path(slot), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
                self._maps.append(mmap.mmap(fd, nbytes))
            except OSError as e:  # ENOSPC: another process filled the tmpfs meanwhile
                log.warning("no room for the same-host send buffers in %s (%s)", self.root, e)
                self.close()
                return None
            finally:
                os.close(fd)
            out.append(torch.frombuffer(self._maps[-1], dtype=torch.uint8))
        return out

    def close(self) -> None:
        """Remove the folder (the mappings stay valid until dropped; a subscriber still
        copying a file keeps it until it is done)."""
        shutil.rmtree(self.folder, ignore_errors=True)


def sees_offer(offer: bytes | str | None) -> bool:
    """Whether this process shares the ``/dev/shm`` of the publisher whose offer
    (:attr:`ShmOffer.offer`) it read: the probe file exists here and holds the nonce."""
    if not offer:
        return False
    text = offer.decode() if isinstance(offer, bytes) else offer
    folder, _, nonce = text.partition("\n")
    try:
        return (Path(folder) / "probe").read_text() == nonce
    except OSError:
        return False


class ShmFiles:
    """A subscriber's read-only mappings of the send buffers it copies versions out of,
    kept from one version to the next: mapping a 538 MB file again for every copy faults
    its 131k pages in again (0.09 s a copy, against 0.035 s through a kept mapping).
    Mappings of another folder than the last one read (an earlier publisher's) are
    dropped, so their tmpfs pages are freed once the publisher removed them."""

    def __init__(self):
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}  # path -> (inode, mapping)

    def copy_out(self, path: str, nbytes: int,
                 flat: torch.Tensor | None) -> tuple[torch.Tensor, str]:
        """Copy the first ``nbytes`` of the file at ``path`` (a send buffer) into ``flat``
        (uint8 ``[nbytes]`` on the CPU, reused when its size fits; a new one otherwise),
        with the checksum of the bytes copied (:func:`copy_with_checksum`).

        Returns:
            ``(the buffer, its checksum)``.

        Raises:
            FileNotFoundError: no file at ``path`` (its publisher closed).
            ValueError: the file is shorter than ``nbytes``.
        """
        if flat is None or flat.numel() != nbytes or flat.device.type != "cpu":
            flat = torch.empty(nbytes, dtype=torch.uint8)
        src = self.view(path, nbytes)
        try:
            digest = copy_with_checksum(flat.numpy(), src)
        finally:
            del src  # a mapping closes only once no array points into it
        return flat, digest

    def view(self, path: str, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of the file at ``path`` (a send buffer) as a read-only
        uint8 array over its kept mapping (no copy). Drop it after use: a mapping closes
        only once no array points into it.

        Raises:
            FileNotFoundError: no file at ``path`` (its publisher closed).
            ValueError: the file is shorter than ``nbytes``.
        """
        return np.frombuffer(self._map(path, nbytes), dtype=np.uint8, count=nbytes)

    def stage(self, path: str, row: dict, staging) -> bool:
        """Copy the version a WEIGHTS announcement ``row`` made of the file at ``path``
        straight into an engine's spare buffers (``staging``: :meth:`HFEngine.staging`),
        entry by entry, checksummed as it is copied (:func:`copy_entries`).

        Returns:
            True when staged; False when the bytes copied are not that version's (the
            publisher has since written a newer one there): nothing is staged then.

        Raises:
            FileNotFoundError: no file at ``path`` (nothing staged or changed).
            ValueError: the file is shorter than the announcement says.
            KeyError, ValueError: the engine refuses the manifest's names or shapes
                (:meth:`HFEngine.staging`; nothing staged or changed).
        """
        manifest = manifest_from_rows(row["manifest"])
        src = self.view(path, row["total_bytes"])
        try:
            with staging({e.name: e.shape for e in manifest}, row["policy_version"]) as spare:
                if copy_entries(src, manifest, spare) != row["checksum"]:
                    raise ChecksumError(f"{path} no longer holds v{row['policy_version']}")
        except ChecksumError:  # raised in the block: the engine staged nothing
            return False
        finally:
            del src  # a mapping closes only once no array points into it
        return True

    def _map(self, path: str, nbytes: int) -> mmap.mmap:
        folder = os.path.dirname(path)
        for old in [p for p in self._maps if os.path.dirname(p) != folder]:
            self._drop(old)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size < nbytes:
                    raise ValueError(f"{path}: {st.st_size} bytes, the announcement says {nbytes}")
                kept = self._maps.get(path)
                if kept is not None and kept[0] == st.st_ino and len(kept[1]) >= nbytes:
                    return kept[1]
                self._drop(path)
                m = mmap.mmap(f.fileno(), st.st_size, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            self._drop(path)
            raise
        self._maps[path] = (st.st_ino, m)
        return m

    def _drop(self, path: str) -> None:
        kept = self._maps.pop(path, None)
        if kept is not None:
            kept[1].close()

    def close(self) -> None:
        """Drop every mapping."""
        for path in list(self._maps):
            self._drop(path)


def shm_root_usable(root: str | Path) -> bool:
    """Whether ``root`` is a writable folder (``/dev/shm`` exists on Linux, not on macOS)."""
    return os.path.isdir(root) and os.access(root, os.W_OK)
