"""Every command's ``--help`` renders (help strings are rich markup: a stray ``[`` breaks it)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from relax.infra.cli.app import app


def _command_paths(t: typer.Typer, prefix=()):
    yield prefix
    for c in t.registered_commands:
        yield (*prefix, c.name or c.callback.__name__.replace("_", "-"))
    for g in t.registered_groups:
        yield from _command_paths(g.typer_instance, (*prefix, g.name))


PATHS = list(_command_paths(app))


def test_the_tree_is_walked():
    assert ("publish",) in PATHS and ("broker", "start") in PATHS and len(PATHS) > 12


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "relax")
def test_help_renders(path):
    r = CliRunner().invoke(app, [*path, "--help"])
    assert r.exit_code == 0, r.output
    assert "Usage" in r.output
