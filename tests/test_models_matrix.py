"""The architecture matrix (docs/models.md): every MoE architecture in the router registry
and one dense model, as tiny random checkpoints from transformers' own classes
(tests/test_models_zoo.py).

Per architecture:

- replay (in process, fp32 and bf16): routes captured on a free forward, replayed, give
  ``torch.equal`` logits and gates; other routes change the logits; dense layers' columns
  are ignored; the router gets gradients through the replayed gates;
- serving over HTTP (real uvicorn on a port, real Tansu broker, the torch engine with
  ``aligned_logprobs``): the CompletionEvent's routes are in vLLM's layout and equal an
  independent teacher-forced capture; the learner's replayed recompute of the logged
  sample matches the behavior logprobs exactly (mismatch 0); one training step through the
  trainer's own ``train`` (DeepSpeed ZeRO-2, gloo, CPU) with replay moves the weights, the
  router included; the new version is a delta in the real store that reconstructs bit for
  bit, and its bf16 delta round-trips bit for bit through the store codec; a hot swap
  (load candidate, promote) serves the new weights: its logged logprobs are the new
  weights' own.

The serving tests run one training step in process (the trainer code a cycle runs) rather
than a learner cycle subprocess per architecture, to fit the suite's budget.
"""

from __future__ import annotations

import time
import uuid

import httpx
import numpy as np
import pytest
import torch

from learner.batch import build_batch
from learner.replay import capture_routes, router_replay, stack_routes
from learner.trainer import LearnerConfig, measure_start, train
from schemas.events import CompletionEvent, ExpertRoutes, RewardedSample
from schemas.modelspec import load_model, teacher_forced_inputs, token_logprobs
from schemas.routers import ADAPTERS, UnsupportedArchitectureError, route_shape, routed_layers
from test_models_zoo import ARCHS, DENSE, make_arch, zoo  # noqa: F401 - zoo is a fixture

DENSE_FIRST = {"deepseek_v3", "glm4_moe"}  # first_k_dense_replace=1: layer 0 is dense


def _inputs(model, seed: int = 0):
    """A left-padded batch of 2 x 12 tokens with the serving/learner position ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))


def _forward(model, x, routes=None):
    """``(logits, gates per MoE layer, indices per MoE layer)`` of one forward, replaying
    ``routes`` (B, T, L, k) when given; gates/indices come from each router's own output."""
    gates, idx = [], []

    def hook(_m, _i, out):
        gates.append(out[1].detach())
        idx.append(out[2])

    hs = [rl.router.register_forward_hook(hook) for rl in routed_layers(model)]
    try:
        with router_replay(model, routes):
            logits = model(**x).logits
    finally:
        for h in hs:
            h.remove()
    return logits, gates, idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS + [DENSE])
def test_replay_is_bitwise_on_every_architecture(zoo, arch, dtype):  # noqa: F811
    model = load_model(zoo[arch], dtype=dtype)
    x = _inputs(model)
    L, k, E = route_shape(model)
    cap: list = []
    with torch.no_grad(), capture_routes(model, cap):
        free, free_gates, _ = _forward(model, x)
    if arch == DENSE:
        assert (L, k, E) == (0, 0, 0) and cap == [] and routed_layers(model) == []
        return
    assert ADAPTERS[arch].router_type() is type(routed_layers(model)[0].router)
    routes = stack_routes(cap, 2, 12)  # (B, T, L, k)
    assert tuple(routes.shape) == (2, 12, model.config.num_hidden_layers, 2) and (L, k, E) == (2, 2, 4)
    moe = [rl.layer for rl in routed_layers(model)]
    assert moe == ([1] if arch in DENSE_FIRST else [0, 1])  # global layer index
    dense = [i for i in range(L) if i not in moe]
    assert all(int(routes[:, :, i].abs().sum()) == 0 for i in dense)  # dense columns hold 0, as vLLM's

    with torch.no_grad():
        rep, rep_gates, rep_idx = _forward(model, x, routes)
    assert torch.equal(rep, free)  # bitwise
    for g0, g1 in zip(free_gates, rep_gates):
        assert g0.dtype == g1.dtype and torch.equal(g0, g1)
    for j, layer in enumerate(moe):
        assert torch.equal(rep_idx[j], routes[:, :, layer].reshape(-1, k))

    other = routes.clone()
    for i in dense:
        other[:, :, i] = 3  # dense columns are ignored on replay
    with torch.no_grad():
        assert torch.equal(_forward(model, x, other)[0], free)
    for layer in moe:
        other[:, :, layer] = (other[:, :, layer] + 1) % E  # every token's experts move
    with torch.no_grad():
        assert not torch.equal(_forward(model, x, other)[0], free)

    if dtype == torch.float32:  # the router learns through the replayed gates
        model.zero_grad()
        with router_replay(model, routes):
            model(**x).logits.float().logsumexp(-1).sum().backward()
        for rl in routed_layers(model):
            assert rl.router.weight.grad is not None and rl.router.weight.grad.abs().sum() > 0


def test_an_moe_without_adapter_is_refused(tmp_path, tiny_moe_dir):
    """PhiMoE has experts and no adapter here: refused by name at load, never run as dense."""
    import transformers as tf

    from serving.engine import TorchEngine

    cfg = tf.PhimoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "phimoe")
    tf.AutoTokenizer.from_pretrained(tiny_moe_dir).save_pretrained(tmp_path / "phimoe")
    with pytest.raises(UnsupportedArchitectureError, match="'phimoe' is a mixture-of-experts architecture"):
        load_model(tmp_path / "phimoe")
    with pytest.raises(UnsupportedArchitectureError, match="phimoe"):
        TorchEngine(tmp_path / "phimoe").load_base()
    assert "phimoe" not in ADAPTERS


# --------------------------------------------------------------------------- served matrix

SALT = "matrix-salt"


@pytest.fixture(scope="module")
def broker_mod():
    from flywheel.broker import spawn

    b = spawn(die_with_parent=True)
    yield b
    b.stop()


def _events(bootstrap: str, ids: list[str]) -> dict[str, CompletionEvent]:
    from tests.test_serving_app import consume

    recs = consume(bootstrap, "flywheel.completions", len(ids), keys=set(ids))
    return {str(e.completion_id): e for e in (CompletionEvent.from_bytes(r.value) for r in recs)}


def _complete(url: str, **kw) -> list[str]:
    body = {"model": "flywheel", "prompt": "def add(a, b):", "max_tokens": 6, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [c["completion_id"] for c in r.json()["choices"]]


def _reference(model, ev: CompletionEvent):
    """Logprobs (C,) and routes (P + C - 1, L, k) of ``ev``'s tokens from an independent
    teacher-forced forward of ``model`` (the learner's batch-1 layout, free routing)."""
    x = teacher_forced_inputs(ev.prompt_token_ids, ev.completion_token_ids)
    cap: list = []
    with torch.no_grad(), capture_routes(model, cap):
        logits = model(input_ids=x["input_ids"], attention_mask=x["attention_mask"],
                       position_ids=x["position_ids"]).logits
    lp = token_logprobs(logits, x["target_ids"])[0, -len(ev.completion_token_ids):]
    routes = stack_routes(cap, 1, x["input_ids"].shape[1])[0].numpy() if cap else None
    return lp, routes


def _sample(ev: CompletionEvent, label: bool) -> RewardedSample:
    now = int(time.time() * 1000)
    return RewardedSample(**ev.model_dump(include={"completion_id", "model_version", "created_at", "user_hash",
                                                   "prompt_token_ids", "completion_token_ids",
                                                   "behavior_logprobs", "sampling", "expert_routes",
                                                   "finish_reason"}),
                          reward=1.0 if label else -1.0, label=label, n_votes=1, votes_up=int(label),
                          votes_down=int(not label), event_ids=[str(uuid.uuid4())], sealed_at=now)


@pytest.mark.parametrize("arch", ARCHS + [DENSE])
def test_serve_route_learn_delta_swap(zoo, arch, broker_mod, tmp_path, monkeypatch):  # noqa: F811
    from modelstore.codec import decode_state, encode_state
    from modelstore.store import ModelStore
    from serving.commands import build_pod
    from servers import ServerThread

    monkeypatch.setenv("FLYWHEEL_USER_SALT", SALT)
    store = ModelStore(tmp_path / "store")
    store.init_base(zoo[arch])
    pod = build_pod(store, pod=f"pod-{arch}", max_batch=4, bootstrap=broker_mod.bootstrap,
                    journal=tmp_path / "ev.journal", aligned_logprobs=True)
    srv = ServerThread(pod.app).start()
    try:
        if arch == "gpt_oss":  # sliding window 32: served up to the window (D39)
            r = httpx.post(srv.url + "/v1/completions", json={"model": "flywheel", "prompt": "def add(a, b):",
                                                              "max_tokens": 40}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        ids = _complete(srv.url, temperature=1.0, seed=7, n=2)
        evs = _events(broker_mod.bootstrap, ids)
        assert sorted(evs) == sorted(ids)
        v0 = load_model(zoo[arch])
        L, k, _ = route_shape(v0)
        for ev in evs.values():
            assert ev.model_version == "v000000"
            lp, routes = _reference(v0, ev)
            assert torch.equal(torch.tensor(ev.behavior_logprobs, dtype=torch.float32), lp)
            if arch == DENSE:
                assert ev.expert_routes is None
                continue
            arr = ev.expert_routes.to_array()  # vLLM's layout: every transformer layer
            assert arr.shape == (len(ev.prompt_token_ids) + len(ev.completion_token_ids) - 1, L, k)
            assert np.array_equal(arr, routes)
            if arch in DENSE_FIRST:
                assert not arr[:, 0].any() and arr[:, 1].any()

        samples = [_sample(ev, label=i == 0) for i, ev in enumerate(evs.values())]
        pad = v0.config.pad_token_id
        _, mm = measure_start(v0, build_batch(samples, pad, with_routes=arch != DENSE), "v000000", chunk=1,
                              free_max=None)
        assert mm["mismatch/max"] == 0.0  # aligned: the learner's replayed forward is the logged one

        state, metrics = train(v0, samples, "v000000", LearnerConfig(steps=1, batch_size=2, lr=1e-2, seed=0), pad)
        assert state is not None and metrics["data/n_samples"] == 2
        base = store.load("v000000")
        moved = [n for n in base if not torch.equal(base[n], state[n].to(base[n].dtype))]
        assert moved
        if arch != DENSE:  # the router learns through replay
            assert any(n.endswith(("gate.weight", "router.weight")) and "experts" not in n and "mlp" in n
                       for n in moved), moved

        m1 = store.publish(state, "v000000")
        assert m1.version == "v000001" and m1.kind == "delta"
        got = store.load("v000001")
        assert all(torch.equal(got[n], state[n]) for n in state)
        parent16 = {n: t.to(torch.bfloat16) for n, t in base.items()}
        child16 = {n: t.to(torch.bfloat16) for n, t in state.items()}
        entries, payload = encode_state(child16, parent16)
        back = decode_state("v000001", entries, payload, parent16)
        assert all(back[n].dtype == torch.bfloat16 and torch.equal(back[n], child16[n]) for n in child16)

        pod.slots.load_candidate("v000001")
        pod.slots.promote()
        ids2 = _complete(srv.url, temperature=0.0)
        ev2 = _events(broker_mod.bootstrap, ids2)[ids2[0]]
        assert ev2.model_version == "v000001"
        v1 = load_model(zoo[arch])
        v1.load_state_dict(state)
        lp1, routes1 = _reference(v1, ev2)
        assert torch.equal(torch.tensor(ev2.behavior_logprobs, dtype=torch.float32), lp1)  # the new weights'
        assert not torch.equal(lp1, _reference(load_model(zoo[arch]), ev2)[0])  # ... and not the old ones'
        if routes1 is not None:
            assert np.array_equal(ev2.expert_routes.to_array(), routes1)
    finally:
        srv.stop()
        pod.close()
