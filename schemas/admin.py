"""Serving admin API contract, shared by ``serving`` (server) and ``deploy`` (client).

Endpoints (all under the admin token, ``Authorization: Bearer <admin token>``):

* ``PUT  /admin/desired`` / ``GET /admin/desired``: the declarative target the fleet's
  reconcilers send and the pod's state against it (:mod:`schemas.pod_target`); the only
  endpoint Flywheel's fleet code changes a pod through. The routes below drive one pod by
  hand (benchmarks, tests, the demo's fixed eval).
* ``GET  /admin/slots``                -> :class:`SlotsStatus`
* ``POST /admin/load``  :class:`LoadRequest`  -> :class:`SlotsStatus`
  Loads ``version`` from the model store into the candidate slot; the store reconstructs
  it (snapshot, or delta on its exact parent) and every tensor hash is verified before the
  slot is swapped in. On any error the slots stay as they were (HTTP 409 with the reason).
* ``POST /admin/weight`` :class:`WeightRequest` -> :class:`SlotsStatus`
  Share of traffic (0..1) sent to the candidate, by sticky hash of the user.
* ``POST /admin/promote`` -> candidate becomes stable (hot swap: pointer flip), weight 0.
* ``POST /admin/rollback`` :class:`RollbackRequest` -> candidate dropped; with ``version``,
  stable is replaced by that version (loaded and verified first).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, Strict

from schemas.manifest import VERSION_PATTERN


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    version: str = Field(min_length=1, pattern=VERSION_PATTERN)


class WeightRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    # a JSON number only: `true` or "1" would send every user to the candidate
    candidate_weight: Annotated[float, Strict()] = Field(ge=0.0, le=1.0)


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    version: str | None = Field(None, min_length=1, pattern=VERSION_PATTERN)  # None: back to the stable; "" is refused


class SlotInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    version: str
    weights_digest: str  # schemas.manifest.digest_of_hashes of the loaded tensors
    loaded_at: int  # ms
    load_ms: float = 0.0
    # the store's manifest digest for this version now, and whether the served weights still
    # equal it (False: the version's files changed under the same id; None: manifest unreadable)
    manifest_digest: str | None = None
    digest_ok: bool | None = None


class SlotsStatus(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    pod: str
    stable: SlotInfo
    candidate: SlotInfo | None = None
    candidate_weight: float = 0.0
    last_swap_pause_ms: float | None = None
