"""``relax rollout``, ``relax reference`` and ``relax stage KIND``: run one stage instance
from the command line.

Settings come from an optional YAML file (the fields of the stage's config class:
:class:`relax.consumers.rollout.config.RolloutConfig`,
:class:`relax.consumers.reference_config.ReferenceConfig`, any contract stage's
``config_type``; the bus is ``--bootstrap``) and ``--set key=value`` overrides (values read
as YAML). The stage runs
until Ctrl-C (or SIGTERM), then flushes, commits and exits. Imports stay light: the
stages load inside the commands.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import typer

from relax.infra.cli.bus import BootstrapOpt, bus_config

_ConfigOpt = typer.Option(None, "--config", "-c", help="YAML file with the stage's settings")
_SetOpt = typer.Option(
    None, "--set", "-s", help="override key=value (value parsed as YAML); repeatable"
)


def stage_settings(config: Path | None, sets: list[str] | None, **given) -> dict:
    """Merge the YAML file, then the explicit options, then ``--set`` overrides.

    Raises:
        typer.BadParameter: an override without ``=`` or a file that is not a mapping.
    """
    import yaml

    from relax.infra.recipe.overrides import parse_settings

    out: dict = {}
    if config is not None:
        loaded = yaml.safe_load(Path(config).read_text()) or {}
        if not isinstance(loaded, dict):
            raise typer.BadParameter(
                f"{config} must hold a mapping of settings", param_hint="--config"
            )
        out.update(loaded)
    out.update({k: v for k, v in given.items() if v is not None})
    try:  # the grammar of every command (relax.infra.recipe.overrides)
        return parse_settings(sets, into=out)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--set") from None


@contextmanager
def _until_signal():
    """Yields a ``should_stop`` callable that turns true on SIGINT/SIGTERM; the previous
    handlers are restored afterwards."""
    import signal
    import threading

    stop = threading.Event()
    old = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield stop.is_set
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def rollout_cmd(
    run: str = typer.Option(..., "--run", help="run name"),
    dataset: str | None = typer.Option(None, "--dataset", help="prompt topic prompts.DATASET"),
    model: str | None = typer.Option(
        None, "--model", help="smollm2-135m, tiny-llama, a folder or a Hub id"
    ),
    exit_when_exhausted: bool = typer.Option(False, help="stop after the last epoch"),
    config: Path | None = _ConfigOpt,
    sets: list[str] | None = _SetOpt,
    bootstrap: str | None = BootstrapOpt,
) -> None:
    """Run a rollout instance: prompts.DATASET -> RUN.rollouts (see consumers/rollout/)."""
    from pydantic import ValidationError

    from relax.consumers.rollout.config import RolloutConfig
    from relax.consumers.rollout.stage import RolloutStage

    try:
        cfg = RolloutConfig(
            **stage_settings(config, sets, run=run, dataset=dataset, model=model),
        )
    except ValidationError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    with _until_signal() as should_stop:
        stats = RolloutStage(cfg, bus_config(bootstrap)).run(
            should_stop, stop_when_exhausted=exit_when_exhausted)
    typer.echo(
        f"groups={stats.groups} samples={stats.samples} tokens={stats.tokens} "
        f"budget_waits={stats.budget_waits} weight_waits={stats.weight_waits} "
        f"prompt_errors={stats.prompt_errors}"
    )


def reference_cmd(
    run: str = typer.Option(..., "--run", help="run name"),
    model: str | None = typer.Option(None, "--model", help="reference model"),
    follow_every: int | None = typer.Option(
        None, help="follow the policy every N versions (0 = frozen)"
    ),
    config: Path | None = _ConfigOpt,
    sets: list[str] | None = _SetOpt,
    bootstrap: str | None = BootstrapOpt,
) -> None:
    """Run a reference instance: RUN.rollouts -> RUN.ref_logprobs (see consumers/reference.py)."""
    from pydantic import ValidationError

    from relax.consumers.reference import ReferenceStage
    from relax.consumers.reference_config import ReferenceConfig

    try:
        cfg = ReferenceConfig(
            **stage_settings(config, sets, run=run, model=model, follow_every=follow_every),
        )
    except ValidationError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    with _until_signal() as should_stop:
        stats = ReferenceStage(cfg, bus_config(bootstrap)).run(should_stop)
    typer.echo(f"rows_in={stats.rows_in} rows_out={stats.rows_out} errors={stats.errors}")


def stage_cmd(
    kind: str = typer.Argument(..., help="rollout, reward, reference or aggregate"),
    run: str = typer.Option(..., "--run", help="run name"),
    config: Path | None = _ConfigOpt,
    sets: list[str] | None = _SetOpt,
    bootstrap: str | None = BootstrapOpt,
) -> None:
    """Run one instance of any stage on the stage contract (KIND: a key of
    relax.infra.recipe.specs.CONTRACT_STAGES); its settings are the fields of that stage's
    config class, from --config and --set (e.g. ``relax stage reward --run exp1 --set
    reward=gsm8k``)."""
    from relax.infra.recipe.specs import stage_class
    from relax.streams.stage_contract import ensure_declared_topics, run_stage

    try:
        cls = stage_class(kind)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="KIND") from None
    try:  # a pydantic ValidationError is a ValueError; so is an unknown reward
        stage = cls(cls.config_type(**stage_settings(config, sets, run=run)),
                    bus_config(bootstrap))
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    try:  # a run that does not exist (yet) is a clear error, not a traceback
        ensure_declared_topics(stage.bus, stage.declare())
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    with _until_signal() as should_stop:
        stats = run_stage(stage, should_stop)
    typer.echo(f"{kind} stopped: {stats}")


def register(app: typer.Typer) -> None:
    """Add ``rollout``, ``reference`` and ``stage`` to the ``relax`` app."""
    app.command("rollout")(rollout_cmd)
    app.command("reference")(reference_cmd)
    app.command("stage")(stage_cmd)
