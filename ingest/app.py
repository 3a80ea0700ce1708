"""The ingest faust app: configuration and the worker entry point.

``flywheel ingest`` (or ``python -m ingest``) builds the app with :func:`build_app` and
runs a faust worker in this process. faust is the stream runtime (consumer group,
partition assignment, agents, timer, producer); the join state is in
``ingest.state.StateStore`` (why: see that module), not in a faust table, and
``exactly_once`` is off (the embedded broker's InitProducerId fails, DESIGN §3).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from schemas import settings

from ingest.join import JoinConfig

APP_ID = "flywheel-ingest"  # consumer group id; bump the suffix if the state layout changes
SESSION_TIMEOUT_S = 6.0  # group joins take ~half the session timeout on Tansu (DESIGN §3)

log = logging.getLogger("ingest")


@dataclass
class IngestConfig:
    """Everything one ingest worker needs.

    Args:
        join: :class:`ingest.join.JoinConfig` (seal/orphan/age timings, policies, shaping).
        tick_s: how often the seal timer runs (s).
        worker_port: faust web port (metrics/health); 0 disables the web server.
        bootstrap: Kafka ``host:port`` (default ``schemas.settings.bootstrap()``).
        samples_dir: shard root (default ``schemas.settings.samples_dir()``).
        state_path: the SQLite join state (default ``$FLYWHEEL_HOME/ingest/state.sqlite``).
        catalog: the DuckDB catalog (default ``schemas.settings.catalog_path()``).
        app_id: faust app id = Kafka consumer group (default ``APP_ID``); workers with the
            same id split the partitions and must share ``state_path``.
    """

    join: JoinConfig = field(default_factory=JoinConfig)
    tick_s: float = 1.0
    worker_port: int = 0
    bootstrap: str | None = None
    samples_dir: Path | None = None
    state_path: Path | None = None
    catalog: Path | None = None
    app_id: str = APP_ID

    def __post_init__(self):
        if not self.app_id or not self.app_id.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"app_id: must be non-empty [A-Za-z0-9._-], got {self.app_id!r}")
        if not self.tick_s > 0:
            raise ValueError(f"tick_s: must be > 0 seconds, got {self.tick_s}")
        if not 0 <= self.worker_port < 65536:
            raise ValueError(f"worker_port: must be 0..65535, got {self.worker_port}")
        self.bootstrap = self.bootstrap or settings.bootstrap()
        self.samples_dir = Path(self.samples_dir or settings.samples_dir())
        self.state_path = Path(self.state_path or settings.home() / "ingest" / "state.sqlite")
        self.catalog = Path(self.catalog or settings.catalog_path())


def faust_settings(cfg: IngestConfig) -> dict:
    """The faust App settings of an ingest worker (also used by ``bench/ingest.py``)."""
    return dict(
        broker=f"kafka://{cfg.bootstrap}", store="memory://", datadir=str(cfg.state_path.parent / "faust"),
        broker_session_timeout=SESSION_TIMEOUT_S, broker_heartbeat_interval=1.0,
        consumer_auto_offset_reset="earliest", topic_allow_declare=False,
        processing_guarantee="at_least_once",
        web_enabled=cfg.worker_port > 0, web_port=cfg.worker_port or 6066, web_bind="127.0.0.1",
        key_serializer="raw", value_serializer="raw",
        # fetch more per round trip: completions carry expert routes (~18 KB each)
        consumer_max_fetch_size=16 * 1024 * 1024, broker_max_poll_records=2000,
        stream_buffer_maxsize=8192)


def build_app(cfg: IngestConfig):
    """A faust App with the ingest agents and seal timer attached (see ``ingest.agents``).

    Also opens the state store and runs :meth:`ingest.join.Joiner.recover` so that claims
    left by a killed worker are finished or released before any event is read.
    """
    import faust

    from ingest import agents

    app = faust.App(cfg.app_id, **faust_settings(cfg))
    agents.attach(app, cfg)
    return app


def run_worker(cfg: IngestConfig, loglevel: str = "warn") -> None:
    """Run the ingest worker in this process until SIGTERM/SIGINT."""
    from faust.worker import Worker

    app = build_app(cfg)
    Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()
