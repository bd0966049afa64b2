"""``eval.every``: greedy held-out accuracy during training (the eval stage,
infra/control/eval_stage.py), in the metrics topic, the monitor, TensorBoard; and its pure
pieces (which versions are due, the rows, the monitor's fold)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from relax.infra.control.eval_stage import DueVersions, last_due
from relax.infra.observe.monitor import eval_points, render
from relax.infra.observe.monitor_reader import MetricsFold
from relax.infra.offline.evaluate import EvalResult, eval_metrics, next_due
from relax.schemas import metric_names as M

EVAL_SOURCE = ("reasoning_gym:basic_arithmetic?size=40&seed=7&min_digits=1&max_digits=1")


def _row(name: str, value: float, v: int | None, component: str = "eval") -> dict:
    return {"ts": 0, "component": component, "name": name, "value": value, "policy_version": v}


# --- pure pieces -------------------------------------------------------------------------


def test_next_due_is_the_next_multiple_of_every():
    assert [next_due(v, 2) for v in range(6)] == [2, 2, 4, 4, 6, 6]
    assert [next_due(v, 3) for v in (0, 2, 3, 7)] == [3, 3, 6, 9]
    assert next_due(5, 1) == 6
    assert [last_due(s, 2) for s in (1, 2, 5, 6)] == [0, 2, 4, 6]  # what the driver waits for
    with pytest.raises(ValueError, match="every must be >= 1"):
        next_due(3, 0)


def test_eval_metrics_are_the_rows_of_one_eval():
    r = EvalResult(accuracy=0.75, n=4, correct=3, seconds=1.5, errors=1, first_error="x")
    assert eval_metrics(r) == {M.EVAL_ACCURACY: 0.75, M.EVAL_N: 4, M.EVAL_CORRECT: 3,
                               M.EVAL_REWARD_ERRORS: 1, M.EVAL_S: 1.5}


def _named(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 3), value), "b": torch.full((3,), -value)}


def test_due_versions_keep_copies_of_multiples_of_every_oldest_first():
    due = DueVersions(every=2, max_pending=3)
    buf = _named(1.0)
    for v in range(5):  # 0 is eval.before's; odd ones are not due
        buf["w"].fill_(float(v))  # the subscriber reuses its receive buffer
        due.update_weights(buf, v)
    v, named = due.take()
    assert v == 2 and named["w"].eq(2.0).all()  # a copy, not a view of the buffer
    v, named = due.take()
    assert v == 4 and named["w"].eq(4.0).all()
    assert due.take() is None
    due.update_weights(_named(9.0), 4)  # a resumed trainer publishes v4 again: evaluated
    due.update_weights(_named(9.0), 2)  # an older one after a newer was taken: not
    assert due.take() is None and due.dropped == []


def test_due_versions_drop_the_oldest_when_evaluating_falls_behind():
    due = DueVersions(every=1, max_pending=2)
    for v in (1, 2, 3, 4):
        due.update_weights(_named(float(v)), v)
    assert due.dropped == [1, 2]
    assert [due.take()[0], due.take()[0], due.take()] == [3, 4, None]
    with pytest.raises(ValueError, match="must be >= 1"):
        DueVersions(every=0)


def test_the_monitor_folds_eval_rows_per_policy_version():
    fold = MetricsFold()
    fold.add([_row(M.EVAL_ACCURACY, 0.25, 0), _row(M.EVAL_N, 4, 0), _row(M.EVAL_CORRECT, 1, 0),
              _row(M.STEP_S, 1.0, 1, "trainer"), _row(M.EVAL_ACCURACY, 0.5, 2),
              _row(M.EVAL_N, 4, 2), _row(M.EVAL_CORRECT, 2, 2), _row(M.EVAL_S, 0.3, 2),
              _row(M.EVAL_N, 4, 4),  # its accuracy row not read yet: left out
              _row(M.EVAL_ACCURACY, 0.9, None)])  # no version: not a point
    pts = eval_points(fold.evals)
    assert [(p["policy_version"], p["accuracy"], p["n"], p["correct"]) for p in pts] == \
        [(0, 0.25, 4, 1), (2, 0.5, 4, 2)]
    assert pts[0]["seconds"] is None and pts[1]["seconds"] == 0.3
    fold.add([_row(M.EVAL_ACCURACY, 0.75, 2)])  # a restarted stage's second eval: the newest
    assert eval_points(fold.evals)[1]["accuracy"] == 0.75


# --- a tiny run ----------------------------------------------------------------------------


STEPS, EVERY, SIZE = 4, 2, 4


@pytest.mark.e2e
@pytest.mark.usefixtures("local_ray")
def test_eval_every_writes_held_out_accuracy_during_a_tiny_run(broker, tmp_path):
    from rich.console import Console
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from testdata import tiny_recipe

    from relax.infra.control.launch import train
    from relax.infra.observe.monitor import snapshot
    from relax.streams.client import BusConfig
    from relax.streams.read import read_table

    run = "evev" + uuid.uuid4().hex[:6]
    recipe = tiny_recipe(
        broker, tmp_path, run, f"trainer.steps={STEPS}", "resources.eval={torch_threads: 1}",
        # a snapshot of each due version: evaluated even when the stage joins after it
        f"trainer.weights_snapshot_every={EVERY}",
        f'eval={{source: "{EVAL_SOURCE}", size: {SIZE}, max_new_tokens: 2, every: {EVERY}, '
        'after: false, reward: {name: e, fn: "testdata:parity_reward"}}')
    lines: list[str] = []
    s = train(recipe, say=lines.append, timeout_s=500)
    assert s["steps"] == STEPS, (s, lines)
    run_dir = Path(s["run_dir"])

    bus = BusConfig(bootstrap_servers=broker)
    rows = [r for r in read_table(bus, f"{run}.metrics").to_pylist()
            if r["component"] == M.EVAL_COMPONENT]
    log = (run_dir / "logs" / "eval.log").read_text() if (run_dir / "logs" / "eval.log").exists() else ""
    acc = {r["policy_version"]: r["value"] for r in rows if r["name"] == M.EVAL_ACCURACY}
    n = {r["policy_version"]: r["value"] for r in rows if r["name"] == M.EVAL_N}
    assert sorted(acc) == [0, 2, 4], (rows, lines, log[-3000:])  # 0: eval.before
    assert all(0.0 <= a <= 1.0 for a in acc.values()) and n == {0: SIZE, 2: SIZE, 4: SIZE}, rows
    assert acc[0] == s["eval_before"]["accuracy"]

    snap = snapshot(bus, run)
    assert [(e["policy_version"], e["n"]) for e in snap["evals"]] == [(0, SIZE), (2, SIZE),
                                                                       (4, SIZE)], snap["evals"]
    assert snap["eval"]["policy_version"] == 4 and snap["eval"]["accuracy"] == acc[4]
    console = Console(width=80, record=True)
    console.print(render(snap))
    assert "greedy held-out accuracy" in console.export_text()

    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars(M.EVAL_ACCURACY)] == [2, 4]  # the stage's; 0 is the driver's


def test_the_stage_scores_installed_weights_as_relax_eval_scores_the_model(tmp_path):
    """The stage's eval of the initial weights, installed over other ones, equals
    ``greedy_accuracy`` of the model by name (the ``relax eval`` / ``eval.before`` path):
    same rows, same greedy responses, same count correct."""
    from testdata import tiny_recipe

    from relax.infra.control.eval_stage import EvalStage
    from relax.infra.offline.evaluate import greedy_accuracy, greedy_accuracy_of
    from relax.infra.recipe.specs import EvalStageConfig, run_bus, stage_specs

    recipe = tiny_recipe("localhost:9", tmp_path, "evpar", f'eval={{source: "{EVAL_SOURCE}", '
                         'size: 8, max_new_tokens: 6, every: 1, reward: {name: e, '
                         'fn: "testdata:parity_reward"}}')
    spec = next(s for s in stage_specs(recipe, tmp_path) if s.name == "eval")
    stage = EvalStage(EvalStageConfig(**spec.config), run_bus(recipe, "localhost:9", tmp_path))

    def responses() -> list[str]:  # of the weights installed last (5 examples)
        r = greedy_accuracy_of(stage.model, stage.tokenizer, stage.rows, stage.pool,
                               prompt_template=recipe.rollout.prompt_template, max_new_tokens=6)
        return [e["response"] for e in r.examples]

    try:
        initial = {k: v.detach().clone() for k, v in stage.model.named_parameters()}
        torch.manual_seed(0)
        stage.evaluate(1, {k: torch.randn_like(v) for k, v in initial.items()})
        junk = responses()
        pulses = []
        got = stage.evaluate(2, initial, pulse=lambda: pulses.append(1))
        mine = responses()
    finally:
        stage.pool.close()
    want = greedy_accuracy(recipe.model, stage.rows, reward_fn="testdata:parity_reward",
                           prompt_template=recipe.rollout.prompt_template, max_new_tokens=6)
    assert len(stage.rows) == 8 and pulses == [1]  # one engine call of 8 prompts
    assert mine == [e["response"] for e in want.examples] != junk
    assert (got[M.EVAL_N], got[M.EVAL_CORRECT], got[M.EVAL_ACCURACY]) == \
        (want.n, want.correct, want.accuracy), (got, want.examples)


def test_the_eval_reads_held_out_clips_with_the_training_data_s_frame_rule(tmp_path):
    """``eval.video_field``: the held-out prompts carry their clip, sampled by ``data``'s
    ``video_fps`` / ``video_max_frames`` as the training prompts are, in the eval stage's
    config and in the driver's before/after eval."""
    from testdata import RECIPES

    from relax.infra.offline.evaluate import eval_rows
    from relax.infra.recipe.recipe import load_recipe
    from relax.infra.recipe.specs import EvalStageConfig, stage_specs
    from relax.schemas.media import video_frames

    recipe = load_recipe(RECIPES / "video_grpo.yaml", [
        "bootstrap_servers=localhost:9", f"run_root={tmp_path}", "run=vid",
        "data.video_max_frames=4",
        'eval={source: "moving_square:test?size=8&seed=5", size: 2, every: 2, '
        'video_field: video, reward: {name: e, fn: "testdata:parity_reward"}}'])
    spec = next(s for s in stage_specs(recipe, tmp_path) if s.name == "eval")
    held_out = EvalStageConfig(**spec.config).held_out
    for media in (held_out.media(), recipe.eval.media(recipe.data)):
        assert media.fields == (("video", "video"),) and media.video_max_frames == 4
        rows = eval_rows(held_out.source, 2, prompt_field="question", label_field="answer",
                         media=media)
        for row in rows:
            (item,) = row["media"]
            frames, stamps, _ = video_frames(item["data"])
            assert item["kind"] == "video" and len(frames) == 4 == len(stamps)
