"""One real DeepSpeed learner cycle end to end: Parquet shards -> DuckDB -> KTO with router
replay (ZeRO-2, gloo, fp32, CPU) -> a new version in the real model store; then the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.batch import build_batch
from learner.cycle import load_state, read_samples, run_cycle
from learner.losses import sequence_logprobs
from learner.trainer import LearnerConfig, forward_token_logprobs
from samplestore import shards as writer
from schemas.modelspec import load_model

try:
    from modelstore.store import ModelStore
except ImportError:  # pragma: no cover - the store is another engineer's package
    ModelStore = None

from test_learner_replay import make_samples  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def write_shard(samples_dir: Path, samples, version: str, name: str) -> Path:
    assert {s.model_version for s in samples} == {version}
    return writer.write_shard(samples, writer.shard_path(samples_dir, min(s.sealed_at for s in samples), name))


def seq_logps(model, samples, pad_id):
    b = build_batch(samples, pad_id)
    with torch.no_grad():
        return sequence_logprobs(forward_token_logprobs(model, b), b.completion_mask)


@pytest.mark.skipif(ModelStore is None, reason="modelstore.store not importable")
def test_cycle_end_to_end(tiny_moe_dir, tmp_path):
    store = ModelStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)  # v000000
    model = load_model(store.base_dir)
    pad = model.config.pad_token_id
    samples = make_samples(model, 8, version="v000000", seed=3)
    samples_dir = tmp_path / "samples"
    write_shard(samples_dir, samples[:5], "v000000", "a")
    write_shard(samples_dir, samples[5:], "v000000", "b")
    stale = make_samples(model, 2, version="v000000", seed=9)  # seeds differ -> other ids

    assert len(read_samples(samples_dir)) == 8
    before = seq_logps(model, samples, pad)

    cfg = LearnerConfig(steps=4, batch_size=8, lr=1e-3, beta=0.1, seed=0)
    m = run_cycle(tmp_path / "store", samples_dir, tmp_path / "state", cfg, show_progress=False)
    assert m is not None and m.version == "v000001" and m.parent == "v000000" and m.kind == "delta"
    met = m.metrics
    # aligned numerics: fp32 eager, replayed routes, same forward as the one that logged -> exactly 0
    assert met["mismatch/n_tokens"] == sum(len(s.completion_token_ids) for s in samples)
    assert met["mismatch/max"] == 0.0 and met["mismatch/mean"] == 0.0
    assert met["routes/flip_frac"] == 0.0 and met["mismatch_free/max"] == 0.0
    # step 1 runs on the parent weights, but as one padded batch of 8: CPU fp32 matmuls over a
    # different row count differ in the last bits (measured <= ~1e-6 per token), so the
    # importance ratio and KL are 1 and 0 to 1e-5, not bitwise
    assert abs(met["is/ratio_mean_first"] - 1.0) < 1e-5 and abs(met["kl/k1_first"]) < 1e-5
    for key in ("kto/loss", "kto/loss_first", "is/ratio_mean", "mismatch/p99", "data/n_samples",
                "perf/tokens_per_s", "kl/k3"):
        assert key in met, key
    assert met["data/n_samples"] == 8 and met["perf/tokens_per_s"] > 0

    # the store reconstructs the learner's weights; they changed; the policy moved toward desirable
    new = store.load("v000001")
    old = store.load("v000000")
    changed = [k for k in new if not torch.equal(new[k], old[k])]
    assert any(".gate." in k for k in changed)  # the router learned under replay
    assert len(changed) > len(new) // 2
    model.load_state_dict(new, strict=False)
    after = seq_logps(model, samples, pad)
    des = torch.tensor([s.label for s in samples])
    assert (after - before)[des].mean() > 0 > (after - before)[~des].mean()

    # shards are consumed once: the state holds the watermark and the shard names, no sample ids
    st = load_state(tmp_path / "state")
    assert sorted(st["consumed"]) == sorted("/".join(p.parts[-3:]) for p in samples_dir.rglob("*.parquet"))
    assert st["watermark_ms"] == max(writer.shard_time(p) for p in samples_dir.rglob("*.parquet"))
    assert "trained" not in st and st["cycles"][-1]["version"] == "v000001"
    assert run_cycle(tmp_path / "store", samples_dir, tmp_path / "state", cfg, show_progress=False) is None

    # the CLI as a subprocess: new samples from v000001 plus two stale ones; trains from latest
    model.load_state_dict(new, strict=False)
    fresh = make_samples(model, 4, version="v000001", seed=4)
    write_shard(samples_dir, fresh, "v000001", "c")
    store.init_base  # noqa: B018 - store stays as it is
    env = {**os.environ, "FLYWHEEL_HOME": str(tmp_path / "home")}
    env.pop("MASTER_PORT", None)
    # stale: produced by v000000, parent v000001, --max-staleness 0 -> dropped and counted
    write_shard(samples_dir, stale, "v000000", "d")
    r = subprocess.run([sys.executable, "-m", "flywheel.cli", "learn", "--once", "--store", str(tmp_path / "store"),
                        "--samples", str(samples_dir), "--state", str(tmp_path / "state"), "--steps", "2",
                        "--lr", "1e-4", "--max-staleness", "0", "--parent", "latest", "--micro-batch-size", "2",
                        "--gate-problems", "0,23", "--gate-samples", "1", "--gate-max-tokens", "8"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "published v000002" in r.stdout
    m2 = store.manifest("v000002")
    # the HumanEval gate ran on parent and candidate: 2 held-out prompts x 1 completion each
    # (the tiny random model passes none: 0 >= 0 - max_regression, published)
    assert m2.eval["parent"]["n"] == m2.eval["candidate"]["n"] == 2 and m2.eval["passed"] is True
    bad = subprocess.run([sys.executable, "-m", "flywheel.cli", "learn", "--once", "--store", str(tmp_path / "store"),
                          "--samples", str(samples_dir), "--state", str(tmp_path / "state"), "--gate-problems", "170"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--gate-problems" in bad.stderr and "0..163" in bad.stderr
    assert m2.parent == "v000001"
    assert m2.metrics["data/n_samples"] == 4 and m2.metrics["data/dropped_stale"] == 2
    assert m2.metrics["train/micro_batch_size"] == 2 and m2.metrics["train/grad_accumulation"] == 2
    # micro-batches of 2 recompute samples that were scored 4 at a time: other matmul shapes, so
    # the last bits may differ (seen: 4.8e-7 = 2^-21 under load); exact 0 needs the same layout
    # (asserted above, test_serving_aligned.py)
    assert m2.metrics["mismatch/max"] <= 1e-5


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="lr: must be >= 0"):
        LearnerConfig(lr=-1)
    with pytest.raises(ValueError, match="is_level: KTO"):
        LearnerConfig(is_level="token")
    with pytest.raises(ValueError, match="zero_stage"):
        LearnerConfig(zero_stage=3)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_lr0_200_passes_ratio_exactly_one_with_top_p(tiny_moe_dir):
    """Issue 5: at zero weight change the importance ratio is exactly 1 even for samples
    served with top_p < 1 (behavior logprobs are raw), and 200 passes keep mismatch flat."""
    from learner.trainer import train
    from schemas.events import SamplingParams

    model = load_model(tiny_moe_dir)
    samples = [s.model_copy(update={"sampling": SamplingParams(top_p=0.5, temperature=0.7)})
               for s in make_samples(model, 4, version="v000003", seed=5)]
    before = _state(model)
    ratios, kls = [], []
    cfg = LearnerConfig(steps=200, batch_size=1, lr=0.0, seed=1)
    state, met = train(model, samples, "v000003", cfg, model.config.pad_token_id,
                       progress=lambda step, m: (ratios.append(m["is/ratio_mean"]), kls.append(m["kl/k1"])))
    assert len(ratios) == 200
    assert set(ratios) == {1.0} and set(kls) == {0.0}  # bitwise: batch-1 train forward == logged forward
    assert met["mismatch/max"] == 0.0
    assert all(torch.equal(state[k], before[k]) for k in before)


def test_reinforce_zero1_free_routing(tiny_moe_dir):
    """REINFORCE + LOO baseline + TIS (token level) + KL penalty on ZeRO-1, router replay off:
    weights move; route-flip fraction and free-routing mismatch are reported."""
    from learner.trainer import train

    model = load_model(tiny_moe_dir)
    samples = make_samples(model, 6, version="v000000", seed=6)
    before = _state(model)
    cfg = LearnerConfig(objective="reinforce", is_level="token", kl_coef=0.1, zero_stage=1, steps=2,
                        batch_size=6, lr=1e-3, router_replay=False)
    state, met = train(model, samples, "v000000", cfg, model.config.pad_token_id)
    assert met["data/n_samples"] == 6
    assert "pg/loss" in met and "pg/kl_k3" in met and met["train/steps"] == 2
    assert met["routes/flip_frac"] == 0.0 and met["mismatch_free/max"] == 0.0  # same forward as logged
    assert any(not torch.equal(state[k], before[k]) for k in before)
    # with replay on, a sample without routes is refused and counted, never trained on free routing
    samples[0] = samples[0].model_copy(update={"expert_routes": None})
    model2 = load_model(tiny_moe_dir)
    _, met2 = train(model2, samples, "v000000", LearnerConfig(steps=1, lr=0.0), model2.config.pad_token_id)
    assert met2["data/dropped_routes_missing"] == 1 and met2["data/n_samples"] == 5


def test_reinforce_prompt_baseline_learns_nothing_from_prompts_with_one_verdict(tiny_moe_dir):
    """Per-prompt LOO (RLOO): two prompts, three completions each, every completion of a prompt
    with the same vote -> every advantage is 0 and (no KL term) the weights are bit-identical;
    the batch baseline on the same data moves them."""
    import uuid

    from learner.trainer import train

    model = load_model(tiny_moe_dir)
    a, b = make_samples(model, 2, seed=11)
    samples = [s.model_copy(update={"completion_id": uuid.uuid4(), "reward": r, "label": r > 0})
               for s, r in ((a, 1.0), (a, 1.0), (a, 1.0), (b, -1.0), (b, -1.0), (b, -1.0))]
    before = _state(model)
    cfg = LearnerConfig(objective="reinforce", baseline="prompt", steps=2, batch_size=6, lr=1e-2)
    state, met = train(model, samples, "v000000", cfg, model.config.pad_token_id)
    assert met["pg/prompts"] == 2 and met["pg/prompts_repeated"] == 2
    assert met["pg/zero_advantage_frac"] == 1.0 and met["pg/adv_mean"] == 0.0
    assert all(torch.equal(state[k], before[k]) for k in before)
    model2 = load_model(tiny_moe_dir)
    state2, met2 = train(model2, samples, "v000000", LearnerConfig(objective="reinforce", steps=2, batch_size=6,
                                                                    lr=1e-2), model2.config.pad_token_id)
    assert "pg/prompts" not in met2
    assert any(not torch.equal(state2[k], before[k]) for k in before)
    with pytest.raises(ValueError, match="baseline"):
        LearnerConfig(baseline="group")
    with pytest.raises(ValueError, match="baseline"):  # KTO has no baseline: never silently ignored
        LearnerConfig(objective="kto", baseline="prompt")


@pytest.mark.skipif(ModelStore is None, reason="modelstore.store not importable")
def test_sigkill_mid_cycle_resumes_to_same_hashes(tiny_moe_dir, tmp_path):
    """Issue 5: a learner killed with SIGKILL mid-cycle resumes from its DeepSpeed checkpoint
    and publishes a version whose tensor hashes equal an uninterrupted run's (same seed)."""
    model = load_model(tiny_moe_dir)
    samples = make_samples(model, 6, version="v000000", seed=7)
    for run in ("a", "b"):
        ModelStore(tmp_path / run / "store").init_base(tiny_moe_dir)
        write_shard(tmp_path / run / "samples", samples, "v000000", "x")
    args = ["--steps", "5", "--batch-size", "4", "--lr", "1e-3", "--checkpoint-every", "1", "--seed", "3"]

    def learn(run: str, extra_env: dict) -> subprocess.CompletedProcess:
        env = {**os.environ, "FLYWHEEL_HOME": str(tmp_path / run / "home"), **extra_env}
        env.pop("MASTER_PORT", None)
        return subprocess.run([sys.executable, "-m", "flywheel.cli", "learn", "--once",
                               "--store", str(tmp_path / run / "store"), "--samples", str(tmp_path / run / "samples"),
                               "--state", str(tmp_path / run / "state"), *args],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=240)

    r = learn("a", {"FLYWHEEL_LEARN_SIGKILL_AFTER_STEP": "3"})
    assert r.returncode == -9, r.stderr[-2000:]
    assert json.loads((tmp_path / "a" / "state" / "ckpt" / "meta.json").read_text())["step"] == 3
    assert ModelStore(tmp_path / "a" / "store").versions() == ["v000000"]  # nothing published
    r = learn("a", {})
    assert r.returncode == 0, r.stderr[-2000:]
    resumed = ModelStore(tmp_path / "a" / "store").manifest("v000001")
    assert resumed.metrics["train/resumed_from_step"] == 3
    assert not (tmp_path / "a" / "state" / "ckpt").exists()

    r = learn("b", {})
    assert r.returncode == 0, r.stderr[-2000:]
    straight = ModelStore(tmp_path / "b" / "store").manifest("v000001")
    assert straight.metrics["train/resumed_from_step"] == 0
    assert {k: t.sha256 for k, t in resumed.tensors.items()} == {k: t.sha256 for k, t in straight.tensors.items()}
    base = ModelStore(tmp_path / "b" / "store").manifest("v000000")
    assert straight.weights_digest != base.weights_digest


@pytest.mark.skipif(ModelStore is None, reason="modelstore.store not importable")
def test_eval_gate_publishes_improvement_and_rejects_regression(tiny_moe_dir, tmp_path):
    """Desirable completions repeat token 40, undesirable ones token 41. Training on them
    raises the held-out preference margin (published, eval in the manifest); judged against a
    holdout whose labels say the opposite, the same update is a regression and is rejected."""
    from learner.gate import preference_margin_evaluator

    model = load_model(tiny_moe_dir)
    pattern = lambda i, C: [40 if i % 2 == 0 else 41] * C  # noqa: E731
    samples = make_samples(model, 24, version="v000000", seed=11, completion=pattern)
    cfg = LearnerConfig(steps=6, batch_size=8, lr=3e-3, holdout_frac=0.3, max_regression=0.0)
    for run in ("good", "bad"):
        ModelStore(tmp_path / run / "store").init_base(tiny_moe_dir)
        write_shard(tmp_path / run / "samples", samples, "v000000", "x")

    m = run_cycle(tmp_path / "good" / "store", tmp_path / "good" / "samples", tmp_path / "good" / "state", cfg,
                  show_progress=False)
    assert m is not None and m.eval["passed"] is True
    assert m.eval["candidate"]["score"] > m.eval["parent"]["score"]
    assert m.metrics["data/n_samples"] + m.eval["parent"]["n"] == 24

    flipped = [s.model_copy(update={"label": not s.label}) for s in samples[:6]]
    bad = run_cycle(tmp_path / "bad" / "store", tmp_path / "bad" / "samples", tmp_path / "bad" / "state", cfg,
                    show_progress=False, evaluate=preference_margin_evaluator(flipped, model.config.pad_token_id))
    assert bad is None
    assert ModelStore(tmp_path / "bad" / "store").versions() == ["v000000"]
    last = load_state(tmp_path / "bad" / "state")["cycles"][-1]
    assert last["version"] is None and last["rejected"].startswith("eval score")
    assert last["eval"]["candidate"]["score"] < last["eval"]["parent"]["score"]


@pytest.mark.skipif(ModelStore is None, reason="modelstore.store not importable")
def test_daemon_triggers_on_new_samples(tiny_moe_dir, tmp_path):
    """``flywheel learn`` without --once waits until --every-n new samples are sealed."""
    import time

    ModelStore(tmp_path / "store").init_base(tiny_moe_dir)
    model = load_model(tiny_moe_dir)
    samples = make_samples(model, 4, version="v000000", seed=12)
    write_shard(tmp_path / "samples", samples[:2], "v000000", "a")
    env = {**os.environ, "FLYWHEEL_HOME": str(tmp_path / "home")}
    env.pop("MASTER_PORT", None)
    p = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "learn", "--store", str(tmp_path / "store"),
                          "--samples", str(tmp_path / "samples"), "--state", str(tmp_path / "state"),
                          "--every-n", "4", "--every-h", "10", "--poll-s", "0.3", "--steps", "1"],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(5)  # 2 new samples < every_n: no cycle
        assert ModelStore(tmp_path / "store").versions() == ["v000000"] and p.poll() is None
        write_shard(tmp_path / "samples", samples[2:], "v000000", "b")
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and ModelStore(tmp_path / "store").versions() == ["v000000"]:
            time.sleep(0.5)
        assert ModelStore(tmp_path / "store").versions() == ["v000000", "v000001"]
        assert ModelStore(tmp_path / "store").manifest("v000001").metrics["data/n_samples"] == 4
    finally:
        p.kill()
        p.wait(timeout=10)


def test_config_documents_every_field():
    """Each setting's help is its Field description (shown by `flywheel learn --help`)."""
    from learner.daemon import DaemonConfig
    from schemas.options import model_fields

    for model in (LearnerConfig, DaemonConfig):
        missing = [name for name, info in model_fields(model).items() if not (info.description or "").strip()]
        assert not missing, f"{model.__name__} fields without a description: {missing}"


@pytest.mark.skipif(ModelStore is None, reason="modelstore.store not importable")
def test_two_processes_torchrun_match_one(tiny_moe_dir, tmp_path):
    """ZeRO-2 on two gloo ranks (torchrun) trains the same update as one process: each rank
    takes half of every global batch, gradients are averaged, KTO's z0 is all-reduced."""
    model = load_model(tiny_moe_dir)
    samples = make_samples(model, 8, version="v000000", seed=13)
    for run in ("one", "two"):
        ModelStore(tmp_path / run / "store").init_base(tiny_moe_dir)
        write_shard(tmp_path / run / "samples", samples, "v000000", "x")
    env = {**os.environ, "FLYWHEEL_HOME": str(tmp_path / "home")}
    for k in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)

    def args(run):
        return ["learn", "--once", "--store", str(tmp_path / run / "store"), "--samples", str(tmp_path / run / "samples"),
                "--state", str(tmp_path / run / "state"), "--steps", "3", "--lr", "1e-3", "--batch-size", "8"]

    torchrun = Path(sys.executable).parent / "torchrun"
    r2 = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", str(_port()), "-m", "flywheel.cli",
                         *args("two")], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert r2.stdout.count("published v000001") == 1  # rank 0 publishes, rank 1 does not
    r1 = subprocess.run([sys.executable, "-m", "flywheel.cli", *args("one")], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=240)
    assert r1.returncode == 0, r1.stderr[-3000:]
    base = ModelStore(tmp_path / "one" / "store").load("v000000")
    one = ModelStore(tmp_path / "one" / "store").load("v000001")
    two = ModelStore(tmp_path / "two" / "store").load("v000001")
    d1 = torch.cat([(one[k] - base[k]).flatten() for k in base])
    d2 = torch.cat([(two[k] - base[k]).flatten() for k in base])
    # same update up to float summation order (gloo all-reduce, OMP_NUM_THREADS=1 under torchrun)
    assert d1.abs().max() > 1e-3
    assert (d1 - d2).abs().max() < 1e-5
    m1 = ModelStore(tmp_path / "one" / "store").manifest("v000001").metrics
    m2 = ModelStore(tmp_path / "two" / "store").manifest("v000001").metrics
    assert m2["kto/loss"] == pytest.approx(m1["kto/loss"], abs=1e-4)


def _port() -> int:
    from schemas.settings import free_port

    return free_port()


def test_balance_classes_weights_the_minority_class(tiny_moe_dir):
    """KTO λ_D, λ_U with --balance-classes: 1 desirable vs 3 undesirable -> λ_D = 3, λ_U = 1
    (λ_D·n_D = λ_U·n_U). At lr 0 the policy is the reference, so r = 0 and z0 = 0 and each
    sample's loss is λ/2 (1 − σ(0) = 1/2): batch mean (3·1 + 1·3) / 2 / 4 = 0.75, vs
    (1 + 3) / 2 / 4 = 0.5 unbalanced."""
    from learner.trainer import train

    losses = {}
    for balance in (False, True):
        model = load_model(tiny_moe_dir)
        samples = [s.model_copy(update={"label": i == 0, "reward": 1.0 if i == 0 else -1.0})
                   for i, s in enumerate(make_samples(model, 4, version="v000000", seed=9))]
        cfg = LearnerConfig(steps=1, batch_size=4, lr=0.0, balance_classes=balance)
        seen = []
        _, met = train(model, samples, "v000000", cfg, model.config.pad_token_id,
                       progress=lambda step, m: seen.append(m))
        losses[balance] = seen[0]["kto/loss"]
        assert seen[0]["is/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # padded batch of 4: ~1e-7
        assert (met["kto/desirable_weight"], met["kto/undesirable_weight"]) == ((3.0, 1.0) if balance else (1.0, 1.0))
    assert losses[False] == pytest.approx(0.5, abs=1e-6)
    assert losses[True] == pytest.approx(0.75, abs=1e-6)


@pytest.mark.skipif(ModelStore is None, reason="modelstore.store not importable")
def test_generation_gate_scores_held_out_prompts_like_a_user(tiny_moe_dir, tmp_path):
    """The gate samples completions on held-out prompts and lets a user judge them. Users who
    like token 40 (the desirable samples repeat it): the trained candidate writes 40 more
    often than the parent, so it is published with both pass rates in the manifest; users
    who dislike token 40 see a regression and the candidate is not published."""
    from learner.gate import generation_evaluator

    model = load_model(tiny_moe_dir)
    pattern = lambda i, C: [40 if i % 2 == 0 else 41] * C  # noqa: E731
    samples = make_samples(model, 24, version="v000000", seed=11, completion=pattern)
    held_out = [s.prompt_token_ids for s in make_samples(model, 4, version="v000000", seed=99)]
    cfg = LearnerConfig(steps=8, batch_size=8, lr=1e-2, max_regression=0.0)
    eos = model.config.eos_token_id
    results = {}
    for likes_40 in (True, False):
        root = tmp_path / str(likes_40)
        ModelStore(root / "store").init_base(tiny_moe_dir)
        write_shard(root / "samples", samples, "v000000", "x")
        ev = generation_evaluator(held_out, lambda i, comp, w=likes_40: (comp.count(40) >= len(comp) / 2) == w, eos,
                                  max_tokens=6, samples_per_prompt=4, seed=3)
        results[likes_40] = run_cycle(root / "store", root / "samples", root / "state", cfg, show_progress=False,
                                   evaluate=ev)
    good = results[True]
    assert good is not None and good.eval["passed"] is True
    assert good.eval["parent"]["n"] == good.eval["candidate"]["n"] == 16
    assert good.eval["candidate"]["score"] > good.eval["parent"]["score"]
    assert results[False] is None
    assert ModelStore(tmp_path / "False" / "store").versions() == ["v000000"]
    last = load_state(tmp_path / "False" / "state")["cycles"][-1]
    assert last["rejected"].startswith("eval score")
    assert last["eval"]["candidate"]["score"] < last["eval"]["parent"]["score"]
    with pytest.raises(ValueError, match="prompts"):
        generation_evaluator([], lambda i, c: True, eos, max_tokens=4, samples_per_prompt=1, seed=0)


@pytest.mark.skipif(ModelStore is None, reason="modelstore.store not importable")
def test_parent_of_a_delta_chain_loads_and_publishes_without_extra_copies(tiny_moe_dir, tmp_path):
    """A cycle's parent that is a delta on its own parent (v000002 -> v000001 -> v000000):
    the model's parameters ARE the reconstructed tensors (no second copy, nothing from the
    base checkpoint's weights), equal to the version's; neither loading it nor publishing on
    it leaves a reconstructed version in the store's cache (each cached state is one more
    model's memory held for the rest of the cycle)."""
    from learner.cycle import _load_parent

    class RecordingStore(ModelStore):
        """The real store, remembering what each load returned."""

        loads: list = []

        def load(self, version, **kw):
            out = super().load(version, **kw)
            self.loads.append((version, kw, out))
            return out

    store = RecordingStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)
    state = store.load("v000000")
    for v in ("v000000", "v000001"):
        state = {k: t + 0.01 if ".layers.1." in k else t for k, t in state.items()}
        store.publish(state, parent=v)
    assert store.manifest("v000002").kind == "delta" and store.manifest("v000001").kind == "delta"
    store.clear_cache()
    store.loads.clear()
    model, dtypes = _load_parent(store, "v000002")
    assert not store._cache  # noqa: SLF001 - the cache is what held the extra copies
    [(version, kw, loaded)] = store.loads
    assert version == "v000002" and kw == {"cache": False}
    params = dict(model.named_parameters())
    assert len(params) >= len(loaded) - 1  # every tensor but a tied lm_head is a parameter
    assert all(params[k].data_ptr() == t.data_ptr() for k, t in loaded.items() if k in params)  # no copy
    want = store.load("v000002", cache=False)
    got = model.state_dict()
    assert set(dtypes) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(p.device.type == "cpu" for p in model.parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".layers.1." in n:
                p.add_(0.01)
    m = store.publish({k: t.detach() for k, t in model.state_dict().items() if k in dtypes}, parent="v000002")
    assert m.kind == "delta" and not store._cache  # noqa: SLF001
    assert all(torch.equal(store.load("v000003", cache=False)[k], t) for k, t in model.state_dict().items()
               if k in dtypes)


def test_a_candidate_with_nonfinite_weights_is_recorded_rejected_and_never_stored(tiny_moe_dir, tmp_path,
                                                                                   monkeypatch):
    """A diverged cycle (here: training returns a NaN and an infinity; the training is what is
    faked, the publishing is under test) publishes nothing; the cycle's record says which
    tensors; the store refuses such weights by itself too."""
    import learner.cycle as cycle_mod

    store = ModelStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)
    model = load_model(store.base_dir)
    samples_dir = tmp_path / "samples"
    write_shard(samples_dir, make_samples(model, 8, version="v000000", seed=3), "v000000", "a")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.norm.weight"][[1, 2]] = float("nan")
    state["model.layers.0.input_layernorm.weight"][5] = float("inf")
    monkeypatch.setattr(cycle_mod, "train", lambda *a, **k: (dict(state), {"data/n_samples": 8}))
    cfg = LearnerConfig(steps=1, batch_size=8, lr=1e-3, seed=0)
    assert run_cycle(tmp_path / "store", samples_dir, tmp_path / "state", cfg, show_progress=False) is None
    assert store.versions() == ["v000000"]
    rec = json.loads((tmp_path / "state" / "learner_state.json").read_text())["cycles"][-1]
    hidden = model.config.hidden_size
    assert rec["version"] is None and rec["rejected"].startswith("candidate weights: 2 tensors hold NaN"), rec
    assert f"'model.norm.weight': 2 of {hidden}" in rec["rejected"], rec
    assert f"'model.layers.0.input_layernorm.weight': 1 of {hidden}" in rec["rejected"], rec
    with pytest.raises(ValueError, match=r"state: 2 tensors hold NaN or infinite values"):
        store.publish(state, parent="v000000")
    assert store.versions() == ["v000000"]
    state["model.norm.weight"][[1, 2]] = 1.0
    state["model.layers.0.input_layernorm.weight"][5] = 0.5
    assert store.publish(state, parent="v000000").version == "v000001"  # finite again: stored
