"""Stall rules of the controller and the run watch loop's end (pure logic)."""

from __future__ import annotations

from relax.infra.control.watch import (
    StageWatch,
    broker_state_lost,
    input_group,
    input_stalled,
    loop_stalled,
)


def test_input_stalled_only_when_input_waits_and_nothing_is_committed_for_the_limit():
    w = StageWatch(since=0.0)
    a = {("r.rollouts", 0): 5}
    assert not input_stalled(w, a, lag=3, now=1.0, timeout_s=10)   # first look: clock starts
    assert not input_stalled(w, a, lag=3, now=10.5, timeout_s=10)
    assert input_stalled(w, a, lag=3, now=11.5, timeout_s=10)      # 10.5 s, no commit
    b = {("r.rollouts", 0): 6}
    assert not input_stalled(w, b, lag=2, now=12.0, timeout_s=10)  # committed: clock restarts
    assert not input_stalled(w, b, lag=0, now=30.0, timeout_s=10)  # nothing waits: idle is fine
    assert not input_stalled(w, b, lag=1, now=35.0, timeout_s=10)  # counted from the idle look
    assert input_stalled(w, b, lag=1, now=40.5, timeout_s=10)


def test_loop_stalled_names_the_cause():
    assert loop_stalled(True, 2.0, 0.0, 10) is None
    assert "inside one call for 12s" in loop_stalled(True, 12.0, 0.0, 10)
    assert loop_stalled(True, None, 0.0, 10) is None          # still starting: not judged
    assert loop_stalled(False, None, 5.0, 10) is None         # one missed answer is no stall
    assert "not answered a heartbeat for 11s" in loop_stalled(False, None, 11.0, 10)


def test_input_group_of_each_stage_kind():
    assert input_group("r", "reward", "reward.correct") == ("r.reward.correct", ["r.rollouts"])
    assert input_group("r", "aggregate", "aggregate") == ("r.aggregate", ["r.rollouts", "r.rewards"])
    assert input_group("r", "reference", "teacher") == ("r.teacher", ["r.rollouts"])
    assert input_group("r", "reference", "reference") == ("r.reference", ["r.rollouts"])
    assert input_group("r", "trainer", "trainer") is None
    assert input_group("r", "rollout", "rollout-0") is None


def test_broker_state_lost_when_the_metrics_log_shrinks_or_vanishes():
    assert not broker_state_lost(None, 0)           # nothing seen yet
    assert not broker_state_lost(40, 40) and not broker_state_lost(40, 57)
    assert broker_state_lost(40, 3)                  # restarted, re-created by a stage
    assert broker_state_lost(40, None)               # restarted, not re-created yet


def test_a_finished_trainer_s_last_steps_still_get_their_lines_and_on_step(tmp_path):
    """The trainer's process may end before its last steps' metric records reach the
    driver (a live CI run printed step 1 of 3 and never called on_step for step 2): the
    watch loop reads the metrics to their end before it returns."""
    from testdata import RECIPES

    from relax.infra.control.run_watch import RunWatch
    from relax.infra.recipe.recipe import load_recipe
    from relax.schemas import metric_names as M

    def row(step: int) -> dict:
        return {"component": "trainer", "name": M.STEP_S, "value": 1.0,
                "policy_version": step, "ts": 0}

    class Follower:  # its records arrive only when read to the end
        rows: list[dict] = []

        def poll(self, timeout_s: float) -> list[dict]:
            return []

        def read_to_end(self, timeout_s: float = 30.0) -> bool:
            self.rows = [row(1), row(2), row(3)]
            return True

    class Finished:  # the trainer's process has ended
        def check(self, timeout_s: float) -> set[str]:
            return {"trainer"}

    seen: list[int] = []
    lines: list[str] = []
    recipe = load_recipe(RECIPES / "tiny_ci.yaml", ["trainer.steps=3"])
    RunWatch(recipe, None, tmp_path, Finished(), Follower(), lines.append,
             lambda s, _: seen.append(s["step"])).until_done(lambda: False)
    assert seen == [1, 2, 3] and len(lines) == 3, (seen, lines)


def test_how_to_go_on_names_a_lora_checkpoint_as_an_adapter(tmp_path):
    from testdata import RECIPES

    from relax.infra.control.run_watch import how_to_go_on
    from relax.infra.recipe.recipe import load_recipe
    from relax.trainer.checkpoint import STATE_FILE

    ckpt = tmp_path / "checkpoints" / "step_000002"
    (ckpt / "adapter").mkdir(parents=True)
    (ckpt / STATE_FILE).write_text("{}")
    recipe = load_recipe(RECIPES / "tiny_ci.yaml", ["trainer.lora={r: 4}"])
    text = how_to_go_on(recipe, tmp_path)
    assert f"a LoRA adapter over {recipe.model} in {ckpt / 'adapter'}" in text, text
    assert "model=" not in text  # not a model folder to start a run from
