"""Prefix caching (serving.prefix_cache): prompts that share a prefix prefill only their suffix,
and what they generate is what one full forward of prompt + completion gives."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.events import SamplingParams
from serving.engine import TorchEngine
from serving.params import GenRequest
from serving.prefix_cache import PrefixCache, common_prefix_len

from test_serving_engine import _reference, _submit_all  # noqa: I001

SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # a 12-token "system turn" every prompt starts with
PROMPTS = [SYSTEM + [40, 41, 42], SYSTEM + [300, 12], SYSTEM + [77, 78, 79, 80, 81], SYSTEM + [5]]


def test_common_prefix_and_candidates_by_hand():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    pc = PrefixCache(min_tokens=2)
    # a group: the longest prefix all its prompts share, capped at the shortest minus one
    assert pc.candidate([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 3, 4, 5]]) == 3
    assert pc.candidate([[1, 2, 3], [1, 2, 3, 4]]) == 2
    # a single prompt: against the remembered ones (the three above and the two after)
    assert pc.candidate([[1, 2, 3, 4, 7, 7]]) == 4
    assert pc.candidate([[9, 9, 9]]) == 0


def test_lookup_takes_the_longest_entry_all_prompts_start_with():
    from serving.prefix_cache import PrefixEntry

    pc = PrefixCache(max_entries=2)
    for toks in [(1, 2), (1, 2, 3, 4), (5, 6)]:
        pc.add(PrefixEntry(tokens=toks, kv=[], routes=None))
    assert list(pc.entries) == [(1, 2, 3, 4), (5, 6)]  # (1, 2) evicted: least recently used
    assert pc.lookup([[1, 2, 3, 4, 5], [1, 2, 3, 4, 9]]).tokens == (1, 2, 3, 4)
    assert pc.lookup([[1, 2, 3, 4]]) is None  # it must leave one token to prefill
    assert pc.lookup([[1, 2, 3, 4, 5], [1, 2, 9]]) is None
    pc.used(pc.entries[(5, 6)], rows=3, computed=2)
    assert (pc.hits, pc.tokens_reused) == (1, 4) and list(pc.entries)[-1] == (5, 6)


@pytest.fixture(scope="module")
def cached(tiny_moe_dir):
    e = TorchEngine(tiny_moe_dir, max_batch=8, prefix_caching=True)
    yield e, e.load_base("v000000")
    e.close()


def test_prefix_cached_generation_matches_a_full_forward(cached, tiny_moe_dir):
    engine, base = cached
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=10, seed=7)
    first = _submit_all(engine, base, PROMPTS, sp)  # one group: builds the 12-token entry and uses it
    pc = base.prefix_cache
    assert list(pc.entries) == [tuple(SYSTEM)] and pc.hits == 1
    assert pc.tokens_reused == len(SYSTEM) * (len(PROMPTS) - 1)
    again = [engine.generate_sync(GenRequest(prompt_token_ids=p, sampling=sp, model=base), 60) for p in PROMPTS]
    assert pc.hits == 1 + len(PROMPTS)  # each alone: from the entry
    assert [r.cached_tokens for r in first + again] == [len(SYSTEM)] * (2 * len(PROMPTS))
    for p, r, r2 in zip(PROMPTS, first, again):
        assert r.expert_routes.shape == (len(p) + len(r.completion_token_ids) - 1, 2, 2)
        ref_lp, ref_routes = _reference(tiny_moe_dir, p, r.completion_token_ids)
        np.testing.assert_array_equal(r.expert_routes.astype(np.int64), ref_routes.astype(np.int64))
        np.testing.assert_allclose(r.behavior_logprobs, ref_lp, atol=1e-4, rtol=0)
        assert r2.completion_token_ids == r.completion_token_ids  # same seed, same tokens
        np.testing.assert_allclose(r2.behavior_logprobs, r.behavior_logprobs, atol=1e-4, rtol=0)


def test_greedy_with_and_without_prefix_caching_agree(cached, tiny_moe_dir):
    engine, base = cached
    plain = TorchEngine(tiny_moe_dir, max_batch=8)
    try:
        pbase = plain.load_base("v000000")
        sp = SamplingParams(temperature=0.0, max_tokens=8)
        a = _submit_all(engine, base, PROMPTS, sp)
        b = _submit_all(plain, pbase, PROMPTS, sp)
        assert pbase.prefix_cache is None and {r.cached_tokens for r in b} == {0}
    finally:
        plain.close()
    for x, y in zip(a, b):
        assert x.completion_token_ids == y.completion_token_ids
        np.testing.assert_array_equal(x.expert_routes, y.expert_routes)
        np.testing.assert_allclose(x.behavior_logprobs, y.behavior_logprobs, atol=1e-4, rtol=0)


def test_a_longer_shared_prefix_extends_the_entry_and_unrelated_prompts_skip_it(cached, tiny_moe_dir):
    engine, base = cached
    pc = base.prefix_cache
    longer = SYSTEM + [200, 201, 202, 203, 204, 205, 206, 207, 208, 209]
    prompts = [longer + [1], longer + [2, 3]]
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    _submit_all(engine, base, PROMPTS[:2], sp)  # the 12-token entry exists (built here if this test runs alone)
    built = pc.built
    res = _submit_all(engine, base, prompts, sp)
    assert pc.built == built + 1
    assert tuple(longer) in pc.entries and tuple(SYSTEM) in pc.entries  # built on top of the 12-token one
    for p, r in zip(prompts, res):
        ref_lp, ref_routes = _reference(tiny_moe_dir, p, r.completion_token_ids)
        np.testing.assert_array_equal(r.expert_routes.astype(np.int64), ref_routes.astype(np.int64))
        np.testing.assert_allclose(r.behavior_logprobs, ref_lp, atol=1e-4, rtol=0)
    hits = pc.hits
    other = [[250, 251, 252], [253]]  # nothing shared: prefilled whole
    res = _submit_all(engine, base, other, sp)
    assert pc.hits == hits
    for p, r in zip(other, res):
        ref_lp, _ = _reference(tiny_moe_dir, p, r.completion_token_ids)
        np.testing.assert_allclose(r.behavior_logprobs, ref_lp, atol=1e-4, rtol=0)


def test_metrics_count_prefix_cache_queries_and_hits():
    """The pod's /metrics: prompt tokens looked up and found, per model name."""
    from prometheus_client.parser import text_string_to_metric_families

    from serving.http.metrics import ServingMetrics
    from serving.params import GenResult

    m = ServingMetrics("flywheel", queue_depth=lambda: 0, running=lambda: 0, swap_pause_s=lambda: None)
    for cached in (0, 12, 12):
        m.observe(GenResult(completion_token_ids=[1, 2], behavior_logprobs=[-0.1, -0.2], top_logprobs=[],
                            expert_routes=None, finish_reason="stop", ttft_ms=5.0, latency_ms=9.0,
                            version="v000000", cached_tokens=cached), prompt_len=20)
    got = {s.name: s.value for f in text_string_to_metric_families(m.render()[0].decode()) for s in f.samples
           if s.name.startswith("flywheel_prefix_cache") and s.name.endswith("_total")}
    assert got == {"flywheel_prefix_cache_queries_total": 60.0, "flywheel_prefix_cache_hits_total": 24.0}


def test_prefix_caching_refused_with_vllm():
    from serving.pod import build_pod

    class _Store:
        base_dir = "/nonexistent"

    with pytest.raises(ValueError, match="prefix_caching"):
        build_pod(_Store(), engine="vllm", prefix_caching=True)
