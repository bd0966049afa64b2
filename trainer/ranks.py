"""The trainer's data-parallel ranks (``resources.trainer.processes: N``).

The trainer stage is rank 0: it alone reads ``train_samples`` (one consumer, one
ledger, one set of offsets in its checkpoints, so exactly-once and staleness work as
with one process), publishes weights and saves checkpoints. It starts ranks
1..N-1 as child processes (``python -m relax.trainer.ranks``, like ``torchrun`` on one
node), or, with ``resources.trainer.rank_hosts``, as Ray tasks on the named hosts
(rank 0 listens on its node's address; each rank's gloo binds to the interface that
reaches it, :func:`relax.trainer.distributed.gloo_interface`), and, every step, deals the global batch's groups out to the ranks
(:func:`relax.trainer.batching.split_groups`, balanced by tokens) with one
``scatter_object_list``; each rank runs forward/backward on its share and DDP
all-reduces the gradients, so every rank ends the step with the same weights
(:class:`relax.trainer.backends.torch_backend.TorchBackend`).

Faults: a child that exits before the process group forms fails rank 0 at once (rank 0
waits for the children on the rendezvous store while watching them). A rank that dies
later breaks the process group, so the collective of every other
rank raises (gloo: connection closed) and the stage fails; the controller restarts
the trainer stage, which starts new ranks from its newest checkpoint (rank 0 restores
it and :meth:`TorchBackend.broadcast_state` hands it to the others). A rank whose
parent (rank 0) is gone exits within a second.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from relax.streams.ports import free_port
from relax.trainer.config import TrainerConfig
from relax.trainer.distributed import destroy_data_parallel, init_data_parallel, node_address

log = logging.getLogger(__name__)


class Ranks:
    """Rank 0's side: the child ranks and the step's hand-out.

    Args:
        world_size: N >= 2 ranks in all (this process and N-1 children).
        trainer: the trainer settings every rank builds its back end from.
        log_dir: each child writes ``trainer-rank<r>.log`` here.
        torch_threads: torch threads of each child (None: torch's default).
        hosts: the host of each rank 1..N-1 (Ray tasks on the nodes offering
            ``host:<name>``, this process being a Ray worker); None = child processes
            on this host.
        num_cpus: CPUs each remote rank asks Ray for.

    Raises:
        ValueError: ``world_size < 2``.
        RuntimeError: a child rank exited before the process group formed (names it and
            its log file; the other children are killed).
        TimeoutError: the process group did not form within the rendezvous timeout.
    """

    def __init__(self, world_size: int, trainer: TrainerConfig, log_dir: Path,
                 torch_threads: int | None = None, hosts: list[str] | None = None,
                 num_cpus: float = 1.0):
        if world_size < 2:
            raise ValueError(f"Ranks needs world_size >= 2, got {world_size}")
        if hosts is not None and len(hosts) != world_size - 1:
            raise ValueError(f"{len(hosts)} hosts for ranks 1..{world_size - 1}")
        self.world_size = world_size
        master = node_address() if hosts else "127.0.0.1"
        port = free_port(master)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs = []
        self.remote: list = []  # Ray object refs of the remote ranks' tasks
        for r, host in enumerate(hosts or [], 1):
            self.remote.append(_start_remote(r, world_size, port, master, trainer, host,
                                             num_cpus, torch_threads, log_dir))
        for r in range(1, world_size) if not hosts else ():
            cmd = [sys.executable, "-m", "relax.trainer.ranks", "--rank", str(r),
                   "--world-size", str(world_size), "--port", str(port),
                   "--parent", str(os.getpid()), "--trainer", trainer.model_dump_json()]
            if torch_threads:
                cmd += ["--threads", str(torch_threads)]
            with open(log_dir / f"trainer-rank{r}.log", "ab") as out:
                self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
        self.log_dir = log_dir
        try:
            init_data_parallel(0, world_size, master_addr=master, master_port=port,
                               check=self._children_alive)
        except BaseException:
            self._kill_children()
            raise
        self._healthy = True
        split = (f"megatron tp={trainer.megatron.tp} x pp={trainer.megatron.pp}"
                 if trainer.backend == "megatron" else f"data-parallel ({trainer.data_parallel})")
        log.info("%s trainer: %d ranks (children %s)", split, world_size,
                 [p.pid for p in self.procs] or [f"{h} (Ray)" for h in hosts or []])

    def _children_alive(self) -> None:
        """Raise when a child rank exited before the process group formed (rank 0 would
        otherwise wait for it until the rendezvous timeout)."""
        for r, p in enumerate(self.procs, 1):
            if p.poll() is not None:
                raise RuntimeError(f"trainer rank {r} exited with {p.returncode} before the "
                                   f"process group formed; see "
                                   f"{self.log_dir / f'trainer-rank{r}.log'}")
        if self.remote:
            import ray

            done, _ = ray.wait(self.remote, num_returns=len(self.remote), timeout=0)
            for ref in done:
                r = self.remote.index(ref) + 1
                try:
                    ray.get(ref)
                    why = "ended"
                except ray.exceptions.RayError as e:
                    why = f"failed: {e}"
                raise RuntimeError(f"trainer rank {r} (Ray task) {why} before the process "
                                   f"group formed; see {self.log_dir / f'trainer-rank{r}.log'}")

    def _kill_children(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if self.remote:
            import ray

            for ref in self.remote:
                ray.cancel(ref, force=True)

    def scatter(self, shares: list, counts: tuple[int, int], gather_optimizer: bool = False
                ) -> tuple[list, tuple[int, int]]:
        """Hand ``shares[r]`` (a list of group tables) to rank r; rank 0 keeps
        ``shares[0]`` and the batch's ``counts`` (the others get ``(0, 0)``: the back end
        sums counts over the ranks). ``gather_optimizer``: a checkpoint follows the step
        (every rank then takes part in gathering the FSDP2 optimizer state). Returns
        rank 0's ``(share, counts)``.

        Raises:
            ValueError: not one share per rank.
            RuntimeError (torch.distributed): a rank is gone.
        """
        if len(shares) != self.world_size:
            raise ValueError(f"{len(shares)} shares for {self.world_size} ranks")
        self._healthy = False  # until the collective returns
        mine = [None]
        dist.scatter_object_list(mine, [(s, counts if r == 0 else (0, 0), gather_optimizer)
                                        for r, s in enumerate(shares)], src=0)
        self._healthy = True
        return mine[0][:2]

    def close(self, timeout_s: float = 30.0) -> None:
        """Tell the ranks to stop (when the group still works), wait for them, kill those
        still running, leave the process group."""
        if self._healthy and dist.is_initialized():
            dist.scatter_object_list([None], [None] * self.world_size, src=0)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.remote:
            import ray

            _, late = ray.wait(self.remote, num_returns=len(self.remote),
                               timeout=max(0.0, deadline - time.monotonic()))
            for ref in late:
                ray.cancel(ref, force=True)
        destroy_data_parallel()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(3)  # rank 0 is gone: no one will ever scatter to this rank again


def _start_remote(rank: int, world_size: int, port: int, master: str, trainer: TrainerConfig,
                  host: str, num_cpus: float, threads: int | None, log_dir: Path):
    """Start rank ``rank`` as a Ray task on the node offering ``host:<host>``; returns
    its object ref (the steps it took)."""
    import ray

    task = ray.remote(_remote_rank).options(num_cpus=num_cpus, max_retries=0,
                                            resources={f"host:{host}": 0.001})
    return task.remote(rank, world_size, port, master, trainer.model_dump_json(), threads,
                       str(log_dir / f"trainer-rank{rank}.log"))


def _remote_rank(rank: int, world_size: int, port: int, master: str, trainer_json: str,
                 threads: int | None, log_file: str) -> int:
    """A rank in a Ray worker on another host: log to ``log_file`` (the run folder) and
    :func:`follow`."""
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        if threads:
            import torch

            torch.set_num_threads(threads)
        log.info("rank %d on %s joins rank 0 at %s:%d", rank, node_address(), master, port)
        steps = follow(rank, world_size, port, TrainerConfig(**json.loads(trainer_json)), master)
        log.info("rank %d done after %d steps", rank, steps)
        return steps
    finally:
        root.removeHandler(handler)
        handler.close()


def follow(rank: int, world_size: int, port: int, trainer: TrainerConfig,
           master_addr: str = "127.0.0.1") -> int:
    """A child rank: join the group, build the back end, take rank 0's state, then train
    each share rank 0 scatters until it sends None. Returns the steps taken."""
    from relax.trainer.backends import build_backend
    from relax.trainer.batching import micro_batches

    init_data_parallel(rank, world_size, master_addr=master_addr, master_port=port)
    backend = build_backend(trainer)
    backend.broadcast_state()
    steps = 0
    while True:
        work = [None]
        dist.scatter_object_list(work, None, src=0)
        if work[0] is None:
            break
        groups, counts, gather_optimizer = work[0]
        backend.train_step(micro_batches(groups, trainer.max_tokens_per_microbatch),
                           counts=counts, gather_optimizer=gather_optimizer)
        steps += 1
    destroy_data_parallel()
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one child rank of the data-parallel trainer")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--trainer", required=True, help="TrainerConfig as JSON")
    ap.add_argument("--threads", type=int)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, args=(a.parent,), daemon=True).start()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    steps = follow(a.rank, a.world_size, a.port, TrainerConfig(**json.loads(a.trainer)))
    log.info("rank %d done after %d steps", a.rank, steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
