"""The learner trains on any reward policy's output: REINFORCE on the scalar ``reward``
column with the per-prompt leave-one-out baseline, KTO on the policy's sign (``label``,
which the join sets to ``reward > 0``; the learner never re-derives it from the vote counts).

The batch mixes the kinds of feedback a reward policy combines. The rewards below are the
values a join wrote into the ``reward`` column (the policy's mapping is the join's business):

    prompt A: thumb up +1.0, copied +0.5, regenerated -0.5
    prompt B: edited with kept share 0.6 -> +0.2, dissatisfied followup -1.0
    prompt C: one completion whose signals cancel -> 0.0 (label False: 0 is not > 0)

Hand-worked per-prompt leave-one-out baseline b_i = mean reward of the other completions of
the same prompt (RLOO); a prompt with one completion falls back to the leave-one-out mean
over all six rows:

    A: b = [(0.5-0.5)/2, (1-0.5)/2, (1+0.5)/2] = [0, 0.25, 0.75]  -> A_i = [1, 0.25, -1.25]
    B: b = [-1.0, 0.2]                                          -> A_i = [1.2, -1.2]
    C: b = (sum of all 6 = 0.2, minus its own 0) / 5 = 0.04       -> A_i = -0.04
"""

from __future__ import annotations

import math
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from samplestore import shards as writer
from learner.data import InMemorySamples, RefLogprobs, SpilledSamples
from learner.losses import group_loo_baseline
from learner.replay import capture_routes, router_replay, stack_routes
from learner.trainer import LearnerConfig, _loader, _measure_pass, _prompt_baselines, accumulate_step, train
from schemas.events import ExpertRoutes, RewardedSample, SamplingParams
from schemas.modelspec import load_model, token_logprobs

#: (prompt, kind, reward) of the six samples, in batch order
KINDS = [("A", "thumb", 1.0), ("A", "copy", 0.5), ("A", "regenerate", -0.5),
         ("B", "edit", 0.2), ("B", "followup", -1.0), ("C", "mixed", 0.0)]
WANT_BASE = [0.0, 0.25, 0.75, -1.0, 0.2, 0.04]
WANT_ADV = [1.0, 0.25, -1.25, 1.2, -1.2, -0.04]

#: the contract's per-sample component columns (COMMON.md): a shard may carry them or not
COMPONENTS = {"reward_policy": pa.string(), "thumb": pa.float64(), "copied": pa.int32(),
              "regenerated": pa.int32(), "kept_share": pa.float64(), "followup": pa.float64()}


def _sample(model, prompt: list[int], comp: list[int], reward: float, i: int) -> RewardedSample:
    """A sample whose behavior logprobs and routes come from a free batch-1 forward of
    ``model`` (what serving logs); its label is the policy's sign, reward > 0. The vote
    counts say nothing about the reward (no thumbs at all): the learner must not read them."""
    x = torch.tensor([prompt + comp[:-1]])
    cap: list = []
    with torch.no_grad(), capture_routes(model, cap):
        logits = model(input_ids=x, use_cache=False).logits
    C = len(comp)
    lp = token_logprobs(logits, torch.tensor([(prompt + comp)[1:]]))[0, -C:]
    routes = stack_routes(cap, 1, x.shape[1])[0].numpy().astype(np.uint8)
    now = int(time.time() * 1000)
    return RewardedSample(
        completion_id=uuid.UUID(int=i + 1), model_version="v000000", created_at=now, user_hash="u",
        prompt_token_ids=prompt, completion_token_ids=comp, behavior_logprobs=[float(v) for v in lp],
        sampling=SamplingParams(), expert_routes=ExpertRoutes.from_array(routes), finish_reason="stop",
        reward=reward, label=reward > 0, n_votes=1, votes_up=0, votes_down=0,
        event_ids=[str(uuid.UUID(int=1000 + i))], sealed_at=now + i)


@pytest.fixture(scope="module")
def mixed(tiny_moe_dir):
    """The six samples of :data:`KINDS` on the tiny MoE: three prompts, completions of 2-5 tokens."""
    model = load_model(tiny_moe_dir)
    V = model.config.vocab_size
    rng = np.random.default_rng(5)
    prompts = {g: rng.integers(3, V, n).tolist() for g, n in (("A", 5), ("B", 3), ("C", 4))}
    return [_sample(model, prompts[g], rng.integers(3, V, 2 + i % 4).tolist(), r, i)
            for i, (g, _, r) in enumerate(KINDS)]


def test_per_prompt_baseline_and_advantages_by_hand(mixed):
    src = InMemorySamples(mixed)
    assert src.meta.rewards == [r for _, _, r in KINDS]  # the reward column, as written
    assert src.meta.labels == [True, True, False, True, False, False]  # reward > 0; 0 is undesirable
    metrics: dict = {}
    base = _prompt_baselines(src, list(range(6)), metrics)
    assert [base[i] for i in range(6)] == pytest.approx(WANT_BASE, abs=1e-6)
    adv = [r - base[i] for i, (_, _, r) in enumerate(KINDS)]
    assert adv == pytest.approx(WANT_ADV, abs=1e-6)
    assert metrics["pg/prompts"] == 3 and metrics["pg/prompts_repeated"] == 2
    assert metrics["pg/zero_advantage_frac"] == 0.0
    # the same numbers from the loss module with the prompts as keys
    g = group_loo_baseline(torch.tensor([r for _, _, r in KINDS]), [k for k, _, _ in KINDS])
    assert g.tolist() == pytest.approx(WANT_BASE, abs=1e-6)


def _reference_reinforce(model, samples, ref_lp, adv, cap: float, kl_coef: float) -> torch.Tensor:
    """REINFORCE written out per sample, each forwarded alone (no padding), free routing
    (the logged routes are this model's own free routes): token-level TIS weight
    w_t = min(exp(log pi_t - log mu_t), cap) (detached), k3_t = exp(d) - 1 - d with
    d = log pi_ref_t - log pi_t, loss = sum over completion tokens of (-w_t A_i log pi_t +
    kl_coef k3_t) / total completion tokens."""
    num, n_tok = torch.zeros(()), 0
    for s, ref, a in zip(samples, ref_lp, adv):
        full = s.prompt_token_ids + s.completion_token_ids
        C = len(s.completion_token_ids)
        routes = torch.from_numpy(s.expert_routes.to_array().astype("int64")).unsqueeze(0)  # (1, P+C-1, L, k)
        with router_replay(model, routes):
            logits = model(input_ids=torch.tensor([full[:-1]]), use_cache=False).logits[0]  # (P+C-1, V)
        lp_all = logits.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
        lp = lp_all[torch.arange(len(full) - 1), torch.tensor(full[1:])][-C:]  # (C,)
        mu = torch.tensor(s.behavior_logprobs)
        w = torch.exp(lp.detach() - mu).clamp(max=cap)
        d = torch.tensor(ref) - lp
        num = num + (-w * a * lp + kl_coef * (torch.exp(d) - 1 - d)).sum()
        n_tok += C
    return num / n_tok


def test_reinforce_loss_and_gradient_match_a_reference(tiny_moe_dir, mixed, tmp_path):
    """The learner's REINFORCE step (per-prompt baseline, router replay, token TIS, k3 KL)
    on the mixed batch equals :func:`_reference_reinforce`, in loss and in every gradient.
    The weights are moved off the parent after the reference pass, so the importance ratios
    differ from 1 (some truncated at the cap) and the KL term is not 0.
    Tolerance: 1e-5 on the loss, 1e-6 + 1e-4 |g| per gradient element (fp32; the learner pads
    the batch, the reference does not)."""
    model = load_model(tiny_moe_dir)
    src = InMemorySamples(mixed)
    cfg = LearnerConfig(objective="reinforce", baseline="prompt", batch_size=6, kl_coef=0.1, is_cap=1.05,
                        is_level="token")
    idx = list(range(6))
    refs = RefLogprobs(tmp_path / "ref.f32")
    _measure_pass(model, src, idx, "v000000", cfg, model.config.pad_token_id, True, refs)
    ref_lp = [refs.get(i).copy() for i in idx]
    base = _prompt_baselines(src, idx, {})
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 2e-2)
    model.train()
    model.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []

    def backward(loss: torch.Tensor) -> None:
        losses.append(loss.detach())
        loss.backward()

    met, _ = accumulate_step(model, _loader(src, refs, model.config.pad_token_id, True, base), idx, cfg,
                             src.meta.completion_lens, backward)
    got = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    refs.close()
    assert met["pg/adv_mean"] == pytest.approx(sum(WANT_ADV) / 6, abs=1e-6)

    model.zero_grad(set_to_none=True)
    want = _reference_reinforce(model, mixed, ref_lp, WANT_ADV, cap=1.05, kl_coef=0.1)
    want.backward()
    assert float(losses[0]) == pytest.approx(float(want.detach()), abs=1e-5)
    assert met["pg/loss"] == pytest.approx(float(want.detach()), abs=1e-5)
    assert met["pg/kl_k3"] > 0 and met["is/ratio_mean"] != pytest.approx(1.0, abs=1e-3)
    assert got.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        err = (got[n] - p.grad).abs()
        assert bool((err <= 1e-6 + 1e-4 * p.grad.abs()).all()), (n, float(err.max()))
    assert sum(float(g.abs().sum()) for g in got.values()) > 0


def test_kto_splits_desirable_from_undesirable_by_the_policy_sign(tiny_moe_dir, mixed):
    """One DeepSpeed KTO step at lr 0: the policy equals the reference, so r = 0, z0 = 0
    and each sample's loss is lambda/2 of its class; the importance weights are 1 (the
    behavior logprobs are this model's). With lambda_D = 1 and lambda_U = 2 the step's loss
    is (3 x 0.5 + 3 x 1.0) / 6 = 0.75; if reward 0 counted as desirable it would be
    (4 x 0.5 + 2 x 1.0) / 6 = 0.667, and by votes (no thumbs: all undesirable) 1.0."""
    model = load_model(tiny_moe_dir)
    cfg = LearnerConfig(objective="kto", steps=1, batch_size=6, lr=0.0, desirable_weight=1.0,
                        undesirable_weight=2.0)
    state, met = train(model, mixed, "v000000", cfg, model.config.pad_token_id)
    assert state is not None
    assert met["data/n_desirable"] == 3  # thumb, copy, edit
    assert met["kto/loss_first"] == pytest.approx(0.75, abs=1e-4)
    assert met["kto/loss_unweighted_first"] == pytest.approx(0.75, abs=1e-4)


def test_reinforce_cycle_reports_the_hand_worked_advantages(tiny_moe_dir, mixed):
    """The same batch through ``train`` (DeepSpeed, one step over all six): the per-prompt
    baseline's figures and the first step's mean advantage are the hand-worked ones."""
    model = load_model(tiny_moe_dir)
    cfg = LearnerConfig(objective="reinforce", baseline="prompt", steps=1, batch_size=6, lr=0.0)
    state, met = train(model, mixed, "v000000", cfg, model.config.pad_token_id)
    assert state is not None
    assert met["pg/prompts"] == 3 and met["pg/prompts_repeated"] == 2
    assert met["pg/adv_mean_first"] == pytest.approx(sum(WANT_ADV) / 6, abs=1e-6)
    # lr 0, no KL term: the token-mean loss is -sum_i A_i sum_t log pi_t / tokens, by hand
    lp_sum = [sum(s.behavior_logprobs) for s in mixed]
    n_tok = sum(len(s.completion_token_ids) for s in mixed)
    want = -sum(a * s for a, s in zip(WANT_ADV, lp_sum)) / n_tok
    assert met["pg/loss_first"] == pytest.approx(want, abs=1e-4)


def test_psr_trains_on_the_positive_samples_weighted_by_their_reward(tiny_moe_dir, mixed):
    """Positive sample reinforcement (Zhu et al. 2025, arXiv:2506.01347) on the mixed batch:
    only the three samples of reward > 0 (thumb +1.0, copy +0.5, edit +0.2) are kept, the
    zero-reward and negative ones are dropped and counted, and the advantage is the reward
    itself (no baseline). At lr 0 the first step's token-mean loss is
    -(1.0 lp_0 + 0.5 lp_1 + 0.2 lp_3) / (C_0 + C_1 + C_3), lp_i the completion's summed
    behavior logprobs (the model is the one that logged them), and the mean advantage
    (1.0 + 0.5 + 0.2) / 3."""
    model = load_model(tiny_moe_dir)
    cfg = LearnerConfig(objective="psr", steps=1, batch_size=6, lr=0.0)
    state, met = train(model, mixed, "v000000", cfg, model.config.pad_token_id)
    assert state is not None
    assert met["data/n_samples"] == 3 and met["data/dropped_not_positive"] == 3
    assert met["train/batch_size"] == 3  # the batch is cut to the kept samples
    assert met["pg/adv_mean_first"] == pytest.approx((1.0 + 0.5 + 0.2) / 3, abs=1e-6)
    pos = [(0, 1.0), (1, 0.5), (3, 0.2)]
    want = (-sum(r * sum(mixed[i].behavior_logprobs) for i, r in pos)
            / sum(len(mixed[i].completion_token_ids) for i, _ in pos))
    assert met["pg/loss_first"] == pytest.approx(want, abs=1e-4)


def test_psr_skips_a_cycle_with_no_positive_sample(tiny_moe_dir, mixed):
    """A cycle whose samples all have reward <= 0 trains nothing under PSR (min_samples 1)."""
    model = load_model(tiny_moe_dir)
    negatives = [s for s in mixed if s.reward <= 0]
    state, met = train(model, negatives, "v000000", LearnerConfig(objective="psr", steps=1, batch_size=3),
                       model.config.pad_token_id)
    assert state is None and met["data/n_samples"] == 0 and met["data/dropped_not_positive"] == 3
    assert "min_samples" in met["data/skipped_reason"]


def _rewrite(path: Path, fn) -> None:
    t = fn(pq.read_table(path))
    pq.write_table(t, path)


def test_shards_with_and_without_component_columns_read_reward_and_label(mixed, tmp_path):
    """A shard carrying the per-sample component columns and an old shard without them both
    read; the learner's metadata holds the ``reward`` and ``label`` columns as written
    (labels that the vote counts, all 0 here, would never give; ``reward`` is float32 in a shard)."""
    new = writer.write_shard(mixed[:3], writer.shard_path(tmp_path / "s", mixed[0].sealed_at, "new"))
    old = writer.write_shard(mixed[3:], writer.shard_path(tmp_path / "s", mixed[3].sealed_at, "old"))
    comp_vals = {"reward_policy": "0123456789abcdef", "thumb": 1.0, "copied": 1, "regenerated": 1,
                 "kept_share": None, "followup": None}

    def add_components(t: pa.Table) -> pa.Table:
        for name, typ in COMPONENTS.items():
            if name not in t.column_names:
                t = t.append_column(pa.field(name, typ), pa.array([comp_vals[name]] * t.num_rows, typ))
        return t.append_column("a_column_no_reader_knows", pa.array([7] * t.num_rows, pa.int64()))

    def drop_components(t: pa.Table) -> pa.Table:
        return t.drop_columns([c for c in [*COMPONENTS, "scores"] if c in t.column_names])

    _rewrite(new, add_components)
    _rewrite(old, drop_components)
    src = SpilledSamples.from_shards([new, old], tmp_path / "c" / "x.arrow")
    assert src.meta.completion_ids == [str(s.completion_id) for s in mixed]
    assert src.meta.rewards == pytest.approx([r for _, _, r in KINDS], abs=1e-7)  # float32 column
    assert src.meta.labels == [True, True, False, True, False, False]
    got = src.take([0, 5])
    assert [s.reward for s in got] == [1.0, 0.0] and [s.label for s in got] == [True, False]
    assert got[1].expert_routes.to_array().tolist() == mixed[5].expert_routes.to_array().tolist()
    assert math.isclose(sum(got[0].behavior_logprobs), sum(mixed[0].behavior_logprobs), abs_tol=1e-5)
