"""The weight channel's copies on one host (issue 19): the publisher checksums as it
flattens and sends a tied alias once; a same-host engine stages each version from the
publisher's file in one copy (``ShmFiles.stage`` into ``HFEngine.staging``), verified
as it is copied, and a file overwritten since its announcement stages nothing."""

from __future__ import annotations

import time

import pytest
import torch

from relax.streams.weights.announce import AnnouncementReader
from relax.streams.weights.layout import (
    build_manifest,
    checksum,
    copy_entries,
    distinct_tensors,
    flatten_into,
    total_bytes,
    views,
)
from relax.streams.weights.publisher import WeightPublisher
from relax.streams.weights.subscriber import WeightSubscriber


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    big = torch.randn(700, 3000, generator=g)  # 8.4 MB: spans several copy chunks
    return {
        "big": big,
        "t": torch.randn(6, 5, generator=g).t(),  # not contiguous
        "half": torch.randn(3, 3, generator=g).to(torch.bfloat16),
        "steps": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def test_flatten_returns_the_checksum_of_what_it_wrote():
    t = _tensors()
    m = build_manifest(t)
    flat = torch.empty(total_bytes(m), dtype=torch.uint8)
    digest = flatten_into(flat, t, m)
    assert digest == checksum(flat)
    assert all(torch.equal(v, t[n]) for n, v in views(flat, m).items())
    t["big"][0, 0] += 1
    assert flatten_into(flat, t, m) != digest


def test_a_tied_alias_is_left_out_and_other_views_are_kept():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as a tied LM head
    state = {"emb.weight": emb.weight.detach(), "head.weight": head.weight.detach(),
             "rows": emb.weight.detach()[:2], "col": emb.weight.detach()[:, :1],
             "none": torch.zeros(0), "none2": torch.zeros(0)}
    assert list(distinct_tensors(state)) == ["emb.weight", "rows", "col", "none", "none2"]


def test_copy_entries_fills_each_target_once_and_converts_a_dtype():
    t = _tensors()
    m = build_manifest(t)
    flat = torch.empty(total_bytes(m), dtype=torch.uint8)
    digest = flatten_into(flat, t, m)
    dst = {n: torch.empty(v.shape, dtype=v.dtype) for n, v in t.items()}
    dst["steps"] = torch.empty(5, dtype=torch.float64)  # the engine's dtype differs
    assert copy_entries(flat.numpy(), m, dst) == digest
    assert all(torch.equal(dst[n], v) for n, v in t.items() if n != "steps")
    assert torch.equal(dst["steps"], t["steps"].double())
    with pytest.raises(KeyError):
        copy_entries(flat.numpy(), m, {k: v for k, v in dst.items() if k != "mask"})
    with pytest.raises(ValueError, match="half: shape"):
        copy_entries(flat.numpy(), m, {**dst, "half": torch.empty(9, dtype=torch.bfloat16)})
    flat[3] ^= 1  # a byte changed in the source: the copy's checksum says so
    assert copy_entries(flat.numpy(), m, dst) != digest


def test_a_same_host_engine_stages_each_version_in_one_copy(bus, unique, tmp_path):
    """An HF engine subscribed on the publisher's host gets v1-v3 from the same-host
    files straight into its spare buffers: the swaps install the publisher's weights, the
    subscriber's receive buffer is never filled, and the tied head travels once. v1's
    file holds v3 by then: staging it with v1's checksum fails, and the engine is left
    with nothing staged and its live weights as they were."""
    from relax.consumers.engines.hf import HFEngine
    from relax.trainer.models import load_model

    model = load_model("tiny-llama")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    engine = HFEngine("tiny-llama", device="cpu")
    (tmp_path / "shm").mkdir()
    pub = WeightPublisher(bus, unique, shm_root=tmp_path / "shm", join_timeout_s=30)
    sub = WeightSubscriber(bus, unique, member_id="engine", target=engine,
                           rendezvous=pub.rendezvous).start()
    try:
        pub.wait_for_members(1, 60)
        for v in (1, 2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * v)
            state = {k: x.detach() for k, x in model.state_dict().items()}
            stats = pub.publish(state, v).result()
            assert stats.error is None and stats.local == ["engine"]
            assert sub.wait_for(v, 60) == v and engine.pending_version == v
            assert engine.apply_pending() and engine.policy_version == v
            for n, p in engine.model.named_parameters():
                assert torch.equal(p, model.get_parameter(n)), n
        assert sub.stats.history == [(1, "shm"), (2, "shm"), (3, "shm")]
        assert sub.latest() is None  # no version went through the receive buffer
        rows = _shm_rows(bus, unique, 3)
        assert "lm_head.weight" not in {e["name"] for e in rows[0]["manifest"]}
        assert rows[0]["total_bytes"] == sum(p.numel() * 4 for p in model.parameters())
        live = {n: p.clone() for n, p in engine.model.named_parameters()}
        torn = {**rows[0], "policy_version": 4}  # v1's checksum, the file holds v3
        assert sub.load_shm(torn) is None and engine.pending_version is None
        assert not engine.apply_pending()
        assert all(torch.equal(p, live[n]) for n, p in engine.model.named_parameters())
    finally:
        sub.close()
        pub.close()


def test_staging_from_a_missing_file_keeps_what_was_staged(tmp_path):
    from relax.consumers.engines.hf import HFEngine
    from relax.streams.weights.shm import ShmFiles

    engine = HFEngine("tiny-llama", device="cpu")
    v1 = {n: p.detach() + 0.5 for n, p in engine.model.named_parameters()}
    engine.update_weights(v1, 1)
    m = build_manifest(distinct_tensors(v1))
    row = {"manifest": [{"name": e.name, "shape": list(e.shape), "dtype": e.dtype,
                         "offset": e.offset, "nbytes": e.nbytes} for e in m],
           "total_bytes": total_bytes(m), "policy_version": 2, "checksum": "crc32c:0"}
    with pytest.raises(FileNotFoundError):
        ShmFiles().stage(str(tmp_path / "gone"), row, engine.staging)
    assert engine.pending_version == 1


def _shm_rows(bus, run: str, n: int) -> list[dict]:
    reader = AnnouncementReader(bus, run)
    rows: list[dict] = []
    deadline = time.monotonic() + 30
    try:
        while len(rows) < n and time.monotonic() < deadline:
            rows += [r for r in reader.poll(0.5) if r["transport"] == "shm"]
    finally:
        reader.close()
    assert [r["policy_version"] for r in rows] == list(range(1, n + 1))
    return rows

