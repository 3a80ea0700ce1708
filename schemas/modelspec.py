"""The numerics contract between serving and learner (DESIGN §4).

Both sides build the model with :func:`load_model` (same dtype, same attention and experts
implementation) and lay batches out with :func:`left_pad` and :func:`position_ids` so that
the learner's recomputed logprobs line up with the behavior logprobs serving logged; both build a
version's model around the tensors the store reconstructed with :func:`build_model`.
Expert routes follow vLLM's layout: ``(prompt_len + completion_len - 1, num_hidden_layers,
top_k)``, one row per token that went through a forward pass, in sequence order, one column
per transformer layer (dense layers' columns hold 0); the router adapters that find,
capture and replay each architecture's routers are in ``schemas.routers`` (D38).
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

ATTN_IMPLEMENTATION = "eager"  # bitwise-stable across batch shapes on CPU (DESIGN §4)
# MoE experts as one grouped matmul over the tokens sorted by expert (transformers'
# ``grouped_mm``): 2x the decode speed of the per-expert loop on CPU (docs/decisions.md D4).
EXPERTS_IMPLEMENTATION = "grouped_mm"
# Held while a model is constructed or its parameters assigned in this process
# (:func:`load_model`, :func:`build_model`, a serving engine's load): :func:`build_model`
# patches ``torch.nn.Module.register_parameter`` for the whole process, so a parameter another
# thread registers meanwhile (a store loading a checkpoint, a second pod in the same process
# assigning a version's tensors) would be moved to the meta device. Reentrant: a caller may
# hold it around a call that takes it again.
BUILD_LOCK = threading.RLock()


def experts_implementation(config) -> str:
    """The experts implementation for a model ``config``: :data:`EXPERTS_IMPLEMENTATION`
    for a mixture-of-experts model, ``"eager"`` for a dense one (transformers refuses any
    other value on a model without experts).

    Raises:
        schemas.routers.UnsupportedArchitectureError: ``config`` declares experts but its
            architecture has no router adapter (so no model is ever built as if dense).
    """
    from schemas.routers import adapter_for, num_experts

    return EXPERTS_IMPLEMENTATION if adapter_for(config) is not None and num_experts(config) > 1 else "eager"


def attention_window(config) -> int | None:
    """The sliding attention window (tokens) of a model whose layers use one (gpt-oss's
    ``sliding_attention`` layers, Mistral-style ``sliding_window``), else None.

    The torch engine keeps a full KV cache and serves at most this many positions, so the
    window never binds and batched, joined and padded rows attend exactly as the learner's
    unpadded forward does (docs/decisions.md D39).
    """
    w = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not w or (types is not None and "sliding_attention" not in types):
        return None
    return int(w)


def checkpoint_dtype(config):
    """The dtype a checkpoint's weights are kept, trained and served in: bfloat16 when its
    config's ``dtype`` (``torch_dtype`` in older configs) says so, else float32 (a config
    naming none, float32, or a dtype Flywheel does not train in, such as float16, which
    ``flywheel model init --from`` refuses; docs/decisions.md D41).

    Args:
        config: a ``transformers`` config, or the ``config.json`` dict.
    """
    import torch

    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    raw = get("dtype") or get("torch_dtype") or "float32"
    return torch.bfloat16 if str(raw).removeprefix("torch.") == "bfloat16" else torch.float32


def load_model(model_dir: str | Path, dtype=None):
    """Build the causal LM at ``model_dir`` (HF checkpoint dir) in eval mode.

    Args:
        model_dir: directory with ``config.json`` (+ weights, which callers may replace
            with ``load_state_dict`` from the model store).
        dtype: torch dtype, default the checkpoint's own (:func:`checkpoint_dtype`).

    Returns:
        ``transformers`` model (``MixtralForCausalLM`` for the default MoE).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with BUILD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), config=config, dtype=dtype or checkpoint_dtype(config),
            attn_implementation=ATTN_IMPLEMENTATION, experts_implementation=experts_implementation(config))
    model.eval()
    return model


def load_tokenizer(model_dir: str | Path):
    """Tokenizer of the checkpoint, with left padding and a pad token set."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def moe_routers(model) -> list:
    """The router modules (one per MoE layer, in layer order); empty for dense models.

    Found through the architecture's adapter (``schemas.routers``); a router maps hidden
    states ``(N, H)`` to ``(logits (N, E), gates (N, k), indices (N, k))``. Their global
    layer indices: ``schemas.routers.routed_layers``.

    Raises:
        schemas.routers.UnsupportedArchitectureError: an MoE model with no adapter.
    """
    from schemas.routers import routed_layers

    return [r.router for r in routed_layers(model)]


def left_pad(seqs: list[list[int]], pad_id: int):
    """Left-pad token sequences.

    Returns:
        ``(input_ids, attention_mask)``, both ``(B, T_max)`` int64, padding on the left.
    """
    import torch

    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, T - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, T - len(s):] = 1
    return ids, mask


def position_ids(attention_mask):
    """``position_ids = cumsum(mask) - 1`` (clamped at 0 on padding), ``(B, T)`` int64."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(logits, target_ids):
    """log π(y_t) of each target token: ``log_softmax(logits.float())`` gathered at the targets.

    The one definition of "a token's logprob" that serving's aligned scoring pass and the
    learner both use (same ops on the same shapes give the same bits).

    Args:
        logits: (B, T, V) any float dtype (computed in fp32).
        target_ids: (B, T) int64.

    Returns:
        (B, T) float32.
    """
    import torch

    return torch.log_softmax(logits.float(), dim=-1).gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)


def teacher_forced_inputs(prompt_ids: list[int], completion_ids: list[int], pad_id: int = 0) -> dict:
    """The learner's layout of ONE sample, unpadded (batch 1): the inputs of the forward that
    scores ``completion_ids`` after ``prompt_ids``.

    Returns:
        ``{"input_ids", "attention_mask", "position_ids"}`` each (1, P + C - 1) int64 (the
        last completion token is never an input), and ``"target_ids"`` (1, P + C - 1) int64
        = the next token at each position; the completion's logprobs are the last C columns.

    Raises:
        ValueError: empty prompt or completion.
    """
    import torch

    if not prompt_ids or not completion_ids:
        raise ValueError("prompt_ids, completion_ids: both must be non-empty")
    full = list(prompt_ids) + list(completion_ids)
    ids, mask = left_pad([full[:-1]], pad_id)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids(mask),
            "target_ids": torch.tensor([full[1:]], dtype=torch.long)}


class WeightsMismatchError(ValueError):
    """Loaded weights do not have the expected per-tensor sha256 (names listed)."""


@contextlib.contextmanager
def _parameters_on_meta():
    """While active, every parameter a module registers is moved to the meta device (no
    storage); buffers stay real (rotary ``inv_freq`` is computed at construction). The patch
    is process-wide, so it is applied under :data:`BUILD_LOCK`."""
    import torch

    with BUILD_LOCK:
        register = torch.nn.Module.register_parameter

        def on_meta(module, name, param):
            register(module, name, param)
            p = module._parameters.get(name)
            if p is not None and p.device.type != "meta":
                module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

        torch.nn.Module.register_parameter = on_meta
        try:
            yield
        finally:
            torch.nn.Module.register_parameter = register


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim``; no-op elsewhere).

    A version load frees about a model's worth of decode buffers in blocks that glibc keeps
    in its arenas; without this the pod's RSS grows by a fraction of a model per load."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def build_model(model_dir: str | Path, state: dict, dtype=None):
    """The model of ``model_dir``'s config (as :func:`load_model` builds it:
    eager attention and experts, eval mode) whose parameters ARE ``state``'s tensors.

    Nothing is read from the checkpoint's weights and no copy of ``state`` is made
    (``load_state_dict(assign=True)`` on parameters built on the meta device): loading a
    version costs one model's memory, the state the store reconstructed. The caller hands
    ``state`` over and must not modify its tensors afterwards. Tensors of another dtype
    than ``dtype`` are converted (a copy of those only).

    Raises:
        WeightsMismatchError: ``state`` has tensors the model does not, or lacks tensors
            that are not aliases (tied weights) of ones it has.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = dtype or torch.float32
    cfg = AutoConfig.from_pretrained(str(model_dir))
    # the whole build under the lock: ``assign=True`` sets each parameter through
    # ``register_parameter``, which another thread's build may have patched meanwhile
    with BUILD_LOCK:
        with _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
                                                     experts_implementation=experts_implementation(cfg))
        names = set(model.state_dict())
        unexpected = sorted(set(state) - names)
        if unexpected:
            raise WeightsMismatchError(f"weights: unexpected tensors {unexpected[:5]}")
        model.load_state_dict({k: v if v.dtype == dtype else v.to(dtype) for k, v in state.items()},
                              strict=False, assign=True)
        model.tie_weights()  # tied aliases (lm_head -> embed_tokens) point at the assigned tensors
    missing = sorted(k for k, v in model.state_dict().items() if v.device.type == "meta")
    if missing:
        raise WeightsMismatchError(f"weights: tensors missing from the version: {missing[:5]}")
    model.eval()
    return model
