"""Helpers of the ``relax train --resume`` tests (``tests/e2e/test_resume*.py``): start the
tiny recipe's driver as a subprocess, SIGKILL it (and its stages) at a moment, resume it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from testdata import PARITY_REWARD, RECIPES

CLI = [sys.executable, "-m", "relax.infra.cli.app", "train"]
EVAL = ('eval={source: "reasoning_gym:basic_arithmetic?size=40&seed=7&min_digits=1'
        '&max_digits=1", size: 4, max_new_tokens: 2, after: false, '
        'reward: {name: e, fn: "testdata:parity_reward"}}')
"""A held-out eval of 4 prompts, before training only (the resumed part reuses it)."""


def start(run_dir: Path, *args: str) -> subprocess.Popen:
    """``relax train`` of the tiny recipe as run ``run_dir.name`` under ``run_dir.parent``,
    its output in ``run_dir.parent/<run>.part1.log``."""
    return subprocess.Popen(
        [*CLI, str(RECIPES / "tiny_ci.yaml"), f"run={run_dir.name}",
         f"run_root={run_dir.parent}", PARITY_REWARD, *args],
        stdout=(run_dir.parent / f"{run_dir.name}.part1.log").open("w"),
        stderr=subprocess.STDOUT, env=os.environ.copy())


def kill_when(driver: subprocess.Popen, ready: Path, run_dir: Path, everything: bool,
               timeout_s: float = 400.0) -> list[int]:
    """SIGKILL the driver (and with ``everything`` every stage process in
    ``stages.json`` at the same moment) as soon as ``ready`` exists; the pids killed."""
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        log = (run_dir.parent / f"{run_dir.name}.part1.log").read_text()
        assert driver.poll() is None, f"the driver ended before {ready.name}:\n{log[-3000:]}"
        assert time.monotonic() < deadline, f"no {ready} in {timeout_s}s:\n{log[-3000:]}"
        time.sleep(0.02)
    pids = [driver.pid]
    if everything:
        pids += [s["pid"] for s in json.loads((run_dir / "stages.json").read_text()).values()]
    for p in pids:
        os.kill(p, signal.SIGKILL)
    driver.wait(30)
    return pids


def resume(target: str, *args: str, timeout_s: float = 500,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``relax train --resume target *args`` run to its end."""
    return subprocess.run([*CLI, "--resume", target, *args], capture_output=True, text=True,
                          timeout=timeout_s, env=os.environ.copy(), cwd=cwd, check=False)


def last_line_counts(stdout: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in stdout.strip().splitlines()[-1].split())}
