"""``schemas.options.config_options``: a value the model refuses names where it came from (the
flag, a ``FLYWHEEL_<COMMAND>__<OPTION>`` variable, ``flywheel.toml``'s file and key), also for a
command that declares its own ``typer.Context`` (``flywheel demo`` does) and still receives it.

Real parts: typer's CliRunner over a root whose callback reads the file and the variables as
``flywheel``'s does (``schemas.config.configure_cli`` / ``configure_env``), and a pydantic
dataclass config. Expected messages are written out by hand."""

from __future__ import annotations

from typing import Optional

import pytest
import typer
from pydantic import Field
from pydantic.dataclasses import dataclass
from typer.testing import CliRunner

from schemas.config import configure_cli, configure_env
from schemas.options import CONFIG_MODELS, config_options


@dataclass
class ToyConfig:
    """A config of one bounded field, checked by the model (not by click)."""

    width: int = Field(3, description="Width (> 0).")

    def __post_init__(self):
        if self.width <= 0:
            raise ValueError(f"width: must be > 0, got {self.width}")


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def root(ctx: typer.Context, config: Optional[str] = typer.Option(None, "--config")) -> None:
        configure_env(ctx) if config is None else configure_cli(ctx, config)

    @config_options(cfg=ToyConfig)
    def toy(ctx: typer.Context, cfg: ToyConfig, *, loud: bool = typer.Option(False, "--loud")) -> None:
        typer.echo(f"{ctx.info_name} width={cfg.width} loud={loud}")

    app.command("toy")(toy)
    CONFIG_MODELS.pop(f"{ToyConfig.__module__}.{ToyConfig.__qualname__}", None)  # a test's model, not the CLI's
    return app


@pytest.fixture()
def run(monkeypatch):
    for var in ("FLYWHEEL_TOY__WIDTH", "FLYWHEEL_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    app = _app()

    def invoke(*args, env=None):
        r = CliRunner().invoke(app, list(args), env={"COLUMNS": "300", **(env or {})})
        return r.exit_code, " ".join(r.output.replace("│", " ").split())
    return invoke


def test_the_command_still_gets_its_own_context_and_values(run):
    assert run("toy", "--width", "5", "--loud") == (0, "toy width=5 loud=True")


def test_a_refused_flag_names_the_flag(run):
    code, out = run("toy", "--width", "0")
    assert code == 2 and "Invalid value for --width: width: must be > 0, got 0" in out, out


def test_a_refused_variable_names_the_variable(run):
    code, out = run("toy", env={"FLYWHEEL_TOY__WIDTH": "-2"})
    assert code == 2 and "Invalid value for FLYWHEEL_TOY__WIDTH: toy.width: must be > 0, got -2" in out, out


def test_a_refused_file_value_names_the_file_and_key(run, tmp_path):
    f = tmp_path / "flywheel.toml"
    f.write_text("[toy]\nwidth = 0\n")
    code, out = run("--config", str(f), "toy")
    assert code == 2, out
    assert f"Invalid value for '--config' / FLYWHEEL_CONFIG: {f}: toy.width: must be > 0, got 0" in out, out
    # the variable wins over the file, and is the one named; a flag wins over both
    code, out = run("--config", str(f), "toy", env={"FLYWHEEL_TOY__WIDTH": "-1"})
    assert code == 2 and "Invalid value for FLYWHEEL_TOY__WIDTH: toy.width: must be > 0, got -1" in out, out
    assert run("--config", str(f), "toy", "--width", "4", env={"FLYWHEEL_TOY__WIDTH": "-1"}) == (
        0, "toy width=4 loud=False")
