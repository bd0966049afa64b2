"""Blob store for values too large for one Kafka message (images, audio clips).

A local folder or any ``pyarrow.fs`` URI (``s3://bucket/prefix?endpoint_override=...``,
``file:///...``; :mod:`relax.streams.fsuri`).
Blobs are content-addressed (sha256 of the bytes), so writing the same value
twice stores it once and a redelivered record points at the same blob.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow.fs as pafs

from relax.streams.fsuri import child_uri, open_uri, public_uri


class BlobStore:
    """Content-addressed byte store on a ``pyarrow.fs`` file system.

    Args:
        root: a local folder path or a URI understood by ``pyarrow.fs.FileSystem.from_uri``.
    """

    def __init__(self, root: str | Path):
        root = str(root)
        if "://" not in root:
            root = Path(root).resolve().as_uri()
        self.root_uri = root.rstrip("/")
        self._fs, self._base = open_uri(self.root_uri)
        self._fs.create_dir(self._base, recursive=True)

    def put(self, data: bytes) -> str:
        """Store ``data`` and return its URI (``<root>/<sha256>``)."""
        digest = hashlib.sha256(data).hexdigest()
        path = f"{self._base}/{digest}"
        if self._fs.get_file_info(path).type == pafs.FileType.NotFound:
            tmp = f"{path}.tmp"
            with self._fs.open_output_stream(tmp) as f:
                f.write(data)
            self._fs.move(tmp, path)
        return child_uri(public_uri(self.root_uri), digest)

    @staticmethod
    def get(uri: str) -> bytes:
        """Read the bytes behind a blob URI (any ``pyarrow.fs`` URI).

        Raises:
            FileNotFoundError: if the blob does not exist.
        """
        fs, path = open_uri(uri)
        with fs.open_input_stream(path) as f:
            return f.read()
