"""Version manifest of the model store (DESIGN §2) and the tensor hash everyone agrees on.

A version is named ``v000001``-style (zero padded, sortable). Its manifest records the
parent, whether it is stored as a full ``snapshot`` or as a ``delta`` on that exact parent,
and the sha256 of every reconstructed tensor: the learner computes them when it
publishes, the store checks them after reconstruction, serving checks them after a load.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

VersionKind = Literal["snapshot", "delta"]


VERSION_PATTERN = r"^v[0-9]+$"  # what version_name writes and version_number reads


def version_name(n: int) -> str:
    """``7 -> 'v000007'``."""
    return f"v{n:06d}"


BASE_VERSION = version_name(0)  # "v000000": the base model, published by `serve` or `model init`


def version_number(name: str) -> int:
    """``'v000007' -> 7``; raises ValueError on anything else."""
    if not (name.startswith("v") and name[1:].isdigit()):
        raise ValueError(f"version: {name!r} is not of the form v000123")
    return int(name[1:])


def tensor_sha256(t) -> str:
    """sha256 (hex) of a tensor's raw bytes in C order; dtype and shape are hashed too.

    Args:
        t: a ``torch.Tensor`` of any dtype (moved to CPU, made contiguous).
    """
    import torch

    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def state_sha256(state: dict, threads: int | None = None) -> dict[str, str]:
    """``{name: tensor_sha256}`` for a state dict (sorted by name).

    Hashes tensors on ``threads`` threads (default: CPU count, at most 8); hashlib releases
    the GIL on large buffers, so a 1.6 GB state hashes about ``threads`` times faster.
    """
    import os
    from concurrent.futures import ThreadPoolExecutor

    keys = sorted(state)
    n = threads or min(8, os.cpu_count() or 1)
    if n <= 1 or len(keys) < 2:
        return {k: tensor_sha256(state[k]) for k in keys}
    with ThreadPoolExecutor(n) as pool:
        return dict(zip(keys, pool.map(lambda k: tensor_sha256(state[k]), keys)))


def digest_of_hashes(hashes: dict[str, str]) -> str:
    """One sha256 over all per-tensor hashes: a short id of a full set of weights."""
    h = hashlib.sha256()
    for k in sorted(hashes):
        h.update(f"{k}={hashes[k]};".encode())
    return h.hexdigest()


def _non_finite_path(obj: Any, path: str = "") -> str | None:
    """Dotted path of the first NaN/Infinity float inside nested dicts/lists, else None."""
    if isinstance(obj, float):
        return path or "value" if not math.isfinite(obj) else None
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for k, x in items:
        bad = _non_finite_path(x, f"{path}.{k}" if path else str(k))
        if bad is not None:
            return bad
    return None


class TensorMeta(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    dtype: str
    shape: list[int]
    sha256: str


class StatusChange(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    status: str  # published | rejected | canary | promoted | rolled_back | ...
    at: int  # ms since epoch
    reason: str = ""


class VersionManifest(BaseModel):
    """What the store knows about one version."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    version: str
    parent: str | None
    created_at: int
    kind: VersionKind
    tensors: dict[str, TensorMeta]
    metrics: dict[str, Any] = Field(default_factory=dict)
    eval: dict[str, Any] = Field(default_factory=dict)
    status_history: list[StatusChange] = Field(default_factory=list)
    size_bytes: int = 0  # bytes on disk of this version's payload
    snapshot_bytes: int = 0  # bytes a full snapshot of these weights takes

    @field_validator("metrics", "eval")
    @classmethod
    def _finite(cls, v: dict[str, Any], info) -> dict[str, Any]:
        bad = _non_finite_path(v)
        if bad is not None:
            raise ValueError(f"{info.field_name}.{bad}: non-finite number (NaN or Infinity) in a manifest")
        return v

    @property
    def weights_digest(self) -> str:
        return digest_of_hashes({k: v.sha256 for k, v in self.tensors.items()})
