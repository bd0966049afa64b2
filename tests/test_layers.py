"""Imports point down the layers (docs/architecture.md, "Layers"):

    schemas < streams < trainer < consumers < producers < infra

A module may import its own layer's modules and any lower layer's, never a higher one.
Every ``import`` counts, at module level or inside a function (a lazy import is still a
dependency). ``benchmarks/`` and ``tests/`` sit above everything. Within the layers,
modules import each other without a circle (a lazy import that closes one still counts),
and no module imports another module's ``_private`` names: two modules that need each
other's private parts are one module, and one that needs the other's is a seam to name.
Modules are split where a seam is, not at a line count.
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


def _modules() -> dict[str, Path]:
    """``relax.<dotted name>`` -> file of every module of the layers."""
    out = {}
    for layer in LAYERS:
        for p in (ROOT / layer).rglob("*.py"):
            name = ".".join(["relax", *p.relative_to(ROOT).with_suffix("").parts])
            out[name.removesuffix(".__init__")] = p
    return out


def module_imports(path: Path, modules: dict[str, Path]) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` of every import in ``path`` of a module in ``modules``
    (lazy ones and ``if TYPE_CHECKING:`` ones too): ``from relax.a.b import c`` gives
    ``relax.a.b.c`` when that is a module (and the package ``relax.a.b`` itself, whose
    ``__init__`` it runs), else ``relax.a.b`` with ``name`` ``c``; ``import relax.a``
    gives no name."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in modules:
                    out.append((node.lineno, sub, None))
                    if node.module in modules:  # `from pkg import sub` runs pkg's __init__
                        out.append((node.lineno, node.module, None))
                elif node.module in modules:
                    out.append((node.lineno, node.module, a.name))
    return out


def private_imports() -> list[str]:
    """``file:line module._name`` for every import of another module's private name."""
    modules = _modules()
    bad = []
    for me, path in sorted(modules.items()):
        for line, target, name in module_imports(path, modules):
            if name and name.startswith("_") and not name.startswith("__") and target != me:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}.{name}")
    return bad


def import_circles() -> list[list[str]]:
    """Every set of modules that import each other in a circle (the strongly connected
    components of the import graph with more than one module, Tarjan's algorithm)."""
    modules = _modules()
    edges = {m: {t for _, t, _ in module_imports(p, modules) if t != m}
             for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return circles


def test_no_import_circle():
    circles = import_circles()
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_no_import_of_another_modules_private_names():
    bad = private_imports()
    assert not bad, "imports of another module's private names:\n" + "\n".join(bad)


def test_the_checker_sees_a_lazy_circle_and_a_private_import(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from relax.x.b import helper\n")
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                 "    from relax.x import a\ndef f():\n    from relax.x.a import _secret\n")
    modules = {"relax.x": tmp_path / "__init__.py", "relax.x.a": a, "relax.x.b": b}
    assert module_imports(a, modules) == [(1, "relax.x.b", "helper")]
    assert sorted(module_imports(b, modules)) == [
        (3, "relax.x", None), (3, "relax.x.a", None), (5, "relax.x.a", "_secret")]
