"""Weight channel: flat layout, checksums, safetensors checkpoints, a real gloo
broadcast from a publisher to subscriber processes (with a late joiner), and the
same-host transport (``relax.streams.weights.shm``): subscribers that share the
publisher's ``/dev/shm`` read each version from a file there, the others (here: a
process in a mount namespace with its own tmpfs) get the broadcast."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from relax.streams.weights.announce import AnnouncementReader, newest_rows
from relax.streams.weights.files import read_safetensors_flat, write_safetensors
from relax.streams.weights.install import install_weights
from relax.streams.weights.layout import (
    build_manifest,
    checksum,
    flatten_into,
    manifest_rows,
    plan_buckets,
    total_bytes,
    views,
)
from relax.streams.weights.publisher import WeightPublisher
from relax.streams.weights.rendezvous import replay_membership
from relax.streams.weights.shm import ShmFiles, ShmOffer, sees_offer
from relax.streams.weights.subscriber import WeightSubscriber


def _announcements(bus, run: str, n: int, timeout_s: float = 30.0) -> list[dict]:
    """The first ``n`` announcement rows of ``<run>.weights`` (each validated on read)."""
    reader = AnnouncementReader(bus, run)
    rows: list[dict] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(rows) < n and time.monotonic() < deadline:
            rows += reader.poll(0.5)
    finally:
        reader.close()
    return rows


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb": torch.randn(10, 4, generator=g),
        "half": torch.randn(3, 3, generator=g).to(torch.bfloat16),
        "steps": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def test_manifest_is_aligned_and_contiguous():
    m = build_manifest(_tensors())
    assert [e.name for e in m] == ["steps", "emb", "half", "mask"]  # element size 8, 4, 2, 1
    for e in m:
        assert e.offset % torch.tensor([], dtype=getattr(torch, e.dtype)).element_size() == 0
    assert [e.offset for e in m] == [0, 40, 200, 218] and total_bytes(m) == 221
    with pytest.raises(ValueError, match="empty"):
        build_manifest({})
    with pytest.raises(ValueError, match="not supported"):
        build_manifest({"c": torch.zeros(2, dtype=torch.complex64)})


def test_buckets_hold_whole_tensors():
    m = build_manifest({"a": torch.zeros(100), "b": torch.zeros(10), "c": torch.zeros(30)})
    assert plan_buckets(m, 160) == [(0, 400, [0]), (400, 560, [1, 2])]  # a (400 B) travels alone
    assert plan_buckets(m, 10_000) == [(0, 560, [0, 1, 2])]
    with pytest.raises(ValueError):
        plan_buckets(m, 0)


def test_flat_roundtrip_and_checksum_detects_one_flipped_bit():
    t = _tensors()
    m = build_manifest(t)
    flat = torch.empty(total_bytes(m), dtype=torch.uint8)
    flatten_into(flat, t, m)
    for name, v in views(flat, m).items():
        assert torch.equal(v, t[name])
    digest = checksum(flat)
    assert digest.startswith("crc32c:") and len(digest) == 15
    flat[100] ^= 1
    assert checksum(flat) != digest
    with pytest.raises(ValueError, match="manifest says"):
        flatten_into(flat, {**t, "emb": torch.zeros(4, 10)}, m)


def test_safetensors_checkpoint_is_the_flat_stream(tmp_path):
    from safetensors.torch import load_file

    t = _tensors()
    m = build_manifest(t)
    flat = torch.empty(total_bytes(m), dtype=torch.uint8)
    flatten_into(flat, t, m)
    write_safetensors(tmp_path / "model.safetensors", flat, m, {"policy_version": "7"})
    loaded = load_file(tmp_path / "model.safetensors")
    assert set(loaded) == set(t) and all(torch.equal(loaded[k], t[k]) for k in t)
    back, m2 = read_safetensors_flat(tmp_path / "model.safetensors")
    assert m2 == m and checksum(back) == checksum(flat)


def test_membership_log_replays_joins_and_leaves_in_order():
    assert replay_membership(b"+a\n+b\n-a\n+c\n+a\n+b\n") == ["b", "c", "a"]
    assert replay_membership(b"") == []


def test_publish_rejects_old_versions_and_changed_tensors(bus, unique, tmp_path):
    pub = WeightPublisher(bus, unique, checkpoint_dir=tmp_path)
    try:
        w = {"w": torch.ones(3)}
        stats = pub.publish(w, 1).result()
        assert stats.members == [] and stats.checkpoint_uri.endswith("v00000001")
        with pytest.raises(ValueError, match="not newer"):
            pub.publish(w, 1)
        with pytest.raises(ValueError, match="differ"):
            pub.publish({"w": torch.ones(4)}, 2)
    finally:
        pub.close()
    rows = _announcements(bus, unique, 2)
    assert [r["transport"] for r in rows] == ["gloo", "checkpoint"]
    assert [r["policy_version"] for r in rows] == [1, 1]
    assert rows[0]["checkpoint_uri"] is None and rows[1]["checkpoint_uri"] == stats.checkpoint_uri
    assert rows[0]["checksum"] == rows[1]["checksum"] and rows[0]["total_bytes"] == 12


def test_only_the_newest_checkpoints_stay_on_disk(bus, unique, tmp_path):
    model = torch.nn.Linear(4, 3)
    pub = WeightPublisher(bus, unique, checkpoint_dir=tmp_path / "ckpt", keep_checkpoints=2)
    try:
        for v in (1, 2, 3, 4):
            pub.publish(dict(model.named_parameters()), v).result()
    finally:
        pub.close()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["v00000003", "v00000004"]
    with pytest.raises(ValueError, match="keep_checkpoints"):
        WeightPublisher(bus, unique, checkpoint_dir=tmp_path / "x", keep_checkpoints=0)


def test_checkpoint_catch_up_and_checksum_failure(bus, unique, tmp_path):
    """A subscriber with no group catches up from the newest checkpoint into a plain
    module (the reference stage's use); a corrupted checkpoint is refused."""
    model = torch.nn.Linear(4, 3)
    pub = WeightPublisher(bus, unique, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2)
    published = {}
    try:
        for v in (1, 2, 3):
            with torch.no_grad():
                model.weight.add_(1.0)
            published[v] = model.weight.detach().clone()
            pub.publish(dict(model.named_parameters()), v).result()
    finally:
        pub.close()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["v00000001", "v00000002"]
    target = torch.nn.Linear(4, 3)
    with WeightSubscriber(bus, unique, member_id="ref") as sub:
        assert sub.wait_for(2, 30) == 2
        assert sub.apply(target) == 2 and sub.apply(target) is None
    assert torch.equal(target.weight, published[2]) and torch.equal(target.bias, model.bias)
    path = tmp_path / "ckpt" / "v00000002" / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with WeightSubscriber(bus, unique, member_id="ref2") as sub:
        deadline = time.monotonic() + 30
        with pytest.raises(RuntimeError, match="stopped") as err:
            while time.monotonic() < deadline:
                sub.poll(0.2)
        assert "checksum" in str(err.value.__cause__)
        assert sub.stats.checksum_failures == 1


def test_newest_rows_keeps_the_newest_of_each_transport_in_order():
    def row(v, transport, uri="x"):
        return {"policy_version": v, "transport": transport,
                "checkpoint_uri": uri if transport != "gloo" else None}

    rows = [row(0, "checkpoint"), row(1, "gloo"), row(1, "shm"), row(2, "gloo"),
            row(10, "checkpoint"), row(2, "shm"), row(3, "gloo"), row(5, "checkpoint", None)]
    assert newest_rows(rows) == [rows[4], rows[5], rows[6]]
    assert newest_rows([]) == []
    restarted = [row(10, "checkpoint"), row(0, "checkpoint"), row(1, "gloo")]  # from v0 again
    assert newest_rows(restarted) == restarted[1:]


@pytest.mark.parametrize("same_host", [False, True], ids=["remote", "same-host"])
def test_a_late_joiner_past_the_snapshot_window_loads_the_newest_kept_snapshot(
        bus, unique, tmp_path, same_host):
    """A subscriber that starts after the store's retention deleted the early snapshots
    (issue 52: a rollout instance restarted at step 45 went through the history's
    checkpoint announcements in order, loaded v0's deleted snapshot, and the run died)
    reads the whole announcement history, loads the newest kept snapshot or the
    same-host file, and never touches a deleted one. Run past the window: 40 versions,
    3 kept."""
    model = torch.nn.Linear(4, 3)
    store = tmp_path / "ckpt"
    (tmp_path / "shm").mkdir()
    pub = WeightPublisher(bus, unique, checkpoint_dir=store, checkpoint_every=1,
                          keep_checkpoints=3, shm_root=tmp_path / "shm" if same_host else None)
    target = torch.nn.Linear(4, 3)
    # an engine there from the start: same-host files announced for it (in the run of
    # the issue, that made the late joiner skip its catch-up and walk the history)
    early = WeightSubscriber(bus, unique, member_id="early",
                             rendezvous=pub.rendezvous).start()
    try:
        for v in range(1, 41):
            with torch.no_grad():
                model.weight.add_(1.0)
            pub.publish(dict(model.named_parameters()), v).result()
        assert early.wait_for(40, 30) == 40
        assert sorted(p.name for p in store.iterdir()) == [
            "v00000038", "v00000039", "v00000040"]
        with WeightSubscriber(bus, unique, member_id="late") as sub:
            assert sub.wait_for(40, 60) == 40
            assert sub.apply(target) == 40 and sub.error is None
            loaded = [v for v, how in sub.stats.history if how == "checkpoint"]
            assert all(v >= 38 for v in loaded), sub.stats.history
            assert same_host or loaded, sub.stats.history
    finally:
        early.close()
        pub.close()
    assert torch.equal(target.weight, model.weight)


def test_a_trainer_restarted_from_an_older_checkpoint_replaces_the_dead_ones_snapshots(
        bus, unique, tmp_path):
    """A trainer restarted from a checkpoint older than its last published version (with
    ``checkpoint_every: 0``, from the base model) publishes those version numbers again
    with other weights. The dead trainer's snapshots from its start on are deleted (a
    staleness run's restart had left v10 there: its bytes failed the new announcement's
    checksum and the engine stopped; retention also kept them over the new trainer's own);
    an engine that held the dead trainer's v4 and one that starts after the restart both
    end on the new trainer's newest version."""
    store = tmp_path / "ckpt"
    model = torch.nn.Linear(4, 3)
    dead = WeightPublisher(bus, unique, checkpoint_dir=store, checkpoint_every=1,
                           keep_checkpoints=3)
    early = WeightSubscriber(bus, unique, member_id="early", rendezvous=dead.rendezvous,
                             join_timeout_s=3.0).start()
    try:
        for v in range(1, 5):
            with torch.no_grad():
                model.weight.add_(1.0)
            dead.publish(dict(model.named_parameters()), v).result()
        assert early.wait_for(4, 30) == 4
    finally:
        dead.close()
    assert sorted(p.name for p in store.iterdir()) == ["v00000002", "v00000003", "v00000004"]
    restarted = torch.nn.Linear(4, 3)  # the base model: other weights for v0-v2
    new = WeightPublisher(bus, unique, checkpoint_dir=store, checkpoint_every=1,
                          keep_checkpoints=3)
    try:
        for v in range(0, 3):
            with torch.no_grad():
                restarted.weight.sub_(1.0)
            new.publish(dict(restarted.named_parameters()), v).result()
        assert sorted(p.name for p in store.iterdir()) == ["v00000000", "v00000001", "v00000002"]
        with WeightSubscriber(bus, unique, member_id="late") as late:
            deadline = time.monotonic() + 60
            for sub in (early, late):
                while time.monotonic() < deadline:
                    got = sub.latest()
                    if got is not None and got[0] == 2 \
                            and torch.equal(got[1]["weight"], restarted.weight):
                        break
                    sub.poll(0.2)  # raises if it stopped (a checksum failure)
                assert sub.latest()[0] == 2, sub.stats
                assert torch.equal(sub.latest()[1]["weight"], restarted.weight), sub.stats
                assert sub.stats.checksum_failures == 0
    finally:
        early.close()
        new.close()


def test_a_version_only_announcement_is_read_as_the_trainers_version_and_carries_no_weights(
        bus, unique, tmp_path):
    """``announce_version`` (a colocated trainer with no other weight subscriber): the
    reader's latest_version follows it, a subscriber neither takes nor waits on it, and
    nothing is written: no snapshot, no send buffer."""
    pub = WeightPublisher(bus, unique, checkpoint_dir=None)
    try:
        for v in (0, 1, 2):
            pub.announce_version(v)
        rows = _announcements(bus, unique, 3)
        assert [(r["policy_version"], r["transport"], r["total_bytes"]) for r in rows] == [
            (0, "version", 0), (1, "version", 0), (2, "version", 0)]
        assert newest_rows(rows) == [] and pub.history == []
        reader = AnnouncementReader(bus, unique)
        try:
            reader.poll_backlog(5.0)
            assert reader.latest_version == 2
        finally:
            reader.close()
        with WeightSubscriber(bus, unique, member_id="s", join_timeout_s=3.0) as sub:
            time.sleep(3.0)
            assert sub.poll(0.5) is None and sub.version is None and sub.error is None
            assert sub.stats.skipped == 0
        with pytest.raises(ValueError, match="policy_version"):
            pub.announce_version(-1)
    finally:
        pub.close()


def test_a_joiner_after_the_trainer_died_loads_its_snapshot_and_takes_the_next_one(
        bus, unique, tmp_path):
    """A subscriber that starts while the newest announcement is a dead publisher's (a
    resumed run: the driver and its trainer died) takes that publisher for gone once,
    loads its newest snapshot, never tries its store again, and gets the next trainer's
    versions (it raised, and its stage restarted, before)."""
    code = textwrap.dedent(f"""
        import torch
        from relax.streams.client import BusConfig
        from relax.streams.weights.publisher import WeightPublisher
        pub = WeightPublisher(BusConfig(bootstrap_servers={bus.bootstrap_servers!r}),
                              {unique!r}, checkpoint_dir={str(tmp_path / "ckpt")!r},
                              checkpoint_every=1)
        model = torch.nn.Linear(4, 3)
        for v in (1, 2):
            pub.publish(dict(model.named_parameters()), v).result()
        pub.close()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)  # then gone
    model = torch.nn.Linear(4, 3)
    with WeightSubscriber(bus, unique, member_id="late", join_timeout_s=3.0) as sub:
        assert sub.wait_for(2, 60) == 2 and sub.error is None
        time.sleep(8)  # a second try of the dead store (3 s, retried once) would end by now
        assert sub.stats.skipped == 1 and sub.error is None  # one try of the dead store
        new = WeightPublisher(bus, unique, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1)
        try:
            new.publish(dict(model.named_parameters()), 3).result()
            assert sub.wait_for(3, 60) == 3 and sub.error is None
        finally:
            new.close()


def test_a_late_joiner_gets_the_current_version_while_the_trainer_waits(bus, unique, tmp_path):
    """A subscriber that registers after the newest version was broadcast (a restarted
    engine while the trainer waits for its samples) gets that version from a snapshot
    the publisher writes for it, without a next version (issue 12: a chaos run waited
    for weights that only its own samples would have produced)."""
    model = torch.nn.Linear(4, 3)
    pub = WeightPublisher(bus, unique, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=100)
    target = torch.nn.Linear(4, 3)
    try:
        for v in (1, 2):  # v1 is snapshotted (the first version), v2 is not due
            with torch.no_grad():
                model.weight.add_(1.0)
            pub.publish(dict(model.named_parameters()), v).result()
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["v00000001"]
        with WeightSubscriber(bus, unique, member_id="late") as sub:
            assert sub.wait_for(2, 30) == 2
            assert sub.apply(target) == 2
    finally:
        pub.close()
    assert torch.equal(target.weight, model.weight) and torch.equal(target.bias, model.bias)


_SUBSCRIBER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    from safetensors.torch import save_file
    from relax.consumers.engines.base import SamplingParams
    from relax.consumers.engines.hf import HFEngine
    from relax.streams.client import BusConfig
    from relax.streams.weights.layout import build_manifest, checksum, flatten_into, total_bytes
    from relax.streams.weights.subscriber import WeightSubscriber

    bootstrap, run, member, rdv, out, mode = sys.argv[1:7]
    out = Path(out)
    engine = HFEngine("tiny-llama", device="cpu", partial_rollout=(mode == "partial"),
                      chunk_tokens=4, stop_token_ids=(), use_default_stop_ids=False)
    if mode == "late":  # load early; subscribe only once told to
        while not (out / (member + ".go")).exists():
            time.sleep(0.05)
    T0 = time.time()
    def mark(what):
        print(member, what, round(time.time() - T0, 2), file=sys.stderr, flush=True)
    sub = WeightSubscriber(BusConfig(bootstrap_servers=bootstrap), run, member_id=member,
                           target=engine, rendezvous=rdv or None).start()
    mark("started")
    result = {}
    sub.wait_for(2, 180)
    mark("v2")
    engine.apply_pending()
    assert engine.policy_version == 2, engine.policy_version
    (out / (member + ".v2")).touch()
    if mode == "partial":
        calls = []
        def hook(e):
            calls.append(1)
            if len(calls) == 3:  # after the 2nd chunk: wait until v3 is staged
                (out / (member + ".waiting")).touch()
                deadline = time.time() + 180
                while e.pending_version != 3 and time.time() < deadline:
                    time.sleep(0.01)
        engine.safe_point_hook = hook
        g, = engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=14, seed=0))
        engine.safe_point_hook = None
        result["sample_versions"] = g.token_policy_versions
    sub.wait_for(3, 180)
    mark("v3")
    engine.apply_pending()
    named = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    m = build_manifest(named)
    flat = torch.empty(total_bytes(m), dtype=torch.uint8)
    flatten_into(flat, named, m)
    save_file(named, str(out / (member + ".safetensors")))
    result.update(version=engine.policy_version, checksum=checksum(flat),
                  history=sub.stats.history, failures=sub.stats.checksum_failures,
                  blocked_s=engine.stats.swap_blocked_s)
    mark("saved")
    sub.close()
    mark("closed")
    (out / (member + ".json")).write_text(json.dumps(result))
""")


def _wait_file(path: Path, procs, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        for p in procs:
            if p.poll() not in (None, 0):
                raise AssertionError(f"subscriber exited {p.returncode} (its stderr is above)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} not written in {timeout_s}s")
        time.sleep(0.05)


def test_gloo_broadcast_to_two_subscriber_processes_and_a_late_joiner(bus, unique, tmp_path):
    """Publisher here, two subscriber processes (HF engines) joined before v1, a third
    started after v2: all end on v3 with bit-identical weights and verified checksums; the
    late joiner caught up from the v2 safetensors and joined the broadcast at v3; a sample
    generated across the v2 -> v3 swap (partial rollout) is tagged 8 x v2 then 6 x v3."""
    from relax.trainer.models import load_model

    script = tmp_path / "subscriber.py"
    script.write_text(_SUBSCRIBER)
    model = load_model("tiny-llama")
    params = dict(model.named_parameters())
    pub = WeightPublisher(
        bus, unique, checkpoint_dir=tmp_path / "ckpt", bucket_bytes=4 << 20, join_timeout_s=120
    )

    def spawn(member: str, mode: str, rendezvous: str) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                str(script),
                bus.bootstrap_servers,
                unique,
                member,
                rendezvous,
                str(tmp_path),
                mode,
            ],
            text=True,
        )

    def step(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)

    procs = [
        spawn("A", "partial", pub.rendezvous),
        spawn("B", "plain", pub.rendezvous),
        spawn("C", "late", ""),
    ]
    try:
        assert pub.wait_for_members(2, 180) == ["A", "B"] or set(pub.members()) == {"A", "B"}
        for v in (1, 2):
            step(v)
            stats = pub.publish(params, v).result()
            assert stats.error is None and sorted(stats.members) == ["A", "B"]
        for m in ("A", "B"):
            _wait_file(tmp_path / f"{m}.v2", procs)
        (tmp_path / "C.go").touch()
        pub.wait_for_members(3, 180)
        _wait_file(tmp_path / "C.v2", procs)
        _wait_file(tmp_path / "A.waiting", procs)
        step(3)
        stats = pub.publish(params, 3).result()
        assert stats.error is None and sorted(stats.members) == ["A", "B", "C"]
        for m in ("A", "B", "C"):
            _wait_file(tmp_path / f"{m}.json", procs)
        for p in procs:
            assert p.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        pub.close()

    from safetensors.torch import load_file

    ann = _announcements(bus, unique, 6)
    v3 = [a for a in ann if a["policy_version"] == 3 and a["transport"] == "gloo"][0]
    results = {m: json.loads((tmp_path / f"{m}.json").read_text()) for m in ("A", "B", "C")}
    for m, r in results.items():
        assert r["version"] == 3 and r["failures"] == 0
        assert r["checksum"] == v3["checksum"]
        got = load_file(tmp_path / f"{m}.safetensors")
        for name, p in params.items():
            assert torch.equal(got[name], p.detach()), (m, name)
    assert (
        results["A"]["history"]
        == results["B"]["history"]
        == [[1, "broadcast"], [2, "broadcast"], [3, "broadcast"]]
    )
    assert results["C"]["history"] == [[2, "checkpoint"], [3, "broadcast"]]
    assert results["A"]["sample_versions"] == [2] * 8 + [3] * 6


def test_rejected_update_leaves_the_staged_one_intact():
    """v1 staged, then v2 rejected partway (its first tensors fine, then a wrong shape; or
    a parameter left out; or an unknown name): the next swap installs exactly v1, as v1."""
    from relax.consumers.engines.hf import HFEngine

    engine = HFEngine("tiny-llama", device="cpu")
    v1 = {n: p.detach() + 0.01 for n, p in engine.model.named_parameters()}
    engine.update_weights(v1, 1)
    v2 = {n: t + 1.0 for n, t in v1.items()}
    last = list(v2)[-1]
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({**v2, last: torch.zeros(3)}, 2)
    with pytest.raises(ValueError, match="does not cover"):
        engine.update_weights({"model.norm.weight": v2["model.norm.weight"]}, 2)
    with pytest.raises(KeyError, match="nope"):
        engine.update_weights({**v2, "nope": torch.zeros(1)}, 2)
    assert engine.pending_version == 1
    assert engine.apply_pending() and engine.policy_version == 1
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, v1[n]), n


def test_install_into_a_module_checks_every_tensor_before_copying():
    """A bad update (a tensor that would broadcast into the wrong shape, an unknown name)
    is refused before any parameter changes."""
    model = torch.nn.Linear(4, 3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="bias"):
        install_weights(model, {"weight": torch.ones(3, 4), "bias": torch.ones(1)}, 2)
    with pytest.raises(KeyError, match="nope"):
        install_weights(model, {"weight": torch.ones(3, 4), "nope": torch.ones(1)}, 2)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def _checkpoint_row(tmp_path: Path, named: dict[str, torch.Tensor], version: int) -> dict:
    """Write ``named`` as the checkpoint of ``version``; its announcement row."""
    manifest = build_manifest(named)
    flat = torch.empty(total_bytes(manifest), dtype=torch.uint8)
    flatten_into(flat, named, manifest)
    folder = tmp_path / f"v{version}"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", flat, manifest)
    return {"policy_version": version, "checkpoint_uri": f"file://{folder}",
            "checksum": checksum(flat), "manifest": manifest_rows(manifest),
            "total_bytes": total_bytes(manifest), "bucket_bytes": 1 << 20}


def test_failed_receive_never_labels_a_half_written_buffer(bus, unique, tmp_path, monkeypatch):
    """v1 verified and not yet applied; then a checkpoint whose tensors differ from its
    announcement, and a broadcast that dies after writing part of the buffer: neither
    may hand out bytes or a manifest that are not v1's under the label v1."""
    from relax.streams.weights import subscriber as weights_subscriber

    model = torch.nn.Linear(4, 3)
    v1 = {n: p.detach().clone() for n, p in model.named_parameters()}
    sub = WeightSubscriber(bus, unique, member_id="m", catch_up=False)
    try:
        assert sub.load_checkpoint(_checkpoint_row(tmp_path, v1, 1)) == 1
        bad = _checkpoint_row(tmp_path, {"w": torch.ones(12), "b": torch.ones(3)}, 2)
        bad["manifest"] = manifest_rows(build_manifest({"x": torch.ones(15)}))  # 60 bytes too
        with pytest.raises(ValueError, match="differ"):
            sub.load_checkpoint(bad)
        version, got = sub.latest()
        assert version == 1 and got.keys() == v1.keys()
        assert all(torch.equal(got[n], v1[n]) for n in v1)

        def dies_midway(pg, tensor):
            tensor.fill_(0xFF)
            raise RuntimeError("peer went away")

        class Store:
            def append(self, key, value):
                pass

        monkeypatch.setattr(weights_subscriber, "broadcast", dies_midway)  # _receive looks here
        sub._store, sub._group, sub._pg = Store(), "g", object()  # as if in group g
        row = _checkpoint_row(tmp_path, {n: t + 1 for n, t in v1.items()}, 3)
        sub._receive({**row, "transport": "gloo"}, "g", ["m"])
        assert sub.stats.skipped == 1
        target = torch.nn.Linear(4, 3)
        before = {n: p.detach().clone() for n, p in target.named_parameters()}
        latest = sub.latest()
        assert latest is None or all(torch.equal(latest[1][n], v1[n]) for n in v1)
        assert sub.apply(target) in (None, 1)
        for n, p in target.named_parameters():
            assert torch.equal(p, before[n]) or torch.equal(p, v1[n]), n
    finally:
        sub.close()


def test_a_member_registered_again_since_the_group_formed_counts_as_rejoined():
    """A restarted subscriber registers under its predecessor's id: replaying the log
    does not show it, so the publisher reads what was appended since the group formed
    (the chaos run that wedged: the successor never got the newest weights)."""
    from relax.streams.weights.publisher import WeightPublisher

    pub = WeightPublisher.__new__(WeightPublisher)  # only the membership bookkeeping
    formed = b"+rollout-0\n+rollout-1\n"
    pub._members, pub._log_seen = ["rollout-0", "rollout-1"], len(formed)
    assert pub._rejoined(formed) == []
    assert pub._rejoined(formed + b"+rollout-1\n") == ["rollout-1"]
    assert pub._rejoined(formed + b"+rollout-2\n") == []  # new ids: the late-joiner path


def test_an_offer_is_seen_only_with_its_probe_and_its_buffers_are_shared_files(tmp_path):
    stale = tmp_path / "relax-weights-r-old"  # a killed trainer's folder of the same run
    stale.mkdir()
    other = tmp_path / "relax-weights-r-2-x"  # run "r-2"'s: left alone
    other.mkdir()
    offer = ShmOffer(tmp_path, "r", "new")
    assert not stale.exists() and other.exists()
    assert sees_offer(offer.offer) and sees_offer(offer.offer.encode())
    folder, _, nonce = offer.offer.partition("\n")
    assert not sees_offer(f"{folder}\n{nonce[::-1]}")  # another tmpfs holding that path
    assert not sees_offer(f"{tmp_path}/nowhere\n{nonce}") and not sees_offer(None)
    bufs = offer.buffers(1000)
    assert [b.numel() for b in bufs] == [1000, 1000]
    bufs[1].copy_(torch.arange(1000) % 251)  # what the publisher writes, another process reads
    mine = torch.zeros(1000, dtype=torch.uint8)
    files = ShmFiles()
    got, digest = files.copy_out(offer.path(1), 1000, mine)
    assert got.data_ptr() == mine.data_ptr() and torch.equal(got, bufs[1])
    assert digest == checksum(bufs[1])
    part, digest = files.copy_out(offer.path(1), 600, None)
    assert torch.equal(part, bufs[1][:600]) and digest == checksum(bufs[1][:600])
    bufs[1][7] += 1  # the next version written into the kept mapping's file is what is read
    got, digest = files.copy_out(offer.path(1), 1000, got)
    assert torch.equal(got, bufs[1]) and digest == checksum(bufs[1])
    with pytest.raises(ValueError, match="announcement says 2000"):
        files.copy_out(offer.path(1), 2000, None)
    assert offer.buffers(1 << 60) is None  # no room: nothing offered
    offer.close()
    assert not offer.folder.exists()
    with pytest.raises(FileNotFoundError):
        files.copy_out(offer.path(0), 1000, None)
    with pytest.raises(FileNotFoundError):  # a kept mapping of a removed file is not read
        files.copy_out(offer.path(1), 1000, None)
    files.close()


def test_a_same_host_late_joiner_reads_the_newest_file_and_a_torn_copy_is_dropped(
        bus, unique, tmp_path):
    """No checkpoint store: a subscriber on the publisher's host that starts after v1
    gets v1 from the same-host file announced for it, then v2 and v3 from the files
    announced at publish (no broadcast group). v1's file holds v3 by then: a copy of it
    under the label v1 fails the checksum and is dropped."""
    model = torch.nn.Linear(4, 3)
    (tmp_path / "shm").mkdir()
    pub = WeightPublisher(bus, unique, shm_root=tmp_path / "shm", join_timeout_s=30)
    target = torch.nn.Linear(4, 3)

    def step(v: int):
        with torch.no_grad():
            model.weight.add_(1.0)
        return pub.publish(dict(model.named_parameters()), v).result()

    try:
        assert step(1).members == []
        with WeightSubscriber(bus, unique, member_id="late") as sub:
            assert sub.wait_for(1, 30) == 1 and sub.apply(target) == 1
            assert torch.equal(target.weight, model.weight)
            for v in (2, 3):
                stats = step(v)
                assert stats.error is None and stats.members == stats.local == ["late"]
                assert pub.store.get(f"{stats.group_name}/members") == b""  # no broadcast
                assert sub.wait_for(v, 30) == v and sub.apply(target) == v
                assert torch.equal(target.weight, model.weight)
            assert sub.stats.history == [(1, "shm"), (2, "shm"), (3, "shm")]
            rows = [r for r in _announcements(bus, unique, 6) if r["transport"] == "shm"]
            assert [r["policy_version"] for r in rows] == [1, 2, 3]
            assert rows[0]["checkpoint_uri"] == rows[2]["checkpoint_uri"]  # two files in turn
            assert sub.load_shm(rows[0]) is None and sub.stats.skipped >= 1
            assert sub.latest() is None  # the receive buffer holds no whole version now
            assert sub.load_shm(rows[2]) == 3 and sub.latest()[0] == 3
    finally:
        pub.close()
    assert not list((tmp_path / "shm").iterdir())  # close removed the folder


def _private_tmpfs_works(path) -> bool:
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        f'mount -t tmpfs tmpfs "{path}"'], capture_output=True, check=False)
    return r.returncode == 0


def test_same_host_subscribers_read_the_file_others_get_the_broadcast(bus, unique, tmp_path):
    """A subscriber here reads every version from the same-host file; an HF engine in a
    process with its own tmpfs over the publisher's shm folder (another host, as far as
    /dev/shm goes) cannot see the probe and gets the gloo broadcast; both end on v3 with
    the publisher's bytes."""
    shm = tmp_path / "shm"
    shm.mkdir()
    if shutil.which("unshare") is None or not _private_tmpfs_works(shm):
        pytest.skip("needs unshare --mount and tmpfs mounts (root)")
    from relax.trainer.models import load_model

    script = tmp_path / "subscriber.py"
    script.write_text(_SUBSCRIBER)
    params = dict(load_model("tiny-llama").named_parameters())
    pub = WeightPublisher(bus, unique, shm_root=shm, bucket_bytes=4 << 20, join_timeout_s=120)
    mount = 'mount -t tmpfs tmpfs "$1" && shift && exec "$@"'
    remote = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "remote",
         str(shm), sys.executable, str(script), bus.bootstrap_servers, unique, "B",
         pub.rendezvous, str(tmp_path), "plain"], text=True)
    local = WeightSubscriber(bus, unique, member_id="A", rendezvous=pub.rendezvous).start()
    try:
        pub.wait_for_members(2, 180)
        for v in (1, 2, 3):
            g = torch.Generator().manual_seed(v)
            with torch.no_grad():
                for p in params.values():
                    p.add_(torch.randn(p.shape, generator=g) * 0.01)
            stats = pub.publish(params, v).result()
            assert stats.error is None and stats.members == ["A", "B"]
            assert pub.store.get(f"{stats.group_name}/members") == b"B"
            if v == 2:
                _wait_file(tmp_path / "B.v2", [remote])
        _wait_file(tmp_path / "B.json", [remote])
        assert remote.wait(timeout=60) == 0
        assert local.wait_for(3, 60) == 3
        version, got = local.latest()
    finally:
        if remote.poll() is None:
            remote.kill()
        local.close()
        pub.close()
    v3 = [a for a in _announcements(bus, unique, 6) if a["policy_version"] == 3]
    assert sorted(a["transport"] for a in v3) == ["gloo", "shm"]
    assert all(torch.equal(got[n], p.detach()) for n, p in params.items())
    assert local.stats.history == [(1, "shm"), (2, "shm"), (3, "shm")]
    result = json.loads((tmp_path / "B.json").read_text())
    assert result["history"] == [[1, "broadcast"], [2, "broadcast"], [3, "broadcast"]]
    assert result["checksum"] == v3[0]["checksum"] and result["failures"] == 0
