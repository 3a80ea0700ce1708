"""bf16 end to end (issue 20 item 4): a bf16 checkpoint brought with `flywheel model init
--from` (a sharded Qwen3-MoE) is stored as bf16, a learner cycle
(real DeepSpeed, bf16 with fp32 master weights) publishes a bf16 delta that round-trips bit
for bit and is smaller than the snapshot, and a pod serves it with bf16 weights."""

from __future__ import annotations

import httpx
import pytest
import torch

from modelstore.store import ModelStore, decode_state, encode_state
from learner.cycle import run_cycle
from learner.trainer import LearnerConfig, resolve_precision
from schemas.manifest import tensor_sha256
from schemas.modelspec import checkpoint_dtype, load_model, load_tokenizer

from test_learner_cycle import write_shard  # noqa: E402
from test_modelinit import save_checkpoint, tiny_qwen3_moe  # noqa: E402
from test_learner_replay import make_samples  # noqa: E402


@pytest.fixture(scope="module")
def bf16_dir(tiny_moe_dir, tmp_path_factory):
    """A team's own bf16 checkpoint: a tiny random Qwen3-MoE saved by transformers in three
    safetensors shards with an index (config ``dtype: bfloat16``) + a ChatML tokenizer."""
    tok = load_tokenizer(tiny_moe_dir)
    return save_checkpoint(tmp_path_factory.mktemp("qwen3_moe_bf16"), tiny_qwen3_moe(tok), tok,
                           max_shard_size="100KB")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def test_bf16_base_cycle_delta_and_serve(bf16_dir, tmp_path, fw_home):
    from serving.commands import build_pod
    from servers import ServerThread

    from transformers import AutoModelForCausalLM

    from flywheel.modelinit import import_checkpoint

    _, m0 = import_checkpoint(bf16_dir, tmp_path / "store", log=lambda s: None)  # `model init --from`
    store = ModelStore(tmp_path / "store")
    assert {t.dtype for t in m0.tensors.values()} == {"torch.bfloat16"}
    # v000000 holds the checkpoint's own bits (no fp32 round trip)
    want = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16).state_dict()
    v0 = store.load("v000000")
    assert set(v0) == set(want) and all(torch.equal(_bits(want[k]), _bits(v0[k])) for k in want)

    model = load_model(store.base_dir)
    assert model.dtype == torch.bfloat16
    samples = make_samples(model, 4, version="v000000", seed=3)  # bf16 free forward, batch 1
    write_shard(tmp_path / "samples", samples, "v000000", "a")
    # precision "auto": the parent's bf16
    cfg = LearnerConfig(steps=1, batch_size=4, lr=1e-4, seed=0, measure_free_max=1)
    m1 = run_cycle(store.root, tmp_path / "samples", tmp_path / "state", cfg, show_progress=False)
    assert m1 is not None and m1.kind == "delta" and m1.parent == "v000000"
    assert m1.metrics["train/precision"] == "bf16"
    assert {t.dtype for t in m1.tensors.values()} == {"torch.bfloat16"}
    # the learner's free bf16 forward is serving's, bit for bit, and so is the replayed one: the
    # Qwen3-MoE router adapter (schemas.routers) rebuilds the gate in the router's own op order
    assert m1.metrics["mismatch_free/max"] == 0.0 and m1.metrics["routes/flip_frac"] == 0.0
    assert m1.metrics["mismatch/max"] == 0.0

    v1 = ModelStore(store.root).load("v000001")  # a fresh store object: decoded from disk
    assert all(t.dtype == torch.bfloat16 for t in v1.values())
    assert all(tensor_sha256(v1[k]) == meta.sha256 for k, meta in m1.tensors.items())
    changed = sum(int((_bits(v1[k]) != _bits(v0[k])).sum()) for k in v0)
    assert 0 < changed < sum(t.numel() for t in v0.values())
    # the delta round-trips bit for bit and is smaller than the bf16 snapshot, raw and zstd'd
    entries, payload = encode_state(v1, v0)
    back = decode_state("v000001", entries, payload, v0)
    assert all(torch.equal(_bits(back[k]), _bits(v1[k])) for k in v1)
    assert {e["mode"] for e in entries} == {"xor"}
    snapshot = sum(t.numel() * 2 for t in v1.values())  # bf16: 2 bytes per weight
    assert m1.snapshot_bytes == snapshot
    assert m1.size_bytes < len(encode_state(v1, None)[1]) < snapshot

    pod = build_pod(ModelStore(store.root), version="v000001", pod="bf16", max_batch=2, log_events=False)
    srv = ServerThread(pod.app).start()
    try:
        lm = pod.slots.stable
        assert lm.version == "v000001"
        assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                       json={"model": "flywheel", "messages": [{"role": "user", "content": "hello"}],
                             "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        srv.stop()
        pod.close()


def test_resolve_precision(tiny_moe_dir, bf16_dir):
    """auto follows the weights; an fp32 override upcasts a bf16 model exactly; mixed is refused."""
    assert checkpoint_dtype({"dtype": "bfloat16"}) == torch.bfloat16 and checkpoint_dtype({}) == torch.float32
    assert checkpoint_dtype({"torch_dtype": "torch.bfloat16"}) == torch.bfloat16
    assert checkpoint_dtype({"torch_dtype": "float16"}) == torch.float32  # as every model loaded before
    fp32 = load_model(tiny_moe_dir)
    assert resolve_precision(fp32, LearnerConfig()).precision == "fp32"
    bf = load_model(bf16_dir)
    assert resolve_precision(bf, LearnerConfig()).precision == "bf16"
    before = {k: v.clone() for k, v in bf.state_dict().items()}
    assert resolve_precision(bf, LearnerConfig(precision="fp32")).precision == "fp32"
    assert all(v.dtype == torch.float32 and torch.equal(v, before[k].float()) for k, v in bf.state_dict().items())
    mixed = load_model(bf16_dir)
    mixed.lm_head.float()
    mixed.model.embed_tokens.weight.data = mixed.model.embed_tokens.weight.data.float()
    with pytest.raises(ValueError, match="precision: 'auto' needs"):
        resolve_precision(mixed, LearnerConfig())
    with pytest.raises(ValueError, match="precision: must be 'auto', 'fp32' or 'bf16'"):
        LearnerConfig(precision="fp16")
