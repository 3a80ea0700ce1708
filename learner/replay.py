"""Router replay (DESIGN §4): train on the experts serving actually used.

Inside :func:`router_replay`, every MoE router of the model ignores its own top-k choice
and uses the logged expert indices for every token and MoE layer. The gates are recomputed
from the router's logits over the replayed set the way that architecture's router computes
them (its adapter in ``schemas.routers``: softmax or sigmoid scores, ``norm_topk_prob``,
router bias, routed scaling), so the router weight still gets gradients and replaying the
routes of a free forward reproduces that forward bit for bit.

Routes are laid out per transformer layer (``(..., num_hidden_layers, k)``, vLLM's
layout, docs/decisions.md D38): MoE layer ``i`` replays column ``i``; dense layers'
columns are ignored.

:func:`capture_routes` records the routes of a free forward (what serving logs).
This module knows nothing about samples, losses or DeepSpeed.
"""

from __future__ import annotations

import contextlib

import torch

from schemas.routers import adapter_for, route_shape, routed_layers


def _replay_forward(adapter, router, layer_routes: torch.Tensor):
    """A forward for ``router`` that uses ``layer_routes`` (N, k) int64 as its top-k."""

    def forward(hidden_states):
        n = hidden_states.numel() // hidden_states.shape[-1]
        if n != layer_routes.shape[0]:
            raise ValueError(f"routes: {layer_routes.shape[0]} token rows for a forward of "
                             f"{n} tokens (batch shape changed under replay)")
        idx = layer_routes.to(hidden_states.device)
        router_logits, gates = adapter.replay_gates(router, hidden_states, idx)
        return router_logits, gates, idx

    return forward


@contextlib.contextmanager
def router_replay(model, routes: torch.Tensor | None):
    """Force the logged expert selection in every MoE layer for the forwards inside.

    Args:
        model: a transformers MoE model whose architecture has a router adapter
            (``schemas.routers.ADAPTERS``).
        routes: (B, T, L, k) int64 expert indices, L = ``num_hidden_layers`` (dense layers'
            columns are ignored), one row per input token (padding rows may hold any valid
            index: their outputs are masked). None = no replay (free routing).

    Raises:
        ValueError: ``routes`` has the wrong number of layers or top_k, an index outside
            ``[0, E)`` in an MoE layer, or (at forward time) a token count other than B*T.
        schemas.routers.UnsupportedArchitectureError: an MoE model with no adapter.
    """
    if routes is None:
        yield
        return
    layers = routed_layers(model)
    adapter = adapter_for(model.config) if layers else None
    L_model, k_model, E = route_shape(model)
    if routes.dim() != 4:
        raise ValueError(f"routes: expected (B, T, L, k), got shape {tuple(routes.shape)}")
    B, T, L, k = routes.shape
    if L != L_model:
        raise ValueError(f"routes: {L} layers logged, model has {L_model} (num_hidden_layers of an MoE model, "
                         "0 for a dense one)")
    if layers and k != k_model:
        raise ValueError(f"routes: top_k {k} logged, model routes top_k {k_model}")
    moe_cols = routes[:, :, [r.layer for r in layers]] if layers else routes[:, :, :0]
    if moe_cols.numel() and (int(moe_cols.min()) < 0 or int(moe_cols.max()) >= E):
        raise ValueError(f"routes: expert ids must be in [0, {E}), got [{int(moe_cols.min())}, {int(moe_cols.max())}]")
    flat = routes.long().reshape(B * T, L, k)
    try:
        for rl in layers:
            rl.router.forward = _replay_forward(adapter, rl.router, flat[:, rl.layer, :].contiguous())
        yield
    finally:
        for rl in layers:
            rl.router.__dict__.pop("forward", None)


@contextlib.contextmanager
def capture_routes(model, out: list):
    """Record each router's chosen indices during the forwards inside.

    After the block, ``out`` holds, per forward, one (N, k) int64 tensor per transformer
    layer in layer order (zeros for dense layers, vLLM's layout); :func:`stack_routes`
    turns a single forward's list into (B, T, L, k). Nothing is recorded for a dense model.
    """
    layers = routed_layers(model)
    L = route_shape(model)[0]
    got: list = []
    handles = [rl.router.register_forward_hook(lambda m, i, o, j=rl.layer: got.append((j, o[2].detach().clone())))
               for rl in layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        n = len(layers)
        for f in range(0, len(got), n or 1):
            per = dict(got[f:f + n])
            ref = next(iter(per.values()))
            out.extend(per.get(j, torch.zeros_like(ref)) for j in range(L))


def stack_routes(captured: list[torch.Tensor], B: int, T: int) -> torch.Tensor:
    """L captured (B*T, k) tensors -> (B, T, L, k) int64."""
    return torch.stack([c.reshape(B, T, -1) for c in captured], dim=2).long()
