"""Safetensors I/O of the flat stream: the checkpoint file's data section *is* the flat
layout (:mod:`relax.streams.weights.layout`), so one checksum covers both."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from relax.streams.weights.layout import TensorEntry

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


def safetensors_header(manifest: list[TensorEntry], metadata: dict[str, str] | None = None
                       ) -> bytes:
    """The first bytes of a safetensors file whose data section is the flat stream of
    ``manifest``: 8-byte little-endian header length N, then N bytes of JSON header
    (padded with spaces to a multiple of 8; each tensor's ``data_offsets`` relative to
    the data start). Format: https://github.com/huggingface/safetensors, "Format"."""
    header: dict = {"__metadata__": metadata or {}}
    for e in manifest:
        header[e.name] = {
            "dtype": _SAFETENSORS_DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [e.offset, e.offset + e.nbytes],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(
    path: Path,
    flat: torch.Tensor,
    manifest: list[TensorEntry],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``flat`` (uint8 ``[nbytes]``) as one safetensors file at ``path`` whose data
    section *is* the flat stream (:func:`write_safetensors_to`)."""
    with open(path, "wb") as f:
        write_safetensors_to(f, flat, manifest, metadata)


def write_safetensors_to(
    stream,
    flat: torch.Tensor,
    manifest: list[TensorEntry],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``flat`` (uint8 ``[nbytes]``, any device) as a safetensors file to
    ``stream`` (anything with ``write(bytes-like)``: a file, a ``pyarrow`` output
    stream): :func:`safetensors_header`, then one write of the flat bytes, no
    per-tensor copies; readable with ``safetensors.torch.load_file``."""
    host = flat if flat.device.type == "cpu" else flat.cpu()
    stream.write(safetensors_header(manifest, metadata))
    stream.write(memoryview(host.numpy()))


def read_safetensors_flat(path: Path) -> tuple[torch.Tensor, list[TensorEntry]]:
    """Read a file written by :func:`write_safetensors` back as ``(flat, manifest)``
    (:func:`parse_safetensors_flat`).

    Raises:
        ValueError: as :func:`parse_safetensors_flat`.
    """
    return parse_safetensors_flat(Path(path).read_bytes(), str(path))


def parse_safetensors_flat(data: bytes, name: str = "safetensors"
                           ) -> tuple[torch.Tensor, list[TensorEntry]]:
    """The bytes of a file written by :func:`write_safetensors_to` as ``(flat,
    manifest)``: ``flat`` is uint8 ``[nbytes]`` over a copy of the data section.

    Raises:
        ValueError: the data section is not one contiguous stream in header order, or
            the header is cut short (``name`` says which file).
    """
    if len(data) < 8:
        raise ValueError(f"{name}: {len(data)} bytes, not a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if len(data) < 8 + n:
        raise ValueError(f"{name}: header of {n} bytes, file of {len(data)}")
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    inv = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
    entries = sorted(
        ((name_, h) for name_, h in header.items()), key=lambda x: x[1]["data_offsets"][0]
    )
    manifest, offset = [], 0
    for tname, h in entries:
        a, b = h["data_offsets"]
        if a != offset:
            raise ValueError(f"{name}: tensor {tname} starts at {a}, expected {offset}")
        manifest.append(TensorEntry(tname, tuple(h["shape"]), inv[h["dtype"]], a, b - a))
        offset = b
    flat = torch.frombuffer(bytearray(data[8 + n :]), dtype=torch.uint8)
    return flat, manifest
