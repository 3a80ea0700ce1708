"""Hostile values on the command line: each is refused naming the option the user got wrong and
the reason (or the bound), and a read command creates nothing.

``flywheel demo`` runs up to its body, which a recorder replaces (no run starts); ``flywheel
versions`` and ``flywheel status`` run against temporary homes.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import deploy.status
from flywheel.cli import app
from flywheel.demo_config import QUICK, DemoConfig
from learner.config import LearnerConfig
from schemas import settings
from schemas.options import cli_fields

SIGNED_64_MAX = 9_223_372_036_854_775_807  # 2**63 - 1, written out


@pytest.fixture
def demo(monkeypatch, tmp_path):
    """Run ``flywheel demo ARGS`` up to the run; returns ``(exit code, flat output, DemoConfig
    or None)``; the output's box drawing and line wraps are flattened to single spaces."""
    import flywheel.commands as fc

    got: dict = {}
    monkeypatch.setattr(fc, "require_demo_extra", lambda: None)
    monkeypatch.setattr(fc, "_run_demo", lambda cfg: got.update(cfg=cfg))
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path / "home"))

    def run(*args: str):
        got.clear()
        r = CliRunner().invoke(app, ["demo", *args], env={"COLUMNS": "200"})
        return r.exit_code, " ".join(r.output.replace("│", " ").split()), got.get("cfg")

    return run


# the bounds, by hand: 100 cycles, 10000 prompts per phase, 4096 reply tokens (half the default
# model's 8192-token context), a seed that leaves room for seed + 100 cycles in a signed 64-bit int
@pytest.mark.parametrize("flag, too_big, bound", [
    ("--cycles", "99999999999999999999999", 100),
    ("--prompts", "10000000000", 10_000),
    ("--max-tokens", "1000000000", 4096),
    ("--seed", "18446744073709551616", SIGNED_64_MAX - 100),
])
def test_1_sizes_and_seed_have_an_upper_bound_named_in_the_error(demo, flag, too_big, bound):
    code, out, cfg = demo(flag, too_big)
    assert code == 2 and cfg is None, out
    assert f"Invalid value for '{flag}': Input should be less than or equal to {bound}" in out, out
    code, out, cfg = demo(flag, str(bound))  # the bound itself is a value
    assert code == 0 and cfg is not None, out
    help_out = demo("--help")[1]
    assert f"{flag} " in help_out and f"x<={bound}]" in help_out, help_out


def test_1_the_learners_seed_is_a_signed_64_bit_int():
    assert LearnerConfig(seed=SIGNED_64_MAX).seed == SIGNED_64_MAX
    with pytest.raises(ValueError, match=f"seed: must be <= {SIGNED_64_MAX}, got {SIGNED_64_MAX + 1}"):
        LearnerConfig(seed=SIGNED_64_MAX + 1)
    with pytest.raises(ValueError, match="seed: must be >= 0, got -1"):
        LearnerConfig(seed=-1)


@pytest.mark.parametrize("args", [("--families", "gcd", "--held-out", "gcd"),
                                  ("--families", "gcd"),  # gcd is held out by default when asked
                                  ("--families", "gcd,chain_sum_3terms", "--held-out", "gcd")])
def test_2_every_family_held_out_is_refused_naming_held_out(demo, args):
    code, out, cfg = demo(*args)
    assert code == 2 and cfg is None, out
    assert "Invalid value for --held-out: held_out: no family asked is trained on" in out, out
    code, out, cfg = demo("--families", "gcd", "--held-out", "")  # none held out: gcd is trained on
    assert code == 0 and cfg.held_out == () and cfg.families == ("gcd",), out


def test_3_holding_out_a_variants_base_blames_held_out(demo):
    code, out, cfg = demo("--held-out", "chain_sum")
    assert code == 2 and cfg is None, out
    assert "Invalid value for --families" not in out, out
    assert ("Invalid value for --held-out: held_out: 'chain_sum' is the base family of 'chain_sum_3terms', a harder "
            "variant asked, which must be trained on") in out, out
    # the variant's base not asked at all is the families' fault
    code, out, cfg = demo("--families", "gcd,chain_sum_3terms", "--held-out", "")
    assert code == 2 and "Invalid value for --families: families: 'chain_sum_3terms' is a harder variant" in out, out


@pytest.mark.parametrize("value, reason", [("nan", "eval_share: nan is not a number; give a finite number in [0, 1]"),
                                           ("NaN", "eval_share: nan is not a number; give a finite number in [0, 1]"),
                                           ("inf", "eval_share: must be a finite number in [0, 1], got inf"),
                                           ("-inf", "eval_share: must be a finite number in [0, 1], got -inf"),
                                           ("1.5", "eval_share: must be a finite number in [0, 1], got 1.5")])
def test_4_eval_share_not_a_finite_share_is_named(demo, value, reason):
    code, out, cfg = demo("--eval-share", value)
    assert code == 2 and cfg is None, out
    assert f"Invalid value for --eval-share: {reason}" in out, out
    assert demo("--eval-share", "1")[2].eval_share == 1.0 and demo("--eval-share", "0")[2].eval_share == 0.0


@pytest.mark.parametrize("field, value, reason", [
    ("temperature", math.nan, "temperature: nan is not a number; give a finite number in [0, 2]"),
    ("temperature", math.inf, "temperature: must be a finite number in [0, 2], got inf"),
    ("top_p", 0.0, "top_p: must be a finite number in (0, 1], got 0.0"),
    ("top_p", math.nan, "top_p: nan is not a number; give a finite number in (0, 1]"),
    ("family_weights", {"gcd": math.nan}, "family_weights: the weight of 'gcd' must be a finite number >= 0, got nan"),
    ("family_weights", {"gcd": math.inf}, "family_weights: the weight of 'gcd' must be a finite number >= 0, got inf"),
])
def test_4_the_programs_float_fields_refuse_nan_and_inf(field, value, reason):
    with pytest.raises(ValueError) as exc:
        DemoConfig(**{field: value})
    assert reason in str(exc.value), str(exc.value)


def test_5_help_says_what_quick_sets_for_each_option_it_changes():
    changed = set(QUICK) & set(cli_fields(DemoConfig))
    assert changed == {"cycles", "prompts_per_phase", "eval_share", "max_tokens"}
    cmd = typer.main.get_command(app).commands["demo"]
    helps = {p.name: p.help for p in cmd.params}
    by_hand = {"cycles": "1", "prompts_per_phase": "8", "eval_share": "0.25", "max_tokens": "64"}
    for name in changed:
        assert f"(--quick: {by_hand[name]})" in helps[name], (name, helps[name])
    r = CliRunner().invoke(app, ["demo", "--quick", "--help"], env={"COLUMNS": "250"})
    flat = " ".join(r.output.replace("│", " ").split())
    assert "(--quick: 0.25). [default: 0.5]" in flat and "(--quick: 64). [default: 160]" in flat, flat


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) + ("/" if p.is_dir() else "") for p in root.rglob("*"))


def _read_on(home: Path, tmp_path: Path, monkeypatch, args: list[str]) -> tuple[int, str]:
    """Run the read command ``args`` with FLYWHEEL_HOME=``home`` from ``tmp_path``: (exit code,
    flat output); asserts that nothing under ``tmp_path`` was created or removed."""
    monkeypatch.setenv("FLYWHEEL_HOME", str(home))
    monkeypatch.delenv("FLYWHEEL_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    r = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    assert _tree(tmp_path) == before, r.output
    return r.exit_code, " ".join(r.output.split())


NO_STORE = "no model store at {} (no versions directory there); start one with `flywheel serve`"
STATUS = ["status", "--serving", "http://127.0.0.1:9", "--serving-timeout-s", "1"]
STATUS_READS_ONLY = pytest.mark.skipif(not hasattr(deploy.status, "StoreMissingError"),
                                       reason="deploy.status.gather_status opens the store with create=True")
HOME_UNMADE = pytest.mark.skipif("create" not in inspect.signature(settings.home).parameters,
                                 reason="schemas.settings.store_dir() creates FLYWHEEL_HOME (home(create=False))")


@pytest.mark.parametrize("args", [["versions"], ["versions", "-o", "json"],
                                  pytest.param(STATUS, marks=STATUS_READS_ONLY),
                                  pytest.param([*STATUS, "-o", "json"], marks=STATUS_READS_ONLY)])
def test_6_a_read_command_on_a_home_with_no_store_creates_nothing(tmp_path, monkeypatch, args):
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)  # a home with something in it, but no store
    code, out = _read_on(home, tmp_path, monkeypatch, args)
    assert code == 1 and NO_STORE.format(home / "store") in out, out
    assert "or set FLYWHEEL_HOME or FLYWHEEL_STORE to an existing one" in out, out
    if args[0] == "status":  # status shows what it can: the pod given, down
        assert "127.0.0.1:9" in out and "unreachable" in out, out


@HOME_UNMADE
@pytest.mark.parametrize("args", [["versions"], pytest.param(STATUS, marks=STATUS_READS_ONLY)])
def test_6_a_read_command_on_a_mistyped_home_creates_nothing(tmp_path, monkeypatch, args):
    code, out = _read_on(Path("typo"), tmp_path, monkeypatch, args)
    assert code == 1 and NO_STORE.format(tmp_path / "typo" / "store") in out, out


@pytest.mark.parametrize("args", [["data", "stats"], ["data", "stats", "-o", "json"]])
def test_6_data_stats_on_a_mistyped_home_creates_nothing(tmp_path, monkeypatch, args):
    monkeypatch.delenv("FLYWHEEL_SAMPLES", raising=False)
    code, out = _read_on(Path("typo"), tmp_path, monkeypatch, args)
    samples = tmp_path / "typo" / "data" / "samples"
    assert code == 1 and f"no samples at {samples} (no directory there)" in out, out
    assert "set FLYWHEEL_HOME or FLYWHEEL_SAMPLES to an existing one" in out, out


def test_7_an_empty_out_is_refused_naming_out(demo):
    for empty in ("", "  "):
        code, out, cfg = demo("--out", empty)
        assert code == 2 and cfg is None, out
        assert "Invalid value for '--out': out: an empty path names no directory" in out, out
    assert demo("--out", ".")[2].out == Path(".")  # the current directory, said so
    with pytest.raises(ValueError, match="out: an empty path names no directory"):
        DemoConfig(out="")
    assert type(DemoConfig(out="x").out) is type(Path("x"))
