"""``relax broker start|stop|status|tool``: the local Apache Kafka from the command
line; :mod:`relax.infra.broker.local` does the work and keeps the state file.
"""

from __future__ import annotations

from typing import Optional

import typer

broker_app = typer.Typer(no_args_is_help=True,
                         help="Start, stop or inspect the local broker (Apache Kafka).")


@broker_app.command("start")
def broker_start(port: Optional[int] = typer.Option(None, help="TCP port of the first node "
                                                    "(default: a free one), then port+1, ..."),
                 host: str = typer.Option("127.0.0.1", help="address to listen on"),
                 brokers: Optional[int] = typer.Option(
                     None, help="nodes in the KRaft cluster, 1 or 3 (default 1, or as many as "
                     "the --dir cluster has)"),
                 data_dir: Optional[str] = typer.Option(
                     None, "--dir", help="folder for its configs, logs and data (default "
                     "$RELAX_HOME/kafka); a folder that holds a cluster starts it again as it "
                     "was, with its topics"),
                 secure: bool = typer.Option(
                     False, "--secure", help="clients connect with SASL_SSL: user 'relax' "
                     "(SCRAM-SHA-256) with a random password, TLS from a CA made here; the "
                     "password file and CA go in --dir, the settings to use are printed")
                 ) -> None:
    """Start a local Apache Kafka in the background and record it in
    $RELAX_HOME/broker.json.

    With --secure it prints the recipe settings of a SASL_SSL client (bus.security_protocol
    ... bus.ssl_cafile); the relax commands (topics, tail, monitor, ...) use them on their
    own for this broker. A folder made with --secure starts again secure.

    With --port, a broker recorded on another port may keep running: each is recorded
    (`relax broker stop --port` stops one)."""
    import time
    from pathlib import Path

    from relax.infra.broker.local import (
        default_data_dir,
        pid_alive,
        save_state,
        start_kafka,
        status,
    )

    if brokers not in (None, 1, 3):
        raise typer.BadParameter(f"--brokers must be 1 or 3, got {brokers}",
                                 param_hint="--brokers")
    handle, running = status(port=port)  # --port: the one recorded there; else the last
    if running:
        typer.echo(f"broker already running: pid={','.join(map(str, handle.pids))} "
                   f"bootstrap={handle.bootstrap} dir={handle.data_dir}")
        raise typer.Exit(1)
    if handle is not None and any(pid_alive(p) for p in handle.pids):
        if data_dir is not None and Path(data_dir).resolve() != Path(handle.data_dir):
            typer.echo(f"the recorded broker in {handle.data_dir} is partly running "
                       f"(pid={','.join(map(str, handle.pids))}): `relax broker stop` it first")
            raise typer.Exit(1)
        data_dir = handle.data_dir  # start its stopped nodes again
    t0 = time.monotonic()
    try:
        h = start_kafka(data_dir or default_data_dir(), brokers=brokers, port=port, host=host,
                        secure=True if secure else None)
    except (FileNotFoundError, ValueError, OSError, TimeoutError) as e:
        typer.echo(f"broker not started: {e}", err=True)
        raise typer.Exit(1) from None
    save_state(h)
    typer.echo(f"broker started: pid={','.join(map(str, h.pids))} bootstrap={h.bootstrap} "
               f"dir={h.data_dir} ({time.monotonic() - t0:.1f}s)")
    if h.security:
        from relax.infra.broker.secure import TOOLS_CONFIG, settings_line

        typer.echo(f"settings to use (recipe keys; the relax commands take them for this "
                   f"broker on their own): bootstrap_servers={h.bootstrap} "
                   f"{settings_line(h.security)}")
        typer.echo(f"Kafka's tools: relax broker tool NAME --bootstrap-server {h.bootstrap} "
                   f"--command-config {Path(h.data_dir) / TOOLS_CONFIG} ...")


@broker_app.command("stop")
def broker_stop(port: Optional[int] = typer.Option(
        None, help="stop the broker recorded on this port (any of a cluster's); needed "
        "when several brokers are recorded"),
                wipe: bool = typer.Option(False, "--wipe", help="also delete its folder: "
                                          "every topic, committed offset and log")) -> None:
    """Stop a recorded broker, every node of it (SIGTERM, then SIGKILL after 30 s): the one
    on --port, else the only one recorded. Its topics stay in its folder (the next `relax
    broker start` brings them back) unless --wipe."""
    import shutil

    from relax.infra.broker.local import forget_state, load_states, stop_broker

    handles = load_states()
    if not handles:
        typer.echo("no broker recorded")
        raise typer.Exit(0)
    recorded = ", ".join(f"port {','.join(map(str, h.ports))}" for h in handles)
    if port is not None:
        handles = [h for h in handles if port in h.ports]
        if not handles:
            typer.echo(f"error: no broker recorded on port {port}; recorded: {recorded}",
                       err=True)
            raise typer.Exit(1)
    elif len(handles) > 1:
        typer.echo(f"error: {len(handles)} brokers recorded ({recorded}): say which one with "
                   "--port PORT", err=True)
        raise typer.Exit(1)
    h = handles[-1]
    stop_broker(h)
    forget_state(h)
    if wipe and h.data_dir:
        shutil.rmtree(h.data_dir, ignore_errors=True)
    typer.echo(f"broker stopped: pid={','.join(map(str, h.pids))} bootstrap={h.bootstrap}"
               + (f"; deleted {h.data_dir}" if wipe and h.data_dir else
                  f"; its topics stay in {h.data_dir}"))


@broker_app.command("status")
def broker_status(port: Optional[int] = typer.Option(
        None, help="the broker recorded on this port (default: the one recorded last)")) -> None:
    """Print whether the recorded broker runs, and each of its nodes (exit code 1 if not)."""
    from relax.infra.broker.local import pid_alive, port_open, status

    h, running = status(port=port)
    if h is None:
        typer.echo("no broker recorded" + (f" on port {port}" if port is not None else ""))
        raise typer.Exit(1)
    typer.echo(f"{'running' if running else 'not running'}: "
               f"pid={','.join(map(str, h.pids))} bootstrap={h.bootstrap}"
               + (f" dir={h.data_dir}" if h.data_dir else "")
               + (f" security={h.security['security_protocol']}" if h.security else ""))
    for n in h.nodes:
        up = pid_alive(n.pid) and port_open(h.host, n.port)
        typer.echo(f"  node {n.node_id}: {'up' if up else 'down'} pid={n.pid} "
                   f"port={n.port} log={n.log_path}")
    raise typer.Exit(0 if running else 1)


@broker_app.command("tool", context_settings={"allow_extra_args": True,
                                               "ignore_unknown_options": True})
def broker_tool(ctx: typer.Context, name: str = typer.Argument(
        ..., help="consumer-groups | console-consumer | topics")) -> None:
    """Run one of Apache Kafka's own tools (kafka-NAME.sh) on any Kafka-protocol broker,
    e.g. `relax broker tool consumer-groups --bootstrap-server HOST:PORT --describe
    --all-groups` (needs `make install`); exits with the tool's exit code."""
    import subprocess

    from relax.infra.broker.kafka import kafka_tool_cmd

    try:
        cmd = kafka_tool_cmd(name, list(ctx.args))
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(subprocess.run(cmd, check=False).returncode)
