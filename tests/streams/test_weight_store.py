"""The weight snapshot store over the network: the publisher writes snapshots to an
S3-compatible server (moto's, started on loopback by the test) and a late subscriber
loads the newest one from there; announced URIs carry no credentials; the blob store
takes the same URIs."""

from __future__ import annotations

import time

import pytest
import torch
from testdata import s3_uri

from relax.streams.blobs import BlobStore
from relax.streams.fsuri import child_uri, public_uri
from relax.streams.weights.publisher import WeightPublisher
from relax.streams.weights.store import SnapshotStore, read_snapshot
from relax.streams.weights.subscriber import WeightSubscriber


def _uri(endpoint: str, prefix: str) -> str:
    return s3_uri(endpoint, f"relax-test/{prefix}")


def test_uris_keep_their_options_and_lose_their_credentials():
    u = "s3://key:secret@bucket/p?endpoint_override=h:9&scheme=http"
    assert public_uri(u) == "s3://bucket/p?endpoint_override=h:9&scheme=http"
    assert child_uri(public_uri(u), "v1") == "s3://bucket/p/v1?endpoint_override=h:9&scheme=http"
    assert child_uri("/tmp/x/", "v1") == "/tmp/x/v1" and public_uri("/tmp/x") == "/tmp/x"


def test_snapshots_on_s3_are_written_pruned_and_read_back(s3_endpoint, unique):
    # credentials in the store's URI are used to write, never announced
    store = SnapshotStore(_uri(s3_endpoint, f"{unique}/weights").replace(
        "s3://", "s3://test:test@"), keep=2)
    model = torch.nn.Linear(5, 3)
    from relax.streams.weights.layout import build_manifest, checksum, flatten_into, total_bytes

    tensors = dict(model.named_parameters())
    manifest = build_manifest(tensors)
    flat = torch.empty(total_bytes(manifest), dtype=torch.uint8)
    flatten_into(flat, tensors, manifest)
    for v in (1, 2, 3):
        uri = store.write(v, flat, manifest, {"policy_version": str(v)})
    assert store.versions() == [2, 3]
    assert uri.startswith(f"s3://relax-test/{unique}/weights/v00000003?") and "@" not in uri
    back, m2 = read_snapshot(uri)
    assert m2 == manifest and checksum(back) == checksum(flat)
    with pytest.raises(OSError):
        read_snapshot(child_uri(_uri(s3_endpoint, f"{unique}/weights"), "v00000001"))


def test_a_late_subscriber_loads_the_newest_snapshot_from_s3(bus, unique, s3_endpoint):
    """No shared disk: the publisher's snapshots are S3 objects, the late joiner reads
    them through the announced URI; its weights equal the trainer's bit for bit."""
    store = _uri(s3_endpoint, f"{unique}/weights")
    model = torch.nn.Linear(8, 4)
    pub = WeightPublisher(bus, unique, checkpoint_dir=store, checkpoint_every=1)
    try:
        for v in (1, 2):
            with torch.no_grad():
                model.weight.add_(1.0)
            stats = pub.publish(dict(model.named_parameters()), v).result()
        assert stats.checkpoint_uri.startswith("s3://relax-test/")
        got = {}

        class Engine:
            def update_weights(self, tensors, version):
                got[version] = {k: t.clone() for k, t in tensors.items()}

        sub = WeightSubscriber(bus, unique, member_id="late", target=Engine()).start()
        try:
            deadline = time.monotonic() + 60
            while 2 not in got:
                assert time.monotonic() < deadline, "no snapshot loaded"
                sub.poll(0.5)
            assert sub.stats.from_checkpoint >= 1
        finally:
            sub.close()
    finally:
        pub.close()
    for name, t in model.named_parameters():
        assert torch.equal(got[2][name], t.detach())


def test_blobs_on_s3_keep_the_store_options_in_their_uri(s3_endpoint, unique):
    store = BlobStore(_uri(s3_endpoint, f"{unique}/blobs"))
    uri = store.put(b"\x89PNG fake image bytes")
    assert "?endpoint_override=" in uri and uri.startswith(f"s3://relax-test/{unique}/blobs/")
    assert BlobStore.get(uri) == b"\x89PNG fake image bytes"
