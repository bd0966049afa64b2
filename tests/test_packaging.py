"""A regular (non-editable) install of relax works: the wheel built from a copy of the
tree, installed without its dependencies into a fresh venv that sees the dev venv's
third-party packages (``deps.pth``) but not its editable relax, imports every
subpackage from the wheel and runs ``relax --help`` and ``relax --version``. Every other
test runs on the editable install, which finds any folder of the tree: a subpackage
missing from the wheel (``relax.consumers.environments`` once was) is found only here."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".venv", ".kafka", ".git", "runs", "build", "dist", "tests", "benchmarks",
        "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis"}

pytestmark = pytest.mark.slow


def _subpackages() -> list[str]:
    """Every folder of the tree with an ``__init__.py``, as a ``relax.*`` name."""
    out = ["relax"]
    for init in sorted(ROOT.rglob("__init__.py")):
        rel = init.parent.relative_to(ROOT)
        if rel.parts and rel.parts[0] not in SKIP and not rel.parts[0].endswith(".egg-info"):
            out.append(".".join(["relax", *rel.parts]))
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel of this tree installed (no deps, not editable)."""
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=lambda d, names: [
        n for n in names if n in SKIP - {"tests", "benchmarks"} or n.endswith(".egg-info")])
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp / "dist"), str(src)], check=True, timeout=300)
    wheel = next((tmp / "dist").glob("relax_rl-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    # the third-party packages of the dev venv, without its .pth files (the editable relax)
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--no-deps", "-q", str(wheel)], check=True, timeout=300)
    return venv


def test_the_wheel_holds_every_subpackage_and_the_command_runs(installed, tmp_path):
    names = _subpackages()
    assert "relax.consumers.environments" in names and "relax.streams.weights" in names
    code = ("import importlib, json, sys\n"
            f"names = {names!r}\n"
            "print(json.dumps({n: importlib.import_module(n).__file__ for n in names}))\n")
    py = installed / "bin" / "python"
    out = subprocess.run([str(py), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    files = json.loads(out.stdout.strip().splitlines()[-1])
    site = str(installed)
    assert all(f.startswith(site) for f in files.values()), files  # from the wheel
    infra = Path(files["relax.infra"]).parent
    assert (infra / "observe" / "static" / "dashboard.html").is_file()
    assert (infra / "kafka" / "pom.xml").is_file()
    relax = installed / "bin" / "relax"
    help_ = subprocess.run([str(relax), "--help"], capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0 and "train" in help_.stdout, help_.stderr[-2000:]
    from relax import __version__

    version = subprocess.run([str(relax), "--version"], capture_output=True, text=True,
                             timeout=120)
    assert version.returncode == 0 and version.stdout.strip() == f"relax {__version__}"
