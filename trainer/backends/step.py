"""The parts of an optimizer step every trainer back end shares: the optimizer, the
learning rate of a step, one micro-batch's policy loss, the metric sums, the zero
gradients of parameters a step did not reach. Pure functions; the back ends own their
forward and collectives."""

from __future__ import annotations

import torch

from relax.trainer.batching import MicroBatch
from relax.trainer.config import OptimConfig, TrainerConfig
from relax.trainer.losses.registry import compute_policy_loss


def adamw(params, optim: OptimConfig) -> torch.optim.AdamW:
    """torch's AdamW (Loshchilov & Hutter, arXiv 1711.05101) with ``optim``'s settings,
    ``fused``: one kernel per parameter, not ~6 passes over its memory. On one CPU
    thread a step over SmolLM2-135M's parameters takes 0.10 s fused against 0.63 s for
    torch's default on the CPU (the single-tensor loop) and 0.7-0.9 s ``foreach``.

    Args:
        params: the parameters (float tensors on the CPU or a CUDA device; DTensors too).
        optim: lr, betas, eps, weight_decay.
    """
    return torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                             weight_decay=optim.weight_decay, fused=True)


def learning_rate(optim: OptimConfig, steps_done: int) -> float:
    """The learning rate of step ``steps_done + 1``: linear warm-up over
    ``optim.warmup_steps`` steps, then ``optim.lr``."""
    w = optim.warmup_steps
    return optim.lr * (min(1.0, (steps_done + 1) / w) if w else 1.0)


def set_learning_rate(optimizer: torch.optim.Optimizer, optim: OptimConfig,
                      steps_done: int) -> float:
    """Set every parameter group's lr to :func:`learning_rate` for the coming step;
    returns it."""
    lr = learning_rate(optim, steps_done)
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def micro_batch_loss(cfg: TrainerConfig, mb: MicroBatch, logprobs: torch.Tensor,
                     entropy: torch.Tensor | None, recomputed: torch.Tensor | None,
                     tokens: int, seqs: int) -> tuple[torch.Tensor, dict]:
    """``(loss, metrics)`` of one micro-batch: :func:`compute_policy_loss` normalised by
    the global ``tokens`` / ``seqs`` of the step (so micro-batch losses are summed, public
    case C06).

    Args:
        logprobs: ``[B, R]`` float32 differentiable log-probs under the current weights.
        entropy: ``[B, R]`` float32 or None.
        recomputed: ``[B, R]`` pi_old log-probs of a no-grad pass at the start of the step
            (``old_logprobs: recompute``), or None: then pi_old is the rollout's log-probs
            (``rollout``) or the detached current ones.
    """
    if recomputed is not None:
        old = recomputed
    elif cfg.old_logprobs == "rollout":
        old = mb.rollout_logprobs
    else:
        old = logprobs.detach()
    return compute_policy_loss(
        cfg.loss, logprobs, old, mb.advantages, mb.loss_mask,
        rollout_logprobs=mb.rollout_logprobs, ref_logprobs=mb.ref_logprobs, entropy=entropy,
        global_tokens=max(tokens, 1), global_seqs=max(seqs, 1))


def add_metrics(sums: dict[str, float], loss: torch.Tensor, metrics: dict) -> None:
    """Add a micro-batch's loss and metrics to the step's ``sums`` (in place)."""
    sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + float(v)


def to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    """``mb`` with its tensors on ``device`` (the same object on the CPU)."""
    if device.type == "cpu":
        return mb
    def move(v):
        if isinstance(v, dict):
            return {k: t.to(device) for k, t in v.items()}
        return v.to(device) if isinstance(v, torch.Tensor) else v

    return MicroBatch(**{k: move(v) for k, v in mb.__dict__.items()})


def freeze(model: torch.nn.Module, patterns: tuple[str, ...]) -> int:
    """Turn off ``requires_grad`` of the parameters whose names match one of the
    ``fnmatch`` ``patterns``. Returns how many parameters (elements) stay trainable.

    Raises:
        ValueError: a pattern matches no parameter (a typo would silently train all), or
            nothing is left to train.
    """
    from fnmatch import fnmatchcase

    named = list(model.named_parameters())
    for pat in patterns:
        if not any(fnmatchcase(n, pat) for n, _ in named):
            raise ValueError(f"trainer.freeze pattern {pat!r} matches no parameter; names "
                             f"look like {', '.join(n for n, _ in named[:3])}")
    for n, p in named:
        if any(fnmatchcase(n, pat) for pat in patterns):
            p.requires_grad_(False)
    left = sum(p.numel() for _, p in named if p.requires_grad)
    if not left:
        raise ValueError(f"trainer.freeze {list(patterns)} freezes every parameter")
    return left


def fill_missing_grads(params) -> None:
    """Give every trainable parameter without a gradient a zero one, so the optimizer
    steps it (weight decay, Adam moments) exactly as if the rows it did not see had
    contributed their exact zeros."""
    for p in params:
        if p.grad is None and p.requires_grad:
            p.grad = torch.zeros_like(p)
