"""``flywheel demo``'s settings (issue 21): DemoConfig is the one declaration; --quick resizes
what the user did not choose; the learner's settings are overrides by LearnerConfig name."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.demo_config import DEMO_LEARNER, QUICK, QUICK_LEARNER, DemoConfig
from learner.config import LearnerConfig


@pytest.fixture
def parsed(monkeypatch):
    """Run ``flywheel demo ARGS`` up to the run; returns ``(result, DemoConfig or None)``."""
    import flywheel.commands as fc

    got: dict = {}
    monkeypatch.setattr(fc, "require_demo_extra", lambda: None)
    monkeypatch.setattr(fc, "_run_demo", lambda cfg: got.update(cfg=cfg))

    def run(*args: str):
        got.clear()
        return CliRunner().invoke(app, ["demo", *args]), got.get("cfg")

    return run


def test_quick_resizes_only_what_the_user_did_not_choose(parsed):
    r, cfg = parsed("--quick", "--cycles", "3", "--families", "chain_sum,gcd", "--out", "/tmp/d")
    assert r.exit_code == 0, r.output
    assert cfg.quick and cfg.cycles == 3 and cfg.families == ("chain_sum", "gcd") and cfg.out == Path("/tmp/d")
    assert (cfg.prompts_per_phase, cfg.max_tokens, cfg.learner) == (QUICK["prompts_per_phase"], QUICK["max_tokens"],
                                                                     QUICK_LEARNER)
    assert cfg.held_out == ("gcd",) and cfg.seed == LearnerConfig.seed


def test_the_full_run_is_the_models_defaults(parsed):
    r, cfg = parsed()
    assert r.exit_code == 0, r.output
    assert cfg == DemoConfig() and cfg.learner == DEMO_LEARNER and not cfg.quick
    assert DemoConfig.for_mode(Path("flywheel-demo"), False) == cfg


@pytest.mark.parametrize("args, flag", [(("--held-out", "nope"), "--held-out"), (("--cycles", "0"), "--cycles"),
                                        (("--families", "nope"), "--families"),
                                        (("--eval-share", "2"), "--eval-share"),
                                        (("--signals", "votes"), "--signals")])
def test_a_refused_value_is_a_usage_error_naming_its_flag(parsed, args, flag):
    r, cfg = parsed(*args)
    assert r.exit_code == 2 and flag in r.output and cfg is None, r.output


def test_learner_overrides_are_checked_by_name():
    with pytest.raises(ValueError, match="restates LearnerConfig's default"):
        DemoConfig(learner={"objective": "kto"})
    with pytest.raises(ValueError, match="no setting of LearnerConfig"):
        DemoConfig(learner={"learner_steps": 8})
    assert DemoConfig(learner={"steps": 3}).learner_setting("objective") == LearnerConfig.objective


@pytest.mark.parametrize("role, bad, match", [
    ("controller", {"delta": 2.0}, r"controller: delta: must be in \(0, 1\)"),
    ("controller", {"min_votes": 10}, "controller: min_votes=10 restates AnalysisConfig's default"),
    ("ingest", {"tick_s": "x"}, "ingest: tick_s: .*valid number"),
    ("ingest", {"seal_after_s": -1}, "ingest: seal_after_s: must be > 0"),
    ("serve", {"max_batchx": 3}, "serve: 'max_batchx' is no setting of EngineConfig, ServeConfig"),
    ("serve", {"max_batch": 0}, "serve: max_batch: .*greater than or equal to 1")])
def test_other_roles_overrides_are_checked_by_their_models(role, bad, match):
    with pytest.raises(ValueError, match=match):
        DemoConfig(**{role: bad})


@pytest.mark.parametrize("role", ["serve", "ingest", "controller"])
def test_the_flags_the_demo_passes_parse_to_its_values_in_the_real_command(role):
    """Each role's overrides become flags that the role's own command (the click command a
    user runs) parses back to the same values: nothing is spelled twice."""
    import typer

    from flywheel.cli import app
    from flywheel.demo_config import role_models
    from schemas.options import flags_for

    cfg = DemoConfig()
    values = {"max_batch": cfg.concurrency, **cfg.serve} if role == "serve" else getattr(cfg, role)
    cmd = typer.main.get_command(app).commands[role]
    ctx = cmd.make_context(role, flags_for(role_models(role), values))
    for name, value in values.items():
        got = ctx.params[name]
        assert got == value or str(got) == str(value), (name, got, value)


def test_signals_flag_reaches_the_config(parsed):
    r, cfg = parsed("--quick", "--signals", "implicit")
    assert r.exit_code == 0, r.output
    assert cfg.signals == "implicit" and (cfg.fixed_per_family, cfg.fixed_humaneval) == (4, 2)
    r, cfg = parsed()
    assert cfg.signals == "thumbs" and (cfg.fixed_per_family, cfg.fixed_humaneval) == (24, 8)
