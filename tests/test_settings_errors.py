"""Settings refused with the variable or key named, never a traceback (real CLI subprocesses)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def flywheel(tmp_path, *args, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    e.update(FLYWHEEL_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), COLUMNS="200")
    e.update(env)
    (tmp_path / "home" / "store" / "versions").mkdir(parents=True, exist_ok=True)  # `versions` reads a store
    return subprocess.run([sys.executable, "-m", "flywheel.cli", *args], cwd=tmp_path, env=e,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value,why", [("{bad", "not a JSON object"), ("[1]", "got list")])
def test_malformed_retention_json_is_named_not_a_traceback(tmp_path, value, why):
    r = flywheel(tmp_path, "topics", "check", FLYWHEEL_KAFKA_RETENTION_MS=value,
                 FLYWHEEL_KAFKA_BOOTSTRAP="127.0.0.1:1")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "SettingsError" not in r.stderr, r.stderr[-2000:]
    assert "FLYWHEEL_KAFKA_RETENTION_MS" in r.stderr and why in r.stderr, r.stderr


@pytest.mark.parametrize("config", [False, True], ids=["env_only", "with_file"])
def test_malformed_json_list_in_a_command_variable_is_a_usage_error(tmp_path, config):
    args = ["--config", str(tmp_path / "f.toml")] if config else []
    (tmp_path / "f.toml").write_text("[ingest]\ntick_s = 1\n")
    r = flywheel(tmp_path, *args, "versions", "-o", "json", FLYWHEEL_CONTROLLER__SERVING="[bad")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "JSONDecodeError" not in r.stderr and "Traceback" not in r.stderr
    text = " ".join(r.stderr.replace("│", " ").split())
    assert "FLYWHEEL_CONTROLLER__SERVING" in text and "not a JSON list" in text, text


@pytest.mark.parametrize("var", ["FLYWHEEL_INGES__TICK_S", "FLYWHEEL_BROKER__PARTITIONS"])
def test_a_command_variable_naming_no_command_is_refused(tmp_path, var):
    """A typo in the command part used to be ignored silently: the worker ran with its default."""
    r = flywheel(tmp_path, "versions", "-o", "json", **{var: "3"})
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-2000:])
    text = " ".join(r.stderr.replace("│", " ").split())
    assert var in text and "names no command" in text, text


def test_a_value_from_a_variable_is_blamed_on_the_variable_not_the_file(tmp_path):
    (tmp_path / "f.toml").write_text("[ingest]\ntick_s = 1\n")
    r = flywheel(tmp_path, "--config", str(tmp_path / "f.toml"), "versions", "-o", "json",
                 FLYWHEEL_INGEST__TICK_S="abc")
    assert r.returncode == 2
    text = " ".join(r.stderr.replace("│", " ").split())
    assert "FLYWHEEL_INGEST__TICK_S" in text and "ingest.tick_s" in text, text


def test_well_formed_variables_still_apply(tmp_path):
    r = flywheel(tmp_path, "versions", "-o", "json", FLYWHEEL_SERVE__PORT="8001",
                 FLYWHEEL_BROKER__START__PARTITIONS="3", FLYWHEEL_CONTROLLER__SERVING='["http://a:1"]')
    assert r.returncode == 0, r.stderr[-2000:]


def test_home_that_is_a_file_is_named_in_one_line(tmp_path):
    """FLYWHEEL_HOME naming a file was a FileExistsError traceback from mkdir."""
    f = tmp_path / "afile"
    f.write_text("")
    r = flywheel(tmp_path, "ingest", FLYWHEEL_KAFKA_BOOTSTRAP="127.0.0.1:1", FLYWHEEL_HOME=str(f))
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "FileExistsError" not in r.stderr, r.stderr[-2000:]
    assert f"FLYWHEEL_HOME={f}" in r.stderr and "not a directory" in r.stderr


@pytest.mark.parametrize("table,text", [
    ("[ingest]\nseal_after_s = true\n", "ingest.seal_after_s: a number is expected, got a boolean"),
    ("[serve]\nport = true\n", "serve.port: an integer is expected, got a boolean"),
    ("[ingest]\napp_id = false\n", "ingest.app_id: a string is expected, got a boolean"),
])
def test_a_boolean_for_a_number_or_text_in_the_file_is_refused(tmp_path, table, text):
    """TOML true/false for a numeric option was taken as 1/0 (seal after 1 s, port 1)."""
    (tmp_path / "f.toml").write_text(table)
    r = flywheel(tmp_path, "--config", str(tmp_path / "f.toml"), "versions", "-o", "json")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-2000:])
    assert text in " ".join(r.stderr.replace("│", " ").split()), r.stderr


def test_booleans_still_set_flags_in_the_file(tmp_path):
    (tmp_path / "f.toml").write_text("[serve]\nprefix_caching = true\n[learn]\nrouter_replay = false\n")
    r = flywheel(tmp_path, "--config", str(tmp_path / "f.toml"), "versions", "-o", "json")
    assert r.returncode == 0, r.stderr[-2000:]
