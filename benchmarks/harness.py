"""What every benchmark of relax shares: the machine a figure was measured on, a broker to
measure on, the tests' tiny recipe, and where results go.

Every benchmark writes one JSON document (:func:`write_result`) with a ``machine`` key
(:func:`machine`: CPUs, CPU model, GPU, platform, versions, commit, UTC date), so that
``results_md.py`` can put each figure beside the machine, date and commit it came from.
Benchmarks run from a checkout with relax installed editable (``make install``): they
import each other as ``relax.benchmarks.<name>`` and the tests' helpers as
``relax.tests.testdata``, never through ``sys.path``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The checkout (the ``relax`` package's folder)."""
RESULTS = Path(__file__).resolve().parent / "results"
"""``benchmarks/results/``: the JSON documents ``results_md.py`` renders."""
PARITY_REWARD = 'rewards=[{name: parity, fn: "relax.tests.testdata:parity_reward"}]'
"""The tests' parity reward by its package path, importable by every stage process of a
run started from here (the tests' own spelling, ``testdata:...``, needs ``tests/`` on
the path)."""


def commit() -> str | None:
    """The checkout's short commit (``+`` appended when tracked files differ from it);
    None outside a git checkout."""
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=False,
                         capture_output=True, text=True)
    if git.returncode != 0:
        return None
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], cwd=ROOT,
                           check=False).returncode != 0
    return git.stdout.strip() + ("+" if dirty else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(**versions: str | None) -> dict:
    """The machine and software of this run: ``cpus`` (int), ``cpu`` (model name),
    ``gpu`` (CUDA device name or None; torch is asked only if already imported),
    ``platform``, ``python``, ``torch`` (or None), ``commit`` (:func:`commit`), ``date``
    (UTC, ``YYYY-MM-DD HH:MM``), ``load`` (the 1, 5 and 15-minute load averages now: on a
    shared machine, how busy it was) and any ``versions`` given (e.g. ``kafka="4.4.0"``)."""
    import sys

    torch = sys.modules.get("torch")
    gpu = (torch.cuda.get_device_name(0) if torch is not None and torch.cuda.is_available()
           else None)
    return {"cpus": os.cpu_count(), "cpu": _cpu_model(), "gpu": gpu,
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__ if torch is not None else None, "commit": commit(),
            "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "load": [round(x, 1) for x in os.getloadavg()], **versions}


def write_result(path: Path | str, doc: dict, **versions: str | None) -> Path:
    """Write ``doc`` as indented JSON to ``path`` (folders made), with ``machine`` set to
    :func:`machine` (``versions`` added) unless ``doc`` has one; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine(**versions), **doc} if "machine" not in doc else doc
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


@contextmanager
def broker(bootstrap: str | None = None,
           nodes: int | None = None) -> Iterator[tuple[str, list[int]]]:
    """``(bootstrap, broker pids)`` for the ``with`` block: the cluster at ``bootstrap``
    (no pids: nothing of it is measured), else a local Apache Kafka of ``nodes`` nodes
    (default 1) in a temporary folder, stopped and deleted afterwards
    (:class:`relax.infra.broker.local.LocalBroker`).

    Raises:
        FileNotFoundError, TimeoutError: as :func:`relax.infra.broker.kafka.start_kafka`
            (no Kafka installed: ``make install``; a node that does not come up).
    """
    if bootstrap:
        yield bootstrap, []
        return
    from relax.infra.broker.local import LocalBroker

    with LocalBroker(brokers=nodes) as handle:
        yield handle.bootstrap, handle.pids


def tiny_recipe(bootstrap: str, run_root, run: str, *overrides: str):
    """``recipes/tiny_ci.yaml`` (the tests' tiny random Llama) on ``bootstrap``, writing
    under ``run_root`` as run ``run``, scored by the tests' parity reward
    (:data:`PARITY_REWARD`), then ``overrides`` (``key=value``); a loaded recipe."""
    from relax.tests.testdata import tiny_recipe as tests_tiny_recipe

    return tests_tiny_recipe(bootstrap, run_root, run, PARITY_REWARD, *overrides)
