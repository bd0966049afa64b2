"""One ``key=value`` grammar for every command (``infra/recipe/overrides.py``): recipe overrides,
``relax stage --set`` and ``relax reward --option`` read a value the same way."""

from __future__ import annotations

import pytest
import typer

from relax.infra.cli.reward import parse_options
from relax.infra.cli.stages import stage_settings
from relax.infra.recipe.overrides import parse_override, parse_settings

ITEMS = ["lr=2e-5", "steps=3", "on=true", "names=[a, b]", "engine=hf", "opt.beta=0.9"]
WANT = {"lr": 2e-5, "steps": 3, "on": True, "names": ["a", "b"], "engine": "hf",
        "opt": {"beta": 0.9}}


def test_every_command_reads_key_value_alike():
    assert parse_settings(ITEMS) == WANT
    assert parse_options(ITEMS) == WANT  # relax reward attach/eval --option
    assert stage_settings(None, ITEMS) == WANT  # relax stage --set
    assert isinstance(parse_override("lr=2e-5")[1], float)  # YAML 1.1 alone says "2e-5"


@pytest.mark.parametrize("bad", ["noequals", "=3", "k=[1, 2"])
def test_a_bad_item_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="override"):
        parse_settings([bad])
    with pytest.raises(typer.BadParameter):
        parse_options([bad])
    with pytest.raises(typer.BadParameter):
        stage_settings(None, [bad])


def test_explicit_options_come_before_set_and_set_wins():
    assert stage_settings(None, ["model=b"], model="a", run="r") == {"model": "b", "run": "r"}
