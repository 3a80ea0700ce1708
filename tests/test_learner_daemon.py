"""``flywheel learn``'s settings and assembly (issue 21): the options come from LearnerConfig and
DaemonConfig, the role from ``learner.daemon``; the demo's and experiment's learner overrides
reach the learner as the flags the CLI generates."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.demo_config import DEMO_LEARNER, QUICK_LEARNER
from flywheel.experiment import EXPERIMENT_LEARNER
from learner.config import LearnerConfig, check_learner, learn_flags
from learner.daemon import DaemonConfig, SettingError, build_gate


@pytest.fixture
def parsed(monkeypatch):
    """Run ``flywheel learn ARGS`` up to the assembly; returns ``(result, {"cfg", "daemon"})``."""
    import learner.daemon

    got: dict = {}

    class Idle:
        def cycle(self):
            got["ran"] = "cycle"

        def serve(self):
            got["ran"] = "serve"

    def build(cfg, daemon, say=print):
        got.update(cfg=cfg, daemon=daemon)
        return Idle()

    monkeypatch.setattr(learner.daemon, "build_learner", build)

    def run(*args: str):
        return CliRunner().invoke(app, ["learn", *args]), got

    return run


@pytest.mark.parametrize("values", [DEMO_LEARNER, QUICK_LEARNER, EXPERIMENT_LEARNER,
                                    {"router_replay": False, "allow_free_routing": True, "zero_stage": 1}])
def test_overrides_reach_the_learner_as_generated_flags(parsed, values):
    r, got = parsed("--once", *learn_flags(check_learner(values)))
    assert r.exit_code == 0, r.output
    assert got["cfg"] == LearnerConfig(**values) and got["ran"] == "cycle"


def test_options_carry_the_models_defaults(parsed):
    r, got = parsed()
    assert r.exit_code == 0, r.output
    assert got["cfg"] == LearnerConfig() and got["daemon"] == DaemonConfig() and got["ran"] == "serve"


@pytest.mark.parametrize("args, flag", [(("--lr", "-1"), "--lr"), (("--parent", "newest"), "--parent"),
                                        (("--is-level", "token"), "--is-level"),
                                        (("--metrics-port", "70000"), "--metrics-port"),
                                        (("--baseline", "prompt"), "--baseline")])
def test_a_refused_value_is_a_usage_error_naming_its_flag(parsed, args, flag):
    r, _ = parsed("--once", *args)
    assert r.exit_code == 2 and flag in r.output, r.output


def test_config_messages_name_the_field():
    with pytest.raises(ValueError, match="steps: must be >= 1, got 0"):
        LearnerConfig(steps=0)
    with pytest.raises(ValueError, match="beta: must be > 0"):
        LearnerConfig(beta=0)
    with pytest.raises(ValueError, match="gate_samples: must be >= 1"):
        DaemonConfig(gate_samples=0)
    with pytest.raises(ValueError, match="restates LearnerConfig's default"):
        check_learner({"steps": 4})
    with pytest.raises(ValueError, match="learner: 'stepz' is no setting"):
        check_learner({"stepz": 4})
    with pytest.raises(ValueError, match="learner: baseline"):
        check_learner({"baseline": "prompt"})


def test_learn_flags_spell_what_the_cli_accepts():
    assert learn_flags({"steps": 8, "router_replay": False, "balance_classes": True}) == \
        ["--steps", "8", "--no-replay", "--balance-classes"]
    with pytest.raises(ValueError, match="stepz"):
        learn_flags({"stepz": 1})


def test_an_unloadable_gate_verifier_is_a_setting_error():
    with pytest.raises(SettingError) as e:
        build_gate(DaemonConfig(gate_problems="0-3", gate_verifier="no_such_module:f"), None, 0)
    assert e.value.flag == "--gate-verifier" and "does not import" in e.value.reason
    assert build_gate(DaemonConfig(), None, 0) is None  # no --gate-problems: no gate


def test_an_empty_store_exits_1_with_the_message(tmp_path, fw_home):
    r = CliRunner().invoke(app, ["learn", "--once", "--store", str(tmp_path / "store")])
    assert r.exit_code == 1 and "has no version yet" in r.output, r.output
