"""A learner setting that only some objectives read is refused with another objective, never
accepted and ignored (D107), as ``--baseline prompt`` is with ``kto`` or ``psr``: KTO's
``--beta``, ``--desirable-weight``, ``--undesirable-weight`` and ``--balance-classes`` with
``reinforce`` or ``psr``; the REINFORCE loss's ``--kl-coef`` with ``kto``. The check is in
:class:`learner.config.LearnerConfig`, so the flags, ``FLYWHEEL_LEARN__<FIELD>``, the ``[learn]``
table of ``flywheel.toml`` and programs (the demo's, the experiment's overrides) all get it.
A value equal to the field's default is not a choice and passes (as ``--baseline batch`` does).

The CLI cases run the real ``flywheel learn`` in a subprocess; the config is refused before
anything is opened (exit 2 naming where the value came from: the flag, the
``FLYWHEEL_LEARN__<FIELD>`` variable, or the file and its ``learn.<field>`` key). ``--help``
says which objectives read each such setting ("(kto only)"); ``--balance-classes`` has an off
form, so the command line can override a file that turns it on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from learner.config import OBJECTIVE_ONLY, LearnerConfig

ROOT = Path(__file__).resolve().parents[1]

#: (field, a non-default value, its flag, the objectives that read it)
SETTINGS = [("beta", 0.2, ["--beta", "0.2"], ("kto",)),
            ("desirable_weight", 1.5, ["--desirable-weight", "1.5"], ("kto",)),
            ("undesirable_weight", 1.5, ["--undesirable-weight", "1.5"], ("kto",)),
            ("balance_classes", True, ["--balance-classes"], ("kto",)),
            ("kl_coef", 0.1, ["--kl-coef", "0.1"], ("reinforce", "psr"))]
REFUSED = [(f, v, flags, o) for f, v, flags, users in SETTINGS for o in ("kto", "reinforce", "psr") if o not in users]


def test_the_table_names_every_objective_only_setting():
    assert {f: users for f, _, _, users in SETTINGS} == OBJECTIVE_ONLY


@pytest.mark.parametrize("field,value,flags,objective", REFUSED,
                         ids=[f"{f}-{o}" for f, _, _, o in REFUSED])
def test_config_refuses_a_setting_its_objective_does_not_read(field, value, flags, objective):
    with pytest.raises(ValueError) as e:
        LearnerConfig(objective=objective, **{field: value})
    users = OBJECTIVE_ONLY[field]
    which = ("objective " if len(users) == 1 else "objectives ") + " and ".join(f"'{u}'" for u in users)
    assert (f"{field}: is read by {which} only, not by objective '{objective}': leave it at its default "
            f"({getattr(LearnerConfig, field)!r}) or use objective ") in str(e.value)
    assert f"got {value!r}" in str(e.value)


def test_each_setting_with_an_objective_that_reads_it_is_accepted():
    kto = LearnerConfig(objective="kto", beta=0.2, desirable_weight=1.5, undesirable_weight=1.25,
                        balance_classes=True)
    assert (kto.beta, kto.desirable_weight, kto.undesirable_weight, kto.balance_classes) == (0.2, 1.5, 1.25, True)
    for objective in ("reinforce", "psr"):
        assert LearnerConfig(objective=objective, kl_coef=0.1).kl_coef == 0.1
    # a restated default is no choice: accepted, as --baseline batch is with kto
    assert LearnerConfig(objective="reinforce", beta=0.1, balance_classes=False).beta == 0.1
    assert LearnerConfig(objective="kto", kl_coef=0.0).kl_coef == 0.0


def _learn(tmp_path: Path, args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    e.update(PYTHONPATH=str(ROOT), FLYWHEEL_HOME=str(tmp_path / "home"), COLUMNS="250", **(env or {}))
    return subprocess.run([sys.executable, "-m", "flywheel.cli", *args], cwd=tmp_path, env=e,
                          capture_output=True, text=True, timeout=120)


CLI = [(["--objective", "reinforce", "--beta", "0.2"], "--beta", "beta", "reinforce"),
       (["--objective", "psr", "--balance-classes"], "--balance-classes", "balance_classes", "psr"),
       (["--objective", "reinforce", "--desirable-weight", "2"], "--desirable-weight", "desirable_weight",
        "reinforce"),
       (["--objective", "psr", "--undesirable-weight", "2"], "--undesirable-weight", "undesirable_weight", "psr"),
       (["--kl-coef", "0.1"], "--kl-coef", "kl_coef", "kto")]


@pytest.mark.parametrize("args,flag,field,objective", CLI, ids=[c[2] for c in CLI])
def test_learn_cli_refuses_the_flag_naming_it_and_the_objective(tmp_path, args, flag, field, objective):
    r = _learn(tmp_path, ["learn", "--once", *args])
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert f"Invalid value for {flag}: {field}: is read by" in r.stderr, r.stderr[-2000:]
    assert f"not by objective '{objective}'" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


ENV = [("FLYWHEEL_LEARN__BETA", "0.2", "reinforce", "learn.beta", "objective 'kto'", "0.2"),
       ("FLYWHEEL_LEARN__KL_COEF", "0.1", "kto", "learn.kl_coef", "objectives 'reinforce' and 'psr'", "0.1"),
       ("FLYWHEEL_LEARN__BALANCE_CLASSES", "true", "psr", "learn.balance_classes", "objective 'kto'", "True")]


@pytest.mark.parametrize("var,value,objective,key,which,got", ENV, ids=[e[0] for e in ENV])
def test_learn_names_the_variable_a_refused_value_came_from(tmp_path, var, value, objective, key, which, got):
    r = _learn(tmp_path, ["learn", "--once", "--objective", objective], {var: value})
    assert r.returncode == 2, r.stderr[-2000:]
    flat = " ".join(r.stderr.replace("│", " ").split())
    assert (f"Invalid value for {var}: {key}: is read by {which} only, not by objective '{objective}'"
            in flat), flat
    assert flat.count(f", got {got} ") == 1 and "Invalid value for --" not in flat, flat


TOML = [('[learn]\nobjective = "psr"\nbalance_classes = true\n', [], "learn.balance_classes", "psr", "True"),
        # the file's key as a flag name, the objective from the command line
        ("[learn]\ndesirable-weight = 2.5\n", ["--objective", "reinforce"], "learn.desirable_weight",
         "reinforce", "2.5")]


@pytest.mark.parametrize("table,args,key,objective,got", TOML, ids=[t[2] for t in TOML])
def test_learn_names_the_file_and_key_a_refused_value_came_from(tmp_path, table, args, key, objective, got):
    toml = tmp_path / "flywheel.toml"
    toml.write_text(table)
    r = _learn(tmp_path, ["--config", str(toml), "learn", "--once", *args])
    assert r.returncode == 2, r.stderr[-2000:]
    flat = " ".join(r.stderr.replace("│", " ").split())
    # the form schemas.config gives the file's other refused values: the file, then table.key
    assert (f"Invalid value for '--config' / FLYWHEEL_CONFIG: {toml}: {key}: is read by objective 'kto' only, "
            f"not by objective '{objective}'") in flat, flat
    assert f", got {got} " in flat and "Invalid value for --" not in flat, flat


def test_the_variable_over_the_file_is_the_one_named_and_a_flag_over_both_is_the_flag(tmp_path):
    toml = tmp_path / "flywheel.toml"
    toml.write_text('[learn]\nobjective = "psr"\nbeta = 0.3\n')
    r = _learn(tmp_path, ["--config", str(toml), "learn", "--once"], {"FLYWHEEL_LEARN__BETA": "0.4"})
    flat = " ".join(r.stderr.replace("│", " ").split())
    assert r.returncode == 2 and "Invalid value for FLYWHEEL_LEARN__BETA: learn.beta: is read by" in flat, flat
    assert ", got 0.4 " in flat and str(toml) not in flat, flat
    r = _learn(tmp_path, ["--config", str(toml), "learn", "--once", "--beta", "0.5"], {"FLYWHEEL_LEARN__BETA": "0.4"})
    flat = " ".join(r.stderr.replace("│", " ").split())
    # the objective came from the file, the value from the flag: the flag is named
    assert r.returncode == 2 and "Invalid value for --beta: beta: is read by objective 'kto' only" in flat, flat
    assert "not by objective 'psr'" in flat and ", got 0.5 " in flat, flat


def test_any_refused_learner_value_is_named_by_its_source(tmp_path):
    """Not only the objective check: an open bound (grad_clip > 0, checked by the model, not by
    click) refused for a value from the environment names the variable."""
    r = _learn(tmp_path, ["learn", "--once"], {"FLYWHEEL_LEARN__GRAD_CLIP": "0"})
    flat = " ".join(r.stderr.replace("│", " ").split())
    assert r.returncode == 2, flat
    assert "Invalid value for FLYWHEEL_LEARN__GRAD_CLIP: learn.grad_clip: must be > 0, got 0.0" in flat, flat


def test_help_says_which_objective_reads_each_setting(tmp_path):
    r = _learn(tmp_path, ["learn", "--help"])
    assert r.returncode == 0, r.stderr[-2000:]
    # each option's help, its lines joined (the help column wraps at COLUMNS=250 only for long ones)
    rows = [line.strip("│ ").strip() for line in r.stdout.splitlines()]
    text = " ".join(" ".join(rows).split())
    for flag, only in [("--beta", "(kto only)"), ("--desirable-weight", "(kto only)"),
                       ("--undesirable-weight", "(kto only)"), ("--balance-classes", "(kto only)"),
                       ("--kl-coef", "(reinforce and psr only)")]:
        start = text.index(flag + " ")
        assert only in text[start:text.index("[default:", start)], (flag, text[start:start + 400])
    assert text.count(" only) [default:") == 5, text  # no other option says so


def test_balance_classes_has_an_off_form_that_overrides_the_file(tmp_path):
    """``[learn] balance_classes = true`` in the file: ``--no-balance-classes`` turns it off, so
    ``--objective psr`` is accepted (the command goes on to the store: exit 1, no model)."""
    toml = tmp_path / "flywheel.toml"
    toml.write_text("[learn]\nbalance_classes = true\n")
    base = ["--config", str(toml), "learn", "--once", "--objective", "psr", "--store", str(tmp_path / "store")]
    r = _learn(tmp_path, base)
    assert r.returncode == 2 and "learn.balance_classes: is read by" in " ".join(r.stderr.split()), r.stderr[-2000:]
    r = _learn(tmp_path, [*base, "--no-balance-classes"])
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "has no version yet" in r.stderr and "Invalid value" not in r.stderr, r.stderr[-2000:]


def test_learn_accepts_a_setting_with_its_objective(tmp_path):
    """``--objective kto --beta 0.2 --balance-classes`` passes the config check: the command goes
    on to open the model store (none here: exit 1 saying so, not a usage error)."""
    r = _learn(tmp_path, ["learn", "--once", "--objective", "kto", "--beta", "0.2", "--balance-classes",
                          "--store", str(tmp_path / "store")])
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "has no version yet" in r.stderr and "Invalid value" not in r.stderr, r.stderr[-2000:]


def test_programs_get_the_same_check():
    from learner.config import check_learner

    with pytest.raises(ValueError, match=r"^demo: balance_classes: is read by objective 'kto' only"):
        check_learner({"objective": "reinforce", "balance_classes": True}, where="demo")
    assert check_learner({"objective": "psr", "kl_coef": 0.1}) == {"objective": "psr", "kl_coef": 0.1}
