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
