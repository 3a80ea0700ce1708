"""The deployment ledger's row: the contract of topic ``flywheel.deployments``.

Every canary decision and operator action is one :class:`LedgerEntry`: ``deploy.ledger``
writes it to the ledger's DuckDB file and publishes it (JSON, key = version) to
``flywheel.deployments``, where dashboards and other teams' consumers read it; ``flywheel
schemas export`` publishes its JSON Schema as ``DeploymentEvent``. It lives in ``schemas/``
because it is shared by the writer (``deploy/``) and every reader (D52).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from pydantic import ConfigDict, Field

from schemas.events import INT32_MAX, EventTimeMs, IdText, Text

#: Canary step index: -1 outside a canary, else 0..INT32_MAX.
Step = Annotated[int, Field(ge=-1, le=INT32_MAX)]
#: The candidate's traffic share, 0..1.
Weight = Annotated[float, Field(ge=0.0, le=1.0)]


def _published_rows_carry_ts(schema: dict) -> None:
    """In the exported schema ``ts`` is required and has no default: 0 is the in-process
    placeholder that ``deploy.ledger.record`` replaces before a row is written or published."""
    schema["properties"]["ts"].pop("default", None)
    schema["required"] = [*schema.get("required", []), "ts"]


@dataclass
class LedgerEntry:
    """One row of the ledger (a ``DeploymentEvent`` on Kafka).

    Fields:
        version: the candidate, or the version an action acted on (``vNNNNNN``).
        stable: the stable version at the time (the candidate's baseline), or None.
        step: canary step index; -1 outside a canary.
        weight: the candidate's traffic share after the decision, 0..1.
        decision: START | ADVANCE | HOLD | PROMOTE | ROLLBACK | FAILED | ABORT | RELOAD | PAUSE |
            RESUME | RECONCILE | FLEET_CONVERGED | FLEET_NOT_CONVERGED | MANUAL_* (operator
            actions; MANUAL_*_FAILED when one failed).
        reason: why, in words.
        numbers: the decision's figures (JSON object): counts, intervals, per-pod outcomes.
        actor: ``controller`` or the user who ran a CLI command.
        ts: ms since the epoch (UTC); 0 until ``deploy.ledger.record`` stamps it, so every
            published row carries an event time (the exported schema requires one).

    Bounds are stated as for every event (``schemas.events``: times, ids, text without NUL or
    lone surrogates) and exported in the JSON Schema; ``numbers`` is a free-form JSON object.
    """

    __pydantic_config__ = ConfigDict(json_schema_extra=_published_rows_carry_ts)

    version: IdText
    stable: IdText | None
    step: Step
    weight: Weight
    decision: IdText
    reason: Text
    numbers: dict = field(default_factory=dict)
    actor: IdText = "controller"
    ts: EventTimeMs = 0
