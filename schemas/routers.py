"""Router adapters: one per mixture-of-experts architecture, in one registry (DESIGN §4).

Serving (route capture), the learner (router replay, route checks) and ``flywheel model
init`` share this contract. For each architecture it says

* how to find the routers: the router class of the architecture's transformers module,
  matched with ``isinstance`` on the model's modules, for the config's ``model_type``;
  each router's **global** decoder-layer index is read from its module path
  (``...layers.<i>...``);
* what a router returns: ``(router_logits (N, E), gates (N, k), indices (N, k) int64)``
  for every architecture registered here (transformers 5.x routers);
* how its gates are recomputed from logged indices: :meth:`RouterAdapter.replay_gates`
  repeats the architecture's own ops in the same order and dtype, with the top-k
  selection replaced by a gather at the logged indices, so replaying a free forward's
  routes reproduces it bit for bit (Megatron-Core ``RouterReplay``: record/replay per
  router, scores per the router's own scoring mode);
* how indices are captured: element 2 of the router's output, in a forward hook.

Route layout (vLLM's ``routed_experts``, docs/decisions.md D38): ``(tokens, L, k)`` with
``L = config.num_hidden_layers``, every transformer layer in order; rows of dense layers
(DeepSeek-V3's and GLM-4.5's ``first_k_dense_replace``, Qwen-MoE's ``mlp_only_layers``)
hold 0 and are ignored on replay.

A model whose config declares experts but whose ``model_type`` has no adapter is refused
(:class:`UnsupportedArchitectureError`), never treated as dense. torch is imported inside
the functions that need it, so importing ``schemas`` stays light.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Callable

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class UnsupportedArchitectureError(ValueError):
    """A mixture-of-experts model whose architecture has no router adapter."""


@dataclass(frozen=True)
class RouterAdapter:
    """How Flywheel finds, captures and replays the routers of one architecture.

    Attributes:
        model_type: the config's ``model_type`` (``"mixtral"``, ``"deepseek_v3"``, ...).
        module: transformers module holding the router class (``models.<module>``).
        router_class: the router's class name in that module (matched by ``isinstance``).
        scoring: the gate formula, for docs and errors (one of :data:`SCORINGS`).
        gates: ``gates(router, hidden (N, H), indices (N, k) int64) -> (logits (N, E),
            gates (N, k))`` reproducing the router's own forward for the given indices.
        notes: what the architecture's router does that replay leaves alone or must know.
    """

    model_type: str
    module: str
    router_class: str
    scoring: str
    gates: Callable
    notes: str = ""

    def router_type(self):
        """The transformers router class (imports ``transformers.models.<module>``)."""
        mod = importlib.import_module(f"transformers.models.{self.module}.modeling_{self.module}")
        return getattr(mod, self.router_class)

    def replay_gates(self, router, hidden_states, indices):
        """The router's ``(logits (N, E), gates (N, k))`` with ``indices`` (N, k) int64 as its
        top-k choice; ``hidden_states`` is (..., H) in the model's dtype. Gradients flow to the
        router's weight (and bias) through ``gates``."""
        return self.gates(router, hidden_states, indices)


# --------------------------------------------------------------------------- gate formulas
# Each mirrors one transformers router forward op for op; ``topk`` values are replaced by a
# gather at the logged indices (the same values in the same order, hence the same sums).

def _softmax_renorm_fp32(router, hidden_states, idx):
    """Mixtral: softmax over all E in fp32, gather, renormalise to sum 1; gates stay fp32."""
    import torch
    import torch.nn.functional as F

    hidden_states = hidden_states.reshape(-1, router.hidden_dim)  # (N, H)
    router_logits = F.linear(hidden_states, router.weight)  # (N, E)
    router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)  # (N, E) fp32
    top = router_probs.gather(-1, idx)  # (N, k)
    top = top / top.sum(dim=-1, keepdim=True)
    return router_logits, top


def _softmax_optional_renorm(router, hidden_states, idx):
    """Qwen2-MoE, Qwen3-MoE, OLMoE: softmax over all E (computed in fp32), gather,
    renormalise only if ``norm_topk_prob``, gates cast back to the logits' dtype."""
    import torch
    import torch.nn.functional as F

    hidden_states = hidden_states.reshape(-1, router.hidden_dim)  # (N, H)
    router_logits = F.linear(hidden_states, router.weight)  # (N, E)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)  # (N, E)
    top = router_probs.gather(-1, idx)  # (N, k) fp32
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return router_logits, top.to(router_logits.dtype)


def _biased_logits_topk_softmax(router, hidden_states, idx):
    """gpt-oss: logits with the router bias, softmax over the k selected logits only, in the
    logits' dtype."""
    import torch
    import torch.nn.functional as F

    hidden_states = hidden_states.reshape(-1, router.hidden_dim)  # (N, H)
    router_logits = F.linear(hidden_states, router.weight, router.bias)  # (N, E)
    top = router_logits.gather(-1, idx)  # (N, k)
    return router_logits, torch.nn.functional.softmax(top, dim=1, dtype=top.dtype)


def _sigmoid_grouped_scaled(router, hidden_states, idx):
    """DeepSeek-V3, GLM-4.5: fp32 logits, sigmoid scores, gather at the selected experts
    (the ``e_score_correction_bias`` and group-limited top-k only choose experts: the gates
    use the uncorrected scores), renormalise with ``+ 1e-20`` if ``norm_topk_prob``, times
    ``routed_scaling_factor``; gates stay fp32."""
    import torch
    import torch.nn.functional as F

    hidden_states = hidden_states.reshape(-1, router.hidden_dim)  # (N, H)
    router_logits = F.linear(hidden_states.type(torch.float32), router.weight.type(torch.float32))  # (N, E)
    scores = router_logits.sigmoid()
    top = scores.gather(1, idx)  # (N, k)
    if router.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, top * router.routed_scaling_factor


SCORINGS = {
    "softmax-renorm": _softmax_renorm_fp32,
    "softmax-norm_topk_prob": _softmax_optional_renorm,
    "biased-topk-softmax": _biased_logits_topk_softmax,
    "sigmoid-grouped-scaled": _sigmoid_grouped_scaled,
}


def _adapter(model_type: str, router_class: str, scoring: str, notes: str = "", module: str | None = None):
    return RouterAdapter(model_type=model_type, module=module or model_type, router_class=router_class,
                         scoring=scoring, gates=SCORINGS[scoring], notes=notes)


ADAPTERS: dict[str, RouterAdapter] = {a.model_type: a for a in [
    _adapter("mixtral", "MixtralTopKRouter", "softmax-renorm"),
    _adapter("qwen2_moe", "Qwen2MoeTopKRouter", "softmax-norm_topk_prob",
             "shared expert and its sigmoid gate run outside the router, untouched by replay"),
    _adapter("qwen3_moe", "Qwen3MoeTopKRouter", "softmax-norm_topk_prob",
             "mlp_only_layers / decoder_sparse_step layers are dense (0 rows)"),
    _adapter("olmoe", "OlmoeTopKRouter", "softmax-norm_topk_prob"),
    _adapter("gpt_oss", "GptOssTopKRouter", "biased-topk-softmax",
             "router bias; attention sinks and sliding-window layers are attention, not routing"),
    _adapter("deepseek_v3", "DeepseekV3TopkRouter", "sigmoid-grouped-scaled",
             "first_k_dense_replace dense layers (0 rows); shared experts untouched; MLA attention"),
    _adapter("glm4_moe", "Glm4MoeTopkRouter", "sigmoid-grouped-scaled",
             "first_k_dense_replace dense layers (0 rows); shared experts untouched"),
]}

# Config fields that declare routed experts, across architectures.
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def num_experts(config) -> int:
    """Routed experts per MoE layer declared by ``config`` (0 for a dense model)."""
    for f in _EXPERT_FIELDS:
        v = getattr(config, f, None)
        if isinstance(v, int) and v > 0:
            return v
    return 0


def adapter_for(config) -> RouterAdapter | None:
    """The router adapter for a model ``config``; None for a dense model.

    Raises:
        UnsupportedArchitectureError: the config declares experts (``num_local_experts``,
            ``num_experts``, ``n_routed_experts``, ...) and its ``model_type`` has no adapter.
    """
    model_type = getattr(config, "model_type", None)
    if model_type in ADAPTERS:
        return ADAPTERS[model_type]
    if num_experts(config) > 1:
        raise UnsupportedArchitectureError(
            f"model_type: {model_type!r} is a mixture-of-experts architecture ({num_experts(config)} experts) "
            f"with no router adapter; supported: {', '.join(sorted(ADAPTERS))} (see docs/models.md, "
            "'Adding an architecture')")
    return None


@dataclass(frozen=True)
class RoutedLayer:
    """One MoE layer: its global decoder-layer index and its router module."""

    layer: int
    router: object


def _config(model):
    cfg = getattr(model, "config", None)
    if cfg is None and hasattr(model, "module"):
        cfg = model.module.config
    return cfg


def routed_layers(model) -> list[RoutedLayer]:
    """The MoE layers of ``model`` in layer order (empty for a dense model).

    Raises:
        UnsupportedArchitectureError: see :func:`adapter_for`.
        ValueError: a router whose module path has no ``layers.<i>`` index.
    """
    adapter = adapter_for(_config(model))
    if adapter is None:
        return []
    cls = adapter.router_type()
    found = []
    for name, m in model.named_modules():
        if isinstance(m, cls):
            hit = _LAYER_RE.search(name)
            if hit is None:
                raise ValueError(f"router {name!r}: no 'layers.<i>' in its module path")
            found.append(RoutedLayer(int(hit.group(1)), m))
    return sorted(found, key=lambda r: r.layer)


def route_shape(model) -> tuple[int, int, int]:
    """``(L, k, E)`` of the model's routes in the logged layout: L = ``num_hidden_layers``
    (every transformer layer, dense ones included), k = experts per token, E = experts per
    layer; ``(0, 0, 0)`` for a dense model."""
    layers = routed_layers(model)
    if not layers:
        return 0, 0, 0
    cfg = _config(model)
    r = layers[0].router
    return int(cfg.num_hidden_layers), int(r.top_k), int(r.num_experts)
