"""Hostile checkpoints for ``flywheel model init --from`` and ``flywheel serve --model-dir``:
each is refused before any model is built, with exit 2 and a message naming the config field
or the file, the tensor and both sizes (schemas/checkpoint_check.py).

Every case is a copy of the tiny Mixtral checkpoint (conftest ``make_tiny_moe``: hidden 64,
2 layers, 4 experts, heads 4, key/value heads 2) with one edit to ``config.json``, to a
safetensors header (the data section kept), or to the tokenizer files. transformers is never
asked to build a model here: the steps that would are replaced by failures, so a config that
claims 10^9 layers cannot allocate anything.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

SAFETENSORS_DTYPES = ("BOOL, F4, F6_E2M3, F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, "
                      "I16, U16, F16, BF16, I32, U32, F32, C64, F64, I64, U64")
EMBED = "model.embed_tokens.weight"
GATE0 = "model.layers.0.block_sparse_moe.gate.weight"


def _header(f: Path) -> tuple[dict, bytes]:
    """A safetensors file's JSON header and its data section, read by hand."""
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(f: Path, header: dict, data: bytes) -> None:
    hb = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(hb)) + hb + data)


@pytest.fixture()
def ck(tiny_moe_dir, tmp_path) -> Path:
    """A fresh copy of the tiny Mixtral checkpoint."""
    return Path(shutil.copytree(tiny_moe_dir, tmp_path / "ck"))


@pytest.fixture(autouse=True)
def no_model_is_built(monkeypatch):
    """Every step that would ask transformers for a config or a model fails the test."""
    import flywheel.modelinit as mi
    import serving.pod

    def never(*a, **k):
        raise AssertionError("a model was about to be built from a checkpoint that should have been refused")
    for name in ("_transformers_config", "check_router_adapter", "load_checkpoint_state", "_check_tokenizer"):
        monkeypatch.setattr(mi, name, never)
    monkeypatch.setattr(serving.pod, "open_pod_store", never)


def edit_config(d: Path, **kv) -> dict:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(kv)
    (d / "config.json").write_text(json.dumps(cfg))
    return cfg


def edit_tensor(d: Path, name: str, **kv) -> None:
    f = d / "model.safetensors"
    header, data = _header(f)
    header[name].update(kv)
    _write_header(f, header, data)


def refused(d: Path, tmp_path: Path) -> str:
    """``flywheel model init --from d``: exit 2, no traceback, the store left empty; returns
    the error text with rich's box and wraps removed (no spaces at all, so a wrap inside a
    long word cannot split it)."""
    from flywheel.cli import app
    from modelstore.store import ModelStore

    r = CliRunner().invoke(app, ["model", "init", "--from", str(d), "--store", str(tmp_path / "store")])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and "LOAD REPORT" not in r.output, r.output
    assert ModelStore(tmp_path / "store").versions() == []
    return _squash(r.output)


def _squash(text: str) -> str:
    return "".join(text.replace("│", "").replace("╭", "").replace("╰", "").replace("─", "").split())


def check(d: Path, tmp_path: Path, field: str, reason: str) -> None:
    """The API's refusal is exactly ``field: reason``; the CLI's shows it as ``--from``'s error."""
    from flywheel.modelinit import CheckpointError, inspect_checkpoint

    with pytest.raises(CheckpointError) as ei:
        inspect_checkpoint(d)
    assert (ei.value.field, ei.value.reason) == (field, reason)
    assert _squash(f"Invalid value for --from: {field}: {reason}") in refused(d, tmp_path)


# 1. negative sizes in config.json: refused by name, not a traceback from torch

def test_negative_expert_count(ck, tmp_path):
    edit_config(ck, num_local_experts=-4)
    check(ck, tmp_path, "config.json num_local_experts",
          "says -4; experts per MoE layer (0: dense) must be an int >= 0; the weights say 4 (tensor "
          f"{GATE0} in model.safetensors, the router, of shape [4, 64])")


def test_negative_hidden_size(ck, tmp_path):
    vocab = edit_config(ck, hidden_size=-64)["vocab_size"]
    check(ck, tmp_path, "config.json hidden_size",
          f"says -64; the hidden size must be an int >= 1; the weights say 64 (tensor {EMBED} in "
          f"model.safetensors, of shape [{vocab}, 64]: [vocab_size, hidden_size])")


# 2. a layer count the weights do not hold: refused from the tensor names, no meta model built

def test_layer_count_from_the_weights(ck, tmp_path):
    edit_config(ck, num_hidden_layers=10**9)
    last = min(k for k in _header(ck / "model.safetensors")[0] if k.startswith("model.layers.1."))
    check(ck, tmp_path, "config.json num_hidden_layers",
          f"says 1000000000 layers, but the weights hold 2: tensor {last} in model.safetensors is of layer 1, "
          "the last; set num_hidden_layers to 2, or bring the weights saved with this config")


# 3. safetensors headers: every dtype a safetensors name, every dimension a non-negative int

@pytest.mark.parametrize("edit, problem", [
    ({"dtype": "Q7"}, f"has dtype 'Q7', not a safetensors dtype; safetensors knows {SAFETENSORS_DTYPES}"),
    ({"dtype": "f32"}, "has dtype 'f32', not a safetensors dtype (dtype names are upper case: 'F32'); "
                       f"safetensors knows {SAFETENSORS_DTYPES}"),
    ({"shape": "NEG"}, "has shape [-V, -64]: dimension 0 is -V, not a non-negative int"),
    ({"shape": "FLOAT"}, "has shape [V.0, 64]: dimension 0 is V.0, not a non-negative int"),
])
def test_header_dtype_and_shape(ck, tmp_path, edit, problem):
    vocab = json.loads((ck / "config.json").read_text())["vocab_size"]
    if edit.get("shape") == "NEG":
        edit = {"shape": [-vocab, -64]}
    elif edit.get("shape") == "FLOAT":
        edit = {"shape": [float(vocab), 64]}
    edit_tensor(ck, EMBED, **edit)
    check(ck, tmp_path, "model.safetensors",
          f"corrupt safetensors header: tensor '{EMBED}' " + problem.replace("V", str(vocab)))


def test_header_dimension_past_64_bits(ck, tmp_path):
    f = ck / "model.safetensors"
    header, data = _header(f)
    header["extra.weight"] = {"dtype": "F32", "shape": [0, 2**70], "data_offsets": [0, 0]}  # 0 bytes
    _write_header(f, header, data)
    check(ck, tmp_path, "model.safetensors",
          "corrupt safetensors header: tensor 'extra.weight' has shape [0, 1180591620717411303424]: dimension 1 is "
          "1180591620717411303424, larger than a 64-bit size (2**64 - 1)")


def test_unknown_dtype_on_every_tensor(ck, tmp_path):
    """Named as an unknown dtype, not as 'no floating-point tensor'."""
    f = ck / "model.safetensors"
    header, data = _header(f)
    for k, v in header.items():
        if k != "__metadata__":
            v["dtype"] = "Q7"
    _write_header(f, header, data)
    from flywheel.modelinit import CheckpointError, inspect_checkpoint

    with pytest.raises(CheckpointError) as ei:
        inspect_checkpoint(ck)
    assert ei.value.field == "model.safetensors"
    assert ei.value.reason.startswith("corrupt safetensors header: tensor '") and \
        "' has dtype 'Q7', not a safetensors dtype;" in ei.value.reason
    assert "floating-point" not in refused(ck, tmp_path)


# 4. config sizes the weights contradict: named from the headers, before transformers loads

@pytest.mark.parametrize("experts", [0, 1])
def test_too_few_experts(ck, tmp_path, experts):
    edit_config(ck, num_local_experts=experts)
    check(ck, tmp_path, "config.json num_local_experts",
          f"says {experts} experts per MoE layer, but the weights hold 4: tensor {GATE0} in model.safetensors "
          "(the router, of shape [4, 64]); set num_local_experts to 4, or bring the weights saved with this config")


def test_huge_vocab(ck, tmp_path):
    vocab = json.loads((ck / "config.json").read_text())["vocab_size"]
    edit_config(ck, vocab_size=10**12)
    check(ck, tmp_path, "config.json vocab_size",
          f"says 1000000000000, but tensor {EMBED} in model.safetensors has shape [{vocab}, 64] ([vocab_size, "
          f"hidden_size] would be [1000000000000, 64]): its dimension 0 is {vocab}; set vocab_size to {vocab}, or "
          "bring the weights saved with this config")


def test_wrong_tensor_shape(ck, tmp_path):
    """The embedding's header says [64, vocab] (same bytes): refused naming it and both shapes."""
    vocab = json.loads((ck / "config.json").read_text())["vocab_size"]
    edit_tensor(ck, EMBED, shape=[64, vocab])
    check(ck, tmp_path, "config.json vocab_size",
          f"says {vocab}, but tensor {EMBED} in model.safetensors has shape [64, {vocab}] ([vocab_size, "
          f"hidden_size] would be [{vocab}, 64]): its dimension 0 is 64; set vocab_size to 64, or bring the "
          "weights saved with this config")


def test_attention_and_expert_shapes_against_the_config(ck, tmp_path):
    """Key/value heads 4 over k_proj (2 heads x 16 = 32 rows); an intermediate size the
    experts' w1 (128 rows) does not have."""
    edit_config(ck, num_key_value_heads=4)
    check(ck, tmp_path, "config.json num_key_value_heads",
          "gives num_key_value_heads x hidden_size / num_attention_heads = 4 x 16 = 64, but tensor "
          "model.layers.0.self_attn.k_proj.weight in model.safetensors has shape [32, 64] ([num_key_value_heads x "
          "hidden_size / num_attention_heads, hidden_size] would be [64, 64]): its dimension 0 is 32; fix "
          "config.json, or bring the weights saved with this config")
    edit_config(ck, num_key_value_heads=2, intermediate_size=256)
    check(ck, tmp_path, "config.json intermediate_size",
          "says 256, but tensor model.layers.0.block_sparse_moe.experts.0.w1.weight in model.safetensors has shape "
          "[128, 64] ([intermediate_size, hidden_size] would be [256, 64]): its dimension 0 is 128; set "
          "intermediate_size to 128, or bring the weights saved with this config")


def test_sizes_past_their_bounds(ck, tmp_path):
    """A size the weights do not show (the context length) is still bounded."""
    edit_config(ck, max_position_embeddings=10**12)
    check(ck, tmp_path, "config.json max_position_embeddings",
          "says 1000000000000; the longest context in tokens must be at most 134217728 (no model Flywheel can "
          "serve is larger)")


# 5. no tokenizer files: the plain message, never a library message cut mid-word

def test_missing_tokenizer(ck, tmp_path):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (ck / f).unlink()
    check(ck, tmp_path, "tokenizer",
          f"no tokenizer files in {ck} (none of tokenizer.json, tokenizer.model, vocab.json): every prompt would "
          "tokenise to nothing; save the model's tokenizer there with tokenizer.save_pretrained(DIR)")


# 6. flywheel serve --model-dir runs the same checks: a usage error, not a traceback

def _serve(ck: Path) -> str:
    from flywheel.cli import app
    from schemas.settings import free_port

    r = CliRunner().invoke(app, ["serve", "--port", str(free_port()), "--model-dir", str(ck)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    return _squash(r.output)


def test_serve_model_dir_runs_the_same_checks(ck, monkeypatch):
    from serving.pod import check_model_dir

    monkeypatch.delenv("FLYWHEEL_ADMIN_TOKEN", raising=False)
    check_model_dir(ck)  # the checkpoint as saved passes
    f = ck / "model.safetensors"
    header, data = _header(f)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    a, b = header[last]["data_offsets"]
    f.write_bytes(f.read_bytes()[:-100])  # truncated
    assert _squash(f"Invalid value for --model-dir: {ck}: model.safetensors: tensor '{last}' has data_offsets "
                   f"[{a}, {b}], past the end of the data section, which holds {len(data) - 100} bytes (truncated "
                   "or corrupt)") in _serve(ck)

    _write_header(f, header, data)  # whole again; now a config the weights contradict
    edit_config(ck, num_hidden_layers=10**9)
    first = min(k for k in header if k.startswith("model.layers.1."))
    assert _squash(f"Invalid value for --model-dir: {ck}: config.json num_hidden_layers: says 1000000000 layers, "
                   f"but the weights hold 2: tensor {first} in model.safetensors is of layer 1, the last") in _serve(ck)
