"""``flywheel topics create|check`` and ``flywheel schemas export``: the Kafka side of a
deployment on a team's own cluster (``docs/kafka.md``)."""

# no ``from __future__ import annotations``: schemas.options.config_options evaluates the
# commands' own annotations in its module, where ``Optional`` and ``Format`` are not defined

from pathlib import Path
from typing import Optional

import typer
from pydantic import BaseModel, ConfigDict, Field

from schemas.topic_admin import ADMIN_TIMEOUT_S
from schemas.options import config_options
from schemas.output import OUTPUT, Format, emit, resolve

topics_app = typer.Typer(help="Create or verify Flywheel's Kafka topics (FLYWHEEL_KAFKA_* settings).",
                         no_args_is_help=True)
schemas_app = typer.Typer(help="Published JSON Schemas of every Kafka event.", no_args_is_help=True)


class ClusterConfig(BaseModel):
    """Which cluster ``flywheel topics create|check`` talk to, and how long they wait for it
    (the one declaration of both options; the topics' own settings are
    :class:`schemas.settings.KafkaSettings`, from ``FLYWHEEL_KAFKA_*`` or ``[kafka]``).

    Raises:
        pydantic.ValidationError: ``timeout_s`` below 0.1 s.
    """

    model_config = ConfigDict(frozen=True)
    bootstrap: Optional[str] = Field(None, description="host:port of the cluster (default FLYWHEEL_KAFKA_BOOTSTRAP).")
    timeout_s: float = Field(ADMIN_TIMEOUT_S, ge=0.1, description="How long to wait for the cluster.",
                             json_schema_extra={"unit": "s"})


def _settings():
    """The Kafka settings, or exit 1 naming the bad ``FLYWHEEL_KAFKA_*`` variable."""
    from flywheel.cli import check_kafka_settings
    from schemas.settings import kafka_settings

    check_kafka_settings()
    return kafka_settings()


def _rows(result: dict, settings) -> list[dict]:
    from schemas.topics import SPECS, plan

    out = []
    for t in plan(settings):
        have = result["topics"].get(t.name)
        bad = [m for m in result["mismatches"] if m.startswith(t.name + ":")]
        out.append({"topic": t.name, "status": "missing" if have is None else ("mismatch" if bad else "ok"),
                    "partitions": have and have["partitions"], "replication_factor": have and have["replication_factor"],
                    "want": {"partitions": t.partitions, "replication_factor": t.replication_factor, **t.configs},
                    "configs": have["configs"] if have else {}, "key": SPECS[t.short].key,
                    "value": SPECS[t.short].value, "writers": SPECS[t.short].writers,
                    "readers": SPECS[t.short].readers, "problems": bad})
    return out


def _report(rows: list[dict], result: dict, fmt: Format, title: str) -> None:
    def table(wide: bool) -> None:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        cols = ["topic", "status", "partitions", "replicas", "retention.ms", "max.message.bytes"]
        if wide:
            cols += ["key", "value", "writers", "readers"]
        for c in cols:
            t.add_column(c, overflow="fold")
        for r in rows:
            w = r["want"]
            cells = [r["topic"], r["status"], f"{r['partitions']}/{w['partitions']}",
                     f"{r['replication_factor']}/{w['replication_factor']}",
                     r["configs"].get("retention.ms", "?") + "/" + w["retention.ms"],
                     r["configs"].get("max.message.bytes", "?") + "/" + w["max.message.bytes"]]
            if wide:
                cells += [r["key"], r["value"], r["writers"], r["readers"]]
            t.add_row(*[str(c) for c in cells])
        Console(width=200 if wide else None).print(t)
        typer.echo("(have/want; ? = the broker does not report it)")

    emit({"topics": rows, "created": result.get("created", []), "mismatches": result["mismatches"],
          "unverified": result["unverified"]}, fmt, table)
    for m in result["mismatches"]:
        typer.echo(f"error: {m}", err=True)


@topics_app.command("create")
@config_options(cluster=ClusterConfig)
def topics_create(cluster: ClusterConfig, *, output: Optional[Format] = OUTPUT):
    """Create the missing topics with the settings' prefix, partitions, replication factor,
    retention and max message size; then verify every topic. An existing topic that differs is
    never altered: it is reported and the command exits 1."""
    from schemas.topic_admin import create_topics

    s = _settings()
    try:
        res = create_topics(cluster.bootstrap, settings=s, timeout_s=cluster.timeout_s)
    except RuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    _report(_rows(res, s), res, resolve(output), f"topics created: {len(res['created'])}")
    if res["mismatches"]:
        raise typer.Exit(1)


@topics_app.command("check")
@config_options(cluster=ClusterConfig)
def topics_check(cluster: ClusterConfig, *, output: Optional[Format] = OUTPUT,
                 as_json: bool = typer.Option(False, "--json", help="Same as -o json.")):
    """Verify that every topic exists as the settings say; exit 1 on a missing topic or a
    mismatch (partitions, replication factor, a config the broker reports). Changes nothing."""
    from schemas.topic_admin import check_topics

    fmt = resolve(output, as_json)
    s = _settings()
    try:
        res = check_topics(cluster.bootstrap, settings=s, timeout_s=cluster.timeout_s)
    except RuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    _report(_rows(res, s), res, fmt, "topics")
    if res["mismatches"]:
        raise typer.Exit(1)


@schemas_app.command("export")
def schemas_export(out: Path = typer.Argument(Path("flywheel-schemas"), help="Directory to write to."),
                   output: Optional[Format] = OUTPUT):
    """Write <Name>.v<schema_version>.schema.json (JSON Schema 2020-12) for every event and
    sample on Kafka, generated from the pydantic models."""
    from schemas.json_schema import contracts, export

    try:
        files = export(out)
    except OSError as exc:  # a file in the way, no permission, a read-only disk: said, not a traceback
        typer.echo(f"error: cannot write the schemas to {out}: {exc.strerror or exc}", err=True)
        raise typer.Exit(1) from None
    rows = [{"contract": c.name, "schema_version": c.version, "topic": c.topic, "file": str(p)}
            for c, p in zip(contracts(), files)]

    def table(wide: bool) -> None:
        for r in rows:
            typer.echo(r["file"] + (f"\t{r['contract']} v{r['schema_version']} on {r['topic']}" if wide else ""))

    emit(rows, resolve(output), table)


def register(app: typer.Typer) -> None:
    """Add ``topics create|check`` and ``schemas export`` to the ``flywheel`` CLI."""
    app.add_typer(topics_app, name="topics")
    app.add_typer(schemas_app, name="schemas")
