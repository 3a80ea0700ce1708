"""TorchEngine: batched generation vs an independent full forward of prompt+completion."""

from __future__ import annotations

from typing import Any

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
    from serving.torch_engine.sampler import BatchFilter

    params = [SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=1)
              for t, k, p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (1.0, 50, 0.5), (2.0, 1, 1.0),
                              (0.5, 600, 0.95), (1.0, 3, 0.3)]]
    f = BatchFilter(params)
    g = torch.Generator().manual_seed(0)
    for step in range(20):
        logits = torch.randn((len(params), 512), generator=g) * 3  # (S, V)
        gens = [torch.Generator().manual_seed(100 * step + j) for j in range(len(params))]
        refs = [torch.Generator().manual_seed(100 * step + j) for j in range(len(params))]
        got = f.sample(logits.clone(), gens).tolist()
        want = [_sample_ref(logits[j], sp, refs[j]) for j, sp in enumerate(params)]
        assert got == want
        assert got[4] == int(torch.argmax(logits[4]))  # top_k 1 = greedy at any temperature


@pytest.mark.parametrize("scales", [(8.0, 8.0, 8.0), (0.05, 0.05, 0.05), (8.0, 0.05, 8.0)])
def test_top_p_over_a_large_vocabulary_matches_the_full_sort(scales):
    """Peaked rows keep a prefix inside the TOP_P_CANDIDATES largest logits, flat rows do not;
    alone or mixed in one batch, every draw equals the whole-row reference's."""
    from serving.torch_engine.sampler import TOP_P_CANDIDATES, BatchFilter

    V = 8192
    params = [SamplingParams(temperature=t, top_p=p, max_tokens=1) for t, p in [(0.8, 0.95), (1.0, 0.5), (1.2, 0.99)]]
    f = BatchFilter(params)
    g = torch.Generator().manual_seed(1)
    scale = torch.tensor(scales).unsqueeze(1)
    for step in range(10):
        logits = torch.randn((len(params), V), generator=g) * scale
        mass = torch.softmax(logits / f.temp, -1).topk(TOP_P_CANDIDATES, -1).values.sum(-1)  # (S,)
        assert [bool(m >= 0.99) for m in mass] == [s > 1 for s in scales]
        gens = [torch.Generator().manual_seed(10 * step + j) for j in range(len(params))]
        refs = [torch.Generator().manual_seed(10 * step + j) for j in range(len(params))]
        assert f.sample(logits.clone(), gens).tolist() == [_sample_ref(logits[j], sp, refs[j])
                                                           for j, sp in enumerate(params)]


def test_top_p_and_top_k_keep_the_right_tokens_by_hand():
    """probs (0.5, 0.3, 0.15, 0.05): top_p 0.6 may give only tokens 0/1, top_k 1 only token 0."""
    from serving.torch_engine.sampler import BatchFilter

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2))  # (2, 4)
    f = BatchFilter([SamplingParams(temperature=1.0, top_p=0.6, max_tokens=1),
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


# ---------------------------------------------------------------- continuous batching
# Tolerance for behavior logprobs vs a batch-1 recompute (one unpadded full forward of
# prompt + completion, fresh model): 1e-4 nats absolute. Both are fp32 on CPU; the engine's
# numbers come from batched left-padded prefill + KV-cached decode whose width changes as rows
# join and leave, i.e. the same sums in other orders (~1e-6 observed); expert routes are
# compared bitwise.


def _no_eos(engine):
    """Context: eos never ends a request (every request makes exactly max_tokens tokens)."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        saved, engine.eos_id = engine.eos_id, -1
        try:
            yield
        finally:
            engine.eos_id = saved
    return cm()


def _check_against_reference(model_dir, prompt, r, state=None):
    ref_lp, ref_routes = _reference(model_dir, prompt, r.completion_token_ids) if state is None else \
        _reference_state(model_dir, state, prompt, r.completion_token_ids)
    assert r.expert_routes.shape == (len(prompt) + len(r.completion_token_ids) - 1, 2, 2)
    np.testing.assert_array_equal(r.expert_routes.astype(np.int64), ref_routes.astype(np.int64))
    np.testing.assert_allclose(r.behavior_logprobs, ref_lp, atol=1e-4, rtol=0)


def test_request_joins_running_batch_and_leaves_first(engine, base, tiny_moe_dir):
    """A short request submitted while a long one runs joins it at a step boundary (both see a
    batch of 2) and finishes while the long one is still running; each row's numbers equal a
    batch-1 recompute and each seeded row's tokens equal the request run alone."""
    long_sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=5)
    short_sp = SamplingParams(temperature=0.7, top_k=30, max_tokens=4, seed=6)
    long_p, short_p = PROMPTS[0], PROMPTS[2]
    box = {}

    def on_step(out):
        if len(box.setdefault("long", [])) == 0 and "short" not in box:
            box["short"] = engine.submit(GenRequest(prompt_token_ids=short_p, sampling=short_sp, model=base))
        box["long"].append(out.token_ids[0])
        if "short" in box and box["short"].done() and "long_at_short_end" not in box:
            box["long_at_short_end"] = len(box["long"])

    with _no_eos(engine):
        long_r = engine.generate_sync(GenRequest(prompt_token_ids=long_p, sampling=long_sp, model=base,
                                                 on_step=on_step), 60)
        short_r = box["short"].result(60)
        assert long_r.batch_size == 2 and short_r.batch_size == 2
        assert len(short_r.completion_token_ids) == 4 and len(long_r.completion_token_ids) == 40
        assert box["long_at_short_end"] < 40  # the short one left while the long one ran on
        for p, sp, r in ((long_p, long_sp, long_r), (short_p, short_sp, short_r)):
            _check_against_reference(tiny_moe_dir, p, r)
            alone = engine.generate_sync(GenRequest(prompt_token_ids=p, sampling=sp, model=base), 60)
            assert alone.batch_size == 1 and alone.completion_token_ids == r.completion_token_ids


def test_64_concurrent_requests_complete_routes(tiny_moe_dir):
    """64 requests (prompt 1..12 tokens, max_tokens 1..16, greedy and seeded sampled) through
    max_batch 8: rows join and leave at nearly every step. Every result has the complete
    routes (P + C - 1 rows) equal to a full forward bitwise, logprobs within 1e-4, and a
    sample of seeded requests equals the same request alone."""
    e = TorchEngine(tiny_moe_dir, max_batch=8)
    try:
        lm = e.load_base()
        reqs = []
        for i in range(64):
            p = [(11 * i + 3 * j) % 200 + 10 for j in range(1 + i % 12)]
            sp = (SamplingParams(temperature=0.0, max_tokens=1 + i % 16) if i % 3 == 0 else
                  SamplingParams(temperature=1.0, top_p=0.95, max_tokens=1 + (7 * i) % 16, seed=1000 + i))
            reqs.append((p, sp))
        with _no_eos(e):
            futs = [e.submit(GenRequest(prompt_token_ids=p, sampling=sp, model=lm)) for p, sp in reqs]
            res = [f.result(120) for f in futs]
            assert max(r.batch_size for r in res) == 8 and e.batches_run > 8  # joined in many groups
            for (p, sp), r in zip(reqs, res):
                assert len(r.completion_token_ids) == sp.max_tokens and r.finish_reason == "length"
                _check_against_reference(tiny_moe_dir, p, r)
            for p, sp in reqs[1::9]:
                alone = e.generate_sync(GenRequest(prompt_token_ids=p, sampling=sp, model=lm), 60)
                assert alone.completion_token_ids == res[reqs.index((p, sp))].completion_token_ids
        assert e.num_running() == 0 and e.queue_depth() == 0
    finally:
        e.close()


def _reference_state(model_dir, state, prompt, completion):
    model = load_model(model_dir)
    model.load_state_dict(state)
    caught = []
    hs = [r.register_forward_hook(lambda m, i, o: caught.append(o[2].clone())) for r in moe_routers(model)]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion[:-1]])).logits[0].float()
    for h in hs:
        h.remove()
    logp = torch.log_softmax(logits, -1)
    return ([float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion)],
            torch.stack(caught, dim=1).numpy())


def test_two_versions_run_interleaved_without_mixing(engine, base, tiny_moe_dir):
    """Requests on two versions run at the same time (one running batch each, stepped in
    turn); each completion's routes and logprobs equal a recompute on its own weights."""
    g = torch.Generator().manual_seed(9)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) if "experts" in k or "gate" in k else v
             for k, v in base.model.state_dict().items()}
    v1 = engine.load_weights(state, "v000001")
    sp = SamplingParams(temperature=0.0, max_tokens=10)
    with _no_eos(engine):
        engine.pause()
        futs = [(lm, p, engine.submit(GenRequest(prompt_token_ids=p, sampling=sp, model=lm)))
                for p in PROMPTS for lm in (base, v1)]
        engine.resume()
        res = [(lm, p, f.result(60)) for lm, p, f in futs]
    assert {r.version for _, _, r in res} == {"v000000", "v000001"}
    for lm, p, r in res:
        assert r.version == lm.version
        _check_against_reference(tiny_moe_dir, p, r, state=None if lm is base else state)
    assert any(a.completion_token_ids != b.completion_token_ids for (_, _, a), (_, _, b) in zip(res[::2], res[1::2]))


def test_abort_by_id_frees_the_row_within_one_step(engine, base):
    """abort(request_id) on a running request: it resolves with finish_reason abort at most one
    token after the call and leaves the running batch; a queued request aborted before it ran
    resolves with no token."""
    sp = SamplingParams(temperature=0.0, max_tokens=400)
    seen, at_abort = [], []
    req = GenRequest(prompt_token_ids=[5, 6], sampling=sp, model=base)

    def on_step(out):
        seen.extend(out.token_ids)
        if len(seen) == 5:
            at_abort.append(len(seen))
            engine.abort(req.request_id)

    req.on_step = on_step
    with _no_eos(engine):
        r = engine.generate_sync(req, 60)
    assert r.finish_reason == "abort" and len(r.completion_token_ids) - at_abort[0] <= 1
    assert engine.num_running() == 0
    engine.pause()
    try:
        q = GenRequest(prompt_token_ids=[5, 6], sampling=sp, model=base)
        fut = engine.submit(q)
        engine.abort(q.request_id)
    finally:
        engine.resume()
    r2 = fut.result(30)
    assert r2.finish_reason == "abort" and r2.completion_token_ids == [] and r2.expert_routes is None


def test_generate_streams_steps_and_aborts_when_left(engine, base):
    """Engine.generate: one StepOutput per token whose ids/logprobs are the final result's; the
    last carries the result. Leaving the iteration early aborts the request."""
    import asyncio

    sp = SamplingParams(temperature=0.0, max_tokens=6)

    async def full():
        outs = [o async for o in engine.generate(GenRequest(prompt_token_ids=PROMPTS[1], sampling=sp, model=base))]
        return outs

    async def partial():
        req = GenRequest(prompt_token_ids=PROMPTS[1], sampling=SamplingParams(temperature=0.0, max_tokens=300),
                         model=base)
        agen = engine.generate(req)
        got = [await agen.__anext__() for _ in range(3)]
        await agen.aclose()  # the consumer leaves
        return req, got

    with _no_eos(engine):
        outs = asyncio.run(full())
        assert [o.finished for o in outs] == [False] * 6 + [True]
        res = outs[-1].result
        assert [o.token_ids[0] for o in outs[:-1]] == res.completion_token_ids
        assert [o.logprobs[0] for o in outs[:-1]] == res.behavior_logprobs
        req, got = asyncio.run(partial())
        assert len(got) == 3 and req.cancelled.is_set()
        import time

        deadline = time.monotonic() + 10
        while engine.num_running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.num_running() == 0


def test_static_scheduler_makes_a_new_request_wait(tiny_moe_dir, base):
    """scheduler='static': a request submitted while a batch runs waits for the batch's last
    row (its queue time covers the long request's remaining steps); continuous: it joins."""
    waits = {}
    for sched in ("static", "continuous"):
        e = TorchEngine(tiny_moe_dir, max_batch=8, scheduler=sched)
        try:
            lm = e.load_base()
            box = {}

            def on_step(out, e=e, lm=lm, box=box):
                if "f" not in box:
                    box["f"] = e.submit(GenRequest(prompt_token_ids=[9, 10], model=lm,
                                                   sampling=SamplingParams(temperature=0, max_tokens=2)))

            with _no_eos(e):
                long_r = e.generate_sync(GenRequest(prompt_token_ids=[5, 6], model=lm, on_step=on_step,
                                                    sampling=SamplingParams(temperature=0, max_tokens=30)), 60)
                short = box["f"].result(60)
            waits[sched] = (short.queue_ms, long_r.latency_ms, short.batch_size)
        finally:
            e.close()
    assert waits["static"][2] == 1 and waits["continuous"][2] == 2
    assert waits["static"][0] > 0.5 * waits["static"][1]  # waited for most of the long request
    assert waits["continuous"][0] < 0.5 * waits["continuous"][1]


def test_unknown_scheduler_and_structured_outputs_refused(tiny_moe_dir, engine, base):
    from serving.params import ServingValidationError

    with pytest.raises(ValueError, match="scheduler"):
        TorchEngine(tiny_moe_dir, scheduler="fifo")
    with pytest.raises(ServingValidationError) as ei:
        engine.submit(GenRequest(prompt_token_ids=[1], sampling=SamplingParams(max_tokens=1), model=base,
                                 structured={"json": {"type": "object"}}))
    assert ei.value.status == 400 and "vLLM engine" in str(ei.value)


def test_load_weights_uses_the_state_without_copying(engine, base):
    """load_weights builds the model around the given tensors (no second copy in memory),
    re-ties tied weights to them, and refuses a state with a missing or an unknown tensor."""
    from schemas.modelspec import WeightsMismatchError

    state = {k: v.clone() for k, v in base.model.state_dict().items() if k != "lm_head.weight"}
    lm = engine.load_weights(state, "v000009")
    sd = lm.model.state_dict()
    assert all(sd[k].data_ptr() == v.data_ptr() for k, v in state.items())
    assert sd["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # tied
    assert lm.weights_digest == base.weights_digest
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    a = engine.generate_sync(GenRequest(prompt_token_ids=PROMPTS[0], sampling=sp, model=lm), 60)
    b = engine.generate_sync(GenRequest(prompt_token_ids=PROMPTS[0], sampling=sp, model=base), 60)
    assert a.completion_token_ids == b.completion_token_ids
    # same numbers up to kernel choice: the checkpoint's tensors (safetensors, not 64-byte
    # aligned) and the state's (aligned) take other SIMD paths in decode (~1e-6 measured)
    np.testing.assert_allclose(a.behavior_logprobs, b.behavior_logprobs, atol=1e-5, rtol=0)
    missing = {k: v for k, v in state.items() if "layers.1.self_attn.q_proj" not in k}
    with pytest.raises(WeightsMismatchError, match="missing"):
        engine.load_weights(missing, "bad")
    with pytest.raises(WeightsMismatchError, match="unexpected"):
        engine.load_weights(dict(state, extra=torch.zeros(1)), "bad")


def test_waiting_served_ratio_batches_joins_as_tgi_does(tiny_moe_dir):
    """``waiting_served_ratio=0.5, max_waiting_tokens=6`` (text-generation-inference's rule):
    with 4 rows running, one late request waits until 6 decode steps after the last join;
    two late requests (floor(0.5 x 4) = 2) join at the next step, in one prefill; with the
    default (0) a late request joins at the next step. Seeded tokens are unchanged."""
    def run(ratio: float):
        e = TorchEngine(tiny_moe_dir, max_batch=8, waiting_served_ratio=ratio, max_waiting_tokens=6)
        try:
            lm = e.load_base()
            steps: list[int] = []  # L0's tokens so far, appended at each of its steps
            firsts: dict[str, int] = {}  # late request -> L0's token count at its first token
            late: dict[str, Any] = {}

            def first_of(name):
                def cb(out):
                    firsts.setdefault(name, len(steps))
                return cb

            def on_l0(out):
                steps.append(out.token_ids[0])
                n = len(steps)
                if n == 2:  # 4 rows run (L0..L3 joined at n <= 1): one late request
                    late["x"] = e.submit(GenRequest(prompt_token_ids=[9, 10], model=lm, on_step=first_of("x"),
                                                    sampling=SamplingParams(temperature=0, max_tokens=3)))
                if n == 20:  # two late requests at once
                    for k in ("y", "z"):
                        late[k] = e.submit(GenRequest(prompt_token_ids=[11, 12, 13], model=lm, on_step=first_of(k),
                                                      sampling=SamplingParams(temperature=1.0, max_tokens=3,
                                                                              seed=ord(k))))
            with _no_eos(e):
                e.pause()  # the 4 long requests join together, in one prefill
                longs = [e.submit(GenRequest(prompt_token_ids=p, model=lm, on_step=on_l0 if i == 0 else None,
                                             sampling=SamplingParams(temperature=0, max_tokens=40)))
                         for i, p in enumerate(PROMPTS)]
                e.resume()
                [f.result(120) for f in longs]
                res = {k: f.result(60) for k, f in late.items()}
                alone = e.generate_sync(GenRequest(prompt_token_ids=[11, 12, 13], model=lm, sampling=SamplingParams(
                    temperature=1.0, max_tokens=3, seed=ord("y"))), 60)
            return firsts, res, alone
        finally:
            e.close()

    # a join rides in the next step's forward; its first token is sampled at the step after
    firsts, res, alone = run(0.0)
    assert firsts["x"] <= 4 and firsts["y"] <= 22, firsts  # joined at the next step
    firsts, res, alone = run(0.5)
    # x waited: the last join was at step 1, so it joins 6 steps later
    assert 7 <= firsts["x"] <= 9, firsts
    # x's join (the last) was > 6 steps before n = 20, and two waiting meet floor(0.5 x 4) = 2
    assert firsts["y"] == firsts["z"] <= 22, firsts
    assert res["y"].batch_size == res["z"].batch_size == 6  # 4 long + y + z (x is done by then)
    assert res["y"].completion_token_ids == alone.completion_token_ids


def test_waiting_served_ratio_is_checked(tiny_moe_dir):
    for kw, word in (({"waiting_served_ratio": -0.1}, "waiting_served_ratio"),
                     ({"waiting_served_ratio": float("nan")}, "waiting_served_ratio"),
                     ({"max_waiting_tokens": 0}, "max_waiting_tokens")):
        with pytest.raises(ValueError, match=word):
            TorchEngine(tiny_moe_dir, **kw)


def test_a_held_request_that_is_aborted_ends_at_once(tiny_moe_dir):
    """With joins held (ratio 0.5, 4 rows running, max_waiting_tokens far away) an aborted
    waiting request still ends at the next step with finish_reason 'abort', no token made."""
    e = TorchEngine(tiny_moe_dir, max_batch=8, waiting_served_ratio=0.5, max_waiting_tokens=10_000)
    try:
        lm = e.load_base()
        steps: list[int] = []
        box: dict[str, Any] = {}

        def on_l0(out):
            steps.append(out.token_ids[0])
            if len(steps) == 2:
                box["req"] = GenRequest(prompt_token_ids=[9, 10], model=lm,
                                        sampling=SamplingParams(temperature=0, max_tokens=3))
                box["f"] = e.submit(box["req"])
            if len(steps) == 5:
                box["held"] = not box["f"].done()  # still waiting for company
                e.abort(box["req"])
                box["at"] = len(steps)
            if "f" in box and box["f"].done() and "ended" not in box:
                box["ended"] = len(steps)

        with _no_eos(e):
            e.pause()
            longs = [e.submit(GenRequest(prompt_token_ids=p, model=lm, on_step=on_l0 if i == 0 else None,
                                         sampling=SamplingParams(temperature=0, max_tokens=20)))
                     for i, p in enumerate(PROMPTS)]
            e.resume()
            [f.result(120) for f in longs]
        r = box["f"].result(10)
        assert box["held"] and r.finish_reason == "abort" and r.completion_token_ids == []
        assert box["ended"] <= box["at"] + 2, box
    finally:
        e.close()


def _count_forwards(lm):
    """Context: ``box["n"]`` counts top-level model forwards of ``lm`` while inside."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        box = {"n": 0}
        h = lm.model.register_forward_pre_hook(lambda _m, _a: box.__setitem__("n", box["n"] + 1))
        try:
            yield box
        finally:
            h.remove()
    return cm()


@pytest.mark.parametrize("pad_budget,fused", [(1000, True), (0, False)])
def test_a_join_rides_in_the_decode_forward(tiny_moe_dir, pad_budget, fused):
    """A request joining a running batch is prefilled in the same forward as the running row's
    decode when the padding it adds (1 running row x (3 - 1) = 2 tokens) fits the budget, else
    by a forward of its own. Either way both rows' numbers equal a batch-1 recompute (routes
    bitwise, logprobs within 1e-4), the seeded joiner's tokens equal the request alone, and
    while both run every row of the mask is left padding then ones (no hole the fused forward's
    padding could leave) and exactly as wide as the longest row."""
    e = TorchEngine(tiny_moe_dir, max_batch=8, fused_join_pad_tokens=pad_budget)
    try:
        lm = e.load_base()
        long_p, short_p = PROMPTS[0], PROMPTS[2]  # 7 and 3 tokens
        short_sp = SamplingParams(temperature=0.8, top_k=30, max_tokens=6, seed=11)
        box: dict[str, Any] = {"masks": []}

        def on_step(out):
            n = box["n_long"] = box.get("n_long", 0) + 1
            if n == 3:
                box["short"] = e.submit(GenRequest(prompt_token_ids=short_p, sampling=short_sp, model=lm))
            (run,) = e.sched.running.values()  # the engine thread, between forwards: a consistent state
            if len(run.seqs) == 2:
                box["masks"].append(run.mask.clone())

        with _no_eos(e), _count_forwards(lm) as fw:
            long_r = e.generate_sync(GenRequest(prompt_token_ids=long_p, model=lm, on_step=on_step,
                                                sampling=SamplingParams(temperature=0, max_tokens=16)), 60)
            short_r = box["short"].result(60)
            forwards = fw["n"]
        assert long_r.batch_size == short_r.batch_size == 2
        # 1 prefill + 15 decodes for the long row (its 16th token needs no forward), plus the
        # joiner's own prefill unless it rode in a decode forward
        assert forwards == 16 + (0 if fused else 1), forwards
        assert e.fused_joins == (1 if fused else 0)
        for p, r in ((long_p, long_r), (short_p, short_r)):
            _check_against_reference(tiny_moe_dir, p, r)
        alone = e.generate_sync(GenRequest(prompt_token_ids=short_p, sampling=short_sp, model=lm), 60)
        assert alone.completion_token_ids == short_r.completion_token_ids
        assert box["masks"]
        for mask in box["masks"]:
            m = mask.numpy()
            for row in m:  # zeros, then ones: no padding after a real token
                first = int(np.argmax(row))
                assert row[first:].all() and not row[:first].any(), row
            assert m.all(axis=0).any() and m[:, 0].any()  # no column padding in every row
    finally:
        e.close()


def test_fused_join_pad_tokens_is_checked(tiny_moe_dir):
    with pytest.raises(ValueError, match="fused_join_pad_tokens"):
        TorchEngine(tiny_moe_dir, fused_join_pad_tokens=-1)
