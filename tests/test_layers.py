"""Imports point down the layers (docs/architecture.md, "Layers"):

    schemas < streams < trainer < consumers < producers < infra

A module may import its own layer's modules and any lower layer's, never a higher one.
Every ``import`` counts, at module level or inside a function (a lazy import is still a
dependency). ``benchmarks/`` and ``tests/`` sit above everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("schemas", "streams", "trainer", "consumers", "producers", "infra")
RANK = {name: i for i, name in enumerate(LAYERS)}


def _package_of(path: Path) -> str:
    return path.relative_to(ROOT).parts[0]


def _relax_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, top-level relax package)`` of every ``relax.*`` import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "relax":
                names = [f"relax.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "relax" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def upward_imports() -> list[str]:
    """``file:line imports <layer>`` for every import that points up the layers."""
    bad = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            for line, target in _relax_imports(path):
                if target in RANK and RANK[target] > RANK[layer]:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports relax.{target}")
    return bad


def test_imports_point_down_the_layers():
    bad = upward_imports()
    assert not bad, "imports that point up the layers:\n" + "\n".join(bad)


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir()
                if p.is_dir() and (p / "__init__.py").exists()}
    assert packages - {"tests", "benchmarks"} <= set(LAYERS), packages - set(LAYERS)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checker itself: a lazy ``from relax.infra...`` inside a function is found."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from relax.infra.cores import x\n    import relax.trainer\n")
    assert _relax_imports(f) == [(2, "infra"), (3, "trainer")]


MAX_LINES = 450


def test_no_module_over_450_lines():
    """One idea per module: a module that grows past 450 lines is split (docs/architecture.md)."""
    big = [f"{p.relative_to(ROOT)}: {n} lines" for layer in LAYERS
           for p in sorted((ROOT / layer).rglob("*.py"))
           if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, "modules over 450 lines:\n" + "\n".join(big)
