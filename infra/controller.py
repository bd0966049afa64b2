"""The controller: every stage of a run as its own Ray actor, watched and restarted.

Each :class:`~relax.infra.stages.StageSpec` becomes one ``StageActor`` (its own
process) with the CPUs/GPUs the recipe gives it; ``ray.init()`` runs a local Ray
bound to 127.0.0.1, or ``address=`` joins a cluster. The controller calls each
actor's ``run`` and watches the results:

* a stage process that dies (killed, crashed) is restarted as a new actor, up to
  ``max_restarts`` times per stage; meanwhile Kafka rebalancing gives its
  partitions to the other members of its consumer group, and the restarted one
  resumes from the committed offsets (the aggregator also from its changelog,
  the trainer from its checkpoint);
* heartbeats: ``status()`` asks every actor for its pid and last beat;
* :meth:`Controller.stop` asks every stage to stop, waits, then kills what is left
  and shuts Ray down, so no process of the run survives it.

The pids and restart counts are written to ``<run_dir>/stages.json`` (what an
operator, or a chaos test, needs to find a stage's process).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from relax.infra.stages import StageSpec
from relax.streams.client import BusConfig

log = logging.getLogger(__name__)


def _actor_class():
    import ray

    @ray.remote(max_concurrency=4)
    class StageActor:
        """One stage process: ``run`` blocks until the stage ends or ``stop`` is called."""

        def __init__(self, spec: dict, bus: dict, log_file: str):
            self.spec, self.bus, self.log_file = spec, bus, log_file
            self._stop = threading.Event()
            self._started = time.time()

        def pid(self) -> int:
            return os.getpid()

        def heartbeat(self) -> dict:
            return {"pid": os.getpid(), "ts": time.time(), "up_s": time.time() - self._started}

        def run(self) -> str:
            from relax.infra.stages import run_stage

            run_stage(self.spec["kind"], self.spec["config"], BusConfig(**self.bus),
                      self._stop.is_set, self.spec["resources"].get("torch_threads"),
                      self.log_file)
            return "finished"

        def stop(self) -> None:
            self._stop.set()

    return StageActor


@dataclass
class _Running:
    spec: StageSpec
    actor: object
    ref: object
    pid: int
    restarts: int = 0
    finished: bool = False
    history: list[str] = field(default_factory=list)


class StageFailed(RuntimeError):
    """A stage failed more than ``max_restarts`` times (its last error is the message)."""


class Controller:
    """Starts, watches and stops the stage actors of one run.

    Args:
        specs: the stage processes (:func:`relax.infra.stages.stage_specs`).
        bus: bus settings (passed to every stage).
        run_dir: run folder (``logs/`` and ``stages.json`` go there).
        address: Ray cluster address (None = local Ray on 127.0.0.1).
        max_restarts: restarts per stage before the run fails.
    """

    def __init__(self, specs: list[StageSpec], bus: BusConfig, run_dir: Path,
                 address: str | None = None, max_restarts: int = 3):
        self.specs, self.bus, self.run_dir = specs, bus, Path(run_dir)
        self.address, self.max_restarts = address, max_restarts
        self.stages: dict[str, _Running] = {}
        self._ray_started = False

    def _init_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        if self.address:
            ray.init(address=self.address, log_to_driver=False)
        else:
            want = sum(s.resources.num_cpus for s in self.specs)
            # Ray starts its workers at nice 15; then the broker and the driver (nice 0)
            # preempt a stage's torch threads at will, and one preempted OpenMP thread
            # stalls the whole parallel region (measured: trainer step 10 % slower)
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(num_cpus=max(os.cpu_count() or 1, int(want + 0.999)),
                     num_gpus=None, include_dashboard=False, log_to_driver=False,
                     _node_ip_address="127.0.0.1", object_store_memory=128 << 20,
                     configure_logging=False)
        self._ray_started = True

    def _start(self, spec: StageSpec, restarts: int = 0) -> _Running:
        import ray

        cls = _actor_class()
        actor = cls.options(name=None, num_cpus=spec.resources.num_cpus,
                            num_gpus=spec.resources.num_gpus).remote(
            {"name": spec.name, "kind": spec.kind, "config": spec.config,
             "resources": spec.resources.model_dump()},
            self.bus.model_dump(), str(self.run_dir / "logs" / f"{spec.name}.log"))
        pid = ray.get(actor.pid.remote(), timeout=120)
        r = _Running(spec, actor, actor.run.remote(), pid, restarts)
        log.info("started %s (pid %d, restart %d)", spec.name, pid, restarts)
        return r

    def start(self) -> None:
        """Start Ray (if needed) and every stage."""
        self._init_ray()
        for spec in self.specs:
            self.stages[spec.name] = self._start(spec)
        self._write_state()

    def _write_state(self) -> None:
        state = {n: {"pid": r.pid, "restarts": r.restarts, "finished": r.finished,
                     "kind": r.spec.kind, "history": r.history}
                 for n, r in self.stages.items()}
        tmp = self.run_dir / ".stages.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.run_dir / "stages.json")

    def check(self, timeout_s: float = 0.5) -> list[str]:
        """Collect stages that ended; restart the ones that died or failed.

        Returns:
            names of stages that finished normally since the last call.

        Raises:
            StageFailed: a stage used up its restarts.
        """
        import ray

        running = {r.ref: n for n, r in self.stages.items() if not r.finished}
        if not running:
            return []
        done, _ = ray.wait(list(running), num_returns=len(running), timeout=timeout_s)
        finished = []
        for ref in done:
            name = running[ref]
            r = self.stages[name]
            try:
                ray.get(ref)
                r.finished = True
                finished.append(name)
                r.history.append(f"{time.strftime('%H:%M:%S')} finished")
                continue
            except ray.exceptions.RayActorError as e:
                why = f"process died ({type(e).__name__})"
            except ray.exceptions.RayTaskError as e:
                why = f"raised {str(e).strip().splitlines()[-1][:300]}"
            if r.restarts >= self.max_restarts:
                raise StageFailed(f"stage {name} failed {r.restarts + 1} times; last: {why}")
            log.warning("stage %s %s: restarting", name, why)
            ray.kill(r.actor, no_restart=True)
            new = self._start(r.spec, r.restarts + 1)
            new.history = r.history + [f"{time.strftime('%H:%M:%S')} {why}; restarted"]
            self.stages[name] = new
        if done:
            self._write_state()
        return finished

    def status(self) -> dict[str, dict]:
        """Heartbeat of every running stage: ``{name: {pid, ts, up_s}}`` (missing when an
        actor does not answer within a second)."""
        import ray

        out = {}
        for n, r in self.stages.items():
            if r.finished:
                continue
            try:
                out[n] = ray.get(r.actor.heartbeat.remote(), timeout=1.0)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                continue
        return out

    def stop(self, timeout_s: float = 60.0) -> None:
        """Ask every stage to stop, wait up to ``timeout_s``, kill what is left, shut down
        the Ray this controller started."""
        import ray

        if not self.stages:
            return
        for r in self.stages.values():
            if not r.finished:
                try:
                    r.actor.stop.remote()
                except ray.exceptions.RayActorError:
                    pass
        refs = [r.ref for r in self.stages.values() if not r.finished]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for r in self.stages.values():
            ray.kill(r.actor, no_restart=True)
        self.stages.clear()
        if self._ray_started:
            ray.shutdown()
            self._ray_started = False
