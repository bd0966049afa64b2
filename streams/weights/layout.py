"""Flat layout of the weight channel: manifest, buckets, views, copies, checksum.

Flat layout: tensors in manifest order (sorted by element size, largest first, so
every offset is aligned for its dtype), each tensor's bytes contiguous, no padding.
This is also SGLang's ``FlattenedTensorBucket`` layout, and the data section of the
safetensors checkpoint, so one checksum covers all three.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_BUCKET_BYTES = 512 << 20
"""Default broadcast bucket size (bytes)."""

CRC_CHUNK = 4 << 20
"""Bytes copied at a time before the checksum thread takes them (:func:`copy_with_checksum`)."""

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
) -> str | None:
    """Copy ``named_tensors`` into ``flat`` at the manifest offsets.

    On the CPU the bytes are checksummed while they are copied (:func:`copy_with_checksum`),
    so the publisher announces without another pass over the buffer.

    Returns:
        :func:`checksum` of ``flat`` as written when ``flat`` is on the CPU; None on a
        device (checksum it there once the copies are done).

    Raises:
        ValueError: a tensor's shape or dtype differs from its manifest entry.
    """
    targets = views(flat, manifest)
    on_host = flat.device.type == "cpu"
    with _crc_behind() if on_host else nullcontext() as crc, torch.no_grad():
        for e in manifest:
            t = named_tensors[e.name]
            if tuple(t.shape) != e.shape or dtype_name(t.dtype) != e.dtype:
                raise ValueError(
                    f"{e.name}: got {tuple(t.shape)} {t.dtype}, manifest says {e.shape} {e.dtype}"
                )
            dst = targets[e.name]
            src = t.detach()
            if on_host and src.device.type == "cpu" and src.is_contiguous():
                _copy_crc(_bytes(dst), _bytes(src), crc)
                continue
            copy_tensor_(dst, src)
            if on_host:
                crc.add(_bytes(dst))
    return crc.digest if on_host else None


def distinct_tensors(named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``named_tensors`` less the later names of a tensor already in it (the same view of
    the same memory: a tied LM head, which ``state_dict()`` lists as
    ``lm_head.weight`` beside ``model.embed_tokens.weight``). What the weight channel
    sends: a tied alias would carry the same bytes twice (SmolLM2-135M: 651 MB with its
    113 MB head, 538 MB without). HF checkpoints omit it the same way, and every receiver
    takes the update without it (:meth:`HFEngine.update_weights`, a module's tied
    parameter; SGLang's model loaders skip ``lm_head.weight`` of a tied model)."""
    seen: set[tuple] = set()
    out = {}
    for name, t in named_tensors.items():
        key = (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride())
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


class ChecksumError(RuntimeError):
    """Received bytes do not match the announced checksum."""


def checksum(flat: torch.Tensor) -> str:
    """``crc32c:<8 hex>`` over the bytes of ``flat`` (``[N]`` uint8; copied to host if on
    a device). crc32c runs at several GB/s with SSE4.2."""
    import crc32c

    host = flat if flat.device.type == "cpu" else flat.cpu()
    return f"crc32c:{crc32c.crc32c(memoryview(host.numpy())):08x}"


def copy_with_checksum(dst: np.ndarray, src: np.ndarray, chunk: int = CRC_CHUNK) -> str:
    """Copy ``src`` into ``dst`` (uint8 ``[N]`` each) and return :func:`checksum` of what
    was copied: each ``chunk`` bytes are checksummed in a second thread right after
    their copy, while this one copies the next (numpy's copy and crc32c release the
    GIL, so the two run on two cores). 538 MB on an Intel Xeon VM: 72-74 ms, against
    43-44 ms to copy plus 40-41 ms to checksum; in another run 93-97 ms against 134-136
    ms for both chunk by chunk in one thread (benchmarks/JOURNAL.md, 2026-12-05)."""
    with _crc_behind() as crc:
        _copy_crc(dst, src, crc, chunk)
    return crc.digest


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a uint8 array (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class _CrcBehind:
    """crc32c of the byte arrays given to :meth:`add`, in order, computed in a thread of
    its own while the caller copies on. :meth:`close` waits for it; then ``digest`` is
    ``crc32c:<8 hex>``. An array must not change until then."""

    def __init__(self):
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._value, self._error = 0, None
        self.digest: str | None = None
        self._thread = threading.Thread(target=self._run, name="relax-crc32c", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import crc32c

        while (data := self._chunks.get()) is not None:
            if self._error is None:
                try:
                    self._value = crc32c.crc32c(memoryview(data), self._value)
                except (TypeError, ValueError, BufferError) as e:  # raised by close()
                    self._error = e

    def add(self, data: np.ndarray) -> None:
        self._chunks.put(data)

    def close(self) -> None:
        self._chunks.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        self.digest = f"crc32c:{self._value:08x}"


@contextmanager
def _crc_behind() -> Iterator[_CrcBehind]:
    """A :class:`_CrcBehind`, closed when the block ends (its thread too, on an error)."""
    crc = _CrcBehind()
    try:
        yield crc
    finally:
        crc.close()


def _copy_crc(dst: np.ndarray, src: np.ndarray, crc: _CrcBehind,
              chunk: int = CRC_CHUNK) -> None:
    """Copy ``src`` into ``dst`` (uint8 ``[N]`` each) chunk by chunk, handing each chunk
    copied to ``crc``."""
    for a in range(0, src.size, chunk):
        np.copyto(dst[a:a + chunk], src[a:a + chunk])
        crc.add(dst[a:a + chunk])


def copy_entries(src: np.ndarray, manifest: list[TensorEntry],
                 dst: dict[str, torch.Tensor]) -> str:
    """Copy each manifest entry of the flat stream ``src`` (uint8 ``[total_bytes]``, e.g.
    a mapped send buffer) into ``dst[name]`` (CPU tensors of the entry's shape; another
    dtype is converted) and return :func:`checksum` of the stream, computed as in
    :func:`copy_with_checksum`: one copy instead of a copy into a receive buffer and a
    second one out of it.

    Raises:
        KeyError: an entry's name is not in ``dst``.
        ValueError: a ``dst`` tensor's shape differs from its entry's.
    """
    with _crc_behind() as crc:
        for e in manifest:
            d = dst[e.name]
            if tuple(d.shape) != e.shape:
                raise ValueError(f"{e.name}: shape {tuple(d.shape)} != the stream's {e.shape}")
            piece = src[e.offset:e.offset + e.nbytes]
            if d.dtype == _DTYPES[e.dtype] and d.is_contiguous() and d.device.type == "cpu":
                _copy_crc(_bytes(d), piece, crc)
                continue
            tmp = torch.empty(e.nbytes, dtype=torch.uint8)
            _copy_crc(tmp.numpy(), piece, crc)
            d.copy_(tmp.view(_DTYPES[e.dtype]).view(e.shape))
    return crc.digest


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
