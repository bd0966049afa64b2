"""The trainer's data-parallel ranks on one host (``resources.trainer.processes: N``).

The trainer stage is rank 0: it alone reads ``train_samples`` (one consumer, one
ledger, one set of offsets in its checkpoints, so exactly-once and staleness work as
with one process), publishes weights and saves checkpoints. It starts ranks
1..N-1 as child processes (``python -m relax.trainer.ranks``, like ``torchrun`` on one
node) and, every step, deals the global batch's groups out to the ranks
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

from relax.trainer.config import TrainerConfig
from relax.trainer.distributed import destroy_data_parallel, free_port, init_data_parallel

log = logging.getLogger(__name__)


class Ranks:
    """Rank 0's side: the child ranks and the step's hand-out.

    Args:
        world_size: N >= 2 ranks in all (this process and N-1 children).
        trainer: the trainer settings every rank builds its back end from.
        log_dir: each child writes ``trainer-rank<r>.log`` here.
        torch_threads: torch threads of each child (None: torch's default).

    Raises:
        ValueError: ``world_size < 2``.
        RuntimeError: a child rank exited before the process group formed (names it and
            its log file; the other children are killed).
        TimeoutError: the process group did not form within the rendezvous timeout.
    """

    def __init__(self, world_size: int, trainer: TrainerConfig, log_dir: Path,
                 torch_threads: int | None = None):
        if world_size < 2:
            raise ValueError(f"Ranks needs world_size >= 2, got {world_size}")
        self.world_size = world_size
        port = free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs = []
        for r in range(1, world_size):
            cmd = [sys.executable, "-m", "relax.trainer.ranks", "--rank", str(r),
                   "--world-size", str(world_size), "--port", str(port),
                   "--parent", str(os.getpid()), "--trainer", trainer.model_dump_json()]
            if torch_threads:
                cmd += ["--threads", str(torch_threads)]
            with open(log_dir / f"trainer-rank{r}.log", "ab") as out:
                self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
        self.log_dir = log_dir
        try:
            init_data_parallel(0, world_size, master_port=port, check=self._children_alive)
        except BaseException:
            self._kill_children()
            raise
        self._healthy = True
        log.info("data-parallel trainer: %d ranks (children %s)", world_size,
                 [p.pid for p in self.procs])

    def _children_alive(self) -> None:
        """Raise when a child rank exited before the process group formed (rank 0 would
        otherwise wait for it until the rendezvous timeout)."""
        for r, p in enumerate(self.procs, 1):
            if p.poll() is not None:
                raise RuntimeError(f"trainer rank {r} exited with {p.returncode} before the "
                                   f"process group formed; see "
                                   f"{self.log_dir / f'trainer-rank{r}.log'}")

    def _kill_children(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

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
        destroy_data_parallel()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(3)  # rank 0 is gone: no one will ever scatter to this rank again


def follow(rank: int, world_size: int, port: int, trainer: TrainerConfig) -> int:
    """A child rank: join the group, build the back end, take rank 0's state, then train
    each share rank 0 scatters until it sends None. Returns the steps taken."""
    from relax.trainer.backends import build_backend
    from relax.trainer.batching import micro_batches

    init_data_parallel(rank, world_size, master_port=port)
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
