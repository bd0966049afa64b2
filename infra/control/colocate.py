"""The colocated stage (``mode: colocate``): the trainer and one rollout engine in one
process, on the same parameter tensors.

The HF engine is given the torch back end's model object (no copy), and no weight
subscriber: after each optimizer step the engine's policy_version is set to the step's
version directly. The trainer announces every version on the weights topic (the rollout's
credit reads it); it sends the weights only where another stage subscribes (``eval.every``,
a following reference: ``TrainerStageConfig.publish_weights``, set by
``relax.infra.recipe.specs``), so by default the process holds one copy of the model. The
rollout runs in a thread of this process beside the trainer; with ``max_staleness`` 0 its
credit lets it sample one step's groups and then wait for the trainer's progress, so the
two alternate:

    rollout: sample batch_groups groups with version v   (model.eval(), torch.no_grad)
    trainer: consume them (rewards, reference, aggregate on the bus), step -> v + 1
    rollout: the credit opens, sample with version v + 1 ...

A lock over generation and the optimizer step makes sure that they never overlap
whatever the credit does: a generate call never sees half-updated parameters.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pydantic import BaseModel, ConfigDict, model_validator

from relax.consumers.engines.hf import HFEngine
from relax.consumers.rollout.config import RolloutConfig
from relax.consumers.rollout.stage import RolloutStage
from relax.streams.client import BusConfig
from relax.trainer.config import TrainerStageConfig
from relax.trainer.loop import TrainerStage


class ColocateConfig(BaseModel):
    """The colocated stage's config: the run name, the rollout instance's and the
    trainer's own configs (``rollout.follow_weights`` must be False: the engine has no
    subscriber).

    Raises:
        ValueError: (pydantic) the rollout's or the trainer's run is not ``run``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    run: str
    rollout: RolloutConfig
    trainer: TrainerStageConfig

    @model_validator(mode="after")
    def _one_run(self):
        if not self.rollout.run == self.trainer.run == self.run:
            raise ValueError(f"run {self.run!r}: the rollout's is {self.rollout.run!r}, the "
                             f"trainer's {self.trainer.run!r}")
        return self


class SharedEngine(HFEngine):
    """An :class:`HFEngine` on a model it shares with the trainer.

    Each :meth:`generate` holds ``lock`` (the trainer holds it for its step) and runs the
    model in eval mode, putting it back in train mode after. :meth:`set_version` says
    which policy_version the parameters in place are (no weights are copied or swapped).
    """

    def __init__(self, model, tokenizer, lock: threading.Lock, *, engine_id: str,
                 policy_version: int, **kwargs):
        super().__init__(model, tokenizer, engine_id=engine_id, policy_version=policy_version,
                         own_weights=False, **kwargs)
        self.lock = lock
        model.train()  # HFEngine put it in eval mode; the trainer's state is train mode

    def set_version(self, policy_version: int) -> None:
        """The shared parameters are now ``policy_version`` (under the lock).

        Raises:
            ValueError: a version older than the current one.
        """
        if policy_version < self._version:
            raise ValueError(f"policy_version {policy_version} is older than the engine's "
                             f"{self._version}")
        self._version = policy_version

    def generate(self, prompts, params, media=None):
        """:meth:`HFEngine.generate` under the lock, in eval mode (train mode after)."""
        with self.lock:
            self.model.eval()
            try:
                return super().generate(prompts, params, media)
            finally:
                self.model.train()


class ColocatedStage:
    """The trainer and one rollout instance in one process:
    ``ColocatedStage(cfg, bus).run(should_stop)``.

    Attributes:
        trainer: the :class:`TrainerStage` (its back end's ``model`` is the engine's).
        rollout: the :class:`RolloutStage` on a :class:`SharedEngine`.

    Raises:
        ValueError: ``rollout.follow_weights`` is set, or the trainer's back end has no
            single ``model`` to share (megatron).
    """

    def __init__(self, cfg: ColocateConfig, bus: BusConfig):
        if cfg.rollout.follow_weights:
            raise ValueError("colocate: rollout.follow_weights must be false (the engine "
                             "shares the trainer's parameters)")
        self.cfg = cfg
        self.trainer = TrainerStage(cfg.trainer, bus)
        backend = self.trainer.backend
        model = getattr(backend, "model", None)
        if model is None:
            raise ValueError(f"colocate: the {cfg.trainer.trainer.backend} back end has no "
                             "model object to share; use trainer.backend: torch")
        from relax.trainer.models import load_tokenizer

        self.lock = threading.Lock()
        r = cfg.rollout
        self.engine = SharedEngine(model, load_tokenizer(r.model), self.lock,
                                   engine_id=r.engine_id, policy_version=self.trainer.version,
                                   partial_rollout=r.partial_rollout, chunk_tokens=r.chunk_tokens)
        self.rollout = RolloutStage(r, bus, engine=self.engine)
        step = backend.train_step

        def locked_step(*args, **kwargs):
            # TrainerStage.step adds 1 to its version right after this returns
            with self.lock:
                model.train()
                out = step(*args, **kwargs)
                self.engine.set_version(self.trainer.version + 1)
                return out

        backend.train_step = locked_step

    def run(self, should_stop: Callable[[], bool]) -> None:
        """Run the rollout in a thread and the trainer here until the trainer's last step
        or ``should_stop()``; then stop the rollout.

        Raises:
            whatever the rollout thread raised (the trainer stops at once), or the
            trainer's own errors.
        """
        done = threading.Event()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="colocate-rollout") as pool:
            rollout = pool.submit(self.rollout.run, lambda: done.is_set() or should_stop())
            try:
                self.trainer.run(lambda: should_stop() or rollout.done())
            finally:
                done.set()
            rollout.result()  # the rollout's error, if it failed
