"""The bus options every command shares: ``--bootstrap`` (:data:`BootstrapOpt`), which
broker it means when none is given (:func:`resolve_bootstrap`), the command's
:class:`~relax.streams.client.BusConfig` (:func:`bus_config`: its security settings, and
the check that the cluster answers), and the check that a topic exists
(:func:`exit_unless_a_topic`).

Security settings of a command (none takes a recipe): the environment variables of
:data:`SECURITY_ENV` when any is set; else, when the cluster is a local broker that
``relax broker start --secure`` recorded, that broker's settings; else PLAINTEXT.
"""

from __future__ import annotations

import os
from typing import Optional

import typer

SECURITY_ENV = {
    "RELAX_BUS_SECURITY_PROTOCOL": "security_protocol",
    "RELAX_BUS_SASL_MECHANISM": "sasl_mechanism",
    "RELAX_BUS_SASL_USERNAME": "sasl_username",
    "RELAX_BUS_SASL_PASSWORD_FILE": "sasl_password_file",
    "RELAX_BUS_SSL_CAFILE": "ssl_cafile",
    "RELAX_BUS_SSL_CERTFILE": "ssl_certfile",
    "RELAX_BUS_SSL_KEYFILE": "ssl_keyfile",
    "RELAX_BUS_SSL_CHECK_HOSTNAME": "ssl_check_hostname",
}
"""Environment variable -> ``BusConfig`` security setting, for the commands; the password
itself: a file (``RELAX_BUS_SASL_PASSWORD_FILE``) or ``RELAX_BUS_SASL_PASSWORD``."""

BootstrapOpt = typer.Option(None, "--bootstrap", "-b", envvar="RELAX_BOOTSTRAP",
                            help="Kafka bootstrap servers host:port[,host:port]; default: the "
                                 "broker started by `relax broker start`.")


def resolve_bootstrap(bootstrap: Optional[str]) -> str:
    """The bootstrap servers to use: the option, else the running local broker recorded
    last (named on stderr when several are running).

    Raises:
        typer.BadParameter: when neither is available.
    """
    return _resolve(bootstrap)[0]


def _resolve(bootstrap: str | None) -> tuple[str, dict]:
    """``(bootstrap servers, security settings of the recorded local broker they name,
    else {})`` (:func:`resolve_bootstrap`)."""
    from relax.infra.broker.local import load_states, running

    live = [h for h in load_states() if running(h)]
    if bootstrap:
        same = [h for h in live if h.bootstrap == bootstrap]
        return bootstrap, same[-1].security if same else {}
    if len(live) > 1:
        typer.echo(f"using the broker on {live[-1].bootstrap}, the last of {len(live)} "
                   f"running ({', '.join(h.bootstrap for h in live)}); --bootstrap picks "
                   "another", err=True)
    if live:
        return live[-1].bootstrap, live[-1].security
    raise typer.BadParameter("no broker: pass --bootstrap host:port (or set RELAX_BOOTSTRAP), "
                             "or run `relax broker start`", param_hint="--bootstrap")


def env_security() -> dict:
    """The security settings given by the environment (:data:`SECURITY_ENV`), {} if none."""
    return {key: os.environ[env] for env, key in SECURITY_ENV.items() if os.environ.get(env)}


def bus_config(bootstrap: Optional[str], check: bool = True, **kw):
    """A :class:`relax.streams.client.BusConfig` for a command: the cluster
    (:func:`resolve_bootstrap`), security settings (the module docstring), ``kw``; with
    ``check``, the cluster checked to answer with them
    (:func:`relax.streams.bus_check.check_bus`).

    Raises:
        typer.Exit: code 2 with one line on stderr: bad security settings, or the cluster
            cannot be reached with them (the cause named).
    """
    from pydantic import ValidationError

    from relax.streams.bus_check import BusUnreachable, check_bus
    from relax.streams.client import BusConfig

    servers, recorded = _resolve(bootstrap)
    security = env_security() or recorded
    try:
        cfg = BusConfig(bootstrap_servers=servers, **security, **kw)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'bus'}: {err['msg']}"
                             for err in e.errors())
        given = [env for env in SECURITY_ENV if os.environ.get(env)]
        typer.echo(f"error: bus settings from {', '.join(given) or 'the recorded broker'}: "
                   f"{problems}", err=True)
        raise typer.Exit(2) from None
    if check:
        try:
            check_bus(cfg)
        except BusUnreachable as e:
            typer.echo(f"error: bus: {e}", err=True)
            raise typer.Exit(2) from None
    return cfg


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
