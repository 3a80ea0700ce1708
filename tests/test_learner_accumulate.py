"""Cycles not bounded by memory: micro-batch gradient accumulation equals the full batch,
eval samples are refused (the cycle's peak memory against its size: bench/learner_memory.py)."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from samplestore import shards as writer
from learner.data import InMemorySamples, RefLogprobs, SpilledSamples
from learner.trainer import LearnerConfig, _loader, _measure_pass, accumulate_step, train
from learner.losses import loo_baseline
from schemas.events import ExpertRoutes, RewardedSample, SamplingParams, now_ms
from schemas.modelspec import load_model

from test_learner_replay import make_samples  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def grads_after(model, src, cfg, refs, micro: int) -> dict[str, torch.Tensor]:
    """The parameter gradients of one step over every sample of ``src``, accumulated in
    micro-batches of ``micro`` with plain ``loss.backward()`` (no DeepSpeed)."""
    cfg = LearnerConfig(**{**cfg.__dict__, "micro_batch_size": micro})
    idx = list(range(len(src)))
    base = None
    if cfg.objective == "reinforce":
        base = dict(zip(idx, loo_baseline(torch.tensor(src.meta.rewards)).tolist()))
    model.zero_grad(set_to_none=True)
    accumulate_step(model, _loader(src, refs, model.config.pad_token_id, True, base), idx, cfg,
                    src.meta.completion_lens, lambda loss: loss.backward())
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("objective", ["kto", "reinforce"])
def test_accumulated_gradient_equals_full_batch(tiny_moe_dir, tmp_path, objective):
    """Tolerance: |g_micro - g_full| <= 1e-6 + 1e-4 |g_full| per element (fp32; micro-batches
    are padded to their own longest row, and CPU matmuls over other row counts differ in the
    last bits)."""
    model = load_model(tiny_moe_dir)
    samples = make_samples(model, 7, seed=21, p_len=(3, 12), c_len=(2, 9))
    src = InMemorySamples(samples)
    cfg = LearnerConfig(objective=objective, batch_size=7, kl_coef=0.1 if objective == "reinforce" else 0.0)
    refs = RefLogprobs(tmp_path / "ref.f32")
    _measure_pass(model, src, list(range(7)), "v000000", cfg, model.config.pad_token_id, True, refs)
    # move the weights off the reference so KTO's z0 and the KL terms are not trivially 0
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    model.train()
    full = grads_after(model, src, cfg, refs, 0)
    assert sum(float(g.abs().sum()) for g in full.values()) > 0
    assert any(".gate." in n for n in full)  # the router gets gradients under replay
    for micro in (1, 2, 3):
        acc = grads_after(model, src, cfg, refs, micro)
        assert acc.keys() == full.keys()
        for n in full:
            err = (acc[n] - full[n]).abs()
            assert bool((err <= 1e-6 + 1e-4 * full[n].abs()).all()), (micro, n, float(err.max()))
    refs.close()


def test_train_refuses_eval_samples(tiny_moe_dir):
    model = load_model(tiny_moe_dir)
    samples = make_samples(model, 6, seed=22)
    mixed = [s.model_copy(update={"split": "eval"}) if i % 3 == 0 else s for i, s in enumerate(samples)]
    cfg = LearnerConfig(steps=1, batch_size=4, lr=1e-3, micro_batch_size=2)
    state, met = train(load_model(tiny_moe_dir), mixed, "v000000", cfg, model.config.pad_token_id)
    assert state is not None and met["data/dropped_eval_split"] == 2 and met["data/n_samples"] == 4
    assert met["train/grad_accumulation"] == 2 and met["train/micro_batch_size"] == 2
    only_eval = [s.model_copy(update={"split": "eval"}) for s in samples]
    state, met = train(load_model(tiny_moe_dir), only_eval, "v000000", cfg, model.config.pad_token_id)
    assert state is None and met["data/dropped_eval_split"] == 6 and met["data/n_samples"] == 0


def test_spilled_samples_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    samples = _random_samples(rng, 10, 12, now_ms(), layers=2, experts=4)
    p1 = writer.write_shard(samples[:6], writer.shard_path(tmp_path / "s", samples[0].sealed_at))
    p2 = writer.write_shard(samples[4:], writer.shard_path(tmp_path / "s", samples[4].sealed_at))  # 2 dupes
    aside: list = []
    src = SpilledSamples.from_shards([p1, p2], tmp_path / "c" / "x.arrow", keep=lambda s: s.reward > -0.5,
                                     aside=aside)
    want = [s for s in samples if s.reward > -0.5]
    assert len(src) == len(want) and len(aside) == len(samples) - len(want)
    got = src.take([3, 0, len(src) - 1])
    assert [s.completion_id for s in got] == [want[3].completion_id, want[0].completion_id, want[-1].completion_id]
    assert got[0].expert_routes.to_array().tolist() == want[3].expert_routes.to_array().tolist()
    assert src.meta.completion_ids == [str(s.completion_id) for s in want]


def _random_samples(rng, n: int, length: int, t0: int, layers: int, experts: int, vocab: int = 200,
                    version: str = "v000000") -> list[RewardedSample]:
    out = []
    for i in range(n):
        P, C = length // 2, length - length // 2
        out.append(RewardedSample(
            completion_id=uuid.UUID(int=int(rng.integers(1 << 62)) << 64 | i), model_version=version,
            created_at=t0 - 1000, user_hash="u", prompt_token_ids=rng.integers(3, vocab, P).tolist(),
            completion_token_ids=rng.integers(3, vocab, C).tolist(), behavior_logprobs=[-3.0] * C,
            sampling=SamplingParams(), finish_reason="stop",
            expert_routes=ExpertRoutes.from_array(rng.integers(0, experts, (P + C - 1, layers, 2))),
            reward=float(rng.choice([-1.0, 1.0])), label=bool(i % 2), n_votes=1, votes_up=i % 2,
            votes_down=1 - i % 2, event_ids=[str(uuid.uuid4())], sealed_at=t0 + i))
    return out


# The cycle's peak memory against its size is measured by bench/learner_memory.py (a memory
# target is a benchmark's figure, not a timed test).


def test_activation_checkpointing_under_replay_and_bf16(tiny_moe_dir):
    """Through DeepSpeed (ZeRO-2): 2 accumulated micro-batches give the weights of one full
    batch (AdamW's first steps move each weight by ~lr * sign(g), so a wrong accumulation
    would differ by ~lr; allowed: 1 % of lr); recomputing activations in backward (with
    the replay context held open) gives the same fp32 weights bit for bit; bf16 (fp32
    master weights + AdamW state under ZeRO) trains too."""
    model = load_model(tiny_moe_dir)
    samples = make_samples(model, 4, seed=23)
    pad = model.config.pad_token_id
    base = LearnerConfig(steps=2, batch_size=4, micro_batch_size=2, lr=1e-3)
    plain, _ = train(load_model(tiny_moe_dir), samples, "v000000", base, pad)
    whole, _ = train(load_model(tiny_moe_dir), samples, "v000000",
                     LearnerConfig(**{**base.__dict__, "micro_batch_size": 0}), pad)
    assert max(float((plain[k] - whole[k]).abs().max()) for k in plain if plain[k].is_floating_point()) <= 1e-5
    ckpt, _ = train(load_model(tiny_moe_dir), samples, "v000000",
                    LearnerConfig(**{**base.__dict__, "activation_checkpointing": True}), pad)
    assert all(torch.equal(plain[k], ckpt[k]) for k in plain)
    bf, met = train(load_model(tiny_moe_dir), samples, "v000000",
                    LearnerConfig(**{**base.__dict__, "precision": "bf16", "activation_checkpointing": True}), pad)
    parent = load_model(tiny_moe_dir).state_dict()
    assert met["train/precision"] == "bf16" and all(t.dtype == torch.bfloat16 for k, t in bf.items()
                                                    if t.is_floating_point() and "rotary" not in k)
    moved = [k for k in parent if k in bf and not torch.equal(bf[k].float(), parent[k].to(torch.bfloat16).float())]
    assert len(moved) > len(parent) // 2
