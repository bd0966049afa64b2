"""Run one reward function in worker processes, with a time limit per call and a memory
limit per worker, so a failing reward gives null values with the error text, never a
crashed stage.

Contract:

* Each worker is a *spawned* process (no fork: the parent holds Kafka client threads).
  It ignores SIGINT (the parent owns Ctrl-C), sets ``RLIMIT_AS`` to
  ``memory_limit_bytes``, loads the function (:func:`relax.consumers.reward.load_reward_fn`)
  and calls it once with an empty batch: imports and model loads happen there,
  outside the time limit. A function that fails to load or to warm up stops the pool
  start with :class:`RewardLoadError` (a configuration error, not row data).
* :meth:`RewardPool.score` cuts the rows into calls of at most ``batch_rows`` rows
  (fewer when that keeps every worker busy) and spreads them over the workers.
* A call that raises fails with the exception text. A call past ``timeout_s``
  seconds has its worker killed (SIGKILL) and replaced. A ``MemoryError`` (the
  address-space limit) is reported, then the worker exits and is replaced; a worker
  that dies (OOM killer, segfault) is replaced too.
* A failed call of several rows is retried one row per call, so one bad row never
  costs the others their values; a row that fails alone gets ``value=None`` and the
  error text. Non-finite or non-numeric values are per-row errors.
* Parent and workers exchange JSON messages over a pipe (``send_bytes``), never pickle.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import signal
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Self

from relax.consumers.reward.base import Score
from relax.streams.stage import StageConfigError

log = logging.getLogger(__name__)

DEFAULT_MEMORY_LIMIT_BYTES = 4 << 30
"""Default address-space limit of a worker (bytes); raise it for model-based rewards."""


class RewardLoadError(RuntimeError):
    """A worker could not load the reward function, warm it up, or start in time."""


class RewardFunctionError(RewardLoadError, StageConfigError):
    """The reward function failed to load or failed its warm-up call on an empty batch:
    every worker, and every restart, would fail the same way."""


@dataclass
class RowResult:
    """The outcome of one row.

    Attributes:
        value: reward (float, stored as float32) or None (abstain or error).
        details: JSON-serialisable explanation from the function.
        error: exception, timeout or memory text when the row failed, else None.
        elapsed_s: the row's share of its call's time (seconds).
    """

    value: float | None
    details: dict = field(default_factory=dict)
    error: str | None = None
    elapsed_s: float = 0.0


@dataclass
class PoolStats:
    """Counters since the pool started: calls sent, rows scored, failed calls by kind,
    worker restarts, rows retried alone after a failed call, rows ending in an error."""

    calls: int = 0
    rows: int = 0
    exceptions: int = 0
    timeouts: int = 0
    memory_errors: int = 0
    worker_deaths: int = 0
    restarts: int = 0
    retried_rows: int = 0
    row_errors: int = 0


def _describe(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} in {tb[-1].name})" \
        if tb else ""
    return f"{type(e).__name__}: {e}{where}"[:2000]


def _send(conn, msg: dict) -> None:
    conn.send_bytes(json.dumps(msg, default=str).encode())


def normalise(out, n: int) -> list[list]:
    """A function's output as ``[[value, details, error], ...]`` (JSON-ready).

    Raises:
        TypeError / ValueError: when ``out`` is not a list of ``n`` items.
    """
    if not isinstance(out, (list, tuple)):
        raise TypeError(f"reward function returned {type(out).__name__}; expected a list of "
                        f"{n} values")
    if len(out) != n:
        raise ValueError(f"reward function returned {len(out)} values for {n} rows")
    rows = []
    for item in out:
        value, details, error = (item.value, item.details, item.error) \
            if isinstance(item, Score) else (item, {}, None)
        if value is not None and error is None:
            if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
                error = f"reward value {value!r} is not a number"
            elif not math.isfinite(float(value)):
                error = f"reward value {float(value)} is not finite"
            else:
                value = float(value)
        rows.append([None if error else value, details if isinstance(details, dict) else
                     {"details": details}, error])
    return rows


def _worker_main(conn, spec: str, options_json: str, memory_limit_bytes: int | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_limit_bytes:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    options = json.loads(options_json)
    try:
        from relax.consumers.reward import load_reward_fn

        fn = load_reward_fn(spec)
        warm = fn([], [], [], **options)
        if not isinstance(warm, (list, tuple)) or len(warm) != 0:
            raise TypeError(f"returned {warm!r:.80} for an empty batch; expected [] (a reward "
                            "function takes lists of N responses, labels and metadata dicts "
                            "and returns a list of N values)")
    except Exception as e:  # noqa: BLE001  (reported to the parent, which refuses to start)
        _send(conn, {"ready": False, "error": f"reward {spec!r} failed to load or warm up: "
                                              f"{_describe(e)}"})
        return
    _send(conn, {"ready": True})
    while True:
        try:
            req = json.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the parent closed the pipe: stop
            return
        t0 = time.perf_counter()
        try:
            out = fn(req["responses"], req["labels"], req["metadata"], **options)
            rows = normalise(out, len(req["responses"]))
        except MemoryError as e:
            _send(conn, {"ok": False, "kind": "memory", "exiting": True,
                         "error": f"memory limit ({memory_limit_bytes} bytes): {_describe(e)}",
                         "elapsed_s": time.perf_counter() - t0})
            return
        except Exception as e:  # noqa: BLE001  (the isolation boundary: failures become row data)
            _send(conn, {"ok": False, "kind": "exception", "error": _describe(e),
                         "elapsed_s": time.perf_counter() - t0})
            continue
        _send(conn, {"ok": True, "rows": rows, "elapsed_s": time.perf_counter() - t0})


class _Worker:
    def __init__(self, ctx, spec: str, options_json: str, memory_limit_bytes: int | None,
                 startup_timeout_s: float, index: int):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, name=f"reward-worker-{index}",
                                args=(child, spec, options_json, memory_limit_bytes), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.deadline = time.monotonic() + startup_timeout_s
        self.rows: list[int] | None = None
        self.t0 = 0.0

    def stop(self, timeout_s: float = 2.0) -> None:
        self.conn.close()
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout_s)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5.0)
        self.conn.close()


class RewardPool:
    """Worker processes running one reward function (module docstring for the contract).

    Args:
        spec: reward name or ``module:function``.
        options: keyword options of the function (JSON-serialisable).
        workers: number of worker processes (>= 1).
        timeout_s: time limit of one call (seconds).
        memory_limit_bytes: ``RLIMIT_AS`` of each worker (bytes); None = no limit.
        batch_rows: most rows per call.
        startup_timeout_s: time a worker may take to load and warm up (seconds).

    Raises:
        ValueError: bad numbers, or options that are not JSON-serialisable.
        RewardLoadError: a worker could not load or warm up the function.
    """

    def __init__(self, spec: str, options: dict | None = None, *, workers: int = 1,
                 timeout_s: float = 30.0, memory_limit_bytes: int | None = DEFAULT_MEMORY_LIMIT_BYTES,
                 batch_rows: int = 64, startup_timeout_s: float = 300.0):
        if workers < 1 or batch_rows < 1 or not timeout_s > 0:
            raise ValueError(f"need workers >= 1, batch_rows >= 1, timeout_s > 0; got "
                             f"{workers}, {batch_rows}, {timeout_s}")
        try:
            self._options_json = json.dumps(options or {})
        except TypeError as e:
            raise ValueError(f"reward options must be JSON-serialisable: {e}") from None
        self.spec, self.timeout_s, self.batch_rows = spec, timeout_s, batch_rows
        self.memory_limit_bytes, self.startup_timeout_s = memory_limit_bytes, startup_timeout_s
        self.stats = PoolStats()
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        try:
            self._workers = [self._start(i) for i in range(workers)]
            while not all(w.ready for w in self._workers):
                self._wait(self._workers)
                for w in self._workers:
                    if not w.ready:
                        self._check_start(w)
        except BaseException:
            self.close()
            raise

    @property
    def workers(self) -> int:
        """Number of worker processes."""
        return len(self._workers)

    def pids(self) -> list[int]:
        """Process ids of the current workers (changes when one is replaced)."""
        return [w.proc.pid for w in self._workers]

    def _start(self, index: int) -> _Worker:
        return _Worker(self._ctx, self.spec, self._options_json, self.memory_limit_bytes,
                       self.startup_timeout_s, index)

    def _check_start(self, w: _Worker) -> None:
        if w.conn.poll():
            try:
                msg = json.loads(w.conn.recv_bytes())
            except (EOFError, OSError):  # died while starting: perhaps not the function's fault
                raise RewardLoadError(f"reward {self.spec!r}: worker exited with code "
                                      f"{w.proc.exitcode} while starting") from None
            if not msg.get("ready"):  # the function itself failed to load or warm up
                raise RewardFunctionError(msg.get("error", "worker failed to start"))
            w.ready = True
        elif not w.proc.is_alive():
            raise RewardLoadError(f"reward {self.spec!r}: worker exited with code "
                                  f"{w.proc.exitcode} while starting")
        elif time.monotonic() > w.deadline:
            raise RewardLoadError(f"reward {self.spec!r}: worker did not start within "
                                  f"{self.startup_timeout_s} s")

    def _wait(self, active: list[_Worker]) -> None:
        if not active:
            return
        now = time.monotonic()
        timeout = max(0.0, min(w.deadline for w in active) - now)
        wait([w.conn for w in active] + [w.proc.sentinel for w in active], timeout)

    def _replace(self, w: _Worker) -> None:
        w.kill()
        i = self._workers.index(w)
        self._workers[i] = self._start(i)
        self.stats.restarts += 1

    def score(self, responses: list[str], labels: list[str | None],
              metadata: list[dict]) -> list[RowResult]:
        """Score ``[N]`` rows; returns ``[N]`` :class:`RowResult` in input order.

        Raises:
            ValueError: when the three lists differ in length.
            RewardLoadError: when a replacement worker cannot start.
        """
        n = len(responses)
        if len(labels) != n or len(metadata) != n:
            raise ValueError(f"responses, labels and metadata differ in length: "
                             f"{n}, {len(labels)}, {len(metadata)}")
        results: list[RowResult | None] = [None] * n
        size = max(1, min(self.batch_rows, -(-n // len(self._workers))))
        pending = deque(list(range(i, min(i + size, n))) for i in range(0, n, size))
        while pending or any(w.rows is not None for w in self._workers):
            for w in self._workers:
                if w.ready and w.rows is None and pending:
                    self._dispatch(w, pending.popleft(), responses, labels, metadata)
            self._wait([w for w in self._workers if w.rows is not None or not w.ready])
            for w in list(self._workers):
                if not w.ready:
                    self._check_start(w)
                elif w.rows is not None:
                    self._collect(w, pending, results)
        self.stats.row_errors += sum(1 for r in results if r.error is not None)
        return results  # type: ignore[return-value]

    def _dispatch(self, w: _Worker, rows: list[int], responses, labels, metadata) -> None:
        _send(w.conn, {"responses": [responses[i] for i in rows],
                       "labels": [labels[i] for i in rows],
                       "metadata": [metadata[i] for i in rows]})
        w.rows, w.t0 = rows, time.monotonic()
        w.deadline = w.t0 + self.timeout_s
        self.stats.calls += 1

    def _collect(self, w: _Worker, pending: deque, results: list) -> None:
        rows, now = w.rows, time.monotonic()
        msg = None
        if w.conn.poll():
            try:
                msg = json.loads(w.conn.recv_bytes())
            except (EOFError, OSError):
                msg = None
            if msg is None:
                self.stats.worker_deaths += 1
                w.proc.join(1.0)
                self._fail(rows, self._death_text(w), now - w.t0, pending, results)
                self._replace(w)
                return
        elif not w.proc.is_alive():
            self.stats.worker_deaths += 1
            self._fail(rows, self._death_text(w), now - w.t0, pending, results)
            self._replace(w)
            return
        elif now >= w.deadline:
            self.stats.timeouts += 1
            self._fail(rows, f"timeout: the reward call on {len(rows)} row(s) ran past "
                             f"timeout_s={self.timeout_s} (worker killed and replaced)",
                       now - w.t0, pending, results)
            self._replace(w)
            return
        else:
            return
        w.rows = None
        if msg.get("ok"):
            share = msg["elapsed_s"] / len(rows)
            for i, (value, details, error) in zip(rows, msg["rows"]):
                results[i] = RowResult(value, details, error, share)
            self.stats.rows += len(rows)
            return
        if msg.get("kind") == "memory":
            self.stats.memory_errors += 1
        else:
            self.stats.exceptions += 1
        self._fail(rows, msg["error"], msg.get("elapsed_s", 0.0), pending, results)
        if msg.get("exiting"):
            self._replace(w)

    def _death_text(self, w: _Worker) -> str:
        code = w.proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return (f"worker died ({how}; out of memory or a crash in native code) "
                f"and was replaced")

    def _fail(self, rows: list[int], error: str, elapsed_s: float, pending: deque,
              results: list) -> None:
        if len(rows) > 1:
            if not self.stats.retried_rows:  # the first only: the counters tell the rest
                log.warning("reward %r: a call on %d rows failed (%s); its rows are retried one "
                            "by one (a function that works on one row but not on a batch is "
                            "slower for it)", self.spec, len(rows), error)
            self.stats.retried_rows += len(rows)
            pending.extend([i] for i in rows)
            return
        self.stats.rows += 1
        results[rows[0]] = RowResult(None, {}, error, elapsed_s)

    def close(self) -> None:
        """Stop every worker (close its pipe, then kill it if it lingers)."""
        for w in self._workers:
            w.stop()
        self._workers = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
