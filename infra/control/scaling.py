"""Scaling a live run's rollout instances: one operation at a time, each with a state.

An operation asks for a number of rollout instances. It goes

    PENDING -> STARTING -> HEALTH_CHECKING -> WEIGHT_SYNCING -> ACTIVE
    (or FAILED with the reason; CANCELLED while still PENDING)

* STARTING: the controller starts the new instances and stops the removed ones
  (:meth:`relax.infra.control.controller.Controller.replace_stages`); the others go on (the
  instances share one credit through the claim log, :mod:`relax.consumers.rollout.claims`,
  whatever their number). Kafka moves the prompt partitions; the instance that gets one
  reads the run's rollout state first (``PromptQueue.learn_state`` in
  :mod:`relax.consumers.rollout.prompts`): the epoch its last owner saved and the groups it produced without committing their
  prompts, which are handed over, not sampled again; the prompts not yet sampled are
  sampled under the same group_ids, so no group in flight is lost.
* HEALTH_CHECKING: until the stage loop of every instance of the new set turns
  (its heartbeat reports a loop age).
* WEIGHT_SYNCING: until every instance of the new set has reported, after the
  operation started, a ``policy_version`` at least the trainer's at that moment (its
  engine holds current weights).
* ACTIVE: done.

On engine ``sglang`` every instance drives its own SGLang server: an operation then
carries the servers' URLs of all its instances (``engine_urls``, instance i drives the
i-th), so servers are added at the end and the newest are removed first.

Requests are idempotent: asking for the count the run has (or is going to) returns
that operation; asking for another count while one is in progress is refused
(:class:`ScaleConflict`). :class:`RolloutScaler` is driven by the loop that watches the
run (:meth:`RolloutScaler.advance`); the HTTP API (:mod:`relax.infra.control.scale_api`) only
files requests and reads states, under a lock.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

STATES = ("PENDING", "STARTING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "ACTIVE", "FAILED",
          "CANCELLED")
DONE = ("ACTIVE", "FAILED", "CANCELLED")


def _ms(ts) -> float:
    """A metric row's ``ts`` in ms since the epoch (decoded rows hold a datetime)."""
    return ts.timestamp() * 1000 if hasattr(ts, "timestamp") else float(ts)


class ScaleConflict(RuntimeError):
    """Another operation is in progress (its id is in the message)."""


class ScaleError(ValueError):
    """A request that cannot be met (the message says which field and why)."""


@dataclass
class Operation:
    """One scaling request and where it is."""

    id: str
    instances: int
    state: str = "PENDING"
    error: str | None = None
    from_instances: int = 0
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    history: list[str] = field(default_factory=list)
    policy_version: int | None = None  # the trainer's when it started
    engine_urls: list[str] | None = None  # engine sglang: the servers of its instances
    from_engine_urls: list[str] | None = None
    started_mono: float = 0.0

    def to(self, state: str, note: str = "") -> None:
        self.state, self.updated = state, time.time()
        self.history.append(f"{time.strftime('%H:%M:%S')} {state}{': ' + note if note else ''}")

    def public(self) -> dict:
        """The operation as JSON-ready data (what the API returns)."""
        d = asdict(self)
        d.pop("started_mono")
        return d


def moved_servers(current: list[str] | None, urls: list[str],
                  sign: int) -> tuple[int, list[str]]:
    """The instances and their servers after adding (``sign`` +1, at the end) or removing
    (-1, the newest first) the SGLang servers ``urls``, from ``current``.

    Raises:
        ScaleError: the run's engines run inside its instances (``current`` None), no
            URL, a server added twice, or removing servers other than the newest.
    """
    if current is None:
        raise ScaleError("engine_urls: this run's engines run inside its rollout "
                         "instances: give instances, not servers")
    if not urls:
        raise ScaleError("engine_urls: give at least one server URL")
    if sign > 0:
        again = sorted(set(urls) & set(current))
        if again:
            raise ScaleError(f"engine_urls: {again} drive an instance already")
        new = current + list(urls)
    else:
        newest = current[-len(urls):]
        if sorted(newest) != sorted(urls):
            raise ScaleError(f"engine_urls: scale_in removes the newest servers first; the "
                             f"newest {len(urls)} are {newest}")
        new = current[:-len(urls)]
    return len(new), new


class RolloutScaler:
    """The run's rollout instances and the operations that change their number.

    Args:
        instances: the number the run started with.
        max_instances: the most that can sample (the prompt topic's partitions: an
            instance beyond them would hold no partition).
        apply: ``apply(n, engine_urls)`` makes the controller run ``n`` instances (start,
            stop, restart; ``engine_urls``: their SGLang servers, or None); called from
            :meth:`advance`'s thread.
        timeout_s: an operation not ACTIVE after this long is FAILED.
        engine_urls: engine ``sglang``: the servers the run started with, one per
            instance; None for engines inside the instances.
    """

    def __init__(self, instances: int, max_instances: int,
                 apply: Callable[[int, list[str] | None], list[str]],
                 timeout_s: float = 300.0, engine_urls: list[str] | None = None):
        self.instances, self.max_instances = instances, max_instances
        self.apply, self.timeout_s = apply, timeout_s
        self.engine_urls = None if engine_urls is None else list(engine_urls)
        self.ops: dict[str, Operation] = {}
        self.current: Operation | None = None
        self.lock = threading.Lock()

    def base(self) -> int:
        """The count a relative request (``+n`` / ``-n``) starts from: the one before the
        operation in progress, if any (so that a retried request names the same
        target), else the current count."""
        with self.lock:
            op = self.current
            return op.from_instances if op is not None and op.state not in DONE else self.instances

    def base_engine_urls(self) -> list[str] | None:
        """The servers of :meth:`base`'s instances (None: engines inside the instances)."""
        with self.lock:
            op = self.current
            live = op is not None and op.state not in DONE
            urls = op.from_engine_urls if live else self.engine_urls
            return None if urls is None else list(urls)

    def request(self, instances: int, engine_urls: list[str] | None = None) -> Operation:
        """File a request for ``instances`` rollout instances (any thread); on engine
        ``sglang`` with ``engine_urls``, their servers (one per instance, in order).

        Raises:
            ScaleError: ``instances`` outside ``1..max_instances``; ``engine_urls`` given
                or missing against the run's engine, not one per instance, or repeated.
            ScaleConflict: an operation for another count (or other servers) is in
                progress.
        """
        if (engine_urls is None) != (self.engine_urls is None):
            raise ScaleError("engine_urls: this run's rollout engine is sglang: give the "
                             "servers (engine_urls), not a count" if engine_urls is None else
                             "engine_urls: this run's engines run inside its rollout "
                             "instances: give instances, not servers")
        if engine_urls is not None and (len(engine_urls) != instances
                                        or len(set(engine_urls)) != instances):
            raise ScaleError(f"engine_urls: one distinct server per instance, got "
                             f"{engine_urls} for {instances}")
        if not 1 <= instances <= self.max_instances:
            raise ScaleError(f"instances: {instances} is outside 1..{self.max_instances} (an "
                             f"instance beyond the prompt topic's {self.max_instances} "
                             f"partitions would hold none)")
        with self.lock:
            op = self.current
            if op is not None and op.state not in DONE:
                if op.instances == instances and op.engine_urls == engine_urls:
                    return op
                raise ScaleConflict(f"operation {op.id} (to {op.instances} instances) is "
                                    f"{op.state}; wait for it or cancel it")
            if instances == self.instances and engine_urls == self.engine_urls \
                    and op is not None and op.instances == instances:
                return op  # already there: the same operation, nothing to do
            op = Operation(uuid.uuid4().hex[:12], instances, from_instances=self.instances,
                           engine_urls=engine_urls, from_engine_urls=self.engine_urls)
            op.to("PENDING")
            if instances == self.instances and engine_urls == self.engine_urls:
                op.to("ACTIVE", "already at this count")
            self.ops[op.id] = op
            self.current = op
            return op

    def cancel(self, op_id: str) -> Operation:
        """Cancel operation ``op_id`` if it has not started (any thread).

        Raises:
            KeyError: no such operation.
            ScaleConflict: it has started already (or is done).
        """
        with self.lock:
            op = self.ops[op_id]
            if op.state != "PENDING":
                raise ScaleConflict(f"operation {op_id} is {op.state}: only a PENDING one "
                                    f"can be cancelled")
            op.to("CANCELLED")
            return op

    def advance(self, beats: dict[str, dict], metric_rows: list[dict],
                trainer_version: int | None) -> None:
        """Move the current operation on (the watching loop's thread).

        Args:
            beats: the controller's heartbeats (:meth:`Controller.status`).
            metric_rows: the run's metric rows so far (``component``, ``policy_version``,
                ``ts``: a datetime, or ms since the epoch).
            trainer_version: the trainer's latest policy_version (None: none yet).
        """
        with self.lock:
            op = self.current
            if op is None or op.state in DONE:
                return
            names = [f"rollout-{i}" for i in range(op.instances)]
            if op.state == "PENDING":
                op.policy_version = trainer_version or 0
                op.started_mono = time.monotonic()
                op.to("STARTING", f"{self.instances} -> {op.instances} instances")
                import ray

                from relax.infra.control.controller import StageFailed

                try:
                    changed = self.apply(op.instances, op.engine_urls)
                except (StageFailed, ray.exceptions.RayError) as e:  # the op fails, not the run
                    op.error = f"{type(e).__name__}: {e}"
                    op.to("FAILED", op.error)
                    return
                self.instances, self.engine_urls = op.instances, op.engine_urls
                op.to("HEALTH_CHECKING", "started or restarted: " + ", ".join(changed))
                return
            if time.monotonic() - op.started_mono > self.timeout_s:
                op.error = f"not ACTIVE after {self.timeout_s:.0f}s (was {op.state})"
                op.to("FAILED", op.error)
                return
            if op.state == "HEALTH_CHECKING":
                if all(beats.get(n, {}).get("loop_age_s") is not None for n in names):
                    op.to("WEIGHT_SYNCING")
                return
            since_ms = op.created * 1000
            synced = {r["component"] for r in metric_rows
                      if r["component"] in names and _ms(r["ts"]) >= since_ms
                      and r.get("policy_version") is not None
                      and r["policy_version"] >= op.policy_version}
            if synced == set(names):
                op.to("ACTIVE", f"every instance at policy_version >= {op.policy_version}")

    def engines(self, beats: dict[str, dict], stages: dict[str, dict]) -> list[dict]:
        """The rollout instances: name, pid, node, restarts, ``state`` (the current
        operation's while it runs, else ``ACTIVE``) and, on engine sglang, ``engine_url``
        (its server)."""
        with self.lock:
            busy = self.current if self.current and self.current.state not in DONE else None
            urls = self.engine_urls
        out = []
        for i in range(self.instances):
            name = f"rollout-{i}"
            s = stages.get(name, {})
            beat = beats.get(name)
            out.append({"name": name, "pid": s.get("pid"), "node": s.get("node"),
                        "restarts": s.get("restarts"),
                        "loop_age_s": beat.get("loop_age_s") if beat else None,
                        "state": busy.state if busy else "ACTIVE"})
            if urls is not None:
                out[-1]["engine_url"] = urls[i]
        return out
