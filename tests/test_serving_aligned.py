"""Aligned behavior logprobs (issue 5, DESIGN §4): with ``aligned_logprobs`` the torch engine
logs logprobs and routes from one batch-1 scoring forward in the learner's layout, so the
learner's replayed recompute of the logged sample equals them bit for bit; decode-time
numbers from a batched, KV-cached run are only close."""

from __future__ import annotations

import time
import uuid

import pytest

from learner.batch import build_batch
from learner.trainer import measure_start
from schemas.events import ExpertRoutes, RewardedSample, SamplingParams
from schemas.modelspec import load_model
from serving.engine import TorchEngine
from serving.params import GenRequest

PROMPTS = [[5, 17, 300, 41], [9, 8, 7, 6, 5, 4, 3, 99, 100, 101, 102], [250, 251], [11, 12, 13, 14, 15, 16, 17]]


def _run(engine: TorchEngine) -> list:
    lm = engine.load_base()
    engine.pause()  # all four in one left-padded batch
    futs = [engine.submit(GenRequest(prompt_token_ids=p, model=lm,
                                     sampling=SamplingParams(temperature=1.0, max_tokens=8, seed=100 + i)))
            for i, p in enumerate(PROMPTS)]
    time.sleep(0.05)
    engine.resume()
    out = [f.result(timeout=120) for f in futs]
    assert {r.batch_size for r in out} == {4}
    return out


def _samples(results) -> list[RewardedSample]:
    now = int(time.time() * 1000)
    return [RewardedSample(
        completion_id=uuid.uuid4(), model_version="v000000", created_at=now, user_hash="u",
        prompt_token_ids=p, completion_token_ids=r.completion_token_ids, behavior_logprobs=r.behavior_logprobs,
        sampling=SamplingParams(temperature=1.0, max_tokens=8), expert_routes=ExpertRoutes.from_array(r.expert_routes),
        finish_reason=r.finish_reason, reward=1.0, label=True, n_votes=1, votes_up=1, votes_down=0,
        event_ids=[str(uuid.uuid4())], sealed_at=now) for p, r in zip(PROMPTS, results)]


def test_aligned_logprobs_make_the_learner_mismatch_exactly_zero(tiny_moe_dir):
    aligned, default = TorchEngine(tiny_moe_dir, max_batch=4, aligned_logprobs=True), TorchEngine(tiny_moe_dir, max_batch=4)
    try:
        ra, rd = _run(aligned), _run(default)
    finally:
        aligned.close()
        default.close()
    for p, a, d in zip(PROMPTS, ra, rd):
        assert a.completion_token_ids == d.completion_token_ids  # same seeds: sampling is unchanged
        assert a.expert_routes.shape[0] == len(p) + len(a.completion_token_ids) - 1
        # the scoring pass scores the sampled tokens: equal to the decode-time numbers up to
        # matmul-shape rounding (a shifted or wrong token would be off by whole nats)
        assert max(abs(x - y) for x, y in zip(a.behavior_logprobs, d.behavior_logprobs)) < 1e-4
    model = load_model(tiny_moe_dir)
    _, mm = measure_start(model, build_batch(_samples(ra), 0), "v000000", chunk=1, free_max=None)
    assert mm["mismatch/n_tokens"] == sum(len(r.completion_token_ids) for r in ra)
    assert mm["mismatch/max"] == 0.0  # bitwise, replay on: the learner's forward is the logged one
    assert mm["mismatch_free/max"] == 0.0 and mm["routes/flip_frac"] == 0.0
    _, mm_d = measure_start(model, build_batch(_samples(rd), 0), "v000000", chunk=1, free_max=None)
    print(f"decode-time behavior logprobs vs learner: max {mm_d['mismatch/max']:.2e}, aligned: 0")


def test_aligned_logprobs_refused_with_vllm():
    from serving.pod import build_pod

    class _Store:
        base_dir = "/nonexistent"

    with pytest.raises(ValueError, match="aligned_logprobs"):
        build_pod(_Store(), engine="vllm", aligned_logprobs=True)
