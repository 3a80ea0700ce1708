"""The checks a Hugging Face checkpoint directory passes before any model is built from it.

``flywheel model init --from DIR`` (:func:`flywheel.modelinit.inspect_checkpoint`) and
``flywheel serve --model-dir DIR`` (:func:`serving.pod.check_serve`) both run
:func:`check_checkpoint_dir`; it reads only ``config.json``, the safetensors headers and the
tokenizer files' names, so a config that claims huge sizes is refused without allocating
anything (no transformers, no torch).

What it checks, in order:

1. ``config.json``: valid JSON, a ``model_type``, not quantized.
2. The safetensors files (``model.safetensors``, or an index and every shard it names), each
   header as the format defines it (https://github.com/huggingface/safetensors, "Format"):
   valid JSON of at most :data:`MAX_HEADER_BYTES`; every dtype one of safetensors' names
   (:data:`DTYPE_BITS`); every dimension a non-negative int that fits 64 bits; each tensor's
   ``data_offsets`` inside the data section and holding ``prod(shape) x`` its dtype's width;
   the tensors tiling the data section exactly.
3. The config's structure fields (:data:`STRUCTURE_FIELDS`: layers, widths, heads, experts,
   top-k, vocabulary, context) that are ints: at least their minimum, then consistent with
   the weights where the weights say it (the layer count in the tensor names, the
   embedding's ``[vocab_size, hidden_size]``, the router's expert count, the shapes of the
   attention, norm, MLP and per-expert tensors), then at most their bound.
4. Tokenizer files present (``tokenizer.json``, ``tokenizer.model`` or ``vocab.json``).

Each refusal is a :class:`CheckpointError` naming the field (a config key, a file) and the
reason with both sizes and the tensor that shows it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
MAX_SIZE = (1 << 64) - 1  # safetensors reads dimensions, element counts and offsets as 64-bit sizes
# bits per element of every dtype safetensors knows (its Dtype enum)
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
# bytes per element of the whole-byte safetensors dtypes
DTYPE_BYTES = {k: v // 8 for k, v in DTYPE_BITS.items() if v % 8 == 0}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

# config.json fields that size the model: (key, least value, greatest value, what it is).
# The bounds are far above any published model and far below what would exhaust memory
# while a model is built from the config on the meta device.
STRUCTURE_FIELDS = (
    ("num_hidden_layers", 1, 1024, "decoder layers"),
    ("hidden_size", 1, 1 << 17, "the hidden size"),
    ("intermediate_size", 1, 1 << 20, "the MLP's intermediate size"),
    ("moe_intermediate_size", 1, 1 << 20, "each expert's intermediate size"),
    ("num_attention_heads", 1, 1 << 12, "attention heads"),
    ("num_key_value_heads", 1, 1 << 12, "key/value heads"),
    ("head_dim", 1, 1 << 12, "the width of one attention head"),
    *((k, 0, 1 << 14, "experts per MoE layer (0: dense)") for k in EXPERT_KEYS),
    ("num_experts_per_tok", 0, 1 << 14, "experts per token"),
    ("vocab_size", 1, 1 << 23, "the vocabulary size"),
    ("max_position_embeddings", 1, 1 << 27, "the longest context in tokens"),
)

_EXPERT_INDEXED = re.compile(r"^(.*\.experts)\.(\d+)\.")  # per-expert tensors: ...experts.3.w1.weight
_EXPERT_FUSED = re.compile(r"^(.*\.experts)\.[A-Za-z_]+(\.weight)?$")  # (E, ...) tensors: ...experts.gate_up_proj
_ROUTER = re.compile(r"\.(gate|router)\.weight$")  # (E, hidden): ...mlp.gate.weight, ...mlp.router.weight
_EMBED = "embed_tokens.weight"


class CheckpointError(ValueError):
    """A checkpoint directory Flywheel cannot take, and why.

    Attributes:
        field: what is at fault (``config.json``, ``config.json hidden_size``, ``weights``,
            ``chat_template``, ``pad_token``, ``router adapter``, a file name, ...).
        reason: what is wrong and, where there is one, how to fix it.
    """

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


@dataclass
class CheckedFiles:
    """What :func:`check_checkpoint_dir` read from a checkpoint directory.

    Attributes:
        path: the directory.
        config: ``config.json`` as a dict.
        weight_files: the safetensors files (one, or the shards an index names).
        headers: each file's tensor entries ``{name: {dtype, shape, data_offsets}}``.
    """

    path: Path
    config: dict
    weight_files: list[Path]
    headers: dict[Path, dict[str, dict]]


def library_text(exc: BaseException) -> str:
    """``TypeName: message`` of an exception raised by a library, on one line and whole
    (never cut mid-word)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def check_checkpoint_dir(d: Path, check_types: bool = True) -> CheckedFiles:
    """Every check of a checkpoint directory that needs no model built (module docstring).

    Args:
        d: the checkpoint directory.
        check_types: also refuse a structure field that is not an int (``model init``
            leaves that to transformers' typed config, which names the field, and calls
            :func:`check_structure_types` after it).

    Raises:
        CheckpointError: the first problem found, naming the field and the reason.
    """
    d = Path(d)
    config = read_config(d)
    files = weight_files(d)
    headers = {f: read_safetensors_header(f) for f in files}
    check_structure(headers, config)
    if check_types:
        check_structure_types(config)
    check_tokenizer_files(d)
    return CheckedFiles(path=d, config=config, weight_files=files, headers=headers)


def read_config(d: Path) -> dict:
    """``config.json`` of ``d`` as a dict: valid JSON, a ``model_type``, not quantized.

    Raises:
        CheckpointError: field ``config.json`` (or ``config.json quantization_config``).
    """
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
        q = cfg["quantization_config"]
        method = q.get("quant_method", "?") if isinstance(q, dict) else "?"
        raise CheckpointError("config.json quantization_config", f"quantized weights ({method}) are not supported; "
                              "Flywheel trains and serves bfloat16 or float32 weights: dequantize first")
    return cfg


def weight_files(d: Path) -> list[Path]:
    """The safetensors files of the checkpoint (the index's shards, or model.safetensors).

    Raises:
        CheckpointError: no safetensors file, an invalid index, or a shard it names missing.
    """
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


def _dtype_problem(dtype) -> str | None:
    if isinstance(dtype, str) and dtype in DTYPE_BITS:
        return None
    hint = f" (dtype names are upper case: {dtype.upper()!r})" if isinstance(dtype, str) and \
        dtype.upper() in DTYPE_BITS else ""
    return f"has dtype {dtype!r}, not a safetensors dtype{hint}; safetensors knows {', '.join(DTYPE_BITS)}"


def _shape_problem(shape: list) -> str | None:
    count = 1
    for i, x in enumerate(shape):
        if type(x) is not int or x < 0:
            return f"dimension {i} is {x!r}, not a non-negative int"
        if x > MAX_SIZE:
            return f"dimension {i} is {x}, larger than a 64-bit size (2**64 - 1)"
        count *= x
        if count > MAX_SIZE:
            return (f"its element count overflows a 64-bit size at dimension {i} (the product of the first "
                    f"{i + 1} dimensions is {count})")
    return None


def read_safetensors_header(f: Path) -> dict[str, dict]:
    """The tensor entries of a safetensors file's header (``{name: {dtype, shape,
    data_offsets}}``), checked against the format and the file: the header valid JSON of at
    most :data:`MAX_HEADER_BYTES` (``__metadata__``, if there, a JSON object of strings); each
    tensor's dtype one of :data:`DTYPE_BITS`, its shape a list of non-negative ints whose
    product fits 64 bits, its ``data_offsets`` inside the data section and holding
    ``prod(shape) x`` its dtype's width; the tensors' byte ranges tiling the data section
    exactly. A truncated, garbled or hand-edited file is caught before any load.

    Raises:
        CheckpointError: field the file's name; the reason names the tensor and what is wrong
            (its dtype, its shape and the bad dimension, its offsets and the data section's
            size, or the two tensors around a gap or an overlap).
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
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f.name, "corrupt safetensors header: __metadata__ is not a JSON object of strings")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    data = size - 8 - n  # bytes of the data section
    spans = []
    for name, v in tensors.items():
        offs = v.get("data_offsets") if isinstance(v, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs)
                and "dtype" in v and isinstance(v.get("shape"), list)):
            raise CheckpointError(f.name, f"corrupt safetensors header: tensor {name!r} has no dtype, shape and "
                                  "data_offsets [begin, end]")
        problem = _dtype_problem(v["dtype"])
        if problem:
            raise CheckpointError(f.name, f"corrupt safetensors header: tensor {name!r} {problem}")
        shape = v["shape"]
        problem = _shape_problem(shape)
        if problem:
            raise CheckpointError(f.name, f"corrupt safetensors header: tensor {name!r} has shape {shape}: {problem}")
        a, b = offs
        if not 0 <= a <= b:
            raise CheckpointError(f.name, f"corrupt safetensors header: tensor {name!r} has data_offsets [{a}, {b}], "
                                  "not a byte range")
        if b > data:
            raise CheckpointError(f.name, f"tensor {name!r} has data_offsets [{a}, {b}], past the end of the data "
                                  f"section, which holds {data} bytes (truncated or corrupt)")
        bits = DTYPE_BITS[v["dtype"]] * _prod(shape)
        if bits % 8:
            raise CheckpointError(f.name, f"corrupt safetensors header: tensor {name!r} ({v['dtype']} {shape}) "
                                  f"holds {bits} bits, not a whole number of bytes")
        if b - a != bits // 8:
            raise CheckpointError(f.name, f"corrupt safetensors header: tensor {name!r} ({v['dtype']} {shape}) "
                                  f"needs {bits // 8} bytes, its data_offsets [{a}, {b}] hold {b - a}")
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


def _is_int(v) -> bool:
    return type(v) is int


def config_experts_key(config: dict) -> tuple[str, int]:
    """``(key, experts per MoE layer)`` named by a ``config.json`` dict: the first of
    :data:`EXPERT_KEYS` set to a positive int (``text_config.<key>`` when it is there);
    ``("", 0)`` when it names none."""
    for prefix, c in (("", config), ("text_config.", _sub(config))):
        for k in EXPERT_KEYS:
            if _is_int(c.get(k)) and c[k] > 0:
                return prefix + k, int(c[k])
    return "", 0


def config_num_experts(config: dict) -> int:
    """Experts per MoE layer named by a ``config.json`` dict (any of :data:`EXPERT_KEYS`,
    also under ``text_config``), 0 when it names none."""
    return config_experts_key(config)[1]


def _declared_experts(config: dict) -> tuple[str, int | None]:
    """``(key, value)`` of the first of :data:`EXPERT_KEYS` set to a positive int, else of the
    first set to any int (0 or 1: no routed experts); ``("", None)`` when none is an int."""
    key, n = config_experts_key(config)
    if n:
        return key, n
    for prefix, c in (("", config), ("text_config.", _sub(config))):
        for k in EXPERT_KEYS:
            if _is_int(c.get(k)):
                return prefix + k, c[k]
    return "", None


def _sub(config: dict) -> dict:
    tc = config.get("text_config")
    return tc if isinstance(tc, dict) else {}


def _text_config(config: dict) -> tuple[str, dict]:
    """``(key prefix, dict)`` holding the decoder's sizes: ``text_config`` when it has a
    ``hidden_size`` (a multimodal config), else the config itself."""
    tc = _sub(config)
    return ("text_config.", tc) if "hidden_size" in tc else ("", config)


def _routers_in(headers: dict[Path, dict], hidden) -> list[tuple[str, str, int, str]]:
    """``(tensor, file, experts, how)`` of each router the weights hold (``*.gate.weight`` /
    ``*.router.weight`` of shape ``(E, hidden)``), else of the expert tensors
    (``*.experts.<i>.*``, or fused ``*.experts.<name>`` of shape ``(E, ...)``)."""
    found: list[tuple[str, str, int, str]] = []
    for f, h in headers.items():
        for name, v in h.items():
            shape = v["shape"]
            if _ROUTER.search(name) and len(shape) == 2 and (not _is_int(hidden) or shape[1] == hidden):
                found.append((name, f.name, shape[0], f"the router, of shape {shape}"))
    if found:
        return found
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
        found.append((name, where, max(by_index) + 1, f"the expert of the highest index, {max(by_index)}"))
    return found


def check_expert_count(headers: dict[Path, dict], config: dict) -> None:
    """The experts per MoE layer that ``config.json`` names against those the weights hold,
    read from the safetensors headers (no weights loaded): each router tensor
    (``*.gate.weight`` / ``*.router.weight`` of shape ``(E, hidden_size)``), else the expert
    tensors (``*.experts.<i>.*``, or fused ``*.experts.<name>`` of shape ``(E, ...)``). A
    config that names 0 or 1 experts over weights with routed experts is refused too.

    Raises:
        CheckpointError: field ``config.json <key>`` (``num_local_experts``, ``num_experts``,
            ...), naming a tensor of the files and both counts.
    """
    key, n = _declared_experts(config)
    if n is None:
        return
    hidden = config.get("hidden_size") or _sub(config).get("hidden_size")
    for name, where, got, how in _routers_in(headers, hidden):
        if got != n and (n > 1 or got > 1):
            raise CheckpointError(f"config.json {key}", f"says {n} experts per MoE layer, but the weights hold "
                                  f"{got}: tensor {name} in {where} ({how}); set {key} to {got}, or bring the "
                                  "weights saved with this config")


def _fields(config: dict):
    """``(key as named in messages, value, least, greatest, what)`` of each structure field
    present in the config or its ``text_config``."""
    for prefix, c in (("", config), ("text_config.", _sub(config))):
        for k, lo, hi, what in STRUCTURE_FIELDS:
            if c.get(k) is not None:
                yield prefix + k, c[k], lo, hi, what


def _embedding(headers: dict[Path, dict]) -> tuple[str, str, list] | None:
    """``(tensor, file, shape)`` of the decoder's token embedding (the shortest name ending
    in ``embed_tokens.weight``), or None."""
    found = sorted((len(name), name, f.name, v["shape"]) for f, h in headers.items() for name, v in h.items()
                   if name.endswith(_EMBED) and (name == _EMBED or name.endswith("." + _EMBED)))
    return found[0][1:] if found else None


def _layers(headers: dict[Path, dict], prefix: str) -> dict[int, tuple[str, str]]:
    """``{layer index: (a tensor of it, file)}`` of the decoder layers named
    ``<prefix>layers.<i>.*``."""
    pat = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
    out: dict[int, tuple[str, str]] = {}
    for f, h in headers.items():
        for name in sorted(h):
            m = pat.match(name)
            if m:
                out.setdefault(int(m.group(1)), (name, f.name))
    return out


def _evidence(headers: dict[Path, dict], config: dict) -> dict[str, str]:
    """What the weights say of some structure fields, as a phrase per field name (without
    prefix), for the messages that refuse a field's value."""
    out = {}
    emb = _embedding(headers)
    if emb and len(emb[2]) == 2:
        name, where, shape = emb
        out["vocab_size"] = f"{shape[0]} (tensor {name} in {where}, of shape {shape}: [vocab_size, hidden_size])"
        out["hidden_size"] = f"{shape[1]} (tensor {name} in {where}, of shape {shape}: [vocab_size, hidden_size])"
        layers = _layers(headers, name[:-len(_EMBED)])
        if layers:
            top = max(layers)
            out["num_hidden_layers"] = f"{top + 1} (tensor {layers[top][0]} in {layers[top][1]} is of layer {top})"
    hidden = emb[2][1] if emb and len(emb[2]) == 2 else None
    routers = _routers_in(headers, hidden)
    if routers:
        name, where, got, how = routers[0]
        for k in EXPERT_KEYS:
            out[k] = f"{got} (tensor {name} in {where}, {how})"
    return out


def check_structure(headers: dict[Path, dict], config: dict) -> None:
    """The config's structure fields (:data:`STRUCTURE_FIELDS`) that are ints, against their
    least value, the weights' shapes (read from the headers) and their greatest value, in
    that order, so a config that would build an impossible or enormous model is refused
    before one is built. Fields that are not ints are left to :func:`check_structure_types`.

    Raises:
        CheckpointError: field ``config.json <key>``, naming the value, and where the
            weights say it, the tensor, its file and its shape.
    """
    ev = _evidence(headers, config)
    moe = config_num_experts(config) > 1
    for key, v, lo, _hi, what in _fields(config):
        if moe and key.endswith("num_experts_per_tok"):
            continue  # an MoE's top-k must lie in 1..experts: checked against the experts below
        if _is_int(v) and v < lo:
            says = ev.get(key.rsplit(".", 1)[-1])
            raise CheckpointError(f"config.json {key}", f"says {v}; {what} must be an int >= {lo}"
                                  + (f"; the weights say {says}" if says else ""))
    _check_against_weights(headers, config)
    for key, v, _lo, hi, what in _fields(config):
        if _is_int(v) and v > hi:
            raise CheckpointError(f"config.json {key}", f"says {v}; {what} must be at most {hi} (no model "
                                  "Flywheel can serve is larger)")


def check_structure_types(config: dict) -> None:
    """Every structure field present is an int (not a float, a string or a bool).

    Raises:
        CheckpointError: field ``config.json <key>``, naming the value and its type.
    """
    for key, v, lo, _hi, what in _fields(config):
        if not _is_int(v):
            raise CheckpointError(f"config.json {key}", f"{v!r} is a {type(v).__name__}; {what} must be an int "
                                  f">= {lo}")


def _check_against_weights(headers: dict[Path, dict], config: dict) -> None:
    """The layer count, the embedding, the expert count, top-k and the tensor shapes the
    config implies against the headers (see :func:`check_structure`)."""
    p, c = _text_config(config)
    emb = _embedding(headers)
    if emb is not None:
        name, where, shape = emb
        tp = name[:-len(_EMBED)]  # the decoder's prefix: "model.", "model.language_model.", ...
        layers = _layers(headers, tp)
        n = c.get("num_hidden_layers")
        if layers and _is_int(n):
            top = max(layers)
            extra = c.get("num_nextn_predict_layers") if _is_int(c.get("num_nextn_predict_layers")) else 0
            if n > top + 1 or n + extra < top + 1:
                t, f = layers[top]
                raise CheckpointError(f"config.json {p}num_hidden_layers", f"says {n} layers, but the weights hold "
                                      f"{top + 1}: tensor {t} in {f} is of layer {top}, the last; set "
                                      f"num_hidden_layers to {top + 1}, or bring the weights saved with this config")
            missing = sorted(set(range(min(n, top + 1))) - set(layers))
            if missing:
                raise CheckpointError("weights", f"config.json {p}num_hidden_layers says {n} layers, but no tensor "
                                      f"of layer {missing[0]} ({tp}layers.{missing[0]}.*) is in the files")
        _check_shape(name, where, shape, _embed_layout(p, c), config)
    check_expert_count(headers, config)
    key, n = config_experts_key(config)
    k = c.get("num_experts_per_tok")
    if n > 1 and _is_int(k) and not 1 <= k <= n:
        raise CheckpointError(f"config.json {p}num_experts_per_tok", f"{k} experts per token with {n} experts per "
                              f"MoE layer: top-k must lie in 1..{n}")
    if emb is None:
        return
    tp = emb[0][:-len(_EMBED)]
    rules = _tensor_rules(p, c)
    for f, h in headers.items():
        for name, v in sorted(h.items()):
            if name == "lm_head.weight":
                _check_shape(name, f.name, v["shape"], _embed_layout(p, c), config)
                continue
            if not name.startswith(tp):
                continue  # another tower's tensors (vision, audio): not sized by these fields
            rest = name[len(tp):]
            for pat, layout in rules:
                if pat.search(rest):
                    _check_shape(name, f.name, v["shape"], layout, config)
                    break


# A layout is a list of dimensions, each ``(expression, value, field to blame)``; a value of
# None (a field missing or not an int) skips the tensor.
def _embed_layout(p: str, c: dict) -> list:
    return [("vocab_size", c.get("vocab_size"), p + "vocab_size"),
            ("hidden_size", c.get("hidden_size"), p + "hidden_size")]


def _tensor_rules(p: str, c: dict) -> list:
    """``(pattern on the name past the decoder's prefix, layout)`` of the tensors whose shape
    a Llama-family config implies."""
    H = ("hidden_size", c.get("hidden_size"), p + "hidden_size")
    heads, kv = c.get("num_attention_heads"), c.get("num_key_value_heads")
    kv = heads if kv is None else kv
    hd, hd_expr = c.get("head_dim"), "head_dim"
    if hd is None and _is_int(H[1]) and _is_int(heads) and heads > 0 and H[1] % heads == 0:
        hd, hd_expr = H[1] // heads, "hidden_size / num_attention_heads"
    I = ("intermediate_size", c.get("intermediate_size"), p + "intermediate_size")
    ie_key = "moe_intermediate_size" if c.get("moe_intermediate_size") is not None else "intermediate_size"
    Ie = (ie_key, c.get(ie_key), p + ie_key)
    rules = [
        (re.compile(r"^norm\.weight$|^layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight$"), [H]),
        (re.compile(r"^layers\.\d+\.mlp\.(gate_proj|up_proj)\.weight$"), [I, H]),
        (re.compile(r"^layers\.\d+\.mlp\.down_proj\.weight$"), [H, I]),
        (re.compile(r"^layers\.\d+\.[a-z_]+\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$"), [Ie, H]),
        (re.compile(r"^layers\.\d+\.[a-z_]+\.experts\.\d+\.(down_proj|w2)\.weight$"), [H, Ie]),
    ]
    mla = any(k in c for k in ("q_lora_rank", "kv_lora_rank"))  # multi-head latent attention: other shapes
    if not mla and all(_is_int(x) for x in (heads, kv, hd)):
        q = (f"num_attention_heads x {hd_expr} = {heads} x {hd}", heads * hd, p + "num_attention_heads")
        k = (f"num_key_value_heads x {hd_expr} = {kv} x {hd}", kv * hd, p + "num_key_value_heads")
        rules += [(re.compile(r"^layers\.\d+\.self_attn\.q_proj\.weight$"), [q, H]),
                  (re.compile(r"^layers\.\d+\.self_attn\.(k_proj|v_proj)\.weight$"), [k, H]),
                  (re.compile(r"^layers\.\d+\.self_attn\.o_proj\.weight$"), [H, q])]
    return rules


def _check_shape(name: str, where: str, shape: list, layout: list, config: dict) -> None:
    """Refuse ``name`` (in file ``where``) when its shape is not the one ``layout`` gives."""
    if not all(_is_int(val) for _e, val, _f in layout):
        return
    want = [val for _e, val, _f in layout]
    if shape == want:
        return
    form = "[" + ", ".join(e.split(" = ")[0] for e, _v, _f in layout) + "]"
    if len(shape) != len(want):
        e, val, field = layout[0]
        raise CheckpointError(f"config.json {field}", f"tensor {name} in {where} has shape {shape}, but config.json "
                              f"implies {want} ({form}): {len(shape)} dimensions, not {len(want)}")
    i = next(i for i in range(len(want)) if shape[i] != want[i])
    e, val, field = layout[i]
    says = f"says {val}" if e == field.rsplit(".", 1)[-1] else f"gives {e} = {val}"
    fix = f"set {field.rsplit('.', 1)[-1]} to {shape[i]}" if e == field.rsplit(".", 1)[-1] else "fix config.json"
    raise CheckpointError(f"config.json {field}", f"{says}, but tensor {name} in {where} has shape {shape} "
                          f"({form} would be {want}): its dimension {i} is {shape[i]}; {fix}, or bring the weights "
                          "saved with this config")


def check_tokenizer_files(d: Path) -> None:
    """The checkpoint holds tokenizer files (:data:`TOKENIZER_FILES`, any one).

    Raises:
        CheckpointError: field ``tokenizer``, naming the directory and the files looked for.
    """
    if not any((d / f).exists() for f in TOKENIZER_FILES):
        raise CheckpointError("tokenizer", f"no tokenizer files in {d} (none of {', '.join(TOKENIZER_FILES)}): "
                              "every prompt would tokenise to nothing; save the model's tokenizer there with "
                              "tokenizer.save_pretrained(DIR)")
