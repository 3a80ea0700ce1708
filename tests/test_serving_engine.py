"""TorchEngine: batched generation vs an independent full forward of prompt+completion."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from schemas.events import SamplingParams
from schemas.modelspec import load_model, moe_routers
from serving.engine import TorchEngine
from serving.params import GenRequest

PROMPTS = [[5, 17, 33, 99, 250, 7, 8], [40, 41], [300, 12, 13, 14], [77]]


@pytest.fixture(scope="module")
def engine(tiny_moe_dir):
    e = TorchEngine(tiny_moe_dir, max_batch=8)
    yield e
    e.close()


@pytest.fixture(scope="module")
def base(engine):
    return engine.load_base("v000000")


def _reference(model_dir, prompt, completion):
    """Fresh model, one sequence, one full forward (no cache, no padding) of prompt+completion[:-1]."""
    model = load_model(model_dir)
    caught = []
    hs = [r.register_forward_hook(lambda m, i, o: caught.append(o[2].clone())) for r in moe_routers(model)]
    seq = torch.tensor([prompt + completion[:-1]])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0].float()  # (T, V)
    for h in hs:
        h.remove()
    logp = torch.log_softmax(logits, -1)
    P = len(prompt)
    lp = [float(logp[P - 1 + j, t]) for j, t in enumerate(completion)]
    routes = torch.stack(caught, dim=1).numpy()  # (T, L, k)
    return lp, routes


def _submit_all(engine, base, prompts, sampling):
    # pause so that every request lands in one batch
    engine.pause()
    futs = [engine.submit(GenRequest(prompt_token_ids=p, sampling=sampling, model=base)) for p in prompts]
    engine.resume()
    return [f.result(60) for f in futs]


def test_batched_routes_and_logprobs_match_full_forward(engine, base, tiny_moe_dir):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=1234)
    res = _submit_all(engine, base, PROMPTS, sp)
    assert {r.batch_size for r in res} == {len(PROMPTS)}
    for p, r in zip(PROMPTS, res):
        assert len(r.completion_token_ids) >= 1
        assert len(r.behavior_logprobs) == len(r.completion_token_ids)
        assert r.expert_routes.dtype == np.uint8
        assert r.expert_routes.shape == (len(p) + len(r.completion_token_ids) - 1, 2, 2)
        ref_lp, ref_routes = _reference(tiny_moe_dir, p, r.completion_token_ids)
        # routes: bitwise (fp32, eager attention + experts)
        np.testing.assert_array_equal(r.expert_routes.astype(np.int64), ref_routes.astype(np.int64))
        # behavior logprobs vs full-forward recompute: fp32 sums in different orders
        # (padded batch + KV cache vs one unpadded forward), so allow 1e-4 absolute.
        np.testing.assert_allclose(r.behavior_logprobs, ref_lp, atol=1e-4, rtol=0)


def test_greedy_batch_equals_single(engine, base):
    sp = SamplingParams(temperature=0.0, max_tokens=10)
    batched = _submit_all(engine, base, PROMPTS, sp)
    for p, b in zip(PROMPTS, batched):
        single = engine.generate_sync(GenRequest(prompt_token_ids=p, sampling=sp, model=base), 60)
        assert single.batch_size == 1
        assert single.completion_token_ids == b.completion_token_ids
        np.testing.assert_array_equal(single.expert_routes, b.expert_routes)


def test_seed_reproducible_and_max_tokens(engine, base):
    sp = SamplingParams(temperature=1.0, max_tokens=6, seed=7)
    a = engine.generate_sync(GenRequest(prompt_token_ids=PROMPTS[0], sampling=sp, model=base), 60)
    b = engine.generate_sync(GenRequest(prompt_token_ids=PROMPTS[0], sampling=sp, model=base), 60)
    assert a.completion_token_ids == b.completion_token_ids
    if a.finish_reason == "length":
        assert len(a.completion_token_ids) == 6
    else:
        assert a.completion_token_ids[-1] == engine.eos_id


def test_top_k_1_is_greedy(engine, base):
    greedy = engine.generate_sync(GenRequest(prompt_token_ids=PROMPTS[2], model=base,
                                             sampling=SamplingParams(temperature=0.0, max_tokens=8)), 60)
    topk1 = engine.generate_sync(GenRequest(prompt_token_ids=PROMPTS[2], model=base,
                                            sampling=SamplingParams(temperature=1.5, top_k=1, max_tokens=8,
                                                                    seed=3)), 60)
    assert topk1.completion_token_ids == greedy.completion_token_ids


def test_dense_model_has_no_routes(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import make_tiny_moe

    d = make_tiny_moe(tmp_path / "m", num_layers=1)
    cfg = LlamaConfig(vocab_size=515, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")  # overwrite weights+config, keep tokenizer
    e = TorchEngine(tmp_path / "m")
    try:
        lm = e.load_base()
        r = e.generate_sync(GenRequest(prompt_token_ids=[1, 2, 3], model=lm,
                                       sampling=SamplingParams(temperature=0, max_tokens=4)), 60)
        assert r.expert_routes is None and len(r.completion_token_ids) >= 1
    finally:
        e.close()


def test_queue_full_is_429(tiny_moe_dir, base):
    from serving.params import ServingValidationError

    e = TorchEngine(tiny_moe_dir, max_queue=2)
    try:
        e.pause()
        sp = SamplingParams(temperature=0, max_tokens=1)
        futs = [e.submit(GenRequest(prompt_token_ids=[1, 2], sampling=sp, model=base)) for _ in range(2)]
        with pytest.raises(ServingValidationError) as ei:
            e.submit(GenRequest(prompt_token_ids=[1, 2], sampling=sp, model=base))
        assert ei.value.status == 429
        e.resume()
        assert all(len(f.result(30).completion_token_ids) == 1 for f in futs)
    finally:
        e.close()


def test_abort_stops_generation(engine, base):
    sp = SamplingParams(temperature=1.0, max_tokens=500, seed=1)
    seen = []
    req = GenRequest(prompt_token_ids=[5, 6], sampling=sp, model=base)
    req.on_token = lambda t, lp: (seen.append(t), len(seen) == 3 and engine.abort(req))
    r = engine.generate_sync(req, 60)
    if r.finish_reason == "abort":
        assert len(r.completion_token_ids) == 3
    else:  # eos came first
        assert r.completion_token_ids[-1] == engine.eos_id and len(r.completion_token_ids) <= 3


def test_queue_time_is_split_from_engine_time(engine, base):
    """A request held in the queue while the engine is paused reports that wait as queue_ms;
    latency_ms - queue_ms (what the canary compares per version) excludes it."""
    import time

    sp = SamplingParams(temperature=0.0, max_tokens=4)
    engine.pause()
    fut = engine.submit(GenRequest(prompt_token_ids=PROMPTS[0], sampling=sp, model=base))
    time.sleep(0.5)
    engine.resume()
    r = fut.result(60)
    assert r.queue_ms >= 450  # it waited at least the 0.5 s pause
    assert r.queue_ms <= r.ttft_ms <= r.latency_ms
    assert r.latency_ms - r.queue_ms < r.latency_ms - 400


def _sample_ref(logits, sp, gen) -> int:
    """Reference sampler, one row at a time (the engine's pre-batching code): temperature,
    top-k (ties with the k-th kept), top-p (smallest prefix with mass >= top_p), multinomial."""
    x = logits / sp.temperature
    if sp.top_k and 0 < sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        sx, si = torch.sort(x, descending=True)
        probs = torch.softmax(sx, dim=-1)
        drop = probs.cumsum(-1) - probs > sp.top_p
        sx = sx.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, si, sx)
    return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=gen))


def test_batched_filter_matches_per_row_reference():
    from serving.engine import _BatchFilter

    params = [SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=1)
              for t, k, p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (1.0, 50, 0.5), (2.0, 1, 1.0),
                              (0.5, 600, 0.95), (1.0, 3, 0.3)]]
    f = _BatchFilter(params)
    g = torch.Generator().manual_seed(0)
    for step in range(20):
        logits = torch.randn((len(params), 512), generator=g) * 3  # (S, V)
        gens = [torch.Generator().manual_seed(100 * step + j) for j in range(len(params))]
        refs = [torch.Generator().manual_seed(100 * step + j) for j in range(len(params))]
        got = f.sample(logits.clone(), gens).tolist()
        want = [_sample_ref(logits[j], sp, refs[j]) for j, sp in enumerate(params)]
        assert got == want
        assert got[4] == int(torch.argmax(logits[4]))  # top_k 1 = greedy at any temperature


def test_top_p_and_top_k_keep_the_right_tokens_by_hand():
    """probs (0.5, 0.3, 0.15, 0.05): top_p 0.6 may give only tokens 0/1, top_k 1 only token 0."""
    from serving.engine import _BatchFilter

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2))  # (2, 4)
    f = _BatchFilter([SamplingParams(temperature=1.0, top_p=0.6, max_tokens=1),
                      SamplingParams(temperature=1.0, top_k=1, max_tokens=1)])
    seen = [set(), set()]
    for s in range(300):
        gens = [torch.Generator().manual_seed(s), torch.Generator().manual_seed(10_000 + s)]
        a, b = f.sample(logits.clone(), gens).tolist()
        seen[0].add(a)
        seen[1].add(b)
    assert seen == [{0, 1}, {0}]


def test_mixed_batch_rows_finish_at_different_steps(engine, base, tiny_moe_dir):
    """Greedy and seeded sampled rows, max_tokens 1..12 in one batch: every row's routes
    (prompt + completion - 1 rows) equal a full forward bitwise, logprobs within 1e-4, top
    logprobs are the raw distribution's top-k, and each seeded row equals the same request
    run alone."""
    sps = [SamplingParams(temperature=0.0, max_tokens=1), SamplingParams(temperature=1.0, top_k=20, max_tokens=3,
                                                                         seed=11),
           SamplingParams(temperature=0.8, top_p=0.8, max_tokens=7, seed=12),
           SamplingParams(temperature=0.0, max_tokens=12)]
    engine.pause()
    futs = [engine.submit(GenRequest(prompt_token_ids=p, sampling=sp, model=base, top_logprobs=3))
            for p, sp in zip(PROMPTS, sps)]
    engine.resume()
    res = [f.result(60) for f in futs]
    assert {r.batch_size for r in res} == {4}
    for p, sp, r in zip(PROMPTS, sps, res):
        n = len(r.completion_token_ids)
        assert 1 <= n <= sp.max_tokens and (r.finish_reason == "length") == (n == sp.max_tokens)
        assert r.expert_routes.shape == (len(p) + n - 1, 2, 2)
        ref_lp, ref_routes = _reference(tiny_moe_dir, p, r.completion_token_ids)
        np.testing.assert_array_equal(r.expert_routes.astype(np.int64), ref_routes.astype(np.int64))
        np.testing.assert_allclose(r.behavior_logprobs, ref_lp, atol=1e-4, rtol=0)
        assert len(r.top_logprobs) == n and all(len(t) == 3 for t in r.top_logprobs)
        for j, tops in enumerate(r.top_logprobs):
            assert [b for _, b in tops] == sorted((b for _, b in tops), reverse=True)
            if r.completion_token_ids[j] in [a for a, _ in tops]:
                assert dict(tops)[r.completion_token_ids[j]] == r.behavior_logprobs[j]
        if sp.temperature == 0:
            assert [t[0][0] for t in r.top_logprobs] == r.completion_token_ids
        alone = engine.generate_sync(GenRequest(prompt_token_ids=p, sampling=sp, model=base), 60)
        assert alone.batch_size == 1 and alone.completion_token_ids == r.completion_token_ids
