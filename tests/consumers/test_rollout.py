"""Rollout stage on the real broker (tiny model): schema-valid groups, the staleness budget,
weights followed from the broadcast, epochs; multi-turn accumulation (C22), budgets."""

from __future__ import annotations

import time

import pytest
import torch
from stagerun import StageRunner as _Runner
from stagerun import publish_prompts as _publish_prompts
from stagerun import trainer_progress as _trainer_progress
from stagerun import wait_for as _wait
from testdata import ScriptedEngine, prompt_rows

from relax.consumers.engines.base import SamplingParams
from relax.consumers.multiturn import TemplateError, observation_ids, render_ids, run_episodes
from relax.consumers.rollout.config import RolloutConfig
from relax.consumers.rollout.sampling import rollout_batch
from relax.consumers.rollout.stage import RolloutStage
from relax.schemas import metric_names as M
from relax.schemas import topics
from relax.schemas.validate import validate
from relax.streams.read import read_table


@pytest.fixture(scope="module")
def tokenizer():
    from relax.trainer.models import load_tokenizer

    return load_tokenizer("tiny-llama")


def test_rollout_stage_on_the_broker_respects_the_staleness_budget(
    bus, unique, tmp_path, tokenizer
):
    """6 prompts, G = 2, batch_groups = 2, max_staleness = 0: 2 groups at v0, then nothing
    until the trainer announces v1 (and its weights arrive by broadcast), 2 more at v1,
    2 more at v2. Every row valid against ROLLOUTS."""
    from relax.streams.weights.publisher import WeightPublisher
    from relax.trainer.models import load_model

    rows = prompt_rows(8, dataset=unique, messages=False)
    rows[1]["messages"] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1 + 1?"},
    ]
    _publish_prompts(bus, unique, rows, partitions=2)
    pub = WeightPublisher(bus, unique, checkpoint_dir=tmp_path / "ckpt")
    cfg = RolloutConfig(
        run=unique,
        dataset=unique,
        model="tiny-llama",
        group_size=2,
        batch_groups=2,
        max_staleness=0,
        max_new_tokens=6,
        temperature=0.8,
        seed=0,
        weights_rendezvous=pub.rendezvous,
        metrics_every_s=0.5,
        rollouts_partitions=2,
    )
    stage = RolloutStage(cfg, bus)
    runner = _Runner(stage)
    trainer = load_model("tiny-llama")
    params = dict(trainer.named_parameters())
    try:
        pub.wait_for_members(1, 60)
        _wait(lambda: runner.check() or stage.stats.groups >= 2, what="2 groups")
        time.sleep(2.0)
        # waiting for the trainer: for credit, or (as here) for weights fresh enough for a
        # group that would be consumed at v1
        assert stage.stats.groups == 2 and stage.stats.budget_waits + stage.stats.weight_waits > 0
        for v in (1, 2):
            with torch.no_grad():
                for p in params.values():
                    p.mul_(1.01)
            assert pub.publish(params, v).result().members == ["rollout-0"]
            want = 2 + 2 * v
            _wait(lambda n=want: runner.check() or stage.stats.groups >= n, what=f"groups at v{v}")
            time.sleep(1.0 if v == 1 else 0.0)
            assert stage.stats.groups == want
        assert stage.engine.policy_version == 2
        # the trainer's progress metrics: it decided 6 groups and needs none -> no group;
        # then it needs 2 more (it dropped 2, say) -> 2 groups without a new version
        _trainer_progress(bus, unique, consumed=6, needed=0)
        time.sleep(2.0)
        assert stage.stats.groups == 6
        _trainer_progress(bus, unique, consumed=6, needed=2)
        _wait(lambda: runner.check() or stage.stats.groups >= 8, what="groups on credit")
    finally:
        runner.stop()
        pub.close()

    table = read_table(bus, topics.run_topic(unique, "rollouts"))
    validate(table, "rollouts")
    out = table.to_pylist()
    assert len(out) == 16
    by_group: dict[str, list[dict]] = {}
    for r in out:
        by_group.setdefault(r["group_id"], []).append(r)
    assert sorted(by_group) == [f"p{i:04d}:0" for i in range(8)]
    prompts = {r["prompt_id"]: r for r in rows}
    versions = []
    for gid, rs in by_group.items():
        assert sorted(r["sample_index"] for r in rs) == [0, 1]
        src = prompts[gid.split(":")[0]]
        msgs = src["messages"] or [{"role": "user", "content": src["prompt"]}]
        for r in rs:
            assert r["rollout_id"] == f"{gid}/{r['sample_index']}" and r["group_size"] == 2
            assert r["prompt_ids"] == render_ids(tokenizer, msgs)
            n = len(r["response_ids"])
            assert 1 <= n <= 6 and r["loss_mask"] == [1] * n and len(r["logprobs"]) == n
            assert all(lp <= 0 for lp in r["logprobs"])
            assert r["finish_reason"] in ("stop", "length")
            assert r["policy_version_start"] == r["policy_version_end"]
            assert r["token_policy_versions"] is None
            assert r["turns"] == [{"role": "assistant", "start": 0, "end": n}]
            assert r["started_at"] <= r["finished_at"] and r["engine_id"] == "rollout-0"
            assert r["temperature"] == pytest.approx(0.8) and r["label"] == src["label"]
        versions.append((rs[0]["finished_at"], rs[0]["policy_version_start"]))
    assert sorted(v for _, v in versions) == [0, 0, 1, 1, 2, 2, 2, 2]
    metrics = read_table(bus, topics.run_topic(unique, "metrics")).to_pylist()
    mine = [m for m in metrics if m["component"] == "rollout-0"]
    names = {m["name"] for m in mine}
    assert {M.GEN_TOKENS_PER_S, M.GROUPS_IN_FLIGHT, M.BUDGET_WAIT_S, M.GROUPS_SAMPLED} <= names
    assert max(m["value"] for m in mine if m["name"] == M.BUDGET_WAIT_S) > 1.0
    assert max(m["value"] for m in mine if m["name"] == M.GROUPS_SAMPLED) == 8


def test_epochs_reread_the_prompts_with_the_epoch_in_the_group_id(bus, unique):
    _publish_prompts(bus, unique, prompt_rows(2, dataset=unique))
    cfg = RolloutConfig(
        run=unique,
        dataset=unique,
        group_size=1,
        batch_groups=8,
        max_staleness=0,
        max_new_tokens=3,
        epochs=3,
        follow_weights=False,
    )
    stats = RolloutStage(cfg, bus).run(stop_when_exhausted=True)
    assert stats.groups == 6 and stats.epochs_started == 2
    out = read_table(bus, topics.run_topic(unique, "rollouts")).column("group_id").to_pylist()
    assert sorted(out) == sorted(f"p{i:04d}:{e}" for i in range(2) for e in range(3))


def test_a_restarted_stage_goes_on_in_the_committed_epoch(bus, unique):
    """The epoch is committed with the prompt offsets: a stage restarted in epoch 1 does
    not start again at epoch 0 (whose group_ids the trainer already decided)."""
    _publish_prompts(bus, unique, prompt_rows(2, dataset=unique))
    cfg = RolloutConfig(run=unique, dataset=unique, group_size=1, batch_groups=8,
                        max_staleness=0, max_new_tokens=3, epochs=3, follow_weights=False)
    first = RolloutStage(cfg, bus)
    first.run(lambda: first.stats.groups >= 3)  # stopped inside epoch 1
    assert first.stats.epochs_started >= 1
    RolloutStage(cfg, bus).run(stop_when_exhausted=True)
    out = read_table(bus, topics.run_topic(unique, "rollouts")).column("group_id").to_pylist()
    assert sorted(out) == sorted(f"p{i:04d}:{e}" for i in range(2) for e in range(3))


def test_a_restarted_stage_counts_the_groups_its_predecessor_left_in_flight(bus, unique):
    """An instance killed while its groups wait for the trainer: its successor counts them
    against the credit (no extra groups the run never trains), and does not sample again
    the prompts of the message it had not committed yet (issue 12: 28 rollouts of 2,096
    sampled and never decided in 50 chaos runs, all after a rollout restart)."""
    import time as _time

    _publish_prompts(bus, unique, prompt_rows(8, dataset=unique))  # one message, 8 prompts
    cfg = RolloutConfig(run=unique, dataset=unique, group_size=1, batch_groups=2,
                        max_staleness=1, max_new_tokens=3, follow_weights=False)
    first = RolloutStage(cfg, bus)
    first.run(lambda: first.stats.budget_waits > 0)  # the credit (4 groups) is used up
    assert first.stats.groups == 4
    second = RolloutStage(cfg, bus)
    deadline = _time.monotonic() + 60  # its start-up, then 2 s waiting for credit
    second.run(lambda: second.stats.budget_wait_s > 2.0 or _time.monotonic() > deadline)
    out = read_table(bus, topics.run_topic(unique, "rollouts")).column("group_id").to_pylist()
    assert second.stats.groups == 0 and second.stats.budget_waits > 0
    assert len(out) == len(set(out)) == 4


def test_a_rollout_waiting_for_credit_wakes_on_the_trainer_s_progress(bus, unique):
    """Once the trainer has reported, the credit moves with its progress records: a
    rollout waiting for credit wakes on the next one, not at the end of its poll timeout
    (it waited on the weight announcements instead, which held each generate of a sync
    run up to 0.5 s after the progress arrived). The poll timeout here is 60 s: 2 more
    groups follow the new credit within 20 s only if the wait is on the progress."""
    _publish_prompts(bus, unique, prompt_rows(4, dataset=unique))
    _trainer_progress(bus, unique, consumed=0, needed=2)
    cfg = RolloutConfig(run=unique, dataset=unique, group_size=1, batch_groups=2,
                        max_staleness=0, max_new_tokens=3, follow_weights=False,
                        poll_timeout_s=60.0)
    stage = RolloutStage(cfg, bus)
    runner = _Runner(stage)
    try:
        _wait(lambda: runner.check() or stage.stats.budget_waits > 0, what="the credit used up")
        assert stage.stats.groups == 2
        _trainer_progress(bus, unique, consumed=2, needed=2)
        _wait(lambda: runner.check() or stage.stats.groups >= 4, timeout_s=20,
              what="2 groups on the new credit")
        _trainer_progress(bus, unique, consumed=4, needed=0)  # ends the wait: a prompt stop
    finally:
        runner.stop()


def test_a_rollout_waiting_for_weights_wakes_on_the_progress_that_follows_them(
    bus, unique, tmp_path
):
    """The trainer announces a version, then reports its progress. Between the two the
    groups it just consumed still count as in flight, so the rollout takes the version it
    needs to be one step newer than the one it received, and waits for weights. It must
    wake on the report (which came ~0.5 s late in a sync step on Kafka), not at its poll
    timeout: 60 s here, so 2 more groups follow within 20 s only if it does."""
    from relax.streams.weights.publisher import WeightPublisher
    from relax.trainer.models import load_model

    _publish_prompts(bus, unique, prompt_rows(4, dataset=unique, messages=False))
    _trainer_progress(bus, unique, consumed=0, needed=4, version=0)
    pub = WeightPublisher(bus, unique, checkpoint_dir=tmp_path / "ckpt")
    cfg = RolloutConfig(run=unique, dataset=unique, model="tiny-llama", group_size=1,
                        batch_groups=2, max_staleness=0, max_new_tokens=3, seed=0,
                        weights_rendezvous=pub.rendezvous, poll_timeout_s=60.0)
    stage = RolloutStage(cfg, bus)
    runner = _Runner(stage)
    params = dict(load_model("tiny-llama").named_parameters())
    try:
        pub.wait_for_members(1, 60)
        _wait(lambda: runner.check() or stage.stats.groups >= 2, what="2 groups at v0")
        assert pub.publish(params, 1).result().members == ["rollout-0"]
        _wait(lambda: runner.check() or stage.stats.weight_waits > 0, what="a weight wait")
        time.sleep(1.0)  # the wait has begun on the need the late report makes too new
        assert stage.stats.groups == 2 and stage.trainer_version == 1
        _trainer_progress(bus, unique, consumed=2, needed=2, version=1)
        _wait(lambda: runner.check() or stage.stats.groups >= 4, timeout_s=20,
              what="2 groups at v1 on the report")
        assert stage.engine.policy_version == 1
        runner.stop(wake=lambda: pub.publish(params, 2).result())  # it waits for v2 now
    finally:
        runner.stop()
        pub.close()


# ---------------------------------------------------------------- multi-turn


class _ToolEnv:
    """Replies with a tool response for the first ``k`` turns, then ends the episode."""

    def __init__(self, replies: list[str], role: str = "user"):
        self.replies, self.role, self.seen = list(replies), role, []

    def reset(self, prompt_row):
        return None

    def step(self, response_text):
        self.seen.append(response_text)
        if not self.replies:
            return None, True, 1.0
        return (
            {"role": self.role, "content": f"<tool_response>{self.replies.pop(0)}</tool_response>"},
            False,
            0.0,
        )


@pytest.mark.parametrize("k", [1, 2, 3])
def test_c22_incremental_tokenisation_equals_the_full_render(tokenizer, k):
    """k tool turns: prompt + response ids equal the template's full render of the whole
    conversation (length difference 0; the newline after every <|im_end|> is there), and
    loss_mask is 1 exactly on the model's tokens (X <|im_end|> ... Z <|im_end|>)."""
    texts = [f"call tool {i}" for i in range(k)] + ["The answer is Z."]
    engine = ScriptedEngine(tokenizer, texts)
    row = prompt_rows(1)[0]
    env = _ToolEnv([f"Y{i}" for i in range(k)])
    (ep,) = run_episodes(
        engine, tokenizer, [env], row, SamplingParams(max_new_tokens=20), max_turns=k + 1
    )
    assert ep.finish_reason == "stop" and env.seen == texts
    conv = [{"role": "user", "content": row["prompt"]}]
    for i in range(k):
        conv += [
            {"role": "assistant", "content": texts[i]},
            {"role": "user", "content": f"<tool_response>Y{i}</tool_response>"},
        ]
    conv.append({"role": "assistant", "content": texts[-1]})
    full = render_ids(tokenizer, conv, add_generation_prompt=False)
    ours = ep.prompt_ids + ep.response_ids
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert full[-1:] == newline  # the template's newline after the final <|im_end|>
    assert ours == full[:-1]  # token for token; length difference 0
    eot = tokenizer.eos_token_id
    model_spans = [t for t in ep.turns if t["role"] == "assistant"]
    assert len(model_spans) == k + 1 and [t["role"] for t in ep.turns][1::2] == ["user"] * k
    for t in model_spans:
        assert ep.response_ids[t["end"] - 1] == eot
    expected_mask = [0] * len(ep.response_ids)
    for t in model_spans:
        expected_mask[t["start"] : t["end"]] = [1] * (t["end"] - t["start"])
    assert ep.loss_mask == expected_mask
    for t in ep.turns[1::2]:  # environment spans start with the template newline (mask 0)
        assert ep.response_ids[t["start"] : t["start"] + 1] == newline
        assert all(lp == 0.0 for lp in ep.logprobs[t["start"] : t["end"]])
    faulty = [
        tok
        for i, tok in enumerate(ep.response_ids)  # the fault drops those newlines
        if not any(i == t["start"] for t in ep.turns[1::2])
    ]
    assert len(ep.prompt_ids) + len(faulty) == len(full) - 1 - k


def test_observation_delta_without_end_of_turn_closes_the_turn(tokenizer):
    """A model turn cut by a stop string (no <|im_end|>): the template's <|im_end|> and
    newline are appended with the observation, with loss_mask 0."""
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "X"}]
    ids = observation_ids(
        tokenizer,
        conv,
        [{"role": "user", "content": "Y"}],
        ended_with_eot=False,
        eot_text=tokenizer.eos_token,
    )
    assert (
        tokenizer.decode(ids)
        == "<|im_end|>\n<|im_start|>user\nY<|im_end|>\n<|im_start|>assistant\n"
    )


def test_non_prefix_stable_template_is_refused(tokenizer):
    class Stripping:
        eos_token = "<|im_end|>"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            text = "".join(
                f"<{m['role']}>{m['content'] if m is messages[-1] else '...'}<|im_end|>"
                for m in messages
            )
            return text

    with pytest.raises(TemplateError, match="prefix-stable"):
        observation_ids(
            Stripping(),
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}],
            [{"role": "user", "content": "y"}],
            ended_with_eot=True,
            eot_text="<|im_end|>",
        )


def test_turn_and_token_budgets(tokenizer):
    row = prompt_rows(1)[0]
    engine = ScriptedEngine(tokenizer, ["a b c"] * 3)
    (ep,) = run_episodes(
        engine,
        tokenizer,
        [_ToolEnv(["y"] * 10)],
        row,
        SamplingParams(max_new_tokens=10),
        max_turns=3,
    )
    assert ep.finish_reason == "turn_budget"
    assert [t["role"] for t in ep.turns] == ["assistant", "user"] * 2 + ["assistant"]
    assert ep.rewards == [0.0, 0.0, 0.0]
    engine = ScriptedEngine(tokenizer, ["a b c d e f g h"] * 3)
    (ep,) = run_episodes(
        engine,
        tokenizer,
        [_ToolEnv(["y"] * 10)],
        row,
        SamplingParams(max_new_tokens=30),
        max_turns=5,
        max_total_tokens=22,
    )
    assert ep.finish_reason == "token_budget" and len(ep.response_ids) <= 22
    engine = ScriptedEngine(tokenizer, ["a b c d e f g h i j k l m n o p"])
    (ep,) = run_episodes(
        engine, tokenizer, [_ToolEnv(["y"])], row, SamplingParams(max_new_tokens=4), max_turns=3
    )
    assert ep.finish_reason == "length" and ep.loss_mask == [1] * 4
    assert ep.rewards == [0.0]  # the cut turn is still scored (_ToolEnv gives 0.0)


def test_multiturn_rows_through_the_hf_engine_hold_one_version(tokenizer):
    """Real engine, G = 3 episodes in lockstep: rows are schema-valid, model tokens are
    exactly the mask-1 spans, and a weight update staged mid-episode waits for the group."""
    from relax.consumers.engines.hf import HFEngine

    engine = HFEngine("tiny-llama", device="cpu")
    staged = {n: p.detach() * 1.0 for n, p in engine.model.named_parameters()}

    class Env(_ToolEnv):
        def step(self, response_text):
            if len(self.seen) == 0:
                engine.update_weights(staged, 1)  # arrives mid-episode
            return super().step(response_text)

    row = prompt_rows(1)[0]
    envs = [Env(["Y"]) for _ in range(3)]
    params = SamplingParams(max_new_tokens=8, temperature=0.9, seed=1, stop=(" ", "e", "a"))
    eps = run_episodes(engine, engine.tokenizer, envs, row, params, max_turns=2)
    assert all(len(e.turns) == 3 for e in eps)  # stop strings end turn 1 without <|im_end|>
    assert all(e.response_ids[e.turns[1]["start"]] == engine.tokenizer.eos_token_id for e in eps)
    # the staged weights went in when the group's hold ended (the episodes used version 0)
    assert engine.pending_version is None and engine.policy_version == 1
    cfg = RolloutConfig(
        run="r",
        dataset="d",
        group_size=3,
        max_new_tokens=8,
        temperature=0.9,
    )
    batch = rollout_batch(row, "p0000:0", eps, cfg, "hf-0", 0, 1)
    for r in batch.to_pylist():
        assert r["policy_version_start"] == r["policy_version_end"] == 0
        for t in r["turns"]:
            want = 1 if t["role"] == "assistant" else 0
            assert set(r["loss_mask"][t["start"] : t["end"]]) == {want}
        assert sum(t["end"] - t["start"] for t in r["turns"]) == len(r["response_ids"])
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))[0].policy_version_start == 1


def test_relax_rollout_command_runs_the_stage(bus, unique, tmp_path):
    from typer.testing import CliRunner

    from relax.infra.cli.app import app

    _publish_prompts(bus, unique, prompt_rows(2, dataset=unique))
    (tmp_path / "rollout.yaml").write_text("group_size: 2\nmax_new_tokens: 3\nbatch_groups: 4\n")
    result = CliRunner().invoke(
        app,
        [
            "rollout",
            "--run",
            unique,
            "--dataset",
            unique,
            "--model",
            "tiny-llama",
            "--config",
            str(tmp_path / "rollout.yaml"),
            "--set",
            "follow_weights=false",
            "--exit-when-exhausted",
            "--bootstrap",
            bus.bootstrap_servers,
        ],
    )
    assert result.exit_code == 0, result.output
    assert "groups=2 samples=4" in result.output
    bad = CliRunner().invoke(
        app,
        [
            "rollout",
            "--run",
            unique,
            "--dataset",
            unique,
            "--set",
            "group_size=0",
            "--bootstrap",
            bus.bootstrap_servers,
        ],
    )
    assert bad.exit_code == 2 and "group_size" in bad.output


def test_prompt_template_is_applied_before_the_chat_template(tokenizer):
    cfg = RolloutConfig(
        run="r",
        dataset="d",
        prompt_template="{prompt}\nReply with just the number.",
    )
    engine = ScriptedEngine(tokenizer, [])
    stage = RolloutStage(cfg, engine=engine)
    row = prompt_rows(1)[0]
    from relax.consumers.rollout.prompts import PromptItem

    ids = stage._render(PromptItem(None, row, 0))
    want = [{"role": "user", "content": "What is 0 + 1?\nReply with just the number."}]
    assert ids == render_ids(tokenizer, want)
    with pytest.raises(ValueError, match="prompt_template"):
        RolloutConfig(
                run="r",
            dataset="d",
            prompt_template="{question}",
        )


def test_a_text_only_model_refuses_a_row_with_media(tokenizer):
    """A prompt row with an image for a text-only model is that row's error (routed to
    the error topic by the stage), not a prompt sampled without its image."""
    cfg = RolloutConfig(run="r", dataset="d")
    stage = RolloutStage(cfg, engine=ScriptedEngine(tokenizer, []))
    row = {**prompt_rows(1)[0], "media": [{"kind": "image", "uri": None, "data": b"x",
                                           "mime": "image/png", "turn": 0}]}
    from relax.consumers.rollout.prompts import PromptItem

    with pytest.raises(ValueError, match="the row has 1 media items but tiny-llama takes no "
                                         "images or audio"):
        stage._render(PromptItem(None, row, 0))
