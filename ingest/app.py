"""The ingest worker's configuration, Kafka client settings and entry point.

``flywheel ingest`` (or ``python -m ingest``) runs :func:`run_worker`: one member of the
consumer group ``app_id`` (``ingest.worker``: an aiokafka batch loop plus a seal thread;
faust was the runtime until D12 in ``docs/decisions.md``). The join state is in
``ingest.state.StateStore`` (why: see that module); the producer is not transactional
(the embedded broker's InitProducerId fails, DESIGN §3).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from schemas import settings, topics

# the Kafka client settings live in ingest.clients (ingest.worker reads them there, so the
# worker never imports this module); consumer_settings is named here too (tests and bench
# import ``ingest.app.consumer_settings``)
from ingest.clients import consumer_settings
from ingest.join import JoinConfig

__all__ = ["APP_ID", "LOGLEVELS", "IngestConfig", "consumer_settings", "run_worker"]

APP_ID = topics.INGEST_APP_ID  # the group is this under the topic prefix; bump a suffix if the state layout changes

log = logging.getLogger("ingest")


LOGLEVELS = {"crit": logging.CRITICAL, "error": logging.ERROR, "warn": logging.WARNING,
             "info": logging.INFO, "debug": logging.DEBUG}
_PROGRAM = {"cli": False}  # set by programs (tests, the demo); the CLI has no flag for it


@pydantic_dataclass
class IngestConfig:
    """Everything one ingest worker needs: the one declaration of each worker setting
    (``flywheel ingest``'s options, ``[ingest]`` in ``flywheel.toml`` and
    ``FLYWHEEL_INGEST__<FIELD>`` come from these fields, ``schemas.options.config_options``).

    Args:
        join: :class:`ingest.join.JoinConfig` (seal/orphan/age timings, policies, shaping).
        tick_s: how often the seal timer runs (s, > 0).
        checkpoint_s: how often the worker's in-memory join state and its consumed offsets
            are written in one transaction to the state store (s, > 0; also before a
            rebalance and at shutdown); offsets are committed to Kafka after each checkpoint
            (``ingest.keyed``, ``docs/decisions.md`` D81).
        catchup_timeout_s: how long after an assignment the labels of a partition wait for
            the worker to read the partition up to the end offset it had when assigned (s, >
            0, finite); past it a warning names the partition and its labels are sealed
            anyway (``ingest.processor``, ``docs/decisions.md`` D93).
        worker_host: interface of the worker's HTTP port (``0.0.0.0`` for a Prometheus on
            another host).
        worker_port: HTTP port on ``worker_host``: ``GET /metrics`` in the Prometheus text format
            (``ingest.metrics``), any other path the state's counters as JSON; 0 disables it.
        bootstrap: Kafka ``host:port`` (default ``schemas.settings.bootstrap()``).
        samples_dir: shard root (default ``schemas.settings.samples_dir()``).
        state_path: the join state: a SQLite file, shared by the workers of one host (default
            ``$FLYWHEEL_INGEST_STATE``, else ``$FLYWHEEL_HOME/ingest/state.sqlite``), or a
            ``postgresql://`` URL: state scoped to partitions, workers on any host
            (``ingest.state_pg``; ``docs/decisions.md`` D16). The CLI's ``--state``.
        catalog: the DuckDB catalog (default ``schemas.settings.catalog_path()``).
        app_id: names the Kafka consumer group (default ``APP_ID``; the group is
            :attr:`group_id`, the app id under the topic prefix); workers with the same id
            split the partitions and must share ``state_path`` (the same file on one host,
            or the same database).
        loglevel: the ``ingest`` logger's level, one of :data:`LOGLEVELS`.
        samples_value: what ``flywheel.samples`` carries per sealed sample: ``"notice"`` (a
            :class:`schemas.events.SampleNotice`: its shard and row, with the label; ~0.4 KiB)
            or ``"sample"`` (the whole :class:`schemas.events.RewardedSample`, ~19 KiB);
            ``docs/decisions.md`` D67.

    Raises:
        pydantic.ValidationError (a ValueError): a field out of its bounds or pattern; the
            message names the field.
    """

    join: JoinConfig = Field(default_factory=JoinConfig, description="Join timings and policies.",
                             json_schema_extra=_PROGRAM)
    tick_s: float = Field(1.0, description="Seal timer period.", json_schema_extra={"unit": "s"})
    checkpoint_s: float = Field(1.0, description="How often the in-memory join state and the consumed offsets are "
                                "checkpointed (offsets are committed to Kafka after each checkpoint).",
                                json_schema_extra={"unit": "s"})
    catchup_timeout_s: float = Field(300.0, description=(
        "How long a newly assigned partition's labels wait, unsealed, for the worker to read the partition up to "
        "its end offset at the assignment; past it a warning names the partition and they are sealed anyway."),
        json_schema_extra={"unit": "s"})
    worker_port: int = Field(0, ge=0, le=65535, description=(
        "HTTP port on --worker-host: GET /metrics in the Prometheus text format, other paths the counters as "
        "JSON (0: none)."))
    worker_host: str = Field("127.0.0.1", description="Interface of --worker-port (0.0.0.0 for a Prometheus on "
                             "another host).")
    bootstrap: str | None = Field(None, description="Kafka host:port.", json_schema_extra=_PROGRAM)
    samples_dir: Path | None = Field(None, description="Shard root.", json_schema_extra=_PROGRAM)
    state_path: Path | str | None = Field(None, description="Join state: SQLite file or postgresql:// URL.",
                                          json_schema_extra=_PROGRAM)
    catalog: Path | None = Field(None, description="DuckDB catalog.", json_schema_extra=_PROGRAM)
    app_id: str = Field(APP_ID, pattern=r"^[A-Za-z0-9._-]+$", description=(
        "Names the consumer group (the group is the topic prefix + this); workers sharing it split the "
        "partitions."))
    loglevel: Literal["crit", "error", "warn", "info", "debug"] = Field(
        "info", description="crit | error | warn | info | debug.")
    samples_value: Literal["notice", "sample"] = Field(
        "notice", description="flywheel.samples values: notice (the shard row and the label) | sample (the "
        "whole RewardedSample).")

    def __post_init__(self):
        if not (self.tick_s > 0 and math.isfinite(self.tick_s)):  # not Field(gt=0): see JoinConfig
            # (inf: the seal timer never ran, so no label was ever sealed)
            raise ValueError(f"tick_s: must be > 0 seconds and finite, got {self.tick_s}")
        if not (self.checkpoint_s > 0 and math.isfinite(self.checkpoint_s)):
            # (inf: no checkpoint, so no offset commit, until revoke or shutdown)
            raise ValueError(f"checkpoint_s: must be > 0 seconds and finite, got {self.checkpoint_s}")
        if not (self.catchup_timeout_s > 0 and math.isfinite(self.catchup_timeout_s)):
            # (inf: a partition that never catches up would hold its labels forever)
            raise ValueError(f"catchup_timeout_s: must be > 0 seconds and finite, got {self.catchup_timeout_s}")
        self.bootstrap = self.bootstrap or settings.bootstrap()
        self.samples_dir = Path(self.samples_dir or settings.samples_dir())
        state = str(self.state_path or os.environ.get("FLYWHEEL_INGEST_STATE") or
                    settings.home() / "ingest" / "state.sqlite")
        self.state_path = _check_state(state)
        self.catalog = Path(self.catalog or settings.catalog_path())

    @property
    def group_id(self) -> str:
        """The consumer group: ``app_id`` under the topic prefix (:func:`schemas.settings.topic_names`)."""
        return settings.topic_names(app_id=self.app_id).ingest_group


def _check_state(state: str) -> Path | str:
    """``state`` as the join state's location: a ``postgresql://`` URL (checked for syntax, the
    message without the URL, which may hold a password) or a SQLite file path.

    Raises:
        ValueError: a URL of another scheme (``postgresq://``, ``mysql://``: was taken as a
            SQLite file path, so a host ran with a local state of its own), or a malformed
            PostgreSQL URL (was a psycopg traceback at start).
    """
    if state.startswith(("postgresql://", "postgres://")):
        try:
            from psycopg.conninfo import conninfo_to_dict
        except ImportError:  # pragma: no cover - psycopg comes with the ingest role
            return state
        try:
            conninfo_to_dict(state)
        except Exception as exc:  # noqa: BLE001 - psycopg.ProgrammingError: the conninfo parser
            raise ValueError(f"state: not a valid PostgreSQL URL: {str(exc).split(' in URI:')[0]}") from None
        return state
    scheme = state.split("://", 1)[0] if "://" in state else ""
    if scheme and scheme.replace("+", "").replace("-", "").replace(".", "").isalnum():
        raise ValueError(f"state: {scheme}:// is not a join state; give a SQLite file path or a "
                         "postgresql:// URL")
    return Path(state)


def run_worker(cfg: IngestConfig, loglevel: str | None = None) -> None:
    """Run the ingest worker (``ingest.worker``) in this process until SIGTERM/SIGINT: the
    ingest role's assembly, which ``flywheel ingest`` and ``python -m ingest`` call.

    ``loglevel``: one of :data:`LOGLEVELS` for the ``ingest`` logger (assignment, recovery
    and stats lines are INFO), default ``cfg.loglevel``; the Kafka client logs at WARNING or
    above.

    Raises:
        ValueError: unknown ``loglevel``.
    """
    from ingest import worker

    loglevel = loglevel or cfg.loglevel
    if loglevel not in LOGLEVELS:
        raise ValueError(f"loglevel: must be one of {' | '.join(LOGLEVELS)}, got {loglevel!r}")
    level = LOGLEVELS[loglevel]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("aiokafka").setLevel(max(level, logging.WARNING))
    worker.run(cfg)
