"""The reference (and teacher) stage's settings: torch-free, so the recipe's checks load
them in processes without torch (the driver, the reward stage); the stage is
:mod:`relax.consumers.reference`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ReferenceConfig(BaseModel):
    """Settings of one reference instance.

    Attributes:
        run: run name.
        model: reference model (name/folder/Hub id; the initial policy's weights), or
            the teacher model.
        role: ``reference`` (writes ``<run>.ref_logprobs``) or ``teacher`` (writes
            ``<run>.teacher_logprobs``; frozen).
        device: default cuda if available.
        member_id: id in the weight group and metrics component.
        follow_every: follow the policy every N versions (0 = frozen).
        weights_rendezvous: ``tcp://host:port`` of the publisher (see RolloutConfig).
        max_batch_tokens: padded tokens per forward pass.
        poll_timeout_s: rollouts poll timeout (seconds).
        from_beginning: where a new consumer group starts.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str
    model: str = "tiny-llama"
    role: Literal["reference", "teacher"] = "reference"
    device: str | None = None
    member_id: str = "reference-0"
    follow_every: int = Field(0, ge=0)
    weights_rendezvous: str | None = None
    max_batch_tokens: int = Field(4096, ge=1)
    poll_timeout_s: float = Field(1.0, gt=0)
    from_beginning: bool = True

    @model_validator(mode="after")
    def _check(self):
        if self.role == "teacher" and self.follow_every:
            raise ValueError("follow_every: a teacher is frozen (it follows no policy weights)")
        return self
