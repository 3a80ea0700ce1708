"""The torch engine's model loading: a checkpoint or a version's weights become a servable
:class:`serving.engine_base.LoadedModel`.

A pod serves several versions side by side (its weight slots: stable, candidate, the previous
stable for an instant rollback); each is its own module built from the engine's checkpoint
config, never mutated after load, so a hot swap is the slots pointing at another LoadedModel
while requests on the old one finish. :class:`ModelLoader` builds them: from the checkpoint
(:meth:`ModelLoader.load_base`) or from a state dict the store assembled from a version's
full weights or delta (:meth:`ModelLoader.load_state`, hashes checked against the version
manifest). :func:`wrap` computes the hashes, hooks the MoE routers so every forward leaves its
expert routes behind, and gives the version its own prefix cache.

Numerics follow ``schemas.modelspec`` (DESIGN §4): the checkpoint's dtype unless told
otherwise, eager attention and experts, so the learner's recompute lines up.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from schemas.events import now_ms
from schemas.manifest import BASE_VERSION, digest_of_hashes, state_sha256
from schemas.modelspec import WeightsMismatchError, attention_window, build_model, load_model, trim_heap
from schemas.routers import route_shape, routed_layers
from serving.engine_base import LoadedModel


class ModelLoader:
    """Builds the LoadedModels of one checkpoint.

    Args:
        model_dir: HF checkpoint dir (config + base weights).
        dtype: torch dtype of the weights.
        device: torch device the weights live on.
        prefix_caching: give every LoadedModel a :class:`serving.prefix_cache.PrefixCache`.
    """

    def __init__(self, model_dir: str | Path, dtype, device, prefix_caching: bool):
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.device = device
        self.prefix_caching = prefix_caching

    def load_base(self, version: str = BASE_VERSION) -> LoadedModel:
        """The checkpoint at ``model_dir`` as served weights (hashes computed, not checked)."""
        t0 = time.perf_counter()
        model = load_model(self.model_dir, dtype=self.dtype).to(self.device)
        return wrap(model, version, t0, self.prefix_caching)

    def load_state(self, state: dict, version: str, expected_hashes: dict[str, str] | None = None
                   ) -> LoadedModel:
        """Fresh model from ``model_dir``'s config holding ``state``'s tensors (no copy: see
        :func:`schemas.modelspec.build_model`; the caller hands ``state`` over), then verified
        (:func:`verify_hashes`); the C heap's free pages go back to the OS afterwards.

        Args:
            state: ``{name: Tensor}`` (a full state dict; tied aliases may be omitted).
            version: version id it is served as.
            expected_hashes: ``{name: sha256}`` from the version manifest, or None (not checked).

        Raises:
            WeightsMismatchError: missing/unexpected tensors or a hash differs.
        """
        t0 = time.perf_counter()
        model = build_model(self.model_dir, state, dtype=self.dtype).to(self.device)
        lm = wrap(model, version, t0, self.prefix_caching)
        if expected_hashes is not None:
            verify_hashes(lm, expected_hashes)
        lm.load_ms = (time.perf_counter() - t0) * 1000
        trim_heap()
        return lm


def wrap(model, version: str, t0: float, prefix_caching: bool) -> LoadedModel:
    """``model`` (on its device, eval mode) as a LoadedModel: tensor hashes, a forward hook on
    every MoE router writing the selected experts ``(N, k)`` into ``route_buf`` at the
    layer's global index, and a prefix cache if ``prefix_caching``. ``t0``: perf_counter s
    when the load began (for ``load_ms``)."""
    hashes = state_sha256(model.state_dict())
    layers, dims = routed_layers(model), route_shape(model)
    lm = LoadedModel(version=version, model=model, hashes=hashes,
                     weights_digest=digest_of_hashes(hashes), loaded_at=now_ms(),
                     load_ms=(time.perf_counter() - t0) * 1000, routers=[r.router for r in layers],
                     route_buf=[None] * dims[0], route_dims=dims)
    if prefix_caching:
        from serving.prefix_cache import PrefixCache

        lm.prefix_cache = PrefixCache()
    for rl in layers:
        def hook(_mod, _inp, out, i=rl.layer, buf=lm.route_buf):
            buf[i] = out[2]  # (N, k) selected experts
        rl.router.register_forward_hook(hook)
    return lm


def verify_hashes(lm: LoadedModel, expected_hashes: dict[str, str]) -> None:
    """Check ``lm``'s tensors against a version manifest's ``{name: sha256}``; on success its
    hashes and digest become the manifest's.

    Every manifest name must be present in the model with that hash, and every other model
    tensor must alias (share storage with) a verified one (tied weights).

    Raises:
        WeightsMismatchError: a hash differs or is missing, or a tensor is not in the manifest.
    """
    bad = [k for k, h in expected_hashes.items() if lm.hashes.get(k) != h]
    if bad:
        raise WeightsMismatchError(
            f"weights: sha256 mismatch after load for {len(bad)} tensors, e.g. {sorted(bad)[:5]}")
    sd = lm.model.state_dict()
    verified = {sd[k].data_ptr() for k in expected_hashes}
    extra = [k for k in lm.hashes if k not in expected_hashes and sd[k].data_ptr() not in verified]
    if extra:
        raise WeightsMismatchError(f"weights: tensors not in the manifest: {sorted(extra)[:5]}")
    lm.hashes = dict(expected_hashes)
    lm.weights_digest = digest_of_hashes(lm.hashes)


def context_limit(model_config: Any) -> int | None:
    """Most tokens (prompt + completion) a sequence may reach on a model of ``model_config``:
    ``max_position_embeddings``, capped at the sliding attention window if the model has one
    (the engine keeps the full KV cache, so the window never binds, docs/decisions.md D39);
    None when the config states no limit."""
    limit = int(getattr(model_config, "max_position_embeddings", 0) or 0) or None
    window = attention_window(model_config)
    if window is not None:
        limit = min(limit or window, window)
    return limit
