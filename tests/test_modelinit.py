"""`flywheel model init`: the upcycled MoE computes the dense model's function."""

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
