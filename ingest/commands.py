"""CLI of the ingest package: ``flywheel ingest``, ``flywheel data stats`` and ``flywheel data migrate``."""

from __future__ import annotations

import dataclasses
from typing import Optional

import typer
from pydantic import ValidationError

from ingest.app import IngestConfig
from ingest.join import JoinConfig
from schemas.options import config_options
from schemas.output import OUTPUT, Format, dumps, resolve
from schemas.reward import REWARD_LIMIT, RewardPolicy

data_app = typer.Typer(help="Sample shards and the DuckDB catalog.", no_args_is_help=True)


def _thumb_option(field: str):
    """``--reward-up`` / ``--reward-down``: the reward policy's ``thumb_up`` / ``thumb_down``
    (:class:`schemas.reward.RewardPolicy`; its bounds and help) for this worker, over
    ``[reward]`` and ``FLYWHEEL_REWARD__THUMB_UP`` / ``..._DOWN``; unset, the policy's value."""
    info = RewardPolicy.model_fields[field]
    return typer.Option(None, min=-REWARD_LIMIT, max=REWARD_LIMIT, show_default=False,
                        help=f"{info.description} Overrides \\[reward] {field} (default {info.default:g}).")


@config_options(join=JoinConfig, worker=IngestConfig)
def ingest_cmd(
    join: JoinConfig,
    worker: IngestConfig,
    *,
    reward_up: Optional[float] = _thumb_option("thumb_up"),
    reward_down: Optional[float] = _thumb_option("thumb_down"),
    state: str = typer.Option("", help="Join state: a SQLite file shared by one host's workers (default "
                              "$FLYWHEEL_INGEST_STATE, else $FLYWHEEL_HOME/ingest/state.sqlite) or a postgresql:// "
                              "URL (workers on several hosts)."),
) -> None:
    """Run the ingest worker: join completions and feedback into RewardedSample shards, each
    labelled by the reward policy (\\[reward] in flywheel.toml, FLYWHEEL_REWARD__<FIELD>)."""
    from ingest.app import run_worker

    try:
        policy = RewardPolicy.from_env(thumb_up=reward_up, thumb_down=reward_down)
        join = dataclasses.replace(join, reward=policy)
        cfg = dataclasses.replace(worker, join=join, state_path=state or None)
    except ValueError as exc:  # (pydantic's ValidationError is one: its first message, not its input's repr)
        if isinstance(exc, ValidationError):
            e = exc.errors()[0]
            loc = ".".join(str(x) for x in e["loc"])
            msg = e["msg"].removeprefix("Value error, ")
            msg = msg if msg.split(":", 1)[0] in (loc, "state") or not loc else f"{loc}: {msg}"
        else:
            msg = str(exc)
        hint = ("--state" if msg.startswith("state:") else
                "--reward-up" if msg.startswith("reward.thumb_up") and reward_up is not None else
                "--reward-down" if msg.startswith("reward.thumb_down") and reward_down is not None else None)
        raise typer.BadParameter(msg, param_hint=hint) from None
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
    from rich.text import Text

    from samplestore import catalog
    from schemas import settings

    samples = settings.samples_dir(create_home=False)
    if not samples.is_dir():  # a mistyped home or FLYWHEEL_SAMPLES: said, and nothing created there
        typer.echo(f"no samples at {samples} (no directory there); the join writes them (`flywheel ingest`), "
                   "or set FLYWHEEL_HOME or FLYWHEEL_SAMPLES to an existing one", err=True)
        raise typer.Exit(1)
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
            # cells are data (a dead letter's reason may hold "[reward.scores]"), never rich markup
            t.add_row(*[Text(f"{v:.4f}" if isinstance(v, float) else str(v)) for v in r.values()])
        con.print(t)


@data_app.command("migrate")
def migrate_cmd(dry_run: bool = typer.Option(False, "--dry-run", help="Count what would be converted; write nothing.")
                ) -> None:
    """Rewrite format-1 sample shards (model_version=<v>/date=<d>/, JSON columns) into the
    format-2 layout (date=<d>/hour=<h>/, typed columns); once, crash-safe, idempotent."""
    from samplestore import catalog
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
