"""Imports point down the layers (docs/architecture.md, "Layers"):

    schemas < streams < trainer < consumers < producers < infra

A module may import its own layer's modules and any lower layer's, never a higher one.
Every ``import`` counts, at module level or inside a function (a lazy import is still a
dependency). ``benchmarks/`` and ``tests/`` sit above everything. Within the layers,
modules import each other without a circle (a lazy import that closes one still counts),
and no module imports another module's ``_private`` names: two modules that need each
other's private parts are one module, and one that needs the other's is a seam to name.
Modules are split where a seam is, not at a line count.

Inside ``infra/`` the same rule holds between its folders (docs/architecture.md,
"infra/"), top to bottom: ``cli/`` > ``control/`` > ``offline/`` > ``recipe/``,
``observe/``, ``broker/``. A folder imports its own modules and those of folders on a
lower floor; the three bottom folders import none of each other, and every module of
``infra/`` is in one of the folders.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("schemas", "streams", "trainer", "consumers", "producers", "infra")
RANK = {name: i for i, name in enumerate(LAYERS)}
INFRA_FLOORS = {"recipe": 0, "observe": 0, "broker": 0, "offline": 1, "control": 2, "cli": 3}
"""The folders of ``infra/`` and their floor (0 at the bottom)."""


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


def infra_upward_imports(modules: dict[str, Path] | None = None) -> list[str]:
    """``module:line imports module`` for every import between two folders of ``infra/``
    that does not point down :data:`INFRA_FLOORS` (lazy ones included)."""
    modules = _modules() if modules is None else modules
    bad = []
    for me, path in sorted(modules.items()):
        src = me.split(".")
        if src[:2] != ["relax", "infra"] or len(src) < 3:
            continue
        for line, target, _ in module_imports(path, modules):
            dst = target.split(".")
            if dst[:2] == ["relax", "infra"] and len(dst) > 2 and dst[2] != src[2] \
                    and INFRA_FLOORS[dst[2]] >= INFRA_FLOORS[src[2]]:
                bad.append(f"{me}:{line} imports {target}")
    return bad


def test_infra_folders_import_down():
    bad = infra_upward_imports()
    assert not bad, "imports between infra/ folders that do not point down:\n" + "\n".join(bad)


def test_every_infra_module_is_in_a_folder():
    infra = ROOT / "infra"
    loose = sorted(p.name for p in infra.glob("*.py") if p.name != "__init__.py")
    folders = {p.name for p in infra.iterdir() if (p / "__init__.py").exists()}
    assert not loose, f"modules of infra/ outside its folders: {loose}"
    assert folders == set(INFRA_FLOORS), folders ^ set(INFRA_FLOORS)


def test_the_checker_sees_an_infra_import_up_or_across(tmp_path):
    """An import up a floor (lazy too) and one between two bottom folders are found; one
    down a floor and one inside a folder are not."""
    files = {name: tmp_path / f"{name.replace('.', '_')}.py" for name in (
        "relax.infra.recipe.a", "relax.infra.recipe.b", "relax.infra.observe.c",
        "relax.infra.control.d")}
    files["relax.infra.recipe.a"].write_text(
        "from relax.infra.recipe.b import x\ndef f():\n    from relax.infra.control import d\n")
    files["relax.infra.recipe.b"].write_text("import relax.infra.observe.c\n")
    files["relax.infra.observe.c"].write_text("")
    files["relax.infra.control.d"].write_text("from relax.infra.recipe.a import y\n")
    assert infra_upward_imports(files) == [
        "relax.infra.recipe.a:3 imports relax.infra.control.d",
        "relax.infra.recipe.b:1 imports relax.infra.observe.c"]
