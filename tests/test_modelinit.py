"""`flywheel model init`: the upcycled MoE computes the dense model's function; `--from DIR`
takes your own Hugging Face checkpoint into the store as v000000 (tiny random checkpoints
saved by transformers' ``save_pretrained``), or refuses it naming the problem."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from schemas import settings
from schemas.modelspec import load_model, load_tokenizer, moe_routers


@pytest.fixture(scope="module")
def model_dir():
    out = subprocess.run([sys.executable, "-m", "flywheel.cli", "model", "init"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    d = settings.base_model_dir()
    assert out.stdout.strip().splitlines()[-1] == str(d)  # prints where
    return d


def test_upcycled_layout(model_dir):
    info = json.loads((model_dir / "flywheel_model.json").read_text())
    assert info["num_experts"] == 4 and info["top_k"] == 2
    moe = load_model(model_dir)
    assert type(moe).__name__ == "MixtralForCausalLM"
    routers = moe_routers(moe)
    assert len(routers) == moe.config.num_hidden_layers == 30
    assert routers[0].weight.shape == (4, 576)
    experts = moe.model.layers[3].mlp.experts
    # every expert is an exact copy of the dense MLP
    for e in range(1, 4):
        assert torch.equal(experts.gate_up_proj[e], experts.gate_up_proj[0])
        assert torch.equal(experts.down_proj[e], experts.down_proj[0])


def test_upcycled_greedy_equals_dense(model_dir):
    from flywheel.modelinit import load_dense

    dense, _ = load_dense()
    moe = load_model(model_dir)
    tok = load_tokenizer(model_dir)
    # the dense MLP weights are the expert weights
    gu = moe.model.layers[0].mlp.experts.gate_up_proj[1]
    dl = dense.model.layers[0].mlp
    assert torch.equal(gu, torch.cat([dl.gate_proj.weight, dl.up_proj.weight], 0))
    msgs = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        a = dense.generate(**enc, max_new_tokens=32, do_sample=False)
        b = moe.generate(**enc, max_new_tokens=32, do_sample=False)
    n = enc["input_ids"].shape[1]
    assert b.shape[1] > n + 8
    assert a[0, n:].tolist() == b[0, n:].tolist()


# -- bring a checkpoint (`flywheel model init --from DIR`) ------------------------------------

def save_checkpoint(out, model, tok, **save_kw):
    """``model`` and ``tok`` saved by transformers, as a team's own checkpoint would be."""
    model.save_pretrained(out, safe_serialization=True, **save_kw)
    tok.save_pretrained(out)
    return out


def tiny_qwen3_moe(tok, dtype=torch.bfloat16, seed=0):
    """A tiny random Qwen3-MoE (2 layers, 4 experts, top-2, norm_topk_prob) in ``dtype``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return Qwen3MoeForCausalLM(cfg).to(dtype).eval()


def tiny_llama(tok, seed=1):
    """A tiny random dense Llama in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=None)
    return LlamaForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def chat_tok(tiny_moe_dir):
    """The tiny byte-level BPE tokenizer (ChatML template, pad and eos tokens)."""
    return load_tokenizer(tiny_moe_dir)


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def test_init_from_dense_fp32_without_pad_token_then_serve(chat_tok, tmp_path, fw_home):
    """A dense fp32 Llama whose tokenizer has no pad token (the eos token pads, said so):
    stored as v000000 with the checkpoint's own weights, served over HTTP by a pod."""
    import copy

    import httpx

    from modelstore.store import ModelStore
    from flywheel.modelinit import import_checkpoint
    from serving.commands import build_pod
    from servers import ServerThread

    tok = copy.deepcopy(chat_tok)
    tok.pad_token = None
    model = tiny_llama(tok)
    src = save_checkpoint(tmp_path / "llama", model, tok)
    lines: list[str] = []
    info, m0 = import_checkpoint(src, tmp_path / "store", log=lines.append)
    assert (info.model_type, info.dtype, info.moe_layers, info.pad_fallback) == ("llama", "float32", 0, True)
    assert "dense" in lines[0] and "no pad token: the eos token pads" in lines[0]
    store = ModelStore(tmp_path / "store")
    assert store.versions() == ["v000000"] and store.stable() == "v000000" and m0.kind == "snapshot"
    v0 = store.load("v000000")
    want = model.state_dict()
    assert set(v0) == set(want) and all(torch.equal(_bits(v0[k]), _bits(want[k])) for k in want)
    assert (store.base_dir / "tokenizer_config.json").exists()

    pod = build_pod(ModelStore(store.root), pod="llama", max_batch=2, log_events=False)
    srv = ServerThread(pod.app).start()
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                       json={"model": "flywheel", "messages": [{"role": "user", "content": "hello world"}],
                             "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        assert {p.dtype for p in pod.slots.stable.model.parameters()} == {torch.float32}
    finally:
        srv.stop()
        pod.close()


def _header(f) -> tuple[dict, int]:
    """A safetensors file's header (parsed here, by the format's layout: 8-byte little-endian
    length, JSON) and the size of its data section in bytes."""
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), len(raw) - 8 - n


def _write_header(f, header: dict) -> None:
    """Replace a safetensors file's header, keeping its data section."""
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    f.write_bytes(len(hb).to_bytes(8, "little") + hb + raw[8 + n:])


def _refusal_cases(good, chat_tok, tmp_path):
    """``(name, dir, field, message part)`` per refusal, each a broken copy of ``good``."""
    import copy
    import shutil

    from safetensors.torch import load_file, save_file

    def variant(name):
        d = tmp_path / name
        shutil.copytree(good, d)
        return d

    def edit_json(f, **kv):
        cfg = json.loads(f.read_text())
        cfg.update(kv)
        f.write_text(json.dumps(cfg))

    cases = []
    tok = copy.deepcopy(chat_tok)
    tok.chat_template = None
    d = variant("no_template")
    for f in d.glob("chat_template*"):
        f.unlink()
    tok.save_pretrained(d)
    cases.append(("no chat template", d, "chat_template", "the tokenizer has none"))

    d = variant("unknown_moe")
    edit_json(d / "config.json", model_type="acme_moe", architectures=["AcmeMoeForCausalLM"],
              num_local_experts=4, num_experts_per_tok=2)
    cases.append(("MoE with no adapter", d, "router adapter", "'acme_moe' has 4 experts per MoE layer but no router"))

    tok = copy.deepcopy(chat_tok)
    tok.pad_token, tok.eos_token = None, None
    d = variant("no_pad")
    tok.save_pretrained(d)
    cases.append(("no pad token, no eos", d, "pad_token", "no pad token and no eos token"))

    d = variant("no_tokenizer_files")  # AutoTokenizer would build an empty one: every prompt -> no tokens
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model"):
        (d / f).unlink(missing_ok=True)
    cases.append(("no tokenizer files", d, "tokenizer", "no tokenizer files"))

    d = variant("broken_template")
    for f in d.glob("chat_template*"):
        f.unlink()
    tok = copy.deepcopy(chat_tok)
    tok.chat_template = "{% for m in messages %}{{ m[ }}"
    tok.save_pretrained(d)
    cases.append(("a chat template that does not render", d, "chat_template", "does not render"))

    for k in (9, 0):
        d = variant(f"top_{k}")
        edit_json(d / "config.json", num_experts_per_tok=k)
        cases.append((f"top-{k} of 4 experts", d, "config.json num_experts_per_tok", "top-k must lie in 1..4"))

    d = variant("experts_as_text")
    edit_json(d / "config.json", num_experts="four")
    cases.append(("a config field of the wrong type", d, "config.json", "transformers refuses it"))

    d = variant("missing_shard")
    shards = sorted(d.glob("model-*.safetensors"))
    shards[1].unlink()
    cases.append(("missing weights file", d, "weights", f"missing: {shards[1].name}"))

    d = variant("no_weights")
    for f in d.glob("model*.safetensors*"):
        f.unlink()
    cases.append(("no weights at all", d, "weights", "no model.safetensors or model.safetensors.index.json"))

    d = variant("truncated")
    f = sorted(d.glob("model-*.safetensors"))[0]
    header, data_len = _header(f)
    last = max(header, key=lambda k: header[k]["data_offsets"][1] if k != "__metadata__" else -1)
    a, b = header[last]["data_offsets"]
    f.write_bytes(f.read_bytes()[:-100])
    cases.append(("truncated safetensors", d, f.name,
                  f"tensor '{last}' has data_offsets [{a}, {b}], past the end of the data section, which holds "
                  f"{data_len - 100} bytes (truncated or corrupt)"))

    # a header that claims a tensor past the end of the file, in the middle of the data section
    d = variant("past_the_end")
    f = sorted(d.glob("model-*.safetensors"))[0]
    header, data_len = _header(f)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    assert len(names) >= 3
    mid = names[len(names) // 2]
    a = header[mid]["data_offsets"][0]
    header[mid]["data_offsets"] = [a, data_len + 4096]
    _write_header(f, header)
    cases.append(("a tensor past the end of the file", d, f.name,
                  f"tensor '{mid}' has data_offsets [{a}, {data_len + 4096}], past the end of the data section, "
                  f"which holds {data_len} bytes"))

    # the tensors leave a gap: one tensor's offsets moved on by 2 bytes (its size kept)
    d = variant("gap")
    f = sorted(d.glob("model-*.safetensors"))[0]
    header, data_len = _header(f)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    first, second = names[0], names[1]
    a, b = header[second]["data_offsets"]
    header[second]["data_offsets"] = [a + 2, b + 2]
    _write_header(f, header)
    cases.append(("a gap between tensors", d, f.name,
                  f"tensor '{second}' has data_offsets [{a + 2}, {b + 2}] but the tensor before it, '{first}', "
                  f"ends at {a} (a gap in the data section)"))

    # the config's experts disagree with the weights' (transformers saves Qwen3-MoE's num_experts as
    # num_local_experts; the router is (4, 64))
    d = variant("experts_1e9")
    assert json.loads((d / "config.json").read_text())["num_local_experts"] == 4
    edit_json(d / "config.json", num_local_experts=10**9)
    idx = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    gate = "model.layers.0.mlp.gate.weight"
    cases.append(("config experts disagree with the weights", d, "config.json num_local_experts",
                  f"says 1000000000 experts per MoE layer, but the weights hold 4: tensor {gate} in {idx[gate]} "
                  "(the router, of shape [4, 64]); set num_local_experts to 4"))

    d = variant("garbled")
    f = sorted(d.glob("model-*.safetensors"))[0]
    raw = bytearray(f.read_bytes())
    raw[8:20] = b"\xff" * 12
    f.write_bytes(bytes(raw))
    cases.append(("garbled safetensors header", d, f.name, "corrupt safetensors header"))

    d = variant("fp16")
    for f in d.glob("model-*.safetensors"):
        save_file({k: v.half() for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    edit_json(d / "config.json", dtype="float16")
    cases.append(("float16 weights", d, "weights dtype", "F16 is not supported"))

    d = variant("dtype_says_fp32")
    edit_json(d / "config.json", dtype="float32")
    cases.append(("config dtype disagrees", d, "config.json dtype", "the weights are bfloat16"))
    return cases


def test_init_from_refusals(chat_tok, tmp_path):
    """Every refusal names the field and the reason, and leaves the store empty; a
    checkpoint that lacks a tensor the model needs is refused at load (never random-initialised)."""
    from safetensors.torch import load_file, save_file

    from modelstore.store import ModelStore
    from flywheel.modelinit import CheckpointError, import_checkpoint, inspect_checkpoint

    good = save_checkpoint(tmp_path / "good", tiny_qwen3_moe(chat_tok), chat_tok, max_shard_size="100KB")
    info = inspect_checkpoint(good)
    assert (info.model_type, info.dtype, info.num_experts, info.moe_layers, info.top_k) == ("qwen3_moe", "bfloat16",
                                                                                            4, 2, 2)
    assert len(info.weight_files) > 1 and not info.pad_fallback
    for name, d, field, part in _refusal_cases(good, chat_tok, tmp_path / "bad"):
        with pytest.raises(CheckpointError) as ei:
            import_checkpoint(d, tmp_path / "store", log=lambda s: None)
        assert ei.value.field == field and part in str(ei.value), (name, str(ei.value))
        assert ModelStore(tmp_path / "store").versions() == [], name

    # a tensor missing from the files: transformers would initialise it at random
    d = tmp_path / "bad" / "missing_tensor"
    import shutil
    shutil.copytree(good, d)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    gone = "model.layers.1.input_layernorm.weight"
    f = d / idx["weight_map"][gone]
    st = load_file(str(f))
    save_file({k: v for k, v in st.items() if k != gone}, str(f), metadata={"format": "pt"})
    del idx["weight_map"][gone]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="tensors the model needs are not in") as ei:
        import_checkpoint(d, tmp_path / "store", log=lambda s: None)
    assert ei.value.field == "weights" and gone in str(ei.value)

    # NaN and infinite weights: a pod would answer with NaN logits
    d = tmp_path / "bad" / "nonfinite"
    shutil.copytree(good, d)
    poisoned = {"model.norm.weight": (float("nan"), [0, 3]), "model.layers.0.post_attention_layernorm.weight":
                (float("inf"), [5])}
    for name, (value, at) in poisoned.items():
        f = d / idx["weight_map"][name]
        st = load_file(str(f))
        st[name][at] = value
        save_file(st, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="2 tensors hold NaN or infinite values") as ei:
        import_checkpoint(d, tmp_path / "store", log=lambda s: None)
    hidden = json.loads((good / "config.json").read_text())["hidden_size"]
    assert ei.value.field == "weights" and f"'model.norm.weight': 2 of {hidden}" in str(ei.value), str(ei.value)
    assert f"'model.layers.0.post_attention_layernorm.weight': 1 of {hidden}" in str(ei.value), str(ei.value)
    assert ModelStore(tmp_path / "store").versions() == []

    # through the CLI: exit 2, the option and the reason on stderr; a non-empty store is refused
    from typer.testing import CliRunner

    from flywheel.cli import app

    def flat(out: str) -> str:  # rich draws the error in a box, wrapped
        return " ".join(out.replace("│", " ").split())

    bad = tmp_path / "bad" / "no_template"
    r = CliRunner().invoke(app, ["model", "init", "--from", str(bad), "--store", str(tmp_path / "store")])
    assert r.exit_code == 2 and "--from" in r.output and "chat_template: the tokenizer has none" in flat(r.output)
    r = CliRunner().invoke(app, ["model", "init", "--from", str(good), "--store", str(tmp_path / "store")])
    assert r.exit_code == 0, r.output
    assert "Qwen3MoeForCausalLM (qwen3_moe, MoE, 4 experts, top-2, 2 MoE layers), bfloat16" in r.output
    assert f"v000000 (bfloat16, 25 tensors) in {tmp_path / 'store'}" in r.output  # 25 = the model's state dict
    r = CliRunner().invoke(app, ["model", "init", "--from", str(good), "--store", str(tmp_path / "store")])
    assert r.exit_code == 2 and "--store" in r.output and "already holds 1 versions" in flat(r.output)
    afile = tmp_path / "a-file"
    afile.write_text("x")
    r = CliRunner().invoke(app, ["model", "init", "--from", str(good), "--store", str(afile / "store")])
    assert r.exit_code == 2 and "--store" in r.output and "cannot write the model store there" in flat(r.output), \
        r.output
    r = CliRunner().invoke(app, ["model", "init", "--from", str(good), "--experts", "8"])
    assert r.exit_code == 2 and "taken as it is" in flat(r.output)


def test_expert_count_is_checked_before_transformers_loads(tiny_moe_dir, tmp_path, monkeypatch):
    """A Mixtral config claiming 10^9 experts over weights with 4: refused from the headers,
    naming the config key, a router tensor and both counts, before transformers reads the
    config or the weights (both replaced here by failures)."""
    import shutil

    import flywheel.modelinit as mi

    d = tmp_path / "mixtral"
    shutil.copytree(tiny_moe_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_local_experts"] = 10**9
    (d / "config.json").write_text(json.dumps(cfg))
    header, _ = _header(d / "model.safetensors")
    gate = "model.layers.0.block_sparse_moe.gate.weight"
    assert header[gate]["shape"] == [4, cfg["hidden_size"]]

    def never(*a, **k):
        raise AssertionError("transformers was asked before the expert count was checked")
    monkeypatch.setattr(mi, "_transformers_config", never)
    monkeypatch.setattr(mi, "load_checkpoint_state", never)
    with pytest.raises(mi.CheckpointError) as ei:
        mi.import_checkpoint(d, tmp_path / "store", log=lambda s: None)
    assert ei.value.field == "config.json num_local_experts"
    assert str(ei.value) == (f"config.json num_local_experts: says 1000000000 experts per MoE layer, but the "
                             f"weights hold 4: tensor {gate} in model.safetensors (the router, of shape [4, "
                             f"{cfg['hidden_size']}]); set num_local_experts to 4, or bring the weights saved "
                             "with this config")


def test_expert_count_from_expert_tensors_without_a_router():
    """No router tensor in the files: the experts per layer are counted from per-expert
    tensors (``experts.<i>.``) or read from a fused ``(E, ...)`` tensor."""
    from pathlib import Path

    from flywheel.modelinit import CheckpointError, check_expert_count

    def t(shape):
        return {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}

    per_expert = {Path("a.safetensors"): {f"model.layers.0.mlp.experts.{e}.{w}.weight": t([8, 4])
                                          for e in range(6) for w in ("w1", "w2")}}
    check_expert_count(per_expert, {"num_experts": 6, "hidden_size": 4})
    with pytest.raises(CheckpointError) as ei:
        check_expert_count(per_expert, {"num_experts": 8, "hidden_size": 4})
    assert ei.value.field == "config.json num_experts"
    assert "says 8 experts per MoE layer, but the weights hold 6: tensor model.layers.0.mlp.experts.5." in str(ei.value)
    assert "in a.safetensors (the expert of the highest index, 5)" in str(ei.value)
    fused = {Path("b.safetensors"): {"model.layers.3.mlp.experts.gate_up_proj": t([4, 4, 16]),
                                     "model.layers.3.mlp.experts.down_proj": t([4, 8, 4])}}
    check_expert_count(fused, {"text_config": {"num_local_experts": 4, "hidden_size": 4}})
    with pytest.raises(CheckpointError) as ei:
        check_expert_count(fused, {"text_config": {"num_local_experts": 32, "hidden_size": 4}})
    assert ei.value.field == "config.json text_config.num_local_experts"
    assert "the weights hold 4: tensor model.layers.3.mlp.experts.gate_up_proj in b.safetensors (fused experts, " \
           "of shape [4, 4, 16])" in str(ei.value)
    check_expert_count({Path("c.safetensors"): {"model.embed_tokens.weight": t([10, 4])}}, {"hidden_size": 4})
