"""CLI of the ingest package: ``flywheel ingest``, ``flywheel data stats`` and ``flywheel data migrate``."""

from __future__ import annotations

import dataclasses
from typing import Optional

import typer
from pydantic import ValidationError

from ingest.app import IngestConfig
from ingest.join import JoinConfig, RewardShaping
from schemas.options import config_options, model_fields, option_for
from schemas.output import OUTPUT, Format, dumps, resolve

data_app = typer.Typer(help="Sample shards and the DuckDB catalog.", no_args_is_help=True)


def _shaping_option(name: str, field: str):
    """``--reward-up`` / ``--reward-down``: the ``typer.Option`` of a :class:`ingest.join.RewardShaping`
    field (its default, help and bounds) under the flag name ``name`` (the model's field
    names, ``up`` and ``down``, would be unclear among the worker's options)."""
    info = model_fields(RewardShaping)[field]
    return option_for(name, info, info.annotation)


@config_options(join=JoinConfig, worker=IngestConfig)
def ingest_cmd(
    join: JoinConfig,
    worker: IngestConfig,
    *,
    reward_up: float = _shaping_option("reward_up", "up"),
    reward_down: float = _shaping_option("reward_down", "down"),
    state: str = typer.Option("", help="Join state: a SQLite file shared by one host's workers (default "
                              "$FLYWHEEL_INGEST_STATE, else $FLYWHEEL_HOME/ingest/state.sqlite) or a postgresql:// "
                              "URL (workers on several hosts)."),
) -> None:
    """Run the ingest worker: join completions and feedback into RewardedSample shards."""
    from ingest.app import run_worker

    try:
        join = dataclasses.replace(join, shaping=RewardShaping(up=reward_up, down=reward_down))
        cfg = dataclasses.replace(worker, join=join, state_path=state or None)
    except ValueError as exc:  # (pydantic's ValidationError is one: its first message, not its input's repr)
        msg = exc.errors()[0]["msg"].removeprefix("Value error, ") if isinstance(exc, ValidationError) else str(exc)
        raise typer.BadParameter(msg, param_hint="--state" if msg.startswith("state:") else None) from None
    from ingest.worker import WorkerStartError

    try:
        run_worker(cfg)
    except WorkerStartError as exc:  # unreachable Kafka, a port in use: one line, not a traceback
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except Exception as exc:
        if not _is_pg_connection_error(exc, cfg.state_path):
            raise
        typer.echo(f"error: join state {_redacted(str(cfg.state_path))}: {' '.join(str(exc).split())}", err=True)
        raise typer.Exit(1) from None


def _is_pg_connection_error(exc: BaseException, state) -> bool:
    """True for psycopg's OperationalError (server unreachable, refused login, session ended)
    when the join state is a PostgreSQL URL: a one-line message, not a traceback."""
    if not isinstance(state, str):
        return False
    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg comes with the ingest role
        return False
    return isinstance(exc, psycopg.OperationalError)


def _redacted(url: str) -> str:
    """``url`` without its password (``postgresql://user:***@host/db``)."""
    from urllib.parse import urlsplit, urlunsplit

    u = urlsplit(url)
    if u.password is None:
        return url
    host = u.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{u.username}:***@{host}" + (f":{u.port}" if u.port else "")
    return urlunsplit(u._replace(netloc=netloc))


@data_app.command("stats")
def stats_cmd(output: Optional[Format] = OUTPUT) -> None:
    """Print the catalog views: votes by version and by split, label balance, dead letters by reason."""
    from rich.console import Console
    from rich.table import Table

    from ingest import catalog
    from schemas import settings

    catalog.refresh_catalog()
    views = {v: catalog.query(f"SELECT * FROM {v}")
             for v in ("votes_by_version", "votes_by_split", "label_balance", "deadletters_by_reason")}
    fmt = resolve(output)
    if fmt in (Format.json, Format.yaml):
        typer.echo(dumps({"samples": str(settings.samples_dir()), "catalog": str(settings.catalog_path()),
                          **views}, fmt))
        return
    con = Console()
    con.print(f"samples: {settings.samples_dir()}  catalog: {settings.catalog_path()}")
    for view, rows in views.items():
        t = Table(title=view)
        cols = list(rows[0].keys()) if rows else ["(no samples)"]
        for c in cols:
            t.add_column(c)
        for r in rows:
            t.add_row(*[f"{v:.4f}" if isinstance(v, float) else str(v) for v in r.values()])
        con.print(t)


@data_app.command("migrate")
def migrate_cmd(dry_run: bool = typer.Option(False, "--dry-run", help="Count what would be converted; write nothing.")
                ) -> None:
    """Rewrite format-1 sample shards (model_version=<v>/date=<d>/, JSON columns) into the
    format-2 layout (date=<d>/hour=<h>/, typed columns); once, crash-safe, idempotent."""
    from ingest import catalog
    from ingest.migrate import migrate
    from schemas import settings

    sd = settings.samples_dir()
    n = migrate(sd, dry_run=dry_run)
    verb = "would convert" if dry_run else "converted"
    typer.echo(f"data migrate: {verb} {n['shards']} shards ({n['samples']} samples) under {sd}"
               + (f"; {n['already']} already had their new copy" if n["already"] else ""))
    if not dry_run:
        catalog.refresh_catalog()


def register(app: typer.Typer) -> None:
    """Add ``ingest``, ``data stats`` and ``data migrate`` to the ``flywheel`` CLI."""
    app.command("ingest")(ingest_cmd)
    app.add_typer(data_app, name="data")
