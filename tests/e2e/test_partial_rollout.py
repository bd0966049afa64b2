"""Partial rollout (issue 52): a weight swap lands inside one generation, and the tokens
keep the version that produced them.

* HF engine, the whole pipeline (every stage its own process, the real broker, the tiny
  model), ``rollout.partial_rollout`` with ``chunk_tokens`` well below
  ``max_new_tokens``: generations long enough that the trainer waits for them, so new
  weights arrive while a group is being sampled (as in a real run, where generation is
  the long part; when it is shorter than a trainer step, every group starts on the
  newest weights and none spans two). Rows carry two versions in
  ``token_policy_versions``, and the trainer measures each row's staleness from its
  oldest token (``schemas.versions.staleness``).
* SGLang engine against a stand-in server (``tests/fake_sglang.py``): a weight update
  that pauses generation in ``abort`` mode ends the running requests; the engine sends
  them again after the update and joins the parts, so none is dropped.
"""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from fake_sglang import FakeSGLang, version_of
from stagerun import StageRunner, publish_prompts, wait_for
from testdata import prompt_rows, tiny_recipe

from relax.schemas import metric_names as M
from relax.schemas import topics
from relax.schemas.v1 import ROLLOUTS
from relax.schemas.validate import validate
from relax.schemas.versions import admit_batch, staleness
from relax.streams.client import BusConfig
from relax.streams.read import read_table
from relax.trainer import checkpoint
from relax.trainer.ledger import Ledger

pytestmark = [pytest.mark.e2e]

STEPS = 6


def _check_versions(r: dict) -> list[int]:
    """A row's per-token versions, checked against its other version columns."""
    v = r["token_policy_versions"]
    assert v is not None and len(v) == len(r["response_ids"]), r["rollout_id"]
    assert v == sorted(v) and (v[0], v[-1]) == (r["policy_version_start"],
                                                r["policy_version_end"]), (r["rollout_id"], v)
    return v


@pytest.mark.usefixtures("local_ray")
def test_a_partial_rollout_run_splits_generations_and_counts_staleness_per_token(
        broker, tmp_path):
    from relax.infra.control.launch import train

    run = "partial" + uuid.uuid4().hex[:6]
    recipe = tiny_recipe(broker, tmp_path, run, "rollout.partial_rollout=true",
                         "rollout.chunk_tokens=8", "rollout.max_new_tokens=128",
                         f"trainer.steps={STEPS}", "trainer.keep_checkpoints=10")
    lines: list[str] = []
    s = train(recipe, say=lines.append, timeout_s=500)
    assert s["steps"] == STEPS and s["balanced"], (s, lines)
    assert s["trained"] + s["stale"] + s["filtered"] + s["errors"] == s["sampled"] > 0, s

    bus = BusConfig(bootstrap_servers=broker)
    samples = {r["rollout_id"]: r for r in read_table(bus, f"{run}.train_samples").to_pylist()}
    versions = {rid: _check_versions(r) for rid, r in samples.items()}
    mixed = [rid for rid, v in versions.items() if len(set(v)) > 1]
    assert mixed, f"no row of {len(samples)} spans a weight swap"

    # the staleness the trainer decided each row with counts from its oldest token
    ledger = Ledger.load(checkpoint.latest(Path(s["run_dir"])) / "ledger.parquet")
    decided = {rid: (o, v, st) for rid, (o, v, st) in ledger.items() if o in ("trained", "stale")}
    assert len(decided) == s["trained"] + s["stale"], (len(decided), s)
    for rid, (outcome, version, st) in decided.items():
        r = samples[rid]
        want = staleness(version, r["policy_version_start"], versions[rid])
        assert st == want == version - min(versions[rid]), (rid, outcome, version, st)
        assert (outcome == "trained") == (st <= recipe.trainer.max_staleness), (rid, st)
    assert [rid for rid in mixed if decided.get(rid, ("",))[0] == "trained"], \
        "no row that spans a swap was trained"
    # ... and so does the step's staleness histogram the trainer reported
    per_step: dict[int, Counter] = defaultdict(Counter)
    for outcome, version, st in decided.values():
        if outcome == "trained":
            per_step[version + 1][st] += 1
    metrics = read_table(bus, f"{run}.metrics").to_pylist()
    reported: dict[int, Counter] = defaultdict(Counter)
    for m in metrics:
        if m["component"] == "trainer" and m["name"].startswith(M.STALENESS_HIST_PREFIX):
            k = int(m["name"][len(M.STALENESS_HIST_PREFIX):])
            reported[m["policy_version"]][k] += int(m["value"])
    assert reported == per_step


def test_sglang_requests_aborted_by_a_weight_update_are_continued_not_dropped(bus, unique):
    """The rollout stage on an SGLang engine, on the real broker: 4 groups of 4 in one
    generate call; a weight update (what the ServerSubscriber does, from its own thread)
    pauses the server in ``abort`` mode while every request runs. All 16 rollouts come out
    whole (``length``, none ``abort``), each token with the version the server produced it
    with, and the aggregator keeps every one of them (no ``error_rollout``)."""
    from relax.consumers.aggregate_config import AdvantageConfig
    from relax.consumers.rollout.config import RolloutConfig
    from relax.consumers.rollout.stage import RolloutStage
    from relax.consumers.samples import build_train_samples
    from relax.streams.weights.layout import build_manifest, manifest_rows

    fake = FakeSGLang(tick_s=0.01, hold_at=16 * 5, stop_every=10_000)  # ends by length
    publish_prompts(bus, unique, prompt_rows(4, dataset=unique))
    cfg = RolloutConfig(run=unique, dataset=unique, model="tiny-llama",
                        engine="sglang", sglang_url=fake.url, follow_weights=False,
                        group_size=4, batch_groups=4, max_staleness=1, groups_per_generate=4,
                        max_new_tokens=24, metrics_every_s=0.5)
    stage = RolloutStage(cfg, bus)
    runner = StageRunner(stage)
    ann = {"policy_version": 1, "manifest": manifest_rows(build_manifest({"w": torch.zeros(4)})),
           "bucket_bytes": 1 << 20, "group_name": "g"}
    try:
        fake.wait_tokens(16 * 5)
        assert stage.engine.receive_weights(ann, pause_mode="abort") == 1
        wait_for(lambda: runner.check() or stage.stats.groups >= 4, what="4 groups")
    finally:
        runner.stop()
        fake.close()
    assert fake.pauses == ["abort"] and fake.aborted == 16 and stage.engine.policy_version == 1

    table = read_table(bus, topics.run_topic(unique, "rollouts"))
    validate(table, "rollouts")
    rows = table.to_pylist()
    assert len(rows) == 16 and {r["finish_reason"] for r in rows} == {"length"}
    for r in rows:
        v = _check_versions(r)
        assert len(v) == 24 and v == [version_of(lp) for lp in r["logprobs"]], r["rollout_id"]
        assert v[0] == 0 and v[-1] == 1
    groups = defaultdict(list)
    for r in rows:
        groups[r["group_id"]].append(r)
    adv = AdvantageConfig(rewards={"parity": 1.0})
    for gid, rs in groups.items():
        rewards = {r["rollout_id"]: {"parity": (float(r["sample_index"] % 2), None)} for r in rs}
        ts = build_train_samples(pa.Table.from_pylist(rs, schema=ROLLOUTS), rewards, None, adv)
        assert ts.column("drop_reason").to_pylist() == [None] * 4, gid
        assert ts.column("token_policy_versions").to_pylist() == [r["token_policy_versions"]
                                                                   for r in rs]
    # the trainer at v1 admits them with max_staleness 1: staleness from the v0 tokens
    got = admit_batch(1, [r["policy_version_start"] for r in rows],
                      [r["policy_version_end"] for r in rows], 1,
                      [r["token_policy_versions"] for r in rows])
    assert all(a.admitted and a.staleness == 1 for a in got)
