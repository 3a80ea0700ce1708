"""``python -m ingest [flags]``: the same worker as ``flywheel ingest``, with the same settings:
flags, then ``FLYWHEEL_INGEST__<OPTION>`` variables, then the ``[ingest]`` table (and the
paths and ``[kafka]``) of the file ``FLYWHEEL_CONFIG`` names (``schemas.config``)."""

import sys

import typer

from ingest.commands import ingest_cmd
from schemas.config import ConfigError, one_command_defaults


def main(argv: list[str] | None = None) -> None:
    app = typer.Typer(add_completion=False)
    app.command()(ingest_cmd)
    cmd = typer.main.get_command(app)
    try:
        defaults = one_command_defaults("ingest", cmd)
    except ConfigError as exc:  # a usage error, as `flywheel ingest` reports it (exit 2)
        typer.echo(f"Error: {exc}", err=True)
        sys.exit(2)
    cmd.main(args=sys.argv[1:] if argv is None else argv, prog_name="python -m ingest", default_map=defaults)


if __name__ == "__main__":
    main()
