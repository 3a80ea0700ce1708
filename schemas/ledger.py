"""The deployment ledger's row: the contract of topic ``flywheel.deployments``.

Every canary decision and operator action is one :class:`LedgerEntry`: ``deploy.ledger``
writes it to the ledger's DuckDB file and publishes it (JSON, key = version) to
``flywheel.deployments``, where dashboards and other teams' consumers read it; ``flywheel
schemas export`` publishes its JSON Schema as ``DeploymentEvent``. It lives in ``schemas/``
because it is shared by the writer (``deploy/``) and every reader (D52).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
        ts: ms since the epoch (UTC); 0 = stamped by ``deploy.ledger.record``.
    """

    version: str
    stable: str | None
    step: int
    weight: float
    decision: str
    reason: str
    numbers: dict = field(default_factory=dict)
    actor: str = "controller"
    ts: int = 0
