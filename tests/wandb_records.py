"""Read what a W&B run wrote offline (``<dir>/wandb/offline-run-*/run-*.wandb``), to check
relax's W&B output without a W&B server.

The file is W&B's transaction log: a 7-byte header (``:W&B``, magic 0xBEE1 little-endian,
version 0), then LevelDB's log format (32 KiB blocks; each record a 7-byte header: CRC32
uint32, length uint16, type uint8 = 1 full, 2 first, 3 middle, 4 last; a block tail
under 7 bytes is padding), each whole record one ``wandb_internal_pb2.Record``
(https://github.com/google/leveldb/blob/main/doc/log_format.md).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

HEADER = b":W&B\xe1\xbe\x00"
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def raw_records(path: Path) -> list[bytes]:
    """The whole records of one ``.wandb`` file, in order."""
    data = Path(path).read_bytes()
    assert data[:len(HEADER)] == HEADER, f"{path}: not a W&B transaction log"
    out, buf, pos = [], b"", len(HEADER)
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (FULL, FIRST) else buf + chunk
        if kind in (FULL, LAST):
            out.append(buf)
            buf = b""
    return out


def history(run_dir: Path) -> list[dict]:
    """Every history row (``wandb.log``) of every offline W&B run under ``run_dir/wandb``,
    oldest run first: ``{key: value}`` with W&B's own keys (``_step``, ``_runtime``,
    ``_timestamp``) kept."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for f in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")):
        for raw in raw_records(f):
            rec = pb.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in rec.history.item})
    return rows


def run_ids(run_dir: Path) -> set[str]:
    """The W&B run ids of the offline runs under ``run_dir/wandb``."""
    from wandb.proto import wandb_internal_pb2 as pb

    ids = set()
    for f in Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"):
        for raw in raw_records(f):
            rec = pb.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") == "run":
                ids.add(rec.run.run_id)
    return ids
