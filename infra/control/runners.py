"""Runs one stage process: :func:`run_stage_process` builds the stage of a
:class:`~relax.infra.recipe.specs.StageSpec`'s ``kind`` from its JSON config inside
whatever process runs it (a Ray actor of :mod:`relax.infra.control.controller`, a plain
subprocess, a test) and runs it until told to stop. The stages' configs and the specs are
made from the recipe by :mod:`relax.infra.recipe.specs`; this module holds what starts
them: every stage of one table (:data:`relax.infra.recipe.specs.CONTRACT_STAGES`: rollout,
reward, reference, aggregate, trainer, eval) the same way, and the colocated stage (a
rollout and a trainer in one process, :mod:`~relax.infra.control.colocate`) by its own
function.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from relax.infra.recipe.specs import CONTRACT_STAGES, stage_class
from relax.streams.client import BusConfig


def _contract(kind: str) -> Callable[[dict, BusConfig, Callable[[], bool]], None]:
    """The runner of a stage on the stage contract (:data:`CONTRACT_STAGES`): its config
    class from its declaration, the bus its argument,
    :func:`relax.streams.stage_contract.run_stage`."""

    def runner(config: dict, bus: BusConfig, should_stop: Callable[[], bool]) -> None:
        from relax.streams.stage_contract import run_stage

        cls = stage_class(kind)
        run_stage(cls(cls.config_type(**config), bus), should_stop)

    return runner


def _colocate(config: dict, bus: BusConfig, should_stop: Callable[[], bool]) -> None:
    from relax.infra.control.colocate import ColocateConfig, ColocatedStage

    ColocatedStage(ColocateConfig(**config), bus).run(should_stop)


RUNNERS: dict[str, Callable[[dict, BusConfig, Callable[[], bool]], None]] = {
    **{kind: _contract(kind) for kind in CONTRACT_STAGES},
    "colocate": _colocate,
}


def not_a_cancelled_refresh(record: logging.LogRecord) -> bool:
    """Log filter: False for kafka-python 3.0's ``ERROR Metadata refresh: failed
    Cancelled``, which every client logs at start-up when it closes its bootstrap
    connection with a metadata request in flight (``Cancelled`` is retriable: the refresh
    loop retries it); True for every other record, other metadata failures included."""
    return not (record.msg == "Metadata refresh: failed %s" and record.args
                and type(record.args[0]).__name__ == "Cancelled")


def run_stage_process(kind: str, config: dict, bus: BusConfig, should_stop: Callable[[], bool],
              torch_threads: int | None = None, log_file: str | None = None) -> None:
    """Build stage ``kind`` from ``config`` and run it until ``should_stop()`` or its
    own end (the trainer ends after its last step).

    Raises:
        ValueError: unknown kind (lists the valid ones); whatever the stage raises.
    """
    if kind not in RUNNERS:
        raise ValueError(f"unknown stage kind {kind!r}; valid: {', '.join(RUNNERS)}")
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        logging.basicConfig(filename=log_file, level=logging.INFO, force=True,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        logging.getLogger("kafka").setLevel(logging.WARNING)
        logging.getLogger("kafka.coordinator").setLevel(logging.INFO)  # joins, assignments
        logging.getLogger("kafka.cluster").addFilter(not_a_cancelled_refresh)
    if torch_threads:
        import torch

        torch.set_num_threads(torch_threads)
    RUNNERS[kind](config, bus, should_stop)
