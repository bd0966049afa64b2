"""The controller: every stage of a run as its own Ray actor, watched and restarted.

Each :class:`~relax.infra.recipe.specs.StageSpec` becomes one ``StageActor`` (its own
process) with the CPUs/GPUs the recipe gives it; ``ray.init()`` runs a local Ray
bound to 127.0.0.1, or ``address=`` joins a cluster. The controller calls each
actor's ``run`` and watches the results:

* a stage process that dies (killed, crashed) is restarted as a new actor, up to
  ``max_restarts`` times per stage; meanwhile Kafka rebalancing gives its
  partitions to the other members of its consumer group, and the restarted one
  resumes from the committed offsets (the aggregator also from its changelog,
  the trainer from its checkpoint);
* heartbeats and stalls: every stage's ``should_stop`` is a pulse that records when
  the stage loop last turned; :meth:`Controller.watch` asks every actor for it and
  reads the consumer-group offsets of the stages that commit per poll, and restarts a
  stage that is alive but stuck (``relax.infra.control.watch``), with the same restart budget;
* :meth:`Controller.stop` asks every stage to stop, waits, then kills what is left
  and shuts Ray down, so no process of the run survives it.

The pids, Ray node addresses and restart counts are written to
``<run_dir>/stages.json`` (what an operator, or a chaos test, needs to find a stage's
process).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from relax.infra.control.allocator import retain_freed_memory
from relax.infra.control.watch import StageWatch, input_group, input_stalled, loop_stalled
from relax.infra.recipe.specs import StageSpec
from relax.streams.client import BusConfig
from relax.streams.stage import StageConfigError

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
            self._beat: float | None = None  # set by the first should_stop(): loop running

        def pid(self) -> int:
            return os.getpid()

        def node_ip(self) -> str:
            return ray.util.get_node_ip_address()

        def heartbeat(self) -> dict:
            age = None if self._beat is None else time.monotonic() - self._beat
            return {"pid": os.getpid(), "ts": time.time(), "up_s": time.time() - self._started,
                    "loop_age_s": age}

        def _should_stop(self) -> bool:
            self._beat = time.monotonic()  # the pulse: the stage loop turned
            return self._stop.is_set()

        def run(self) -> str:
            from relax.infra.control.runners import run_stage_process

            run_stage_process(self.spec["kind"], self.spec["config"], BusConfig(**self.bus),
                              self._should_stop, self.spec["resources"].get("torch_threads"),
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
    node: str | None = None
    finished: bool = False
    history: list[str] = field(default_factory=list)
    answered: float = field(default_factory=time.monotonic)  # heartbeat last answered
    watch: StageWatch = field(default_factory=lambda: StageWatch(time.monotonic()))


RAY_IDLE_CONFIG: dict = {"enable_metrics_collection": False, "event_stats": False}
"""Ray system settings of :func:`start_local_ray`: no Ray metrics (relax reports its
own): an idle local Ray with 4 stage-like actors wakes 899 times a second instead of
954, on 0.036 cores instead of 0.042 (a study since retired: ``benchmarks/JOURNAL.md``). Most of the rest,
100 a second in each stage process, is Ray's fixed 10-ms signal check."""


def start_local_ray(num_cpus: int, system_config: dict | None = None) -> None:
    """Start a local Ray of our own bound to 127.0.0.1, with at least ``num_cpus`` CPUs
    (the machine's count otherwise; the stages' ``num_cpus`` only schedule), no
    dashboard, its workers at nice 0 and keeping their freed memory, and
    ``system_config`` (default :data:`RAY_IDLE_CONFIG`) as Ray's system settings. Address
    "local": a new Ray even where ``ray start`` left a cluster (or its stale address
    file) on this machine."""
    import ray

    # Ray starts its workers at nice 15; then the broker and the driver (nice 0)
    # preempt a stage's torch threads at will, and one preempted OpenMP thread
    # stalls the whole parallel region (measured: trainer step 10 % slower)
    os.environ.setdefault("RAY_worker_niceness", "0")
    with retain_freed_memory():  # no page faults on every step's buffers: allocator.py
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, num_cpus),
                 num_gpus=None, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", object_store_memory=128 << 20,
                 configure_logging=False,
                 # a copy: ray.init adds its own keys to the dict it is given
                 _system_config=dict(RAY_IDLE_CONFIG if system_config is None
                                     else system_config))


class StageFailed(RuntimeError):
    """A stage failed more than ``max_restarts`` times (its last error is the message)."""


class Controller:
    """Starts, watches and stops the stage actors of one run.

    Args:
        specs: the stage processes (:func:`relax.infra.recipe.specs.stage_specs`).
        bus: bus settings (passed to every stage).
        run_dir: run folder (``logs/`` and ``stages.json`` go there).
        address: Ray cluster address (None = local Ray on 127.0.0.1).
        max_restarts: restarts per stage before the run fails.
        stall_timeout_s: a stage alive but stuck this long is restarted (:meth:`watch`).
    """

    def __init__(self, specs: list[StageSpec], bus: BusConfig, run_dir: Path,
                 address: str | None = None, max_restarts: int = 3,
                 stall_timeout_s: float = 300.0):
        self.specs, self.bus, self.run_dir = specs, bus, Path(run_dir)
        self.address, self.max_restarts = address, max_restarts
        self.stall_timeout_s = stall_timeout_s
        self.stages: dict[str, _Running] = {}
        self._ray_started = False
        self._here: str | None = None  # this host's Ray node address (local_pids)

    def _init_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        if self.address:
            ray.init(address=self.address, log_to_driver=False)
        else:
            start_local_ray(int(sum(s.resources.num_cpus for s in self.specs) + 0.999))
        self._ray_started = True

    def _launch(self, spec: StageSpec):
        """A new actor for ``spec`` (its process starts in the background)."""
        cls = _actor_class()
        place = {f"host:{spec.resources.host}": 0.001} if spec.resources.host else None
        return cls.options(name=None, num_cpus=spec.resources.num_cpus,
                           num_gpus=spec.resources.num_gpus, resources=place).remote(
            {"name": spec.name, "kind": spec.kind, "config": spec.config,
             "resources": spec.resources.model_dump()},
            self.bus.model_dump(), str(self.run_dir / "logs" / f"{spec.name}.log"))

    def _run(self, launched: list[tuple[StageSpec, object]], restarts: int = 0) -> list[_Running]:
        """Wait (120 s at most) until every launched actor answers, then start each one's
        ``run``: the processes start side by side, not one after another."""
        import ray

        where = ray.get([m.remote() for _, a in launched for m in (a.pid, a.node_ip)],
                        timeout=120)
        out = []
        for i, (spec, actor) in enumerate(launched):
            pid, node = where[2 * i], where[2 * i + 1]
            out.append(_Running(spec, actor, actor.run.remote(), pid, restarts, node))
            log.info("started %s (pid %d, restart %d)", spec.name, pid, restarts)
        return out

    def _start(self, spec: StageSpec, restarts: int = 0) -> _Running:
        return self._run([(spec, self._launch(spec))], restarts)[0]

    def start(self) -> None:
        """Start Ray (if needed) and every stage."""
        self._init_ray()
        for r in self._run([(spec, self._launch(spec)) for spec in self.specs]):
            self.stages[r.spec.name] = r
        self._write_state()

    def host(self) -> str:
        """This host's (the driver's) Ray node address."""
        import ray

        if self._here is None:
            self._here = ray.util.get_node_ip_address()
        return self._here

    def nodes(self) -> dict[str, str | None]:
        """name -> the Ray node address each stage runs on."""
        return {n: r.node for n, r in list(self.stages.items())}

    def local_pids(self) -> dict[str, int]:
        """name -> pid of the stages running on this host (the driver's Ray node): the
        processes a :class:`~relax.infra.observe.cpu_timeline.CpuTimeline` here can read."""
        here = self.host()
        return {n: r.pid for n, r in list(self.stages.items())
                if r.node == here and not r.finished}

    def _write_state(self) -> None:
        state = {n: {"pid": r.pid, "node": r.node, "restarts": r.restarts,
                     "finished": r.finished,
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
            except ray.exceptions.RayTaskError as e:  # the stage raised
                why = f"raised {str(e).strip().splitlines()[-1][:300]}"
                with open(self.run_dir / "logs" / f"{name}.log", "a") as f:
                    f.write(f"stage {name} raised (restart {r.restarts}):\n{e}\n")
                if isinstance(e.cause, StageConfigError):  # a restart would fail the same way
                    ray.kill(r.actor, no_restart=True)
                    r.finished = True  # ended: its history says how
                    r.history.append(f"{time.strftime('%H:%M:%S')} cannot run: {e.cause}")
                    self._write_state()
                    raise StageFailed(f"stage {name} cannot run as configured (not restarted): "
                                      f"{e.cause}") from None
            except ray.exceptions.RayError as e:  # died, killed, lost: any other Ray fault
                why = f"process died ({type(e).__name__})"
            self._restart(name, why)
        if done:
            self._write_state()
        return finished

    def _restart(self, name: str, why: str) -> None:
        """Kill stage ``name``'s actor and start a new one, or fail the run when its
        restarts are used up (killed all the same: :meth:`stop` would wait for it).

        Raises:
            StageFailed: ``max_restarts`` restarts were used already.
        """
        import ray

        r = self.stages[name]
        ray.kill(r.actor, no_restart=True)  # stuck or dead: nothing to ask it to stop
        if r.restarts >= self.max_restarts:
            raise StageFailed(f"stage {name} failed {r.restarts + 1} times; last: {why}")
        log.warning("stage %s %s: restarting", name, why)
        new = self._start(r.spec, r.restarts + 1)
        new.history = r.history + [f"{time.strftime('%H:%M:%S')} {why}; restarted"]
        self.stages[name] = new
        self._write_state()

    def replace_stages(self, kind: str, specs: list[StageSpec], stop_s: float = 30.0) -> list[str]:
        """Make the stages of ``kind`` exactly ``specs`` in a live run: stop (gracefully,
        then killed after ``stop_s``) those not in ``specs``, restart those whose config
        changed, start the new ones (in an order that never leaves the stages' consumer
        group empty). Returns the names started or restarted.

        Raises:
            ValueError: a spec of another kind.
        """
        if any(s.kind != kind for s in specs):
            raise ValueError(f"replace_stages({kind!r}) got specs of kinds "
                             f"{sorted({s.kind for s in specs})}")
        wanted = {s.name: s for s in specs}
        gone = [n for n, r in self.stages.items() if r.spec.kind == kind and n not in wanted]
        new = [n for n in wanted if n not in self.stages]
        changed = [n for n, s in wanted.items()
                   if n in self.stages and self.stages[n].spec.config != s.config]
        # new ones first, removed ones last, restarts one at a time in between: the
        # consumer group is never empty (a group that every member left and one rejoins
        # waits out the rebalance timeout)
        for n in new:
            self.stages[n] = self._start(wanted[n])
        for n in changed:
            self._stop(n, stop_s)
            self.stages[n] = self._start(wanted[n])
        for n in gone:
            self._stop(n, stop_s)
        self.specs = [s for s in self.specs if s.kind != kind] + specs
        self._write_state()
        return new + changed

    def _stop(self, name: str, stop_s: float) -> None:
        """Stop stage ``name`` gracefully (killed after ``stop_s``) and forget it."""
        import ray

        r = self.stages.pop(name)
        r.actor.stop.remote()
        ray.wait([r.ref], timeout=stop_s)
        ray.kill(r.actor, no_restart=True)
        log.info("stopped %s (scaling)", name)

    def watch(self, probe=None) -> list[str]:
        """Restart the stages that are alive but stuck (see :mod:`relax.infra.control.watch`):
        a loop inside one call, or a heartbeat unanswered, for ``stall_timeout_s``; or
        input waiting with no commit for as long. Call every few seconds.

        Args:
            probe: a :class:`relax.streams.lag.LagProbe` the caller keeps open between
                calls (None: one for this call only).

        Returns:
            ``"<stage>: <why>"`` for every stage restarted now.

        Raises:
            StageFailed: a stuck stage used up its restarts (says what it waited for).
        """
        from kafka.errors import KafkaError

        from relax.streams.lag import LagProbe

        beats = self.status()
        now = time.monotonic()
        restarted, inputs_of = [], {}
        for name, r in list(self.stages.items()):
            if r.finished:
                continue
            beat = beats.get(name)
            if beat is not None:
                r.answered = now
            why = loop_stalled(beat is not None, beat and beat["loop_age_s"], now - r.answered,
                               self.stall_timeout_s)
            ig = input_group(r.spec.config.get("run", ""), r.spec.kind, name)
            if why is None and ig is not None:
                inputs_of[name] = ig  # checked below, all inputs' ends in one question
            elif why is not None:
                self._restart(name, f"stalled: {why}")
                restarted.append(f"{name}: {why}")
        if not inputs_of:
            return restarted
        own = probe is None
        probe = probe or LagProbe(self.bus)
        try:
            ends = probe.high_watermarks(sorted({t for _, ins in inputs_of.values() for t in ins}))
            for name, (gid, inputs) in inputs_of.items():
                r = self.stages[name]
                committed = {k: v for k, v in probe.group_offsets(gid).items() if k[0] in inputs}
                lag = sum(max(0, hw - committed.get(tp, 0)) for tp, hw in ends.items()
                          if tp[0] in inputs)
                if input_stalled(r.watch, committed, lag, now, self.stall_timeout_s):
                    why = (f"has {lag} input records waiting and committed nothing for "
                           f"{now - r.watch.since:.0f}s")
                    self._restart(name, f"stalled: {why}")
                    restarted.append(f"{name}: {why}")
        except (KafkaError, TimeoutError) as e:  # the broker check judges that
            # retriable: a group's coordinator not elected yet (Kafka makes its offsets
            # topic at the first group's lookup, seconds into a run), a leader moving
            log.log(logging.DEBUG if getattr(e, "retriable", False) else logging.WARNING,
                    "input stall check skipped: %s", e)
        finally:
            if own:
                probe.close()
        return restarted

    def status(self) -> dict[str, dict]:
        """Heartbeat of every running stage: ``{name: {pid, ts, up_s}}`` (missing when an
        actor does not answer within a second, or died: killed, lost, or killed by Ray's
        memory monitor (``OutOfMemoryError``, not an actor error); :meth:`check` restarts it)."""
        import ray

        out = {}
        for n, r in self.stages.items():
            if r.finished:
                continue
            try:
                out[n] = ray.get(r.actor.heartbeat.remote(), timeout=1.0)
            except ray.exceptions.RayError:  # GetTimeoutError and every death
                continue
        return out

    def describe(self) -> str:
        """One line per stage: pid, restarts, and how long ago its loop last turned (or
        that it does not answer), for the report of a run that cannot finish."""
        beats = self.status()
        lines = []
        for n, r in self.stages.items():
            b = beats.get(n)
            if r.finished:
                state = "finished"
            elif b is None:
                state = "does not answer its heartbeat"
            elif b["loop_age_s"] is None:
                state = f"up {b['up_s']:.0f}s, still starting"
            else:
                state = f"up {b['up_s']:.0f}s, loop turned {b['loop_age_s']:.1f}s ago"
            lines.append(f"{n} (pid {r.pid}, restarts {r.restarts}): {state}")
        return "\n".join(lines)

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
        done = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0] if refs else []
        for r in self.stages.values():
            if not r.finished:  # stages.json ends with how each one ended
                r.finished = r.ref in done
                r.history.append(f"{time.strftime('%H:%M:%S')} "
                                 f"{'stopped' if r.finished else 'killed (did not stop)'}")
            ray.kill(r.actor, no_restart=True)
        self._write_state()
        self.stages.clear()
        if self._ray_started:
            ray.shutdown()
            self._ray_started = False
