"""Held-out evaluation with a user's reward (``infra/offline/evaluate.py``,
``infra/control/launch.py``): it is scored as the reward stage scores, so a reward that
fails on some rows costs those rows only, one that cannot work fails the run with one line
naming its recipe key, and an eval source too short for ``eval.size`` is a recipe error
found before anything is made."""

from __future__ import annotations

import pytest
from testdata import tiny_recipe

from relax.infra.control import launch
from relax.infra.control.run_watch import RunFailed
from relax.infra.offline.evaluate import eval_rows, greedy_accuracy
from relax.infra.recipe.recipe import RecipeError

SOURCE = "reasoning_gym:basic_arithmetic?size=40&seed=7&min_digits=1&max_digits=1"


def fails_on_odd_labels(responses, labels, metadata, **options):
    """Raises on a batch with an odd label: each of its rows is retried alone, and only
    the odd ones fail."""
    if any(int(x) % 2 for x in labels):
        raise ValueError(f"odd label among {labels}")
    return [1.0 for _ in responses]


def one_float_per_call(responses, labels, metadata, **options):
    """The usual mistake: a per-row function (returns one float, not a list)."""
    return 1.0


def _rows(n: int) -> list[dict]:
    return eval_rows(SOURCE, n, prompt_field="question", label_field="answer")


def test_a_reward_failing_on_some_rows_costs_those_rows_only():
    rows = _rows(8)
    odd = sum(int(r["label"]) % 2 for r in rows)
    assert 0 < odd < 8
    r = greedy_accuracy("tiny-llama", rows, reward_fn=f"{__name__}:fails_on_odd_labels",
                        reward_options={}, max_new_tokens=2, batch_size=4)
    assert (r.n, r.errors, r.correct) == (8, odd, 8 - odd)
    first = rows[[int(x["label"]) % 2 for x in rows].index(1)]  # a generated source: no line
    assert r.first_error.startswith(f"prompt {first['prompt'][:60]!r}: ValueError: odd label")
    assert "failed on" in launch.eval_line("before", r)


def test_a_reward_that_cannot_warm_up_is_a_recipe_error_before_anything_is_made(tmp_path):
    recipe = tiny_recipe("127.0.0.1:9", tmp_path, "ev",
                         f'eval={{source: "{SOURCE}", size: 4, max_new_tokens: 2, '
                         f'reward: {{name: e, fn: "{__name__}:one_float_per_call"}}}}')
    with pytest.raises(RecipeError) as e:
        launch.train(recipe)  # the broker at :9 is never asked
    msg = str(e.value)
    assert msg.startswith("eval.reward.fn: reward ") and "\n" not in msg
    assert "returned 1.0 for an empty batch; expected []" in msg
    assert not (tmp_path / "ev").exists()


def test_a_reward_failing_on_every_eval_row_fails_the_eval_naming_its_key():
    rows = [r for r in _rows(12) if int(r["label"]) % 2][:3]
    recipe = tiny_recipe("127.0.0.1:9", "/tmp", "ev2",
                         f'eval={{source: "{SOURCE}", size: 3, max_new_tokens: 2, '
                         f'reward: {{name: e, fn: "{__name__}:fails_on_odd_labels"}}}}')
    with pytest.raises(RunFailed, match=r"^eval: eval\.reward\.fn '.*' failed on every one of "
                                        r"the 3 eval rows; the first: prompt '.*': ValueError"):
        launch.evaluate_held_out(recipe, "tiny-llama", rows)


def test_an_eval_source_short_of_eval_size_is_a_recipe_error_before_anything_is_made(tmp_path):
    recipe = tiny_recipe("127.0.0.1:9", tmp_path, "short",
                         f'eval={{source: "{SOURCE}", size: 500}}')
    with pytest.raises(RecipeError,
                       match=r"^eval\.size: eval source .* has only \d+ usable prompts"):
        launch.train(recipe)
    assert not (tmp_path / "short").exists()  # no run folder, no topics (the broker is :9)


def test_relax_eval_measures_a_model_on_the_recipes_eval_set(tmp_path):
    from typer.testing import CliRunner

    from relax.infra.cli.app import app

    base = ["eval", "recipes/tiny_ci.yaml", f"run_root={tmp_path}",
            f'eval={{source: "{SOURCE}", size: 6, max_new_tokens: 2, '
            'reward: {name: e, fn: "testdata:parity_reward"}}']
    res = CliRunner().invoke(app, base)
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("eval of tiny-llama: greedy held-out accuracy ") and "/6 = " in \
        res.stdout
    res = CliRunner().invoke(app, [*base, "--model", str(tmp_path / "no-such-folder")])
    assert res.exit_code == 2 and res.stderr.startswith("error: model: ")
    res = CliRunner().invoke(app, base[:2])  # tiny_ci has no eval section
    assert res.exit_code == 2 and res.stderr.startswith("error: eval: the recipe has no eval")
    res = CliRunner().invoke(app, [*base[:2], f'eval={{source: "{SOURCE}", size: 999}}'])
    assert res.exit_code == 2 and res.stderr.startswith("error: eval.size: eval source")


def test_relax_train_says_what_publishing_its_data_skipped_and_where_the_bad_rows_are(
        bus, unique, tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text('{"question": "2*3?", "answer": 6}\n{"question": "2*3?", "answer": 6}\n'
                   '{"question": "4*4?", "answer": null}\n{"question": "5*5?", "answer": 25}\n')
    recipe = tiny_recipe(bus.bootstrap_servers, tmp_path, unique, f"data.source={src}",
                         f"data.dataset={unique}", "data.limit=null")
    said: list[str] = []
    launch._publish_data(recipe, bus, said.append)
    assert said == [f"prompts: published=2 errors=1 topic=prompts.{unique} (skipped 1 rows "
                    "repeating an earlier prompt) (first error: line 3: field 'answer' (the "
                    "label field) is null; give the row a label, or publish without a label "
                    f"field for rewards that need none; see `relax errors prompts.{unique}`)"]
    # the same data.dataset with another source: the run would train on the old prompts
    other = tmp_path / "d2.jsonl"
    other.write_text('{"question": "2*3?", "answer": 6}\n{"question": "7*7?", "answer": 49}\n')
    said.clear()
    launch._publish_data(tiny_recipe(bus.bootstrap_servers, tmp_path, unique,
                                     f"data.source={other}", f"data.dataset={unique}",
                                     "data.limit=null"), bus, said.append)
    assert said[0] == f"prompts: prompts.{unique} already holds 2 prompts"
    assert said[1].startswith(f"warning: 1 of data.source's 2 prompts are not in prompts.{unique}")
    assert len(said) == 2
