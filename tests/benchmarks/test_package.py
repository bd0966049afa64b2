"""``benchmarks/`` is a package of the product's benchmarks (``relax.benchmarks``): every
module imports (their heavy imports are inside functions or light), and none reaches
another module or the tests' helpers through ``sys.path``."""

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MODULES = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_module_imports(name):
    module = importlib.import_module(f"relax.benchmarks.{name}")
    assert module.__doc__, f"benchmarks/{name}.py has no docstring"


def test_no_benchmark_touches_sys_path():
    bad = []
    for p in BENCHMARKS.glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "path"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys"):
                bad.append(f"{p.name}:{node.lineno}")
    assert not bad, f"sys.path in benchmarks: {bad}"
