"""``relax reward ...``: attach a reward consumer to a run, or score a JSONL file offline.

Imports stay light (typer only); the stage, the pool and the reward libraries load
inside the commands.
"""

from __future__ import annotations

import json
from typing import Optional

import typer

from relax.infra.cli.bus import BootstrapOpt, bus_config

reward_app = typer.Typer(no_args_is_help=True,
                         help="Reward functions: attach one to a run, or score a file offline.")

_OptionOpt = typer.Option(None, "--option", "-o",
                          help="reward option key=value (value read as JSON when it parses, "
                               "else as text); repeatable")
_WorkersOpt = typer.Option(1, "--workers", "-w", min=1, help="scoring worker processes")
_TimeoutOpt = typer.Option(30.0, "--timeout-s", help="time limit of one scoring call (seconds)")
_MemoryOpt = typer.Option(None, "--memory-limit-bytes",
                          help="address-space limit per worker (bytes); default 4 GiB, 0 = none")
_BatchOpt = typer.Option(64, "--batch-rows", min=1, help="most rows per scoring call")
_FromVersionOpt = typer.Option(None, "--from-policy-version", min=0,
                               help="first group policy_version the change counts for; default "
                                    "and least: the run's latest policy_version + 2")


def parse_options(items: list[str] | None) -> dict:
    """``["k=v", ...]`` as a dict, in the grammar of every command
    (:func:`relax.infra.recipe.overrides.parse_settings`: the value is YAML).

    Raises:
        typer.BadParameter: for an item without ``=`` or a value that is not YAML.
    """
    from relax.infra.recipe.overrides import parse_settings

    try:
        return parse_settings(items)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--option") from None


def _memory(limit: Optional[int]):
    from relax.consumers.reward.pool import DEFAULT_MEMORY_LIMIT_BYTES

    if limit is None:
        return DEFAULT_MEMORY_LIMIT_BYTES
    return limit or None


@reward_app.command("attach")
def attach_cmd(reward: str = typer.Argument(..., help="reward name or module:function"),
               run: str = typer.Option(..., "--run", help="run to attach to"),
               start: str = typer.Option("earliest", "--from",
                                         help="earliest | latest: where a new consumer group "
                                              "starts"),
               name: Optional[str] = typer.Option(None, "--name",
                                                  help="reward_name on the rows (default: the "
                                                       "reward or function name)"),
               option: Optional[list[str]] = _OptionOpt, workers: int = _WorkersOpt,
               timeout_s: float = _TimeoutOpt, memory_limit_bytes: Optional[int] = _MemoryOpt,
               batch_rows: int = _BatchOpt,
               exit_when_idle: Optional[float] = typer.Option(
                   None, "--exit-when-idle", help="stop after SECONDS without new rollouts"),
               weight: Optional[float] = typer.Option(
                   None, "--weight", help="count this reward in the final reward with this "
                                          "weight, for groups sampled after now (announced on "
                                          "<run>.reward_changes); without it the scores are "
                                          "only recorded"),
               from_version: Optional[int] = _FromVersionOpt,
               bootstrap: Optional[str] = BootstrapOpt) -> None:
    """Start one more reward consumer on RUN: its values appear in <run>.rewards under its
    name, and with --weight they count two policy_versions on (the next may be sampled
    already). Runs until Ctrl-C / SIGTERM (or --exit-when-idle)."""
    import signal

    from relax.consumers.reward.pool import RewardLoadError
    from relax.consumers.reward.stage import RewardStage, RewardStageConfig
    from relax.schemas.topics import reward_group

    if start not in ("earliest", "latest"):
        raise typer.BadParameter(f"expected earliest or latest, got {start!r}", param_hint="--from")
    if weight is not None and start != "earliest":
        raise typer.BadParameter("--weight needs --from earliest (a counted reward must score "
                                 "every rollout from its policy_version on)", param_hint="--from")
    try:
        bus = bus_config(bootstrap)
        cfg = RewardStageConfig(run=run, reward=reward, name=name,
                                options=parse_options(option), workers=workers,
                                timeout_s=timeout_s, memory_limit_bytes=_memory(memory_limit_bytes),
                                batch_rows=batch_rows, from_beginning=start == "earliest",
                                exit_when_idle_s=exit_when_idle)
        stage = RewardStage(cfg, bus)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    try:
        stage.ensure_topics()
        if weight is not None:
            first = _announce_attach(bus, run, stage.name, weight, from_version)
            stage = RewardStage(cfg.model_copy(update={"from_policy_version": first}), bus)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    stop = {"flag": False}

    def _stop(signum, frame):
        stop["flag"] = True

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    typer.echo(f"reward {stage.name!r} attached to run {run!r} (consumer group "
               f"{reward_group(run, stage.name)}, {workers} worker(s))")
    try:
        s = stage.run(lambda: stop["flag"])
    except RewardLoadError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    typer.echo(f"stopped: rows={s.rows_in} errors={s.errors} commits={s.commits}")


def _announce_attach(bus, run: str, name: str, weight: float, from_version: Optional[int]) -> int:
    """Announce ``name`` counted with ``weight`` (unless the run's latest change of it
    already says so: a restarted attach), and say so. Returns the first policy_version
    this consumer must score: the earliest attach of ``name`` (scoring more rows than
    count costs time; skipping one that counts would stall its group)."""
    from relax.consumers.reward.changes import ChangeFollower, announce

    follower = ChangeFollower(bus, run)
    try:
        earlier = [c for c in follower.poll() if c.reward_name == name]
    finally:
        follower.close()
    last = earlier[-1] if earlier else None
    if last is None or last.action != "attach" or last.weight != weight or from_version is not None:
        last = announce(bus, run, "attach", name, weight, from_version)
        earlier.append(last)
        typer.echo(f"announced: reward {name!r} counts with weight {weight:g} for groups "
                   f"sampled with policy_version >= {last.from_policy_version}")
    else:
        typer.echo(f"reward {name!r} already counts with weight {weight:g} from policy_version "
                   f"{last.from_policy_version}")
    return min(c.from_policy_version for c in earlier if c.action == "attach")


@reward_app.command("detach")
def detach_cmd(name: str = typer.Argument(..., help="reward_name to stop counting"),
               run: str = typer.Option(..., "--run", help="the live run"),
               from_version: Optional[int] = _FromVersionOpt,
               bootstrap: Optional[str] = BootstrapOpt) -> None:
    """Stop counting reward NAME in RUN's final reward for groups sampled after now
    (announced on <run>.reward_changes; groups in flight keep it). Stop its consumer
    (Ctrl-C on its `relax reward attach`) once the run no longer waits for it."""
    from relax.consumers.reward.changes import announce

    try:
        c = announce(bus_config(bootstrap), run, "detach", name, 0.0, from_version)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"announced: reward {name!r} no longer counts for groups sampled with "
               f"policy_version >= {c.from_policy_version} (the aggregator refuses, and logs, "
               "a detach of a reward not counted or of the last one)")


class _DataError(ValueError):
    """A bad line in the evaluated file."""


def _read_jsonl(path: str, fields: list[str]) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise _DataError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise _DataError(f"{path}:{n}: expected a JSON object per line")
            missing = [k for k in fields if k not in row]
            if missing:
                raise _DataError(f"{path}:{n}: missing field(s) {missing}; has {sorted(row)}")
            rows.append(row)
    return rows


def _metadata(row: dict, field: Optional[str], where: str) -> dict:
    m = row[field] if field else {}
    try:
        m = json.loads(m) if isinstance(m, str) and m else (m or {})
    except ValueError as e:
        raise _DataError(f"{where}: {field} is not JSON ({e})") from None
    if not isinstance(m, dict):
        raise _DataError(f"{where}: {field} is not a JSON object")
    return m


def _text(v) -> Optional[str]:
    return v if v is None or isinstance(v, str) else json.dumps(v)


def _label(v, where: str) -> Optional[str]:
    """The label column's text, as ``relax publish`` writes it (a list: a JSON array of
    strings, scored any-of by the built-in rewards)."""
    from relax.consumers.reward.base import label_text

    try:
        return label_text(v)
    except ValueError as e:
        raise _DataError(f"{where}: {e}") from None


@reward_app.command("eval")
def eval_cmd(reward: str = typer.Argument(..., help="reward name or module:function"),
             data: str = typer.Argument(..., help="JSONL file, one object per line"),
             response_field: str = typer.Option(..., "--response-field",
                                                help="field holding the response text"),
             label_field: Optional[str] = typer.Option(None, "--label-field",
                                                       help="field holding the label"),
             metadata_field: Optional[str] = typer.Option(
                 None, "--metadata-field", help="field holding the metadata object (or JSON)"),
             option: Optional[list[str]] = _OptionOpt, workers: int = _WorkersOpt,
             timeout_s: float = _TimeoutOpt, memory_limit_bytes: Optional[int] = _MemoryOpt,
             batch_rows: int = _BatchOpt) -> None:
    """Score DATA offline through the same worker pool as the stage; the last line is
    `scored=N mean=X errors=E` (N = rows with a value); the first failed rows are named on
    stderr, and it exits 1 when rows failed and none was scored."""
    import time

    from relax.consumers.reward import load_reward_fn
    from relax.consumers.reward.pool import RewardLoadError, RewardPool

    try:
        load_reward_fn(reward)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="REWARD") from None
    fields = [f for f in (response_field, label_field, metadata_field) if f]
    try:
        rows = _read_jsonl(data, fields)
        metadata = [_metadata(r, metadata_field, f"{data}: row {n}")
                    for n, r in enumerate(rows, 1)]
    except (_DataError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    responses = [_text(r[response_field]) or "" for r in rows]
    try:
        labels = [_label(r[label_field], f"{data}: row {n}") if label_field else None
                  for n, r in enumerate(rows, 1)]
    except _DataError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    t0 = time.perf_counter()
    try:
        pool = RewardPool(reward, parse_options(option), workers=workers, timeout_s=timeout_s,
                          memory_limit_bytes=_memory(memory_limit_bytes), batch_rows=batch_rows)
    except RewardLoadError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    with pool:
        t1 = time.perf_counter()
        results = pool.score(responses, labels, metadata)
        t2 = time.perf_counter()
    values = [r.value for r in results if r.value is not None]
    errors = [(n, r.error) for n, r in enumerate(results, 1) if r.error is not None]
    for n, e in errors[:3]:
        typer.echo(f"error: {data}: row {n}: {e}", err=True)
    abstained = len(results) - len(values) - len(errors)
    mean = round(sum(values) / len(values), 4) if values else float("nan")
    typer.echo(f"rows={len(results)} abstained={abstained} workers={workers} "
               f"startup_s={t1 - t0:.2f} score_s={t2 - t1:.3f} "
               f"rows/s={len(results) / max(t2 - t1, 1e-9):.1f}")
    typer.echo(f"scored={len(values)} mean={mean} errors={len(errors)}")
    if errors and not values:  # nothing scored: the function does not work on this data
        raise typer.Exit(1)
