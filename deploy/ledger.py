"""Deployment ledger: every canary decision with its numbers, in DuckDB, also on Kafka.

The DuckDB file (``schemas.settings.ledger_path()`` by default; callers pass the path) is
the source of truth; each call opens a short-lived connection and retries while another
process holds the file lock. Operator actions that change traffic are rows too, failed ones
included (``MANUAL_PROMOTE``, ``MANUAL_ROLLBACK``, ``MANUAL_CANARY_START``,
``MANUAL_CANARY_ABORT``, each also with the suffix ``_FAILED``; ``actor`` is who, and
``numbers`` holds ``why``, the error, the pod and the failure kind, and ``generation``, the
desired-state record's generation the action wrote). An operator command appends its
decision when it changes the record, then one ``FLEET_CONVERGED`` / ``FLEET_NOT_CONVERGED`` row
with each pod's observed outcome (``numbers.pods.by_pod``). Which version is stable is the
fleet's desired-state record (:mod:`modelstore.desired`), not this ledger. The file lives beside
that record on the store's shared storage (``fleet/ledger.duckdb``), so every machine an
operator acts from writes the one audit log; DuckDB's exclusive file lock and the retry
below serialise the short writes. Each recorded decision is also published to the topic
``flywheel.deployments`` (key = version) when a bootstrap address is given.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path

import duckdb

from schemas.events import now_ms
from schemas.ledger import LedgerEntry
from schemas.settings import topic_names

__all__ = ["LedgerEntry", "record", "publish", "decisions"]

log = logging.getLogger(__name__)

_DDL = """
CREATE TABLE IF NOT EXISTS decisions (
    ts BIGINT,            -- ms since epoch
    version VARCHAR,      -- candidate (or the version acted on)
    stable VARCHAR,       -- stable version at the time (the candidate's baseline)
    step INTEGER,         -- canary step index, -1 outside a canary
    weight DOUBLE,        -- candidate traffic share after the decision (0..1)
    decision VARCHAR,     -- START | ADVANCE | HOLD | PROMOTE | ROLLBACK | FAILED | ABORT | RELOAD | PAUSE |
                          -- RESUME | MANUAL_* (operator actions; MANUAL_*_FAILED when one failed)
    reason VARCHAR,
    numbers VARCHAR,      -- JSON
    actor VARCHAR         -- 'controller' or the user who ran a CLI command
)
"""


def _finite(x):
    """``x`` with every non-finite float (NaN, +-inf: no JSON value) replaced by None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _json(x) -> str:
    """Strict JSON of a row or its numbers: a ratio over zero votes (inf) or an undefined
    interval (NaN) becomes null, never the non-JSON tokens ``Infinity``/``NaN`` that other
    languages' consumers refuse."""
    return json.dumps(_finite(json.loads(json.dumps(x, default=str))), allow_nan=False)


def _connect(path: Path, read_only: bool = False, timeout_s: float = 10.0):
    """Open DuckDB at ``path``, retrying while another process holds its lock."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if read_only and not path.exists():
                read_only = False
            con = duckdb.connect(str(path), read_only=read_only)
            if not read_only:
                con.execute(_DDL)
            return con
        except duckdb.IOException as exc:
            if "lock" not in str(exc).lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def record(path: Path, entry: LedgerEntry, bootstrap: str | None = None, topic: str | None = None) -> LedgerEntry:
    """Append ``entry`` (ts set now if 0) and publish it to the deployments topic ``topic``
    (default: ``schemas.settings.topic_names().deployments``).

    A failed Kafka publish is logged, not raised: the DuckDB row is the source of truth.
    """
    if not entry.ts:
        entry.ts = now_ms()
    con = _connect(path)
    try:
        con.execute("INSERT INTO decisions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [entry.ts, entry.version, entry.stable, entry.step, entry.weight, entry.decision,
                     entry.reason, _json(entry.numbers), entry.actor])
    finally:
        con.close()
    if bootstrap:
        topic = topic or topic_names().deployments
        try:
            publish(bootstrap, entry, topic)
        except Exception as exc:  # noqa: BLE001 - ledger row is written; Kafka is a copy
            log.warning("could not publish decision for %s to %s: %s", entry.version, topic, exc)
    return entry


def publish(bootstrap: str, entry: LedgerEntry, topic: str, timeout_s: float = 5.0) -> None:
    """Send one decision to the deployments topic ``topic`` (key = version, value = JSON), waiting at
    most about ``timeout_s`` seconds for the broker in all (metadata, send, close): the DuckDB
    row is the source of truth, and an on-call rollback during a Kafka outage must not wait on
    its copy (it waited ~10 s per row)."""
    from kafka import KafkaProducer

    from schemas.settings import kafka_client_config

    ms = int(timeout_s * 1000)
    p = KafkaProducer(**kafka_client_config(bootstrap), acks="all", linger_ms=0, max_block_ms=ms,
                      request_timeout_ms=ms, bootstrap_timeout_ms=ms)
    try:
        p.send(topic, key=entry.version.encode(),
               value=_json(asdict(entry)).encode()).get(timeout=timeout_s)
    finally:
        p.close(timeout=timeout_s)


def decisions(path: Path, version: str | None = None, limit: int | None = None) -> list[LedgerEntry]:
    """Recorded decisions, oldest first (the newest ``limit`` if given)."""
    path = Path(path)
    if not path.exists():
        return []
    con = _connect(path)
    try:
        q = "SELECT ts, version, stable, step, weight, decision, reason, numbers, actor FROM decisions"
        args: list = []
        if version:
            q += " WHERE version = ?"
            args.append(version)
        q += " ORDER BY ts DESC, rowid DESC"
        if limit:
            q += f" LIMIT {int(limit)}"
        rows = con.execute(q, args).fetchall()
    finally:
        con.close()
    out = [LedgerEntry(ts=r[0], version=r[1], stable=r[2], step=r[3], weight=r[4], decision=r[5],
                       reason=r[6], numbers=_numbers(r[7]), actor=r[8]) for r in rows]
    return out[::-1]


def _numbers(raw):
    """A ledger row's ``numbers`` column as written (JSON text), or, when another tool wrote
    something that is not JSON there, ``{"unreadable": raw}``: one bad row never hides the rest."""
    try:
        return json.loads(raw or "{}")
    except ValueError:
        return {"unreadable": str(raw)}


FINAL_DECISIONS = ("PROMOTE", "ROLLBACK", "FAILED", "ABORT", "MANUAL_PROMOTE", "MANUAL_ROLLBACK")


class Ledger:
    """The ledger at one path, with an optional Kafka copy (``bootstrap``).

    Thin object wrapper over :func:`record` and :func:`decisions` for callers that keep one.
    """

    def __init__(self, path: str | Path, bootstrap: str | None = None):
        self.path, self.bootstrap = Path(path), bootstrap

    def record(self, entry: LedgerEntry) -> LedgerEntry:
        return record(self.path, entry, self.bootstrap)

    def decisions(self, version: str | None = None, limit: int | None = None) -> list[LedgerEntry]:
        return decisions(self.path, version, limit)

    def final_decision(self, version: str) -> dict | None:
        """The last final decision (one of :data:`FINAL_DECISIONS`) about ``version`` as a
        dict (ts, version, stable, step, weight, decision, reason, numbers, actor), or None
        while the canary is still undecided."""
        for e in reversed(self.decisions(version)):
            if e.decision in FINAL_DECISIONS:
                return asdict(e)
        return None
