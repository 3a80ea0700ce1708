"""Batch layout, router replay and sample refusal on a tiny random MoE (fp32, eager)."""

from __future__ import annotations

import random
import time
import uuid

import numpy as np
import pytest
import torch

from learner.batch import RefusedSample, build_batch, check_sample, filter_samples
from learner.losses import token_logprobs
from learner.replay import capture_routes, router_replay, stack_routes
from learner.trainer import staleness_filter
from schemas.events import ExpertRoutes, RewardedSample, SamplingParams
from schemas.modelspec import load_model, moe_routers


def make_samples(model, n: int, version: str = "v000000", seed: int = 0, p_len=(3, 9), c_len=(2, 7),
                 completion=None) -> list[RewardedSample]:
    """RewardedSamples whose behavior logprobs and routes come from a free forward of ``model``
    on each sample alone (batch 1, no padding), as serving's full-forward would log them.
    Labels alternate desirable / undesirable; ``completion(i, C) -> tokens`` overrides the
    random completion tokens."""
    rng = random.Random(seed)
    V = model.config.vocab_size
    out = []
    for i in range(n):
        P, C = rng.randint(*p_len), rng.randint(*c_len)
        prompt = [rng.randrange(3, V) for _ in range(P)]
        comp = completion(i, C) if completion else [rng.randrange(3, V) for _ in range(C)]
        x = torch.tensor([prompt + comp[:-1]])
        cap: list = []
        with torch.no_grad(), capture_routes(model, cap):
            logits = model(input_ids=x, use_cache=False).logits
        lp = token_logprobs(logits, torch.tensor([(prompt + comp)[1:]]))[0, -C:]
        routes = stack_routes(cap, 1, x.shape[1])[0].numpy().astype(np.uint8) if cap else None
        now = int(time.time() * 1000)
        out.append(RewardedSample(
            completion_id=uuid.UUID(int=rng.getrandbits(128)), model_version=version, created_at=now,
            user_hash="u", prompt_token_ids=prompt, completion_token_ids=comp,
            behavior_logprobs=[float(v) for v in lp], sampling=SamplingParams(),
            expert_routes=ExpertRoutes.from_array(routes) if routes is not None else None,
            finish_reason="stop", reward=1.0 if i % 2 == 0 else -1.0, label=i % 2 == 0, n_votes=1,
            votes_up=int(i % 2 == 0), votes_down=int(i % 2 == 1), event_ids=[str(uuid.uuid4())],
            sealed_at=now + i))
    return out


@pytest.fixture(scope="module")
def model(tiny_moe_dir):
    return load_model(tiny_moe_dir)


def test_build_batch_layout_by_hand():
    s = [RewardedSample(completion_id=uuid.uuid4(), model_version="v000001", created_at=10**12, user_hash="u",
                        prompt_token_ids=p, completion_token_ids=c, behavior_logprobs=b,
                        sampling=SamplingParams(), expert_routes=ExpertRoutes.from_array(r),
                        finish_reason="stop", reward=rw, label=rw > 0, n_votes=1, votes_up=1, votes_down=0,
                        event_ids=["e"], sealed_at=10**12)
         for p, c, b, r, rw in [([5, 6, 7], [8, 9], [-0.5, -0.25], np.arange(16).reshape(4, 2, 2) % 4, 1.0),
                                ([5], [8], [-1.0], np.full((1, 2, 2), 3), -1.0)]]
    b = build_batch(s, pad_id=0)
    # inputs: [5,6,7,8] and [5] -> T = 4, left padded
    assert b.input_ids.tolist() == [[5, 6, 7, 8], [0, 0, 0, 5]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1], [0, 0, 0, 1]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3], [0, 0, 0, 0]]
    assert b.target_ids.tolist() == [[6, 7, 8, 9], [0, 0, 0, 8]]
    assert b.completion_mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    assert b.behavior_logprobs.tolist() == [[0, 0, -0.5, -0.25], [0, 0, 0, -1.0]]
    assert b.routes.shape == (2, 4, 2, 2)
    assert b.routes[0].tolist() == (np.arange(16).reshape(4, 2, 2) % 4).tolist()
    assert b.routes[1, 3].tolist() == [[3, 3], [3, 3]] and b.routes[1, :3].abs().sum() == 0
    assert b.labels.tolist() == [True, False] and b.rewards.tolist() == [1.0, -1.0]


def _batch(model, n=4, seed=1):
    return build_batch(make_samples(model, n, seed=seed), pad_id=model.config.pad_token_id)


def test_replay_of_free_routes_is_bitwise_identical(model):
    b = _batch(model)
    with torch.no_grad():
        cap: list = []
        with capture_routes(model, cap):
            free = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
        routes = stack_routes(cap, *b.input_ids.shape)
        with router_replay(model, routes):
            rep = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
    assert torch.equal(free, rep)
    # the logged (batch-1, unpadded) routes agree with the padded batch's free routes on real tokens
    real = b.attention_mask.bool()
    assert torch.equal(b.routes[real], routes[real])
    # routers are restored after the block
    assert all("forward" not in r.__dict__ for r in moe_routers(model))


def test_forced_routes_change_outputs_and_router_learns(model):
    b = _batch(model)
    E = moe_routers(model)[0].num_experts
    other = (b.routes + 1) % E  # a different, still valid expert set for every token/layer
    model.zero_grad()
    with torch.no_grad(), router_replay(model, b.routes):
        base = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
    with router_replay(model, other):
        out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
    real = b.attention_mask.bool()
    assert (out[real] - base[real]).abs().max() > 1e-4
    (token_logprobs(out, b.target_ids) * b.completion_mask).sum().backward()
    for r in moe_routers(model):
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_replay_rejects_bad_routes(model):
    b = _batch(model, n=2)
    E = moe_routers(model)[0].num_experts
    with pytest.raises(ValueError, match="1 layers logged, model has 2"):
        with router_replay(model, b.routes[:, :, :1]):
            pass
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 4\)"):
        with router_replay(model, b.routes + E):
            pass
    with pytest.raises(ValueError, match="token rows"):
        with torch.no_grad(), router_replay(model, b.routes[:, 1:]):
            model(input_ids=b.input_ids, attention_mask=b.attention_mask)


def test_refused_samples_are_counted(model):
    good = make_samples(model, 3, seed=2)
    no_routes = good[0].model_copy(update={"expert_routes": None})
    short = good[1].model_copy(update={"expert_routes": ExpertRoutes.from_array(
        good[1].expert_routes.to_array()[1:])})
    with pytest.raises(RefusedSample, match="expert_routes: absent") as e:
        check_sample(no_routes, 2, 2, 4)
    assert e.value.reason == "routes_missing"
    with pytest.raises(RefusedSample, match="prompt\\+completion-1"):
        check_sample(short, 2, 2, 4)
    keep, refused = filter_samples([no_routes, short, good[2]], 2, 2, 4)
    assert keep == [good[2]] and refused == {"routes_missing": 1, "routes_misaligned": 1}
    keep, refused = filter_samples([no_routes, good[2]], 2, 2, 4, allow_free_routing=True)
    assert len(keep) == 2 and not refused


def test_staleness_filter_counts():
    base = dict(created_at=10**12, user_hash="u", prompt_token_ids=[1], completion_token_ids=[2],
                behavior_logprobs=[-1.0], sampling=SamplingParams(), finish_reason="stop", reward=1.0,
                label=True, n_votes=1, votes_up=1, votes_down=0, event_ids=["e"], sealed_at=10**12)
    vs = ["v000010", "v000006", "v000005", "v000011", "latest"]
    ss = [RewardedSample(completion_id=uuid.uuid4(), model_version=v, **base) for v in vs]
    keep, dropped = staleness_filter(ss, "v000010", max_staleness=4)
    assert [s.model_version for s in keep] == ["v000010", "v000006", "v000011"]
    assert dropped == {"stale": 1, "bad_version": 1, "newer_than_parent": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_start_mismatch_exactly_zero_and_detects_wrong_routes(tiny_moe_dir, dtype):
    """Issue 5: with replay (fp32, and bf16 with eager attention) the recomputed logprobs equal
    the logged ones bit for bit; logged routes that differ from the model's are caught as
    route flips and a nonzero mismatch."""
    from learner.trainer import measure_start

    m = load_model(tiny_moe_dir, dtype=dtype)
    b = build_batch(make_samples(m, 6, seed=8), pad_id=m.config.pad_token_id)
    ref, met = measure_start(m, b, "v000000")
    assert met["mismatch/max"] == 0.0 and met["mismatch_free/max"] == 0.0 and met["routes/flip_frac"] == 0.0
    assert met["mismatch/n_tokens"] == int(b.completion_mask.sum())
    assert torch.equal(ref * b.completion_mask, b.behavior_logprobs)
    E = moe_routers(m)[0].num_experts
    b.routes = (b.routes + 1) % E  # every logged top-2 set now differs from the model's own
    _, bad = measure_start(m, b, "v000000")
    assert bad["routes/flip_frac"] == 1.0
    assert bad["mismatch/max"] > 1e-3 and bad["mismatch_free/max"] == 0.0
