"""Two weight slots (stable, candidate), the sticky traffic split, and hot swap.

Loads happen off the request path into a fresh model; the per-tensor sha256 must equal the
version manifest before the slot is installed, and any error leaves the slots unchanged.
Promote is a pointer flip under a lock (the pause is measured, ms). Requests already
running keep the weights they started on (their KV cache is their own), so versions
never mix within a completion.

The model store is duck-typed (``modelstore.store.ModelStore`` API: ``base_dir``,
``load(version) -> {name: Tensor}``, ``manifest(version) -> VersionManifest``, ``latest()``,
``versions()``). :class:`CheckpointStore` serves one plain checkpoint dir the same way.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

from schemas.admin import SlotInfo, SlotsStatus
from schemas.manifest import BASE_VERSION, TensorMeta, VersionManifest, state_sha256
from schemas.modelspec import BUILD_LOCK
from serving.engine_base import Engine, LoadedModel


class SlotError(RuntimeError):
    """A slot operation was refused (rendered as HTTP 409 with this reason)."""


class CheckpointStore:
    """A read-only, one-version store over a HF checkpoint dir (``flywheel serve --model-dir``).

    ``versions() == [version]``; ``load`` returns the checkpoint's state dict, ``manifest``
    its hashes (computed at first use).
    """

    def __init__(self, model_dir: str | Path, version: str = BASE_VERSION):
        self.base_dir = Path(model_dir)
        self.version = version
        self._manifest: VersionManifest | None = None

    def versions(self) -> list[str]:
        return [self.version]

    def latest(self) -> str:
        return self.version

    def _state(self) -> dict:
        from schemas.modelspec import load_model

        # The model's own state dict: on-disk layouts (e.g. Mixtral's per-expert w1/w2/w3)
        # are converted by transformers at load time.
        return load_model(self.base_dir).state_dict()

    def load(self, version: str) -> dict:
        """State dict of the checkpoint as the model names it; KeyError for any other version."""
        if version != self.version:
            raise KeyError(f"version {version!r} not in store (only {self.version})")
        return self._state()

    def manifest(self, version: str) -> VersionManifest:
        if version != self.version:
            raise KeyError(f"version {version!r} not in store (only {self.version})")
        if self._manifest is None:
            st = self._state()
            hashes = state_sha256(st)
            self._manifest = VersionManifest(
                version=self.version, parent=None, created_at=0, kind="snapshot",
                tensors={k: TensorMeta(dtype=str(st[k].dtype), shape=list(st[k].shape), sha256=h)
                         for k, h in hashes.items()})
        return self._manifest


def sticky_fraction(user_hash: str) -> float:
    """Map a user (hashed id) to a stable point in [0, 1): same user, same slot."""
    return int(hashlib.sha256(f"slot:{user_hash}".encode()).hexdigest()[:12], 16) / float(16 ** 12)


class Slots:
    """Stable + candidate weights over one engine.

    Args:
        engine: builds and runs the weights (any :class:`serving.engine_base.Engine`).
        store: model store (see module docstring).
        pod: this pod's name (reported in :class:`SlotsStatus`).
    """

    def __init__(self, engine: Engine, store, pod: str = "pod-0"):
        self.engine = engine
        self.store = store
        self.pod = pod
        self._lock = threading.Lock()
        self._admin_lock = threading.Lock()  # one load/promote/rollback at a time
        self.stable: LoadedModel | None = None
        self.candidate: LoadedModel | None = None
        self.candidate_weight = 0.0
        self.previous: LoadedModel | None = None  # stable before the last promote (instant rollback)
        self.last_swap_pause_ms: float | None = None

    # ------------------------------------------------------------------ loading
    def load_version(self, version: str) -> LoadedModel:
        """Reconstruct ``version`` from the store into a fresh model and verify every hash.

        Raises:
            SlotError: unknown version, corrupt payload, or hash mismatch (reason inside).
        """
        try:
            manifest = self.store.manifest(version)
            state = self._load_state(version)
            expected = {k: v.sha256 for k, v in manifest.tensors.items()}
            with BUILD_LOCK:  # the engine builds and assigns parameters under a process-wide torch patch
                return self.engine.load_weights(state, version, expected_hashes=expected)
        except SlotError:
            raise
        except Exception as exc:  # noqa: BLE001 - CorruptVersionError, KeyError, FileNotFoundError...
            # (a KeyError's str() is its repr: the message in quotes)
            why = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            raise SlotError(f"cannot load {version}: {type(exc).__name__}: {why}") from exc

    def _load_state(self, version: str) -> dict:
        """``version``'s state from the store. A store that can (``modelstore.store.ModelStore``)
        rebuilds a delta on the resident slots' weights (verified at their load, never
        modified) and keeps no cached copy: one model's memory per load, on top of the
        resident versions (the peak-RSS budget of ``bench/serve_memory.py``)."""
        import inspect

        params = inspect.signature(self.store.load).parameters
        if "resident" not in params:
            return self.store.load(version)
        with self._lock:
            held = [lm for lm in (self.stable, self.candidate, self.previous) if lm is not None]
        # only weights that still equal the store's manifest: a version whose files changed
        # under the same id is rebuilt from its files, never from the stale resident copy;
        # and never ``version`` itself: a load (a reload of the stable) reads it from the store
        resident = {lm.version: lm.model.state_dict() for lm in held
                    if lm.version != version and hasattr(lm.model, "state_dict") and self._digest_ok(lm)}
        return self.store.load(version, resident=resident, cache=False)

    def start(self, version: str) -> None:
        """Install ``version`` as stable at startup (verified)."""
        self.stable = self.load_version(version)

    def load_candidate(self, version: str) -> SlotsStatus:
        """``/admin/load``: verified load into the candidate slot; weight unchanged (0 after a
        promote). Raises SlotError, slots unchanged."""
        with self._admin_lock:
            lm = self.load_version(version)
            with self._lock:
                self.candidate = lm
            return self.status()

    def set_weight(self, w: float) -> SlotsStatus:
        """``/admin/weight``: share of users (0..1) sent to the candidate.

        Raises:
            SlotError: a positive weight with no candidate loaded.
        """
        if not 0.0 <= w <= 1.0:
            raise SlotError(f"candidate_weight: must be in [0, 1], got {w}")
        with self._lock:
            if w > 0 and self.candidate is None:
                raise SlotError("candidate_weight: no candidate loaded")
            self.candidate_weight = float(w)
        return self.status()

    def promote(self) -> SlotsStatus:
        """``/admin/promote``: hot swap, candidate becomes stable (pointer flip), weight 0.

        Raises:
            SlotError: no candidate loaded.
        """
        with self._admin_lock:
            t0 = time.perf_counter()
            with self._lock:
                if self.candidate is None:
                    raise SlotError("promote: no candidate loaded")
                # the old stable stays resident (verified when it was loaded) so that the
                # usual rollback, to the version promoted just before, is a pointer flip
                self.previous = self.stable
                self.stable, self.candidate, self.candidate_weight = self.candidate, None, 0.0
            self.last_swap_pause_ms = (time.perf_counter() - t0) * 1000
            return self.status()

    def rollback(self, version: str | None = None) -> SlotsStatus:
        """``/admin/rollback``: drop the candidate; with ``version``, replace stable by it
        (loaded and verified first; on error nothing changes). Rolling back to the version
        that was stable before the last promote reuses its resident weights (instant)."""
        with self._admin_lock:
            prev = self.previous
            reload = self.stable is not None and self.stable.version == version  # from the store, verified
            if version and not reload and prev is not None and prev.version == version and self._digest_ok(prev):
                lm = prev  # resident, verified at its own load, still what the store holds
            else:
                lm = self.load_version(version) if version else None
            t0 = time.perf_counter()
            with self._lock:
                self.candidate, self.candidate_weight = None, 0.0
                if lm is not None:
                    if lm is not self.stable:
                        self.previous = self.stable
                    self.stable = lm
            if lm is not None:
                self.last_swap_pause_ms = (time.perf_counter() - t0) * 1000
            return self.status()

    # ------------------------------------------------------------------ routing
    def pick(self, user_hash: str, version: str | None = None) -> LoadedModel:
        """Weights for a request: ``version`` if it is served, else the sticky split."""
        with self._lock:
            stable, cand, w = self.stable, self.candidate, self.candidate_weight
        if stable is None:
            raise SlotError("no stable weights loaded")
        if version is not None:
            for lm in (stable, cand):
                if lm is not None and lm.version == version:
                    return lm
        if cand is not None and w > 0 and sticky_fraction(user_hash) < w:
            return cand
        return stable

    def served_versions(self) -> list[str]:
        with self._lock:
            return [lm.version for lm in (self.stable, self.candidate) if lm is not None]

    def _manifest_digest(self, version: str) -> str | None:
        """The store's manifest digest of ``version`` now (None if unreadable)."""
        try:
            return self.store.manifest(version).weights_digest
        except Exception:  # noqa: BLE001 - reported as digest_ok=None, never fails a status read
            return None

    def _digest_ok(self, lm: LoadedModel) -> bool:
        return self._manifest_digest(lm.version) == lm.weights_digest

    def status(self, check_digests: bool = True) -> SlotsStatus:
        """Slots, weight and, with ``check_digests`` (one manifest read per slot: the admin
        API's answers, not the request path), whether each served digest still equals the
        store's manifest (``digest_ok``; False when the version's files changed under the
        same id)."""
        with self._lock:
            s, c, w, pause = self.stable, self.candidate, self.candidate_weight, self.last_swap_pause_ms
        return SlotsStatus(pod=self.pod, stable=self._info(s, check_digests),
                           candidate=self._info(c, check_digests) if c else None,
                           candidate_weight=w, last_swap_pause_ms=pause)

    def _info(self, lm: LoadedModel, check_digest: bool) -> SlotInfo:
        md = self._manifest_digest(lm.version) if check_digest else None
        return SlotInfo(version=lm.version, weights_digest=lm.weights_digest, loaded_at=lm.loaded_at,
                        load_ms=lm.load_ms, manifest_digest=md,
                        digest_ok=None if md is None else md == lm.weights_digest)
