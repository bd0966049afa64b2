"""Storage URIs for ``pyarrow.fs``: a local path, ``file:///...``, or a remote store such
as ``s3://bucket/prefix?endpoint_override=host:port&scheme=http``. The weight snapshot
store (:mod:`relax.streams.weights.store`) and the blob store (:mod:`relax.streams.blobs`)
both name what they write by such URIs, announced on the bus and read on other hosts.

A URI's options (the query) belong to the store, not to a path: a child of
``s3://b/p?scheme=http`` is ``s3://b/p/name?scheme=http``. Credentials never go into
a URI that is announced (:func:`public_uri`): every host takes them from its
environment (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` for S3, as pyarrow does).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit


def is_local(uri: str) -> bool:
    """A plain path or a ``file://`` URI."""
    return "://" not in uri or uri.startswith("file://")


def public_uri(uri: str) -> str:
    """``uri`` without a ``user:password@`` part (a plain path as it is)."""
    if "://" not in uri:
        return uri
    u = urlsplit(uri)
    netloc = u.netloc.rpartition("@")[2]
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def child_uri(uri: str, name: str) -> str:
    """``uri`` with ``/name`` appended to its path, options kept (a plain path: joined)."""
    if "://" not in uri:
        return f"{uri.rstrip('/')}/{name}"
    u = urlsplit(uri)
    return urlunsplit((u.scheme, u.netloc, f"{u.path.rstrip('/')}/{name}", u.query, u.fragment))


def open_uri(uri: str):
    """``(pyarrow filesystem, path in it)`` of ``uri`` (a plain path: the local file
    system and the absolute path).

    Raises:
        ValueError: pyarrow cannot make a filesystem of ``uri`` (names it, without
            credentials).
    """
    import pyarrow.fs as pafs

    if "://" not in uri:
        return pafs.LocalFileSystem(), str(Path(uri).resolve())
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as e:  # pyarrow.ArrowInvalid is a ValueError
        raise ValueError(f"storage URI {public_uri(uri)!r}: {e}") from e
    return fs, path.rstrip("/")
