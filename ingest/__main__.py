"""``python -m ingest [flags]``: the same worker as ``flywheel ingest``."""

import typer

from ingest.commands import ingest_cmd

if __name__ == "__main__":
    typer.run(ingest_cmd)
