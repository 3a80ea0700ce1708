"""Router replay (DESIGN §4): train on the experts serving actually used.

Inside :func:`router_replay`, every MoE router of the model ignores its own top-k choice
and uses the logged expert indices for every token and layer. The gates are recomputed
from the router's logits over the replayed set, exactly as the router does for its own
top-k (softmax over all E experts in fp32, gather at the replayed indices, renormalise to
sum 1), so the router weight still gets gradients and replaying the routes of a free
forward reproduces that forward bit for bit.

:func:`capture_routes` records the routes of a free forward (what serving logs).
This module knows nothing about samples, losses or DeepSpeed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from schemas.modelspec import moe_routers


def _replay_forward(router, layer_routes: torch.Tensor):
    """A forward for ``router`` that uses ``layer_routes`` (N, k) int64."""

    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)  # (N, H)
        if hidden_states.shape[0] != layer_routes.shape[0]:
            raise ValueError(f"routes: {layer_routes.shape[0]} token rows for a forward of "
                             f"{hidden_states.shape[0]} tokens (batch shape changed under replay)")
        router_logits = F.linear(hidden_states, router.weight)  # (N, E)
        router_probs = torch.softmax(router_logits.float(), dim=-1)  # (N, E) fp32
        idx = layer_routes.to(router_logits.device)
        top = router_probs.gather(-1, idx)  # (N, k)
        top = top / top.sum(dim=-1, keepdim=True)
        return router_logits, top, idx

    return forward


@contextlib.contextmanager
def router_replay(model, routes: torch.Tensor | None):
    """Force the logged expert selection in every MoE layer for the forwards inside.

    Args:
        model: a transformers MoE model (routers found by ``schemas.modelspec.moe_routers``).
        routes: (B, T, L, k) int64 expert indices, one row per input token (padding rows may
            hold any valid index: their outputs are masked). None = no replay (free routing).

    Raises:
        ValueError: ``routes`` has the wrong number of layers or top_k, an index outside
            ``[0, E)``, or (at forward time) a token count different from B*T.
    """
    if routes is None:
        yield
        return
    routers = moe_routers(model)
    if routes.dim() != 4:
        raise ValueError(f"routes: expected (B, T, L, k), got shape {tuple(routes.shape)}")
    B, T, L, k = routes.shape
    if L != len(routers):
        raise ValueError(f"routes: {L} MoE layers logged, model has {len(routers)}")
    if routers and k != routers[0].top_k:
        raise ValueError(f"routes: top_k {k} logged, model routes top_k {routers[0].top_k}")
    if routes.numel() and (int(routes.min()) < 0 or int(routes.max()) >= routers[0].num_experts):
        raise ValueError(f"routes: expert ids must be in [0, {routers[0].num_experts}), got "
                         f"[{int(routes.min())}, {int(routes.max())}]")
    flat = routes.long().reshape(B * T, L, k)
    try:
        for layer, r in enumerate(routers):
            r.forward = _replay_forward(r, flat[:, layer, :].contiguous())
        yield
    finally:
        for r in routers:
            r.__dict__.pop("forward", None)


@contextlib.contextmanager
def capture_routes(model, out: list):
    """Record each router's chosen indices during the forwards inside.

    After the block, ``out`` holds one (N, k) int64 tensor per MoE layer per forward, in
    layer order; :func:`stack_routes` turns a single forward's list into (B, T, L, k).
    """
    handles = []
    for r in moe_routers(model):
        handles.append(r.register_forward_hook(lambda m, i, o: out.append(o[2].detach().clone())))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def stack_routes(captured: list[torch.Tensor], B: int, T: int) -> torch.Tensor:
    """L captured (B*T, k) tensors -> (B, T, L, k) int64."""
    return torch.stack([c.reshape(B, T, -1) for c in captured], dim=2).long()
