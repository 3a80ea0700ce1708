"""Output formats of read commands, kubectl's ``-o``: a table (default), ``wide`` (more
columns), ``json`` or ``yaml`` (the same data, machine-readable, on stdout).

A contract of every package's commands (deploy, ingest and the ``flywheel`` CLI print through
it, and scripts parse what it prints), so it lives in ``schemas/``: packages import it from
here, never from the CLI package (D52).

A read command takes ``output: Optional[str] = OUTPUT`` (and may keep ``--json`` as an alias of
``-o json``), builds one plain dict or list, and calls :func:`emit` with a function that draws
the table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from enum import Enum
from typing import Optional

import typer


class Format(str, Enum):
    """``-o`` values: ``table`` is the default human view; ``wide`` adds columns."""

    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"


OUTPUT = typer.Option(None, "-o", "--output", case_sensitive=False,
                      help="Output format: json | yaml | wide (default: a table).")


def resolve(output: Optional[Format | str], as_json: bool = False) -> Format:
    """The format a command prints: ``--json`` is ``-o json``; both with another ``-o`` is a usage error.

    Raises:
        typer.BadParameter: ``--json`` together with ``-o`` other than json, or an unknown format.
    """
    if output is not None and not isinstance(output, Format):
        try:
            output = Format(str(output).lower())
        except ValueError:
            raise typer.BadParameter(f"{output!r} is not one of json, yaml, wide", param_hint="-o") from None
    if as_json and output not in (None, Format.json):
        raise typer.BadParameter(f"--json conflicts with -o {output.value}", param_hint="-o")
    return Format.json if as_json else (output or Format.table)


def json_safe(x):
    """``x`` (JSON-ready dicts, lists, numbers, strings) with every NaN or infinite float
    replaced by None, so a JSON document of it is valid JSON (``json.dumps(..., allow_nan=False)``
    accepts it): a damaged ledger row or record must not make ``-o json`` emit ``NaN``."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def dumps(data, fmt: Format) -> str:
    """``data`` as JSON (indent 1) or YAML (block style, keys in insertion order); a NaN or
    infinite number is written as null (:func:`json_safe`), so the JSON is valid for any parser."""
    plain = json_safe(json.loads(json.dumps(data, default=str)))  # one normalisation for both (UUIDs, paths, enums)
    if fmt == Format.yaml:
        import yaml

        return yaml.safe_dump(plain, sort_keys=False, default_flow_style=False).rstrip("\n")
    return json.dumps(plain, indent=1, allow_nan=False)


def emit(data, fmt: Format, table: Callable[[bool], None]) -> None:
    """Print ``data`` as JSON or YAML, or call ``table(wide)`` for the human views."""
    if fmt in (Format.json, Format.yaml):
        typer.echo(dumps(data, fmt))
    else:
        table(fmt == Format.wide)
