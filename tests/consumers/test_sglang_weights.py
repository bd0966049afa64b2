"""The weight broadcast to an SGLang server, against a receiver process that joins and
receives the way SGLang's ModelRunner does (``fixtures/sglang/weight_receiver.py``: torch's
``rendezvous`` + ``PrefixStore(group_name)`` + ``_new_process_group_helper``, one flat
uint8 bucket per request). No SGLang server runs here; what this checks is that relax's
publisher and subscriber meet that recipe on the wire (store keys, sequence number,
ranks, bucket bytes) next to an ordinary relax subscriber in the same group."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from testdata import StubTokenizer

from relax.consumers.engines.sglang import SGLangEngine
from relax.streams.weights.publisher import WeightPublisher
from relax.streams.weights.server import ServerSubscriber
from relax.streams.weights.subscriber import WeightSubscriber

RECEIVER = Path(__file__).parent / "fixtures" / "sglang" / "weight_receiver.py"


@pytest.fixture
def receiver(tmp_path):
    """The URL of a fresh receiver process (killed after the test)."""
    port_file = tmp_path / "receiver.port"
    proc = subprocess.Popen([sys.executable, str(RECEIVER), str(port_file)])
    deadline = time.monotonic() + 120
    while not port_file.exists():
        assert proc.poll() is None, f"the receiver exited with {proc.returncode}"
        assert time.monotonic() < deadline, "the receiver did not start in 120 s"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port_file.read_text()}"
    proc.kill()
    proc.wait()


def _dump(engine: SGLangEngine, path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    engine._post("/dump", {"path": str(path)})
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_an_sglang_style_receiver_gets_every_version_beside_a_relax_subscriber(
        bus, unique, tmp_path, receiver):
    g = torch.Generator().manual_seed(0)
    params = {  # two buckets under 2 KiB: a tensor never splits, dtypes mixed
        "embed.weight": torch.randn(16, 24, generator=g),
        "layer.0.weight": torch.randn(8, 24, generator=g).to(torch.bfloat16),
        "layer.0.bias": torch.randn(8, generator=g),
        "head.weight": torch.randn(20, 16, generator=g),
    }
    pub = WeightPublisher(bus, unique, bucket_bytes=2048, join_timeout_s=60)
    engine = SGLangEngine(receiver, StubTokenizer(), engine_id="sglang-0")
    relax_sub = WeightSubscriber(bus, unique, member_id="hf-0", rendezvous=pub.rendezvous)
    server_sub = ServerSubscriber(bus, unique, member_id="sglang-0", target=engine,
                                  rendezvous=pub.rendezvous)
    try:
        relax_sub.start()
        server_sub.start()
        assert sorted(pub.wait_for_members(2, 60)) == ["hf-0", "sglang-0"]
        for v in (1, 2):
            with torch.no_grad():
                for t in params.values():
                    t.add_(float(v))
            stats = pub.publish(params, v).result()
            assert stats.error is None and sorted(stats.members) == ["hf-0", "sglang-0"]
            assert server_sub.wait_for(v, 60) == v and relax_sub.wait_for(v, 60) == v
            got, meta = _dump(engine, tmp_path / f"v{v}.safetensors")
            assert meta["weight_version"] == str(v) and "paused" not in meta
            assert sorted(got) == sorted(params)
            for name, t in params.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        version, mine = relax_sub.latest()
        assert version == 2 and all(torch.equal(mine[k], params[k]) for k in params)
        assert engine.policy_version == 2
        assert server_sub.stats.history == [(1, "broadcast"), (2, "broadcast")]
        assert server_sub.stats.received == 2 and server_sub.stats.checksum_failures == 0
        assert server_sub.latest() is None  # the bytes went to the server, not here
    finally:
        server_sub.close()
        relax_sub.close()
        pub.close()


def test_a_server_with_tp_ranks_joins_and_leaves_under_consecutive_ids(bus, unique):
    pub = WeightPublisher(bus, unique)
    engine = SGLangEngine("http://127.0.0.1:9", StubTokenizer(), tp_size=3)
    sub = ServerSubscriber(bus, unique, member_id="sg", target=engine)
    other = WeightSubscriber(bus, unique, member_id="hf")
    try:
        assert not sub.catch_up and not sub.reads_shm  # the server loads nothing through us
        sub._connect(pub.rendezvous)
        other._connect(pub.rendezvous)
        assert pub.members() == ["sg", "sg/tp1", "sg/tp2", "hf"]
        sub._store.append("relax/membership", sub._log_lines("-"))
        assert pub.members() == ["hf"]
    finally:
        sub.close()
        other.close()
        pub.close()


def test_a_server_that_fails_an_update_rejoins_and_gets_the_next_version(
        bus, unique, tmp_path, receiver):
    """The server answers ``success: false`` to v2's first bucket without receiving it:
    the publisher's broadcast of v2 fails after its group timeout, the subscriber counts
    v2 skipped and registers again, and v3 goes to both members in a new group."""
    params = {"w": torch.arange(600, dtype=torch.float32), "b": torch.ones(100)}
    # the subscribers give up on v2 (5 s) before the publisher does (10 s), so both are
    # registered again and waiting when v3's group forms
    pub = WeightPublisher(bus, unique, bucket_bytes=1024, join_timeout_s=10)
    engine = SGLangEngine(receiver, StubTokenizer(), engine_id="sglang-0")
    relax_sub = WeightSubscriber(bus, unique, member_id="hf-0", rendezvous=pub.rendezvous,
                                 join_timeout_s=5)
    server_sub = ServerSubscriber(bus, unique, member_id="sglang-0", target=engine,
                                  rendezvous=pub.rendezvous, join_timeout_s=5)
    try:
        relax_sub.start()
        server_sub.start()
        pub.wait_for_members(2, 60)
        assert pub.publish(params, 1).result().error is None
        assert server_sub.wait_for(1, 60) == 1
        engine._post("/fail_next", {})
        params["w"] += 1.0
        first = pub.publish(params, 2).result()
        assert first.error is not None and "v2" in first.error
        params["w"] += 1.0
        again = pub.publish(params, 3).result()
        assert again.error is None and sorted(again.members) == ["hf-0", "sglang-0"]
        assert again.group_name != first.group_name
        assert server_sub.wait_for(3, 60) == 3 and relax_sub.wait_for(3, 60) == 3
        got, meta = _dump(engine, tmp_path / "v3.safetensors")
        assert meta["weight_version"] == "3" and torch.equal(got["w"], params["w"])
        assert server_sub.stats.skipped == 1
        assert [v for v, _ in server_sub.stats.history] == [1, 3]
    finally:
        server_sub.close()
        relax_sub.close()
        pub.close()
