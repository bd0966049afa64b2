"""Reference stage: ref log-probs equal the rollout engine's on the same weights (C12),
masks from lengths (C24), the stage on the broker, following the policy every N versions."""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pytest
import torch

from relax.consumers.engines.base import SamplingParams
from relax.consumers.engines.hf import HFEngine
from relax.consumers.reference import ReferenceStage, ref_batch, response_logprobs
from relax.consumers.reference_config import ReferenceConfig
from relax.schemas import topics
from relax.schemas.v1 import ROLLOUTS
from relax.schemas.validate import validate
from relax.streams.client import ensure_topics
from relax.streams.producer import BatchProducer
from relax.streams.read import read_table


@pytest.fixture(scope="module")
def engine():
    return HFEngine("tiny-llama", device="cpu")


def _rollouts(engine: HFEngine, temperature: float, n_prompts: int = 3) -> list[dict]:
    tok = engine.tokenizer
    texts = ["hi", "What is 7 + 35? Reply with the number.", "Name three colours, please."]
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": t}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for t in texts[:n_prompts]
    ]
    gens = engine.generate(
        prompts, SamplingParams(max_new_tokens=10, temperature=temperature, seed=2)
    )
    rows = []
    for i, (p, g) in enumerate(zip(prompts, gens)):
        n = len(g.token_ids)
        rows.append(
            dict(
                rollout_id=f"g{i}:0/0",
                group_id=f"g{i}:0",
                prompt_id=f"g{i}",
                dataset="d",
                sample_index=0,
                group_size=1,
                prompt_ids=p,
                response_ids=g.token_ids,
                loss_mask=[1] * n,
                logprobs=g.logprobs,
                token_policy_versions=None,
                policy_version_start=0,
                policy_version_end=0,
                finish_reason=g.finish_reason,
                turns=[{"role": "assistant", "start": 0, "end": n}],
                prompt_text=texts[i],
                response_text=g.text,
                label=None,
                metadata="{}",
                media=None,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                engine_id="hf-0",
                started_at=0,
                finished_at=0,
            )
        )
    return rows


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.4])
def test_c12_ref_logprobs_equal_rollout_logprobs_on_the_same_weights(engine, temperature):
    rows = _rollouts(engine, temperature)
    batch = ref_batch(engine.model, rows, 0)
    for r, ref in zip(rows, batch.to_pylist()):
        assert ref["rollout_id"] == r["rollout_id"] and len(ref["ref_logprobs"]) == len(
            r["response_ids"]
        )
        ratio = torch.exp(torch.tensor(r["logprobs"]) - torch.tensor(ref["ref_logprobs"]))
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5)


def test_c24_padding_never_comes_from_token_values(engine):
    """Prompts holding the pad/EOS id (2) in the middle and responses ending with it: each
    row scored in a padded batch equals the row scored alone."""
    prompts = [[1, 2, 30, 40], [1, 9690, 198, 2, 198, 1, 520, 9531, 198]]
    responses = [[55, 66, 2], [2, 2]]
    together = response_logprobs(engine.model, prompts, responses, 0.8)
    for p, r, got in zip(prompts, responses, together):
        alone = response_logprobs(engine.model, [p], [r], 0.8)[0]
        assert torch.allclose(torch.tensor(got), torch.tensor(alone), atol=1e-5)
        ids = torch.tensor([p + r])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[:, len(p) - 1 : -1]
        full = torch.log_softmax(logits / 0.8, -1)[0].gather(-1, torch.tensor(r)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(got), full, atol=1e-5)
    assert response_logprobs(engine.model, [[1, 2]], [[]], 1.0) == [[]]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        response_logprobs(engine.model, [[1, 2]], [[49152]], 1.0)


def _run_until(stage: ReferenceStage, bus, out_topic: str, n: int, timeout_s: float = 60):
    """Run ``stage`` in a thread until ``out_topic`` holds ``n`` rows (or the timeout),
    stop it, and return the topic's table."""
    done = threading.Event()
    t = threading.Thread(target=lambda: stage.run(done.is_set), daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + timeout_s
        got = []
        while len(got) < n and time.monotonic() < deadline:
            time.sleep(0.3)
            try:
                got = read_table(bus, out_topic).to_pylist()
            except (TimeoutError, ValueError):
                got = []
    finally:
        done.set()
        t.join(timeout=30)
    return read_table(bus, out_topic)


def test_reference_stage_on_the_broker(bus, unique, engine):
    """Rollouts in (two temperatures, one bad row in its own message), ref_logprobs out:
    every good rollout scored with its temperature, the bad record routed to the error topic."""
    rollouts = topics.run_topic(unique, "rollouts")
    ensure_topics(bus, {rollouts: 2})
    rows = _rollouts(engine, 0.7, 2) + [
        dict(r, rollout_id=f"t{r['rollout_id']}", group_id=f"t{r['group_id']}")
        for r in _rollouts(engine, 1.3, 2)
    ]
    bad = dict(
        rows[0],
        rollout_id="bad:0/0",
        group_id="bad:0",
        response_ids=[49999],
        loss_mask=[1],
        logprobs=[-1.0],
        turns=[{"role": "assistant", "start": 0, "end": 1}],
    )
    p = BatchProducer(bus)
    p.send(rollouts, pa.RecordBatch.from_pylist(rows + [bad], schema=ROLLOUTS))
    p.close()
    stage = ReferenceStage(
        ReferenceConfig(run=unique, poll_timeout_s=0.3), bus, model=engine.model
    )
    out_topic = topics.run_topic(unique, "ref_logprobs")
    table = _run_until(stage, bus, out_topic, len(rows))
    validate(table, "ref_logprobs")
    by_id = {r["rollout_id"]: r for r in table.to_pylist()}
    assert set(by_id) == {r["rollout_id"] for r in rows}
    for r in rows:
        ref = by_id[r["rollout_id"]]
        assert ref["group_id"] == r["group_id"] and ref["ref_policy_version"] == 0
        assert ref["ref_logprobs"] == pytest.approx(r["logprobs"], abs=1e-5)
    errors = read_table(bus, topics.errors_topic(rollouts)).to_pylist()
    assert len(errors) == 1 and "outside the vocabulary" in errors[0]["error"]


def test_reference_follows_the_policy_every_n_versions(bus, unique, tmp_path):
    """follow_every = 2: v1 is not installed, v2 is (from the checkpoint store here)."""
    from relax.streams.weights.publisher import WeightPublisher
    from relax.streams.weights.subscriber import WeightSubscriber
    from relax.trainer.models import load_model

    policy = load_model("tiny-llama")
    params = dict(policy.named_parameters())
    pub = WeightPublisher(bus, unique, checkpoint_dir=tmp_path)
    stage = ReferenceStage(
        ReferenceConfig(run=unique, follow_every=2), bus, model=load_model("tiny-llama")
    )
    before = {n: p.detach().clone() for n, p in stage.model.named_parameters()}
    try:
        with torch.no_grad():
            for p in params.values():
                p.mul_(1.5)
        pub.publish(params, 1).result()
        stage._subscriber = WeightSubscriber(bus, unique, member_id="reference-0").start()
        stage._subscriber.wait_for(1, 30)
        assert not stage.maybe_follow() and stage.version == 0
        for n, p in stage.model.named_parameters():
            assert torch.equal(p, before[n])
        with torch.no_grad():
            for p in params.values():
                p.mul_(1.5)
        pub.publish(params, 2).result()
        stage._subscriber.wait_for(2, 30)
        assert stage.maybe_follow() and stage.version == 2
        for n, p in stage.model.named_parameters():
            assert torch.equal(p, params[n])
        # a trainer restarted from its v1 checkpoint (other weights for v1): taken at once
        pub.close()
        pub = WeightPublisher(bus, unique, checkpoint_dir=tmp_path)
        with torch.no_grad():
            for p in params.values():
                p.mul_(0.5)
        pub.publish(params, 1).result()
        deadline = time.monotonic() + 30
        while stage._subscriber.version != 1 and time.monotonic() < deadline:
            stage._subscriber.poll(0.2)
        assert stage.maybe_follow() and stage.version == 1
        for n, p in stage.model.named_parameters():
            assert torch.equal(p, params[n])
    finally:
        if stage._subscriber is not None:
            stage._subscriber.close()
        pub.close()


def test_teacher_stage_on_the_broker(bus, unique, engine):
    """role teacher: its own model (here the tiny model with perturbed weights), consumer
    group <run>.teacher, output <run>.teacher_logprobs; each row's teacher_logprobs are
    that model's log-probs of the response at the student's positions and temperature."""
    import copy

    rollouts = topics.run_topic(unique, "rollouts")
    ensure_topics(bus, {rollouts: 2})
    rows = _rollouts(engine, 0.8, 3)
    p = BatchProducer(bus)
    p.send(rollouts, pa.RecordBatch.from_pylist(rows, schema=ROLLOUTS))
    p.close()
    teacher = copy.deepcopy(engine.model)
    with torch.no_grad():
        for w in teacher.parameters():
            w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
    stage = ReferenceStage(ReferenceConfig(run=unique, role="teacher", model="t-folder",
                                           member_id="teacher-0", poll_timeout_s=0.3),
                           bus, model=teacher)
    out_topic = topics.run_topic(unique, "teacher_logprobs")
    table = _run_until(stage, bus, out_topic, len(rows))
    validate(table, "teacher_logprobs")
    by_id = {r["rollout_id"]: r for r in table.to_pylist()}
    assert set(by_id) == {r["rollout_id"] for r in rows}
    want = response_logprobs(teacher, [r["prompt_ids"] for r in rows],
                             [r["response_ids"] for r in rows], 0.8)
    for r, w in zip(rows, want):
        got_r = by_id[r["rollout_id"]]
        assert got_r["teacher_model"] == "t-folder" and got_r["group_id"] == r["group_id"]
        assert got_r["teacher_logprobs"] == pytest.approx(w, abs=1e-5)
        assert got_r["teacher_logprobs"] != pytest.approx(r["logprobs"], abs=1e-3)
    from relax.streams.lag import group_offsets, high_watermarks

    assert group_offsets(bus, f"{unique}.teacher") == high_watermarks(bus, [rollouts])
    with pytest.raises(ValueError, match="a teacher is frozen"):
        ReferenceConfig(run=unique, role="teacher", follow_every=1)
