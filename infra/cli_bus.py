"""The bus options every command shares: ``--bootstrap`` (:data:`BootstrapOpt`), which
broker it means when none is given (:func:`resolve_bootstrap`), the command's
:class:`~relax.streams.client.BusConfig` (:func:`bus_config`), and the check that a
topic exists (:func:`exit_unless_a_topic`)."""

from __future__ import annotations

from typing import Optional

import typer

BootstrapOpt = typer.Option(None, "--bootstrap", "-b", envvar="RELAX_BOOTSTRAP",
                            help="Kafka bootstrap servers host:port[,host:port]; default: the "
                                 "broker started by `relax broker start`.")


def resolve_bootstrap(bootstrap: Optional[str]) -> str:
    """The bootstrap servers to use: the option, else the running local broker recorded
    last (named on stderr when several are running).

    Raises:
        typer.BadParameter: when neither is available.
    """
    if bootstrap:
        return bootstrap
    from relax.infra.broker import load_states, running

    live = [h for h in load_states() if running(h)]
    if len(live) > 1:
        typer.echo(f"using the broker on {live[-1].bootstrap}, the last of {len(live)} "
                   f"running ({', '.join(h.bootstrap for h in live)}); --bootstrap picks "
                   "another", err=True)
    if live:
        return live[-1].bootstrap
    raise typer.BadParameter("no broker: pass --bootstrap host:port (or set RELAX_BOOTSTRAP), "
                             "or run `relax broker start`", param_hint="--bootstrap")


def bus_config(bootstrap: Optional[str], **kw):
    """A :class:`relax.streams.client.BusConfig` for a command."""
    from relax.streams.client import BusConfig

    return BusConfig(bootstrap_servers=resolve_bootstrap(bootstrap), **kw)


def exit_unless_a_topic(cfg, *names: str) -> None:
    """Exit 1 with one line unless one of the topics ``names`` is on the cluster: a
    misspelled topic or run name, or a run whose own broker has stopped, would otherwise
    print zero rows as if the topic were empty."""
    from relax.streams.client import list_topics

    if set(names) & set(list_topics(cfg)):
        return
    typer.echo(f"error: no topic {names[0]!r} on {cfg.bootstrap_servers} (`relax topics` lists "
               "them; a run started without --bootstrap had its own broker, gone with it)",
               err=True)
    raise typer.Exit(1)
