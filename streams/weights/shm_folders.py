"""Where the weight channel's same-host files live and when they go: torch-free, so the
driver (``relax train``) can remove a run's folders without loading the transport
(:mod:`relax.streams.weights.shm`, which maps them).
"""

from __future__ import annotations

import shutil
from pathlib import Path

SHM_ROOT = "/dev/shm"
"""Where the same-host files go by default (a tmpfs on Linux)."""


def publisher_folder(root: str | Path, run: str, incarnation: str) -> Path:
    """The folder of one publisher of ``run``: ``<root>/relax-weights-<run>-<incarnation>``
    (``incarnation`` alphanumeric: :func:`remove_run_files` tells ``<run>``'s folders from
    run ``<run>-2``'s by it)."""
    return Path(root) / f"relax-weights-{run}-{incarnation}"


def remove_run_files(root: str | Path, run: str) -> None:
    """Remove the same-host folders of every publisher of ``run`` under ``root`` (a
    trainer that was killed leaves its own; the driver calls this when a run ends)."""
    prefix = f"relax-weights-{run}-"
    for old in Path(root).glob(f"{prefix}*"):
        if old.name[len(prefix):].isalnum():  # not run "<run>-2"'s: "2-<incarnation>"
            shutil.rmtree(old, ignore_errors=True)
