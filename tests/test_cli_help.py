"""``--help`` of the real ``flywheel`` commands lists a boolean flag as click and typer users
know it: ``--quick``, ``--cuped  --no-cuped``, with no value placeholder (``<bool>``) where an
option that takes a value shows ``<int range>``, ``<path>``, ...; a flag on by default has
its ``--no-`` form, and it, ``flywheel.toml`` and ``FLYWHEEL_<COMMAND>__<OPTION>`` set the
same field (schemas/options.py). The role commands' bodies are replaced by recorders where a
command is run (what is under test is option parsing, not the roles)."""

from __future__ import annotations

import functools
import os
import re

import click
import pytest
import typer
from pydantic import BaseModel, Field
from typer.main import get_command
from typer.testing import CliRunner

import flywheel.cli as cli
from schemas.options import config_options

WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}  # one row per option, unwrapped
COMMANDS = [(), ("demo",), ("controller",), ("serve",), ("learn",), ("experiment",), ("model", "init"),
            ("versions",), ("data", "migrate")]
ROLES = ("serve", "learn", "controller")


def _command(path: tuple[str, ...]) -> click.Command:
    cmd = get_command(cli.app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def _help(path: tuple[str, ...]) -> str:
    r = CliRunner().invoke(cli.app, [*path, "--help"], env=WIDE)
    assert r.exit_code == 0, r.output
    return r.output


def _row(text: str, opt: str) -> str:
    """The help row whose first column is ``opt`` (the table's left border stripped)."""
    rows = [ln.strip().removeprefix("│ ").rstrip(" │") for ln in text.splitlines()]  # a wrapped line: indented
    hits = [r for r in rows if re.match(re.escape(opt) + r"(\s|,|$)", r)]
    assert len(hits) == 1, (opt, hits, text)
    return hits[0]


def _options(path: tuple[str, ...]) -> list[click.Option]:
    cmd = _command(path)
    ctx = click.Context(cmd, info_name=path[-1] if path else "flywheel")
    return [p for p in cmd.get_params(ctx) if p.param_type_name == "option" and not p.hidden]


def _type_column(row: str, p) -> str:
    """What follows the option's names (long, short, ``--no-`` form) in its help row: the type
    column (``<int range> [x>=1]``) if any, then the help text."""
    rest, names = row, [*p.opts, *p.secondary_opts]
    while True:
        hit = next((o for o in names if re.match(re.escape(o) + r"(\s|,|$)", rest)), None)
        if hit is None:
            return rest
        rest = rest[len(hit):].lstrip(" ,")


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "flywheel")
def test_help_lists_bool_flags_without_a_value_placeholder(path):
    text = _help(path)
    flags = [p for p in _options(path) if p.is_flag and not p.count]
    valued = [p for p in _options(path) if not p.is_flag and not p.count]
    assert flags  # --help at least
    for p in flags:
        row = _row(text, [o for o in p.opts if o.startswith("--")][0])
        assert not _type_column(row, p).startswith("<"), f"{' '.join(path)}: a value placeholder: {row!r}"
        for off in p.secondary_opts:
            assert off in row, f"its off switch {off} is not listed: {row!r}"
    for p in valued:  # the options that do take a value keep their placeholder
        row = _row(text, [o for o in p.opts if o.startswith("--")][0])
        assert _type_column(row, p).startswith("<"), row
    assert "<bool>" not in text


def test_the_named_rows_read_as_users_expect():
    assert re.fullmatch(r"--quick\s+Small run .*", _row(_help(("demo",)), "--quick"))
    assert re.fullmatch(r"--once\s+reconcile .*", _row(_help(("controller",)), "--once"))
    cuped = _row(_help(("controller",)), "--cuped")
    assert re.match(r"--cuped\s+--no-cuped\s+adjust each arm", cuped), cuped
    assert re.match(r"--cycles\s+<int range> \[1<=x<=100\]\s+Learner cycles", _row(_help(("demo",)), "--cycles"))


def test_every_flag_on_by_default_has_its_off_switch():
    """A flag alone could never turn off a setting whose default is on."""
    seen = []
    for path in COMMANDS:
        for p in _options(path):
            if p.is_flag and not p.count and p.default is True:
                seen.append((path, p.opts[0]))
                assert p.secondary_opts and p.secondary_opts[0].startswith("--no-"), (path, p.opts)
    assert (("controller",), "--cuped") in seen and (("serve",), "--derive-regenerate") in seen


@pytest.fixture()
def calls(monkeypatch):
    """Replace the role commands' bodies by recorders of their parsed options."""
    got: dict[str, dict] = {}
    for info in cli.app.registered_commands:
        name = cli._command_name(info)
        if name in ROLES:
            fn = info.callback

            def rec(*a, _name=name, **kw):
                got[_name] = kw

            monkeypatch.setattr(info, "callback", functools.wraps(fn)(rec))
    for k in list(os.environ):
        if k.startswith("FLYWHEEL_"):
            monkeypatch.delenv(k)
    return got


@pytest.fixture(autouse=True)
def _environ_restored():
    """``configure_cli`` writes a config file's paths to this process's environment."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _run(*args, env=None):
    r = CliRunner().invoke(cli.app, list(args), env=env or {})
    assert r.exit_code == 0, r.output
    return r


@pytest.mark.parametrize("role,field,flag", [("controller", "cuped", "cuped"),
                                              ("serve", "derive_regenerate", "derive-regenerate"),
                                              ("learn", "router_replay", "replay")])
def test_no_forms_file_and_environment_set_a_flag_on_by_default(tmp_path, calls, role, field, flag):
    _run(role)
    assert calls[role][field] is True  # the default
    _run(role, f"--no-{flag}")
    assert calls[role][field] is False
    _run(role, f"--{flag}")
    assert calls[role][field] is True
    key = field.replace("_", "-") if role == "serve" else field
    toml = tmp_path / "flywheel.toml"
    toml.write_text(f"[{role}]\n{key} = false\n")
    _run("--config", str(toml), role)
    assert calls[role][field] is False
    var = f"FLYWHEEL_{role.upper()}__{field.upper()}"
    _run(role, env={var: "false"})
    assert calls[role][field] is False
    _run("--config", str(toml), role, f"--{flag}", env={var: "false"})  # a flag beats both
    assert calls[role][field] is True


def test_a_flag_off_by_default_from_file_and_environment(tmp_path, calls):
    _run("serve")
    assert calls["serve"]["fleet"] is False
    toml = tmp_path / "flywheel.toml"
    toml.write_text("[serve]\nfleet = true\n")
    _run("--config", str(toml), "serve")
    assert calls["serve"]["fleet"] is True
    _run("serve", env={"FLYWHEEL_SERVE__FLEET": "true"})
    assert calls["serve"]["fleet"] is True


class _Knobs(BaseModel):
    """A model with a flag on by default that declares no off switch."""

    warm: bool = Field(True, description="Keep it warm.")
    loud: bool = Field(False, description="Say more.")


def test_a_field_on_by_default_gets_its_no_form():
    app = typer.Typer()
    got = {}

    @app.command()
    @config_options(cfg=_Knobs)
    def knobs(cfg: _Knobs):
        got["cfg"] = cfg

    @app.command()
    def other():  # a second command: typer keeps the command's name on the command line
        pass

    r = CliRunner().invoke(app, ["knobs", "--help"], env=WIDE)
    assert r.exit_code == 0, r.output
    assert re.match(r"--warm\s+--no-warm\s+Keep it warm", _row(r.output, "--warm")), r.output
    assert re.match(r"--loud\s+Say more", _row(r.output, "--loud")), r.output
    for args, warm, loud in [([], True, False), (["--no-warm"], False, False), (["--warm", "--loud"], True, True)]:
        r = CliRunner().invoke(app, ["knobs", *args])
        assert r.exit_code == 0, r.output
        assert (got["cfg"].warm, got["cfg"].loud) == (warm, loud)


def test_table_names_in_help_keep_their_brackets():
    """``[reward]`` in a help text is the TOML table's name, not rich markup."""
    text = " ".join(_help(("ingest",)).replace("│", " ").split())
    assert "the reward policy ([reward] in flywheel.toml" in text and "Overrides [reward] thumb_up" in text


def test_h_is_help_on_every_command_force_is_one_flag_and_choices_read_as_words():
    for path in COMMANDS:
        r = CliRunner().invoke(cli.app, [*path, "-h"], env=WIDE)
        assert r.exit_code == 0 and r.output == _help(path), path
    init = _help(("model", "init"))
    assert re.search(r"--force\s", init) and "--no-force" not in init, init
    controller = " ".join(_help(("controller",)).replace("│", " ").split())
    assert "one of rollback, promote" in controller and "('rollback'" not in controller, controller
