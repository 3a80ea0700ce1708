"""The learner daemon's settings, declared once: :class:`DaemonConfig`.

The settings that are not per cycle (where the store, samples and state are, which version
to train from, the schedule, the held-out generation gate, the metrics port); the cycle's are
:class:`learner.config.LearnerConfig`. ``flywheel learn``'s options derive from both
(``schemas.options``). The role that uses them is :mod:`learner.daemon` (which re-exports
``DaemonConfig``); :mod:`learner.cycle` takes its defaults from here. This module imports no
torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

from learner.config import FINITE, readable_errors

__all__ = ["DaemonConfig"]


@dataclass(config=FINITE)
class DaemonConfig:
    """Where ``flywheel learn`` reads and writes, when it runs a cycle, and its gate and metrics.

    Raises:
        pydantic.ValidationError: (a ``ValueError``) a value out of its bounds; the message
            starts with the field's name.
    """

    store: Optional[str] = Field(None, description="Model store dir or fsspec URL (default $FLYWHEEL_STORE, else "
                                                   "$FLYWHEEL_HOME/store).")
    samples: Optional[Path] = Field(None, description="RewardedSample Parquet root (default "
                                                      "$FLYWHEEL_HOME/data/samples).")
    state: Optional[Path] = Field(None, description="Learner state dir: watermark, consumed shards, resume "
                                                    "checkpoint; on storage that outlives the pod (default "
                                                    "$FLYWHEEL_LEARNER_STATE, else $FLYWHEEL_HOME/learner).")
    parent: Literal["stable", "latest"] = Field("stable", description="Train from the 'stable' (promoted) or "
                                                                      "'latest' version.")
    every_h: float = Field(1.0, ge=0, description="Daemon: run a cycle at least every this many hours.",
                           json_schema_extra={"unit": "h"})
    every_n: int = Field(64, ge=0, description="Daemon: run a cycle once this many new samples are sealed.")
    poll_s: float = Field(10.0, ge=0, description="Daemon: time between checks for new samples (and for an "
                                                  "operator's pause).", json_schema_extra={"unit": "s"})
    gate_problems: Optional[str] = Field(
        None, description="Eval gate on held-out prompts the --gate-verifier selects and scores as the workload's "
                          "users do (HumanEval: code run against the tests in the sandbox), e.g. '120-163'; "
                          "score = pass rate.")
    gate_verifier: str = Field("flywheel.users:gate_verifier",
                               description="Eval gate: the workload's verifier, MODULE:FUNCTION "
                                           "(learner.gate.GateVerifier); the default is HumanEval's.")
    gate_samples: int = Field(2, ge=1, description="Eval gate: completions per held-out prompt.")
    gate_max_tokens: int = Field(128, ge=1, description="Eval gate: new tokens per completion.",
                                 json_schema_extra={"unit": "tokens"})
    metrics_port: int = Field(0, ge=0, le=65535, description="Serve Prometheus /metrics on this port (0 = off; "
                                                             "rank 0 only).")

    _readable = model_validator(mode="wrap")(classmethod(readable_errors))
