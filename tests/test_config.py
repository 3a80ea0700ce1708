"""flywheel.toml (schemas/config.py) through the real `flywheel` command: serve, ingest, learn
and controller take their options from the file; an environment variable overrides the file
and a flag overrides both. The commands' bodies are replaced by recorders (what is under test
is option resolution, not the roles)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

import flywheel.cli as cli
from schemas.config import ConfigError, FlywheelConfig, command_defaults, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "deploy" / "k8s" / "flywheel.toml"
ROLES = ("serve", "ingest", "learn", "controller")


@pytest.fixture()
def calls(monkeypatch):
    """Replace the four role commands' bodies by recorders of their resolved options."""
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
    """``configure_cli`` writes the file's paths and ``[kafka]`` to this process's environment
    (``FlywheelConfig.apply_env``), as the CLI process needs; restore it after each test, so
    that a later test file's subprocesses do not inherit ``FLYWHEEL_KAFKA_PARTITIONS=3``."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def run(*args, env=None):
    r = CliRunner().invoke(cli.app, list(args), env=env or {})
    return r


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "flywheel.toml"
    p.write_text(text)
    return p


CFG = """
home = "{home}"
[kafka]
partitions = 3
retention_ms = {{ completions = 86400000 }}
[serve]
port = 8123
max-batch = 16
[ingest]
seal_after_s = 30.0
[learn]
every_n = 500
[controller]
serving = ["dns+http://flywheel-serving-pods:8000"]
min_votes = 77
"""


def test_every_role_reads_the_file_env_and_flag_override(tmp_path, calls, monkeypatch):
    p = write(tmp_path, CFG.format(home=tmp_path / "home"))
    for role in ROLES:
        r = run("--config", str(p), role)
        assert r.exit_code == 0, r.output
    assert calls["serve"]["port"] == 8123 and calls["serve"]["max_batch"] == 16
    assert calls["serve"]["host"] == "127.0.0.1"  # not in the file: the built-in default
    assert calls["ingest"]["seal_after_s"] == 30.0
    assert calls["learn"]["every_n"] == 500
    assert calls["controller"]["serving"] == ["dns+http://flywheel-serving-pods:8000"]
    assert calls["controller"]["min_votes"] == 77
    # the environment beats the file; a flag beats both
    assert run("serve", env={"FLYWHEEL_CONFIG": str(p), "FLYWHEEL_SERVE__PORT": "9001"}).exit_code == 0
    assert calls["serve"]["port"] == 9001 and calls["serve"]["max_batch"] == 16
    assert run("--config", str(p), "serve", "--port", "9002", env={"FLYWHEEL_SERVE__PORT": "9001"}).exit_code == 0
    assert calls["serve"]["port"] == 9002
    # without a file nothing is read from a file
    assert run("serve").exit_code == 0 and calls["serve"]["port"] == 8000


def test_the_environment_applies_without_a_file(calls):
    """Found by a new user: ``FLYWHEEL_<COMMAND>__<OPTION>`` was read only when a config file
    was named, so a bad value started the worker and a good one was ignored."""
    r = run("ingest", env={"FLYWHEEL_INGEST__SAMPLES_VALUE": "sample", "FLYWHEEL_INGEST__SEAL_AFTER_S": "7"})
    assert r.exit_code == 0, r.output
    assert calls["ingest"]["samples_value"] == "sample" and calls["ingest"]["seal_after_s"] == 7.0
    assert run("ingest", "--samples-value", "notice", env={"FLYWHEEL_INGEST__SAMPLES_VALUE": "sample"}).exit_code == 0
    assert calls["ingest"]["samples_value"] == "notice"  # a flag beats the environment
    for var, value, named in [("FLYWHEEL_INGEST__SAMPLES_VALUE", "1", "ingest.samples_value"),
                              ("FLYWHEEL_INGEST__TICK_S", "abc", "ingest.tick_s"),
                              ("FLYWHEEL_INGEST__NO_SUCH", "1", "ingest.no_such")]:
        r = run("ingest", env={var: value})
        assert r.exit_code == 2 and named in " ".join(r.output.split()), r.output


def test_paths_and_kafka_go_to_the_environment_unless_set(tmp_path, calls, monkeypatch):
    from schemas import settings

    p = write(tmp_path, CFG.format(home=tmp_path / "home"))
    seen = {}
    calls.clear()

    env = {}
    cfg = load_config(p)
    cfg.apply_env(env)
    assert env["FLYWHEEL_HOME"] == str(tmp_path / "home")
    assert env["FLYWHEEL_KAFKA_PARTITIONS"] == "3"
    assert env["FLYWHEEL_KAFKA_RETENTION_MS"] == '{"completions": 86400000}'
    env = {"FLYWHEEL_KAFKA_PARTITIONS": "12", "FLYWHEEL_HOME": "/elsewhere"}
    cfg.apply_env(env)
    assert env["FLYWHEEL_KAFKA_PARTITIONS"] == "12" and env["FLYWHEEL_HOME"] == "/elsewhere"
    # through the CLI, in-process: schemas.settings then sees the file's values
    monkeypatch.setattr(os, "environ", os.environ.copy())
    assert run("--config", str(p), "serve").exit_code == 0
    seen["home"], seen["kafka"] = settings.home(), settings.kafka_settings()
    assert seen["home"] == tmp_path / "home"
    assert seen["kafka"].partitions == 3 and seen["kafka"].retention_ms == {"completions": 86400000}


def test_env_overrides_paths_in_the_model(tmp_path, monkeypatch):
    p = write(tmp_path, 'home = "/from/file"\nstore = "s3://b/fw"\n')
    monkeypatch.setenv("FLYWHEEL_HOME", "/from/env")
    cfg = load_config(p)
    assert (cfg.home, cfg.store) == ("/from/env", "s3://b/fw")


@pytest.mark.parametrize("text,msg", [
    ("[serve]\nprot = 1\n", "serve.prot: not an option of `flywheel serve` (options: "),
    ("[serve]\nport = \"x\"\n", "serve.port: "),
    ("[serve]\nport = 70000\n", "serve.port: "),
    ("[nosuch]\na = 1\n", "[nosuch]: no such command"),
    ("[kafka]\nsasl_password = \"p\"\n", "kafka.sasl_password: secrets do not go in the config file"),
    ("[kafka]\npartitionz = 3\n", "kafka.partitionz: unknown key"),
    ("[kafka]\npartitions = 0\n", "kafka.partitions: "),
    ("colour = \"red\"\n", "colour: a top-level key is one of"),
    ("[serve\nport = 1\n", "not valid TOML"),
    ("[controller]\nserving = 3\n", "controller.serving: a list is expected"),
])
def test_bad_config_is_a_usage_error_naming_the_key(tmp_path, calls, text, msg):
    p = write(tmp_path, text)
    r = run("--config", str(p), "serve")
    assert r.exit_code == 2, r.output
    flat = " ".join(r.output.replace("│", " ").split())
    assert msg in flat, flat
    assert "serve" not in calls


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_the_shipped_example_is_valid_for_every_role(calls, monkeypatch):
    """deploy/k8s/flywheel.toml (the ConfigMap's content) loads, and every table's options
    exist on today's commands with values they accept."""
    cfg = load_config(EXAMPLE)
    import typer

    defaults = command_defaults(cfg, typer.main.get_command(cli.app))
    assert set(defaults) == set(ROLES)
    env: dict[str, str] = {}
    cfg.apply_env(env)
    assert env["FLYWHEEL_KAFKA_REPLICATION_FACTOR"] == "3" and env["FLYWHEEL_STORE"] == "/shared/store"
    assert defaults["controller"]["serving"][0].startswith("dns+http://")
    assert isinstance(cfg, FlywheelConfig)


def test_learner_state_location(tmp_path, monkeypatch):
    """The learner's watermark and resume checkpoint: FLYWHEEL_LEARNER_STATE (shared storage
    in a fleet), else under the home; the shipped example puts them on /shared."""
    from schemas import settings

    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FLYWHEEL_LEARNER_STATE", raising=False)
    assert settings.learner_state_dir() == tmp_path / "home" / "learner"
    monkeypatch.setenv("FLYWHEEL_LEARNER_STATE", str(tmp_path / "shared" / "learner"))
    assert settings.learner_state_dir() == tmp_path / "shared" / "learner"
    assert load_config(EXAMPLE).commands["learn"]["state"] == "/shared/learner"


def test_a_role_without_a_broker_says_so_in_one_line(tmp_path, monkeypatch):
    """Found by a new user: ``flywheel ingest`` with no broker printed a ~40-line traceback
    before the message; it is the message alone, exit status 1."""
    for k in list(os.environ):
        if k.startswith("FLYWHEEL_"):
            monkeypatch.delenv(k)
    r = CliRunner().invoke(cli.app, ["ingest"], env={"FLYWHEEL_HOME": str(tmp_path)})
    assert r.exit_code == 1
    assert r.output.strip() == "error: no Kafka broker: set FLYWHEEL_KAFKA_BOOTSTRAP or run `flywheel broker start`"
