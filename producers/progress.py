"""A rich progress bar on stderr with phases (``relax publish``: reading, then sending)."""

from __future__ import annotations


class Progress:
    """A rich progress bar on stderr, or nothing when ``enabled`` is false: ``start`` a
    phase (its total, None when unknown), ``advance`` it; used as a context manager."""

    def __init__(self, enabled: bool):
        self.enabled, self._p, self._task = enabled, None, None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._p = Progress(TextColumn("{task.description}"), BarColumn(),
                               MofNCompleteColumn(), TimeElapsedColumn(),
                               console=Console(stderr=True), transient=False)
            self._p.__enter__()
        return self

    def start(self, description: str, total: int | None) -> None:
        if self._p is not None:
            if self._task is not None:  # close the previous phase at what it counted
                done = next(t.completed for t in self._p.tasks if t.id == self._task)
                self._p.update(self._task, total=done)
            self._task = self._p.add_task(description, total=total)

    def advance(self, n: int = 1) -> None:
        if self._p is not None:
            self._p.advance(self._task, n)

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.__exit__(*exc)
