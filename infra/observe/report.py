"""The run folder: metrics as JSON lines, a PNG of reward and accuracy per step, and
``summary.json`` with the fate of every sampled rollout (they must add up)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from relax.schemas import metric_names as M


def step_rows(metric_rows: list[dict]) -> list[dict]:
    """Trainer metric rows grouped into one dict per policy_version (step), in order."""
    steps: dict[int, dict] = {}
    for r in metric_rows:
        if r["component"] != "trainer" or r["policy_version"] is None:
            continue
        if r["name"] in (M.GROUPS_CONSUMED, M.GROUPS_NEEDED, "done"):
            continue
        steps.setdefault(int(r["policy_version"]), {"step": int(r["policy_version"])})[r["name"]] \
            = r["value"]
    return [steps[k] for k in sorted(steps) if M.STEP_S in steps[k]]


def ts_ms(ts: float | dt.datetime) -> int:
    """A metric row's ``ts`` as ms since the epoch: decoded ``metrics`` rows carry a
    timezone-aware ``datetime`` (Arrow ``timestamp[ms, UTC]``), hand-made rows an int.

    Raises:
        TypeError: ``ts`` is neither.
    """
    if isinstance(ts, dt.datetime):
        if ts.tzinfo is None:
            raise TypeError(f"metric ts {ts!r} has no time zone (expected UTC)")
        return int(ts.timestamp() * 1000)
    if isinstance(ts, (int, float)):
        return int(ts)
    raise TypeError(f"metric ts must be a datetime or ms since the epoch, got {type(ts).__name__}")


def stall_report(metric_rows: list[dict], now_ms: int, max_names: int = 12) -> str:
    """Where a run stands: per component, how long ago it last wrote a metric and the
    latest value of each of its metrics (staleness histogram buckets left out). Used in
    the error of a run that did not finish.

    Args:
        metric_rows: ``<run>.metrics`` rows (``ts`` a UTC datetime or ms, ``component``,
            ``name``, ``value``), as decoded from the topic.
        now_ms: the current time (ms since the epoch).
        max_names: the most metric names shown per component.

    Returns:
        One line per component, e.g. ``aggregate-0 (2s ago): partial_groups=2 ...``.
    """
    latest: dict[str, dict[str, float]] = {}
    last_ts: dict[str, int] = {}
    for r in metric_rows:
        if r["name"].startswith(M.STALENESS_HIST_PREFIX):
            continue
        latest.setdefault(r["component"], {})[r["name"]] = r["value"]
        last_ts[r["component"]] = max(last_ts.get(r["component"], 0), ts_ms(r["ts"]))
    lines = []
    for comp in sorted(latest):
        vals = " ".join(f"{k}={v:g}" for k, v in sorted(latest[comp].items())[:max_names])
        lines.append(f"{comp} ({(now_ms - last_ts[comp]) / 1000:.0f}s ago): {vals}")
    return "\n".join(lines)


def write_metrics_jsonl(path: Path, metric_rows: list[dict]) -> None:
    """Every metric row as one JSON object per line."""
    with open(path, "w") as f:
        for r in metric_rows:
            f.write(json.dumps({**r, "ts": str(r["ts"])}) + "\n")


def plot_curves(path: Path, steps: list[dict], eval_before: float | None = None,
                eval_after: float | None = None) -> None:
    """PNG with sampled reward mean and accuracy per step (and held-out greedy accuracy
    before/after as two points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [s["step"] for s in steps]
    ax.plot(xs, [s.get(M.REWARD_MEAN) for s in steps], "o-", label="reward mean (sampled)")
    ax.plot(xs, [s.get(M.ACCURACY) for s in steps], "s-", label="accuracy (sampled)")
    if eval_before is not None:
        ax.plot([0], [eval_before], "k^", ms=9, label="held-out greedy, before")
    if eval_after is not None and xs:
        ax.plot([max(xs)], [eval_after], "r^", ms=9, label="held-out greedy, after")
    ax.set_xlabel("policy_version (optimizer step)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def accounting(sampled_ids: set[str], ledger_counts: dict[str, int], ledger_ids: set[str]) -> dict:
    """The fate of every sampled rollout: ``sampled``, ``trained``, ``stale``,
    ``filtered``, ``errors``, and ``unaccounted`` (sampled but not in the ledger) and
    ``unknown`` (in the ledger but never sampled); ``balanced`` when
    trained + stale + filtered + errors == sampled and nothing is unaccounted."""
    out = {"sampled": len(sampled_ids), "trained": ledger_counts.get("trained", 0),
           "stale": ledger_counts.get("stale", 0), "filtered": ledger_counts.get("filtered", 0),
           "errors": ledger_counts.get("error", 0),
           "unaccounted": len(sampled_ids - ledger_ids), "unknown": len(ledger_ids - sampled_ids)}
    out["balanced"] = (out["trained"] + out["stale"] + out["filtered"] + out["errors"]
                       == out["sampled"] and out["unaccounted"] == 0)
    return out
