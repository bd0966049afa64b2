"""A finished tiny-model run on the session broker, shared by the e2e tests."""

from __future__ import annotations

from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def tiny_recipe(broker: str, run_root: Path, run: str, *overrides: str):
    from relax.infra.recipe import load_recipe

    return load_recipe(RECIPES / "tiny_ci.yaml", [f"bootstrap_servers={broker}",
                                                  f"run_root={run_root}", f"run={run}",
                                                  *overrides])


@pytest.fixture(scope="session")
def tiny_run(broker, tmp_path_factory):
    """``(recipe, summary)`` of recipes/tiny_ci.yaml run through the session broker
    (its topics stay on the broker for the tests that read them)."""
    import uuid

    from relax.infra.launch import train

    root = tmp_path_factory.mktemp("runs")
    recipe = tiny_recipe(broker, root, "tiny" + uuid.uuid4().hex[:6],
                         "trainer.keep_checkpoints=10")
    lines: list[str] = []
    summary = train(recipe, say=lines.append, timeout_s=400)
    summary["lines"] = lines
    return recipe, summary
