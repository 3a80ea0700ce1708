"""CLI of the ingest package: ``flywheel ingest``, ``flywheel data stats`` and ``flywheel data migrate``."""

from __future__ import annotations

from typing import Optional

import typer

from schemas.output import OUTPUT, Format, dumps, resolve

data_app = typer.Typer(help="Sample shards and the DuckDB catalog.", no_args_is_help=True)


def ingest_cmd(
    seal_after_s: float = typer.Option(600.0, help="Seal a label after this long without a new vote (s)."),
    max_label_age_s: float = typer.Option(3600.0, help="Seal (or drop, with no vote) completions this old (s)."),
    orphan_ttl_s: float = typer.Option(600.0, help="How long feedback waits for its completion (s)."),
    tick_s: float = typer.Option(1.0, help="Seal timer period (s)."),
    worker_port: int = typer.Option(0, help="HTTP port on --worker-host: GET /metrics in the Prometheus text format, other "
                                     "paths the counters as JSON (0: none)."),
    worker_host: str = typer.Option("127.0.0.1", help="Interface of --worker-port (0.0.0.0 for a Prometheus on "
                                    "another host)."),
    late_policy: str = typer.Option("deadletter", help="Feedback after sealing: deadletter | drop."),
    reward_up: float = typer.Option(1.0, help="Reward of an up-vote."),
    reward_down: float = typer.Option(-1.0, help="Reward of a down-vote."),
    loglevel: str = typer.Option("info", help="crit | error | warn | info | debug."),
    app_id: str = typer.Option("flywheel-ingest", help="Names the consumer group (the group is the topic prefix + "
                                                       "this); workers sharing it split the partitions."),
    state: str = typer.Option("", help="Join state: a SQLite file shared by one host's workers (default "
                              "$FLYWHEEL_INGEST_STATE, else $FLYWHEEL_HOME/ingest/state.sqlite) or a postgresql:// "
                              "URL (workers on several hosts)."),
) -> None:
    """Run the ingest worker: join completions and feedback into RewardedSample shards."""
    from ingest.app import IngestConfig, run_worker
    from ingest.join import JoinConfig, RewardShaping

    from ingest.app import LOGLEVELS

    if loglevel not in LOGLEVELS:
        raise typer.BadParameter(f"must be one of {' | '.join(LOGLEVELS)}, got {loglevel!r}", param_hint="--loglevel")
    try:
        cfg = IngestConfig(
            join=JoinConfig(seal_after_s=seal_after_s, max_label_age_s=max_label_age_s,
                            orphan_ttl_s=orphan_ttl_s, late_policy=late_policy,
                            shaping=RewardShaping(up=reward_up, down=reward_down)),
            tick_s=tick_s, worker_port=worker_port, worker_host=worker_host, app_id=app_id, state_path=state or None)
    except (ValueError, RuntimeError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        run_worker(cfg, loglevel=loglevel)
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
