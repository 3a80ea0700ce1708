"""A cycle that the trainer's filters leave without enough samples (psr with no reward > 0,
every sample stale) says why, is recorded in the learner state, consumes nothing, and the
daemon does not start it again for the same samples (``learner.daemon.Learner.poll``).

Real parts: the tiny MoE in a real model store, hand-made Parquet shards of samples whose
logprobs and routes come from that model (``test_learner_reward_kinds._sample``), DeepSpeed
cycles on CPU. The daemon is driven a poll at a time (``Learner.poll``, what ``serve`` calls
every ``poll_s``), so cycles are counted per poll, never against the clock.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from flywheel.cli import app
from learner.config import LearnerConfig
from learner.cycle import load_state, skip_reason
from learner.daemon import DaemonConfig, build_learner
from modelstore.store import ModelStore
from samplestore import shards as writer
from schemas.modelspec import load_model

from test_learner_reward_kinds import _sample  # noqa: E402


@pytest.fixture(scope="module")
def model(tiny_moe_dir):
    return load_model(tiny_moe_dir)


def _make(model, rewards: list[float], first_id: int, version: str = "v000000") -> list:
    """Samples of ``rewards`` (ids ``first_id`` on), produced by ``version``."""
    rng = np.random.default_rng(first_id)
    V = model.config.vocab_size
    out = []
    for j, r in enumerate(rewards):
        s = _sample(model, rng.integers(3, V, 4).tolist(), rng.integers(3, V, 3).tolist(), r, first_id + j)
        out.append(s.model_copy(update={"model_version": version}))
    return out


def _shard(samples_dir: Path, samples: list, name: str) -> None:
    writer.write_shard(samples, writer.shard_path(samples_dir, min(s.sealed_at for s in samples), name))


def _store(tmp_path: Path, tiny_moe_dir: Path) -> ModelStore:
    st = ModelStore(tmp_path / "store")
    st.init_base(tiny_moe_dir)  # v000000
    return st


def _learner(tmp_path: Path, cfg: LearnerConfig, every_n: int, lines: list[str]):
    d = DaemonConfig(store=str(tmp_path / "store"), samples=tmp_path / "samples", state=tmp_path / "state",
                     every_n=every_n, every_h=1000.0, poll_s=0.0)  # every_h never comes due in a test
    return build_learner(cfg, d, say=lines.append)


def _cycles(learner) -> dict[str, float]:
    """Cycles counted by the learner's Prometheus counter, by outcome."""
    reg = learner.metrics.registry
    return {o: reg.get_sample_value("flywheel_learner_cycles_total", {"outcome": o}) or 0.0
            for o in ("published", "skipped", "rejected")}


PSR_SKIP = ("4 new samples, none trainable: 4 with reward <= 0 (objective psr trains on rewards > 0 only)")


def test_psr_once_with_no_positive_sample_says_why_and_records_the_cycle(tiny_moe_dir, model, tmp_path, fw_home):
    """``flywheel learn --once --objective psr`` on four samples of reward <= 0 (D5): exit 0,
    the reason from the trainer's counts, a state record, nothing consumed or published."""
    _store(tmp_path, tiny_moe_dir)
    _shard(tmp_path / "samples", _make(model, [-1.0, -0.5, 0.0, -0.2], 1), "neg")
    r = CliRunner().invoke(app, ["learn", "--once", "--objective", "psr", "--store", str(tmp_path / "store"),
                                 "--samples", str(tmp_path / "samples"), "--state", str(tmp_path / "state")])
    assert r.exit_code == 0, r.output
    assert f"learn: {PSR_SKIP}; nothing published" in r.output, r.output
    state = load_state(tmp_path / "state")
    assert state["consumed"] == {} and state["watermark_ms"] == 0  # a skipped cycle consumes nothing
    (rec,) = state["cycles"]
    assert rec["skipped"] == PSR_SKIP and rec["version"] is None and rec["parent"] == "v000000"
    assert rec["n_new"] == 4 and rec["n_samples"] == 0
    assert rec["metrics"]["data/dropped_not_positive"] == 4 and rec["metrics"]["data/n_candidates"] == 4
    assert ModelStore(tmp_path / "store").versions() == ["v000000"]


def test_psr_daemon_waits_for_new_samples_after_a_skip(tiny_moe_dir, model, tmp_path):
    """The tester's D6 daemon: four samples of reward <= 0, every_n 2. The first poll runs a
    cycle that skips; the next polls run none (was: one per poll, each loading the model);
    one positive sample is 1 < every_n unjudged, so still none; a second new sample makes 2:
    the cycle trains on the one positive (5 dropped), publishes and consumes all four shards."""
    _store(tmp_path, tiny_moe_dir)
    _shard(tmp_path / "samples", _make(model, [-1.0, -0.5], 1), "neg1")
    _shard(tmp_path / "samples", _make(model, [0.0, -0.2], 3), "neg2")
    lines: list[str] = []
    learner = _learner(tmp_path, LearnerConfig(objective="psr", steps=1, batch_size=2, lr=1e-3), 2, lines)

    ran = [learner.poll() for _ in range(6)]
    assert ran == [True, False, False, False, False, False]
    assert _cycles(learner) == {"published": 0, "skipped": 1, "rejected": 0}
    assert lines == [f"learn: {PSR_SKIP}; nothing published",
                     "learn: waiting for 2 new samples beyond the 4 judged (or one after every_h 1000 h) "
                     "before the next cycle"]  # said once
    assert learner.judged == (4, "v000000")
    state = load_state(tmp_path / "state")
    assert state["consumed"] == {} and len(state["cycles"]) == 1

    _shard(tmp_path / "samples", _make(model, [1.0], 10), "pos")
    assert [learner.poll() for _ in range(3)] == [False, False, False]  # 1 unjudged < every_n 2
    _shard(tmp_path / "samples", _make(model, [-1.0], 11), "neg3")
    assert learner.poll() is True
    assert _cycles(learner) == {"published": 1, "skipped": 1, "rejected": 0}
    st = ModelStore(tmp_path / "store")
    assert st.versions() == ["v000000", "v000001"]
    met = st.manifest("v000001").metrics
    assert met["data/n_samples"] == 1 and met["data/dropped_not_positive"] == 5
    assert lines[-1].startswith("learn: published v000001 (parent v000000")
    state = load_state(tmp_path / "state")
    assert len(state["consumed"]) == 4 and state["cycles"][-1]["version"] == "v000001"
    assert learner.judged is None and learner.poll() is False  # nothing left


def test_kto_daemon_all_stale_waits_until_the_parent_changes(tiny_moe_dir, model, tmp_path):
    """KTO with max_staleness 0, parent v000001, every_n 1: three samples made by v000000 are
    stale; the cycle skips once and the polls after it run none. An operator's rollback of
    stable to v000000 changes the parent, from which they are fresh: the next poll trains
    on them and publishes v000002 from v000000."""
    st = _store(tmp_path, tiny_moe_dir)
    st.publish(st.load("v000000"), parent="v000000", metrics={})  # v000001, the base's weights
    st.set_stable("v000001", actor="test", reason="a stable newer than the samples")
    _shard(tmp_path / "samples", _make(model, [1.0, -1.0, 0.5], 1), "old")
    lines: list[str] = []
    learner = _learner(tmp_path, LearnerConfig(steps=1, batch_size=3, max_staleness=0), 1, lines)

    assert [learner.poll() for _ in range(5)] == [True, False, False, False, False]
    want = ("3 new samples, none trainable: 3 stale (made more than max_staleness 0 versions before the "
            "parent v000001)")
    assert lines[0] == f"learn: {want}; nothing published" and len(lines) == 2
    assert load_state(tmp_path / "state")["cycles"][-1]["skipped"] == want
    assert learner.judged == (3, "v000001")

    st.set_stable("v000000", actor="test", reason="rollback")
    assert learner.poll() is True
    assert ModelStore(tmp_path / "store").manifest("v000002").parent == "v000000"
    assert _cycles(learner) == {"published": 1, "skipped": 1, "rejected": 0}


def test_skip_reason_words_counts_min_samples_and_held_out():
    """The wording from a trainer's metrics written by hand: trainable but too few, a reason
    without wording named as counted, held-out samples, zero counts left out."""
    met = {"data/n_candidates": 7, "data/dropped_stale": 0, "data/dropped_eval_split": 2,
           "data/dropped_some_new_reason": 1, "data/newer_than_parent": 3, "data/n_samples": 4}
    got = skip_reason(met, LearnerConfig(min_samples=8), "v000003", n_held=2)
    assert got == ("9 new samples, 4 trainable, fewer than min_samples 8: 2 in the eval split (never trained "
                   "on), 1 some_new_reason, 2 held out for the eval gate")


def test_learn_help_names_the_objectives_and_kl_coef_users():
    """D10: the command's first help line names the three objectives; kl_coef says PSR uses it."""
    cmd = typer.main.get_command(app).commands["learn"]
    assert cmd.help.splitlines()[0] == ("Train on new sealed samples (KTO, REINFORCE or PSR; router replay, "
                                        "DeepSpeed) and publish a version.")
    helps = {p.name: p.help for p in cmd.params}
    assert helps["kl_coef"].startswith("k3 KL penalty") and helps["kl_coef"].endswith("(reinforce and psr only)")
