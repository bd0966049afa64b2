"""The ``relax`` command: its typer app (:mod:`relax.infra.cli.app`, the console entry
point) and one module per group of subcommands (train, reward, stages, broker, scale),
with the bus settings they share (:mod:`relax.infra.cli.bus`). The top floor of infra/:
it parses arguments and calls down into control/, offline/, recipe/, observe/ and
broker/; nothing imports it."""
