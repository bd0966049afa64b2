"""Checkpoints in a store every host reaches (``trainer.checkpoint_store``): saved to an
S3-compatible server (moto's, on loopback), read back from another run folder (as a
trainer restarted on another host, or the driver's summary, would), pruned, never read
half-uploaded; and the placement warnings of a run across hosts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from testdata import s3_uri, train_sample_table

from relax.infra.recipe.recipe import load_recipe
from relax.infra.recipe.specs import disk_warnings, run_bus
from relax.streams.fsuri import open_uri
from relax.trainer import checkpoint
from relax.trainer.backends.torch_backend import TorchBackend
from relax.streams.codec import group_by_key
from relax.trainer.batching import micro_batches
from relax.trainer.config import TrainerConfig
from relax.trainer.ledger import Ledger

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _stepped(seed: int) -> TorchBackend:
    b = TorchBackend(TrainerConfig(optim={"lr": 1e-3}))
    groups = [g for _, g in group_by_key(train_sample_table(2, seed=seed), "group_id")]
    b.train_step(micro_batches(groups, 512))
    return b


def test_checkpoints_in_a_store_are_read_back_from_another_host(s3_endpoint, unique, tmp_path):
    store = s3_uri(s3_endpoint, f"relax-test/{unique}/checkpoints")
    trainer_host, other_host = tmp_path / "a", tmp_path / "b"
    b = _stepped(seed=4)
    ledger = Ledger()
    for v in (1, 2, 3):
        ledger.record(f"r{v}", "trained", v)
        uri = checkpoint.save(trainer_host, b, checkpoint.TrainerState(v, counters={"n": v}),
                              ledger, keep=2, store=store)
        assert uri == s3_uri(s3_endpoint, f"relax-test/{unique}/checkpoints/step_{v:06d}")
    # nothing stays on the trainer's disk; the store keeps the newest two
    assert [p.name for p in (trainer_host / "checkpoints").iterdir()] == []
    fs, base = open_uri(store)
    assert checkpoint._complete(fs, base) == ["step_000002", "step_000003"]

    got = checkpoint.latest(other_host, store)
    assert got == other_host / "checkpoints" / "store" / "step_000003"
    b2 = TorchBackend(TrainerConfig(optim={"lr": 1e-3}))
    state, ledger2 = checkpoint.load(got, b2)
    assert (state.policy_version, state.counters) == (3, {"n": 3})
    assert ledger2.ids() == {"r1", "r2", "r3"}
    for k, v in b.named_tensors().items():
        assert torch.equal(v, b2.named_tensors()[k]), k
    assert b2.steps_done == 1
    s1 = b.optimizer.state_dict()["state"]
    s2 = b2.optimizer.state_dict()["state"]
    assert s1.keys() == s2.keys() and all(
        torch.equal(s1[i]["exp_avg"], s2[i]["exp_avg"]) for i in s1)

    part = checkpoint.latest(other_host, store, files=("ledger.parquet", checkpoint.STATE_FILE))
    assert sorted(p.name for p in part.iterdir()) == ["ledger.parquet", checkpoint.STATE_FILE]

    # an upload cut off before its state file (the last one written) is never read
    fs.delete_file(f"{base}/step_000003/{checkpoint.STATE_FILE}")
    assert checkpoint.latest(other_host, store).name == "step_000002"
    assert json.loads((checkpoint.latest(other_host, store) / checkpoint.STATE_FILE)
                      .read_text())["policy_version"] == 2


def test_the_final_model_goes_to_the_store_and_comes_back(s3_endpoint, unique, tmp_path):
    store = s3_uri(s3_endpoint, f"relax-test/{unique}/checkpoints")
    b = _stepped(seed=5)
    b.save_model(tmp_path / "a" / "final_model")
    checkpoint.upload_folder(tmp_path / "a" / "final_model", store, checkpoint.FINAL_MODEL)
    got = checkpoint.download(store, checkpoint.FINAL_MODEL, tmp_path / "b" / "final_model")
    assert sorted(p.name for p in got.iterdir()) == sorted(
        p.name for p in (tmp_path / "a" / "final_model").iterdir())
    for f in got.iterdir():
        assert f.read_bytes() == (tmp_path / "a" / "final_model" / f.name).read_bytes(), f.name
    assert checkpoint.download(store, "absent", tmp_path / "c") is None
    assert pafs.LocalFileSystem().get_file_info(str(tmp_path / "c")).type \
        == pafs.FileType.NotFound


def _recipe(*overrides: str):
    return load_recipe(RECIPES / "tiny_ci.yaml", list(overrides))


@pytest.mark.parametrize(("overrides", "nodes", "keys"), [
    ((), {"trainer": "h1", "rollout-0": "h1"}, []),
    ((), {"trainer": "h1", "rollout-0": "h2"},
     ["bus.blob_store", "trainer.weights_store"]),
    ((), {"trainer": "h2", "rollout-0": "h1"},
     ["bus.blob_store", "trainer.weights_store", "trainer.checkpoint_store"]),
    (("bus.blob_store=s3://b/x", "trainer.weights_store=s3://b/w",
      "trainer.checkpoint_store=s3://b/c"), {"trainer": "h2", "rollout-0": "h1"}, []),
])
def test_a_run_across_hosts_names_each_folder_only_one_host_has(overrides, nodes, keys):
    r = _recipe(*overrides)
    lines = disk_warnings(r, run_bus(r, "k:1", Path("runs/x")), nodes, here="h1")
    assert [line.split(":")[0] for line in lines] == keys, lines
