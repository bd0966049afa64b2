"""The weight snapshot store: where the publisher writes a policy_version's flat bytes
as one safetensors file, ``<store>/v<version:08d>/model.safetensors``, and where a late
joiner (a restarted engine, one added by scaling, one that missed a broadcast) reads
them. Addressed by a URI through ``pyarrow.fs``, so it need not be a disk the engines
share with the trainer:

* a local folder (a path or ``file:///...``): the one-host default, ``<run_dir>/weights``;
* ``s3://bucket/prefix?endpoint_override=host:port&scheme=http`` (any S3-compatible
  server: AWS, MinIO, Ceph, moto), ``gs://...``, ``hdfs://...``: every host reads the
  same store over the network.

URIs and credentials: :mod:`relax.streams.fsuri` (announced URIs carry none).
A snapshot is complete or absent: a local one is written to a temporary folder and
renamed; an object store makes an object visible only when its upload completes.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch

from relax.streams.fsuri import child_uri, is_local, open_uri, public_uri
from relax.streams.weights.files import parse_safetensors_flat, write_safetensors_to
from relax.streams.weights.layout import TensorEntry

SNAPSHOT_FILE = "model.safetensors"


class SnapshotStore:
    """The publisher's handle on the store at ``uri`` (see the module docstring).

    Args:
        uri: a local folder or a ``pyarrow.fs`` URI.
        keep: how many of the newest snapshots stay (older ones are deleted after each
            write: a late joiner needs only the newest).

    Raises:
        ValueError: ``keep`` < 1, or a URI pyarrow cannot open.
        OSError: the store cannot be reached or its folder cannot be made.
    """

    def __init__(self, uri: str | Path, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.uri, self.keep = str(uri), keep
        self._fs, self._base = open_uri(self.uri)
        self._local = is_local(self.uri)
        self._fs.create_dir(self._base, recursive=True)  # an unreachable store fails now

    def snapshot_uri(self, version: int) -> str:
        """The URI announced for ``version``'s snapshot (a folder holding
        :data:`SNAPSHOT_FILE`): a local absolute path, or the store's URI with the
        version's folder appended and no credentials."""
        name = f"v{version:08d}"
        if self._local:
            return f"{self._base}/{name}"
        return child_uri(public_uri(self.uri), name)

    def write(self, version: int, flat: torch.Tensor, manifest: list[TensorEntry],
              metadata: dict[str, str] | None = None) -> str:
        """Write ``flat`` (uint8 ``[nbytes]``) as ``version``'s snapshot unless it exists,
        delete all but the newest :attr:`keep`; returns :meth:`snapshot_uri`.

        Raises:
            OSError: the store refused a write (pyarrow's error, with the path).
        """
        import pyarrow.fs as pafs

        target = f"{self._base}/v{version:08d}"
        if self._fs.get_file_info(f"{target}/{SNAPSHOT_FILE}").type != pafs.FileType.NotFound:
            return self.snapshot_uri(version)
        if self._local:
            tmp = f"{self._base}/.v{version:08d}.tmp-{uuid.uuid4().hex[:6]}"
            self._fs.create_dir(tmp)
            try:
                with self._fs.open_output_stream(f"{tmp}/{SNAPSHOT_FILE}") as f:
                    write_safetensors_to(f, flat, manifest, metadata)
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        else:  # one object, visible only once its upload completes
            with self._fs.open_output_stream(f"{target}/{SNAPSHOT_FILE}") as f:
                write_safetensors_to(f, flat, manifest, metadata)
        self.prune()
        return self.snapshot_uri(version)

    def versions(self) -> list[int]:
        """The policy_versions with a snapshot folder in the store, oldest first."""
        import pyarrow.fs as pafs

        infos = self._fs.get_file_info(pafs.FileSelector(self._base, allow_not_found=True))
        out = []
        for i in infos:
            name = i.base_name
            if i.type == pafs.FileType.Directory and name.startswith("v") and name[1:].isdigit():
                out.append(int(name[1:]))
        return sorted(out)

    def prune(self) -> None:
        """Delete all but the newest :attr:`keep` snapshots."""
        for v in self.versions()[:-self.keep]:
            self._fs.delete_dir(f"{self._base}/v{v:08d}")

    def drop_from(self, version: int) -> list[int]:
        """Delete the snapshots of ``version`` and every later one; returns their versions.

        A restarted trainer publishes again from its checkpoint's policy_version: the
        snapshots from there on are a dead trainer's weights for version numbers it will
        use again (with other weights), and newer than its own, so retention would keep
        them and delete its own. It calls this before its first write.
        """
        dropped = [v for v in self.versions() if v >= version]
        for v in dropped:
            self._fs.delete_dir(f"{self._base}/v{v:08d}")
        return dropped


def snapshot_exists(uri: str) -> bool:
    """Whether the snapshot announced as ``uri`` is still in the store (retention deletes
    all but the newest :attr:`SnapshotStore.keep`).

    Raises:
        OSError: the store cannot be reached (pyarrow's error).
    """
    import pyarrow.fs as pafs

    fs, path = open_uri(uri)
    return fs.get_file_info(f"{path}/{SNAPSHOT_FILE}").type == pafs.FileType.File


def read_snapshot(uri: str) -> tuple[torch.Tensor, list[TensorEntry]]:
    """Read the snapshot announced as ``uri`` (:meth:`SnapshotStore.snapshot_uri`; a local
    path, ``file://...`` or a ``pyarrow.fs`` URI) as ``(flat, manifest)``: ``flat`` uint8
    ``[nbytes]`` on the CPU.

    Raises:
        FileNotFoundError / OSError: the snapshot cannot be read (pyarrow's error).
        ValueError: not a snapshot written by :class:`SnapshotStore`.
    """
    fs, path = open_uri(uri)
    with fs.open_input_stream(f"{path}/{SNAPSHOT_FILE}") as f:
        data = f.read()
    return parse_safetensors_flat(data, child_uri(public_uri(uri), SNAPSHOT_FILE))
