"""Where things live: the shared paths and addresses every package agrees on.

Environment:
    FLYWHEEL_HOME: root of all local state (default ``./.flywheel``).
    FLYWHEEL_KAFKA_BOOTSTRAP: ``host:port[,host:port]`` of an external Kafka cluster.
        When unset, the embedded broker started by ``flywheel broker start`` is used
        (its address is read from ``$FLYWHEEL_HOME/broker.json``).
    FLYWHEEL_SERVING_URL: base URL of the serving pod (default ``http://127.0.0.1:8000``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def home() -> Path:
    """Root of Flywheel's local state; created on first use."""
    p = Path(os.environ.get("FLYWHEEL_HOME", ".flywheel")).absolute()
    p.mkdir(parents=True, exist_ok=True)
    return p


def broker_state_file() -> Path:
    return home() / "broker.json"


def bootstrap() -> str:
    """Kafka bootstrap servers.

    Raises:
        RuntimeError: no external cluster is configured and no embedded broker runs.
    """
    env = os.environ.get("FLYWHEEL_KAFKA_BOOTSTRAP")
    if env:
        return env
    f = broker_state_file()
    if f.exists():
        return json.loads(f.read_text())["bootstrap"]
    raise RuntimeError(
        "no Kafka broker: set FLYWHEEL_KAFKA_BOOTSTRAP or run `flywheel broker start`")


def store_dir() -> Path | str:
    """The model store (versions, manifests, snapshots, deltas): ``$FLYWHEEL_STORE`` as given
    when it is an fsspec URL (``s3://bucket/fw``, ``memory://fw``; ``deploy.store.ModelStore``
    opens it), else a local directory (``$FLYWHEEL_STORE`` or ``$FLYWHEEL_HOME/store``)."""
    raw = os.environ.get("FLYWHEEL_STORE", "")
    return raw if "://" in raw else Path(raw or home() / "store")


def samples_dir() -> Path:
    """Parquet shards of RewardedSamples written by ingest."""
    return Path(os.environ.get("FLYWHEEL_SAMPLES", home() / "data" / "samples"))


def catalog_path() -> Path:
    """DuckDB catalog over the sample shards."""
    return home() / "catalog.duckdb"


def ledger_path() -> Path:
    """DuckDB ledger of deployment decisions."""
    return home() / "ledger.duckdb"


def serving_url() -> str:
    return os.environ.get("FLYWHEEL_SERVING_URL", "http://127.0.0.1:8000")


def base_model_dir() -> Path:
    """Where ``flywheel model init`` writes the upcycled MoE checkpoint.

    Shared by every run on the machine (``~/.cache/flywheel/models/...``) so the
    one-time conversion is cached; override with ``FLYWHEEL_MODEL_DIR``.
    """
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flywheel"
    return Path(os.environ.get("FLYWHEEL_MODEL_DIR", cache / "models" / "smollm2-135m-moe"))
