"""``relax train`` (a recipe end to end) and ``relax eval`` (a model's greedy held-out
accuracy on a recipe's eval set). Imports stay light: the run loads inside the commands.
"""

from __future__ import annotations

from typing import Optional

import typer

_RecipeArg = typer.Argument(..., help="recipe YAML (see recipes/)")
_TrainRecipeArg = typer.Argument(None, help="recipe YAML (see recipes/); none with --resume")
_OverridesArg = typer.Argument(None, help="dotted overrides key=value, e.g. trainer.steps=3")


def load_checked_recipe(recipe: str, overrides: list[str] | None):
    """The recipe with ``overrides``, checked before anything starts
    (:func:`relax.infra.recipe.preflight.preflight`); exits 2 with one line naming the key."""
    from relax.infra.recipe.preflight import preflight
    from relax.infra.recipe.recipe import RecipeError, load_recipe

    try:
        rec = load_recipe(recipe, list(overrides or []))
        preflight(rec)  # names that do not resolve: before a broker, Ray or a stage starts
    except (RecipeError, FileNotFoundError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    return rec


def check_bus_first(recipe: str, overrides: list[str]) -> None:
    """Check the recipe's Kafka cluster before the recipe is loaded (loading imports every
    stage's config, torch among them: 4-8 s on a busy 2-core machine): when the recipe
    file and ``overrides`` give ``bootstrap_servers`` and a ``bus`` section that make a
    :class:`~relax.streams.client.BusConfig`, the cluster must answer with its security
    settings (:func:`relax.streams.bus_check.check_bus`); exits 2 with one line if not.
    A recipe or override that does not parse is left to the full load, which names it;
    ``relax.infra.control.launch.train`` checks the bus again with the loaded recipe."""
    from pathlib import Path

    import yaml
    from pydantic import ValidationError

    from relax.infra.recipe.overrides import parse_override, set_dotted
    from relax.streams.bus_check import BusUnreachable, check_bus
    from relax.streams.client import BusConfig

    try:
        tree = yaml.safe_load(Path(recipe).read_text())
        if not isinstance(tree, dict):
            return
        for o in overrides:
            set_dotted(tree, *parse_override(o))
        servers, bus = tree.get("bootstrap_servers"), tree.get("bus") or {}
        if not isinstance(servers, str) or not isinstance(bus, dict):
            return
        cfg = BusConfig(bootstrap_servers=servers, **bus)
    except (OSError, yaml.YAMLError, ValidationError, ValueError):
        return  # the full load says what is wrong
    try:
        check_bus(cfg)
    except BusUnreachable as e:
        typer.echo(f"error: bus: {e}", err=True)
        raise typer.Exit(2) from None


def train_cmd(recipe: Optional[str] = _TrainRecipeArg,
              overrides: Optional[list[str]] = _OverridesArg,
              bootstrap: Optional[str] = typer.Option(
                  None, "--bootstrap", "-b", envvar="RELAX_BOOTSTRAP",
                  help="Kafka cluster host:port (default: the recipe's, else a local broker)"),
              from_archive: Optional[str] = typer.Option(
                  None, "--from-archive", help="train offline from a run archive's train samples"),
              batches_from: Optional[str] = typer.Option(
                  None, "--batches-from", help="with --from-archive: the archived run's folder; "
                  "train its trainer's batches in its order (reproduces its steps)"),
              timeout_s: Optional[float] = typer.Option(
                  None, help="give up after this many seconds (stages are stopped)"),
              resume: Optional[str] = typer.Option(
                  None, "--resume", help="go on with run RUN (its folder, or its name under "
                  "runs/) whose driver died, with its folder's recipe; key=value arguments "
                  "may change trainer.steps and timeouts, not the model or group_size")) -> None:
    """Run GRPO end to end: rollout, rewards, aggregation, trainer, each its own process.

    Run name (topics <run>.*, folder runs/<run>/): recipe key `run`, default <recipe>-<time>.

    Override any recipe key (infra/recipe/recipe.py) with key=value, e.g. run=NAME.

    `relax train --resume RUN key=value...` goes on with a run whose driver died, from
    each stage's committed offsets and the trainer's newest checkpoint (exit 2 with one
    line when it cannot: infra/control/resume.py).
    """
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # clients log closed sockets as ERROR
    extra = list(overrides or [])
    if bootstrap:
        extra.append(f"bootstrap_servers={bootstrap}")
    resumed = None
    if resume:
        rec, resumed = _prepare_resume(resume, [*([recipe] if recipe else []), *extra],
                                       from_archive)
    elif recipe is None:
        typer.echo("error: give a recipe (relax train RECIPE), or --resume RUN", err=True)
        raise typer.Exit(2)
    else:
        if not from_archive:
            check_bus_first(recipe, extra)  # seconds before the recipe's imports
        rec = load_checked_recipe(recipe, extra)
    if from_archive:
        from relax.infra.offline.offline import train_from_archive

        try:
            summary = train_from_archive(rec, from_archive, batches_from=batches_from,
                                         say=typer.echo)
        except ValueError as e:  # too few groups, a folder with no ledger, not an archive
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
    else:
        from relax.infra.control.launch import RunFailed, train
        from relax.infra.recipe.recipe import RecipeError

        try:
            summary = train(rec, say=typer.echo, timeout_s=timeout_s, resumed=resumed)
        except RecipeError as e:  # found before anything started (the eval set)
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        except RunFailed as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
    from relax.infra.control.launch import final_line

    typer.echo(f"run folder: {summary['run_dir']}")
    if "samples_per_s" in summary:
        typer.echo(f"throughput: samples/s={summary['samples_per_s']:.2f} (trained rows over "
                   f"the {summary['train_s']:.0f} s from the stages' start to the last step) "
                   f"trainer data-wait="
                   f"{summary['trainer_wait_pct']:.0f}% wall_s={summary['wall_s']:.0f}")
    before, after = summary.get("eval_before"), summary.get("eval_after")
    if before and after:
        gain = 100 * (after["accuracy"] - before["accuracy"])
        typer.echo(f"greedy held-out accuracy: before {before['accuracy']:.3f} after "
                   f"{after['accuracy']:.3f} ({gain:+.1f} points, n={after['n']})")
    typer.echo(final_line(summary))


def _prepare_resume(run: str, overrides: list[str], from_archive: str | None):
    """The recipe and :class:`~relax.infra.control.resume.Resumed` of run ``run``
    (:func:`relax.infra.control.resume.prepare_resume`); exits 2 with one line when it cannot
    go on, when an argument is not ``key=value`` (the recipe is the run's), or when the
    run's cluster cannot be used (:func:`check_bus_first`)."""
    from pathlib import Path

    # the run's own cluster first, before relax.infra.control.resume imports the recipe's stages
    # (torch: 7-10 s on a busy machine); the places relax.infra.control.resume.run_folder looks
    for d in (Path(run), Path("runs") / run):
        if (d / "recipe.yaml").is_file() and not from_archive:
            check_bus_first(str(d / "recipe.yaml"), [o for o in overrides if "=" in o])
            break
    from relax.infra.control.resume import ResumeRefused, prepare_resume
    from relax.infra.recipe.recipe import RecipeError

    try:
        if from_archive:
            raise ResumeRefused("--resume continues a run on its bus; --from-archive "
                                "trains offline: give one of them")
        odd = [o for o in overrides if "=" not in o]
        if odd:
            raise ResumeRefused(f"with --resume the recipe is the run's own (recipe.yaml in "
                                f"its folder): give only key=value overrides, got {odd[0]!r}")
        rec, resumed = prepare_resume(run, overrides, say=typer.echo)
    except (ResumeRefused, RecipeError, FileNotFoundError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    return rec, resumed


def eval_cmd(recipe: str = _RecipeArg, overrides: Optional[list[str]] = _OverridesArg,
             model: Optional[str] = typer.Option(
                 None, "--model", "-m", help="model to evaluate: a run's final_model or "
                 "checkpoint folder, a built-in name or a Hub id (default: the recipe's)")) -> None:
    """Greedy held-out accuracy of a model on the recipe's eval set, as `relax train` measures
    it before and after training (the same prompts, template, reward and threshold).

    Needs no broker: it decodes in this process. Exit 2: a recipe error (no eval section, or
    too few eval prompts); exit 1: the reward cannot score.
    """
    from relax.infra.control.launch import RunFailed, eval_line, evaluate_held_out, held_out_rows
    from relax.infra.recipe.recipe import RecipeError

    rec = load_checked_recipe(recipe, [*(overrides or []), *([f"model={model}"] if model else [])])
    try:
        if rec.eval is None:
            raise RecipeError("eval: the recipe has no eval section (eval: {source: ..., "
                              "size: ...})")
        rows = held_out_rows(rec)
    except RecipeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    try:
        r = evaluate_held_out(rec, rec.model, rows)
    except RunFailed as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(eval_line(f"of {rec.model}", r))


def register(app: typer.Typer) -> None:
    """Add ``train`` and ``eval`` to the ``relax`` app."""
    app.command("train")(train_cmd)
    app.command("eval")(eval_cmd)
