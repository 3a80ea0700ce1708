"""The ``flywheel`` CLI follows kubectl's and the Argo Rollouts plugin's conventions: ``-o
json|yaml|wide`` on read commands (``--json`` kept), ``--version``, shell completion, an example
in every command's help that parses, exit 1 for runtime and state errors and 2 for usage errors,
third-party INFO logs only with ``-v``."""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from flywheel import DISTRIBUTION
import typer.main
import yaml
from typer.testing import CliRunner

from flywheel.broker import free_port
from flywheel.cli import THIRD_PARTY_LOGGERS, app, quiet_third_party

READ_COMMANDS = ("status", "versions", "runbook", "broker status", "topics check", "topics create", "data stats",
                 "schemas export")


def leaf_commands():
    """``[(path, click command)]`` for every command the app has, groups walked."""
    out = []

    def walk(cmd, path):
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                walk(sub, path + [name])
        else:
            out.append((" ".join(path), cmd))

    walk(typer.main.get_command(app), [])
    return out


FLYWHEEL = str(Path(sys.executable).with_name("flywheel"))  # the installed entry point (completion keys on its name)


def run(*args, env: dict | None = None):
    return subprocess.run([FLYWHEEL, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_every_command_has_an_example_that_parses():
    cmds = leaf_commands()
    assert len(cmds) >= 20
    for path, cmd in cmds:
        r = CliRunner().invoke(app, [*path.split(), "--help"], terminal_width=200)
        assert r.exit_code == 0, (path, r.output)
        assert "Example:" in r.stdout, f"`flywheel {path} --help` shows no example"
        text = (cmd.help or "") + "\n" + (cmd.epilog or "")
        words = shlex.split(text.split("Example:", 1)[1].strip().splitlines()[0])
        while words and "=" in words[0] and not words[0].startswith("-"):
            words.pop(0)  # VAR=value prefixes
        n = len(path.split())
        assert words[:1 + n] == ["flywheel", *path.split()], (path, words)
        # the example's options and arguments are ones the command accepts (parsed, not run)
        cmd.make_context(path, words[1 + n:])


def test_read_commands_take_output_formats():
    for path in READ_COMMANDS:  # refused while parsing, before the command runs
        r = CliRunner().invoke(app, [*path.split(), "-o", "xml"], terminal_width=200)
        flat = " ".join(r.output.replace("│", " ").split())
        assert r.exit_code == 2 and "'xml' is not one of 'table', 'wide', 'json', 'yaml'" in flat, (path, flat)


def test_json_yaml_wide_show_the_same_data(fw_home):
    (fw_home / "store" / "versions").mkdir(parents=True)  # an empty model store (none: versions exits 1)
    for args in (["runbook"], ["versions"]):
        j = CliRunner().invoke(app, [*args, "-o", "json"])
        y = CliRunner().invoke(app, [*args, "-o", "yaml"])
        legacy = CliRunner().invoke(app, [*args, "--json"])
        assert j.exit_code == y.exit_code == legacy.exit_code == 0, (j.output, y.output)
        assert json.loads(j.stdout) == yaml.safe_load(y.stdout) == json.loads(legacy.stdout)
        w = CliRunner().invoke(app, [*args, "-o", "wide"], terminal_width=200)
        assert w.exit_code == 0 and w.stdout.strip()
    # status with its pod down: exit 1, and the same record in both formats
    url = f"http://127.0.0.1:{free_port()}"
    j = CliRunner().invoke(app, ["status", "--serving", url, "--serving-timeout-s", "1", "-o", "json"])
    y = CliRunner().invoke(app, ["status", "--serving", url, "--serving-timeout-s", "1", "-o", "yaml"])
    assert j.exit_code == y.exit_code == 1
    jd, yd = json.loads(j.stdout), yaml.safe_load(y.stdout)
    assert jd == yd and jd["serving"] is None and url.split("//")[1] in jd["serving_error"]
    r = CliRunner().invoke(app, ["versions", "--json", "-o", "yaml"])
    assert r.exit_code == 2 and "--json conflicts with -o yaml" in r.output


def test_version_flag():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"flywheel {version(DISTRIBUTION)}"


def test_shell_completion():
    env = {"_FLYWHEEL_COMPLETE": "complete_bash", "COMP_WORDS": "flywheel sta", "COMP_CWORD": "1"}
    assert run(env=env).stdout.split() == ["status"]  # the installed entry point answers bash
    env.update(COMP_WORDS="flywheel topics check -o ", COMP_CWORD="4")
    r = CliRunner().invoke(app, [], env=env, prog_name="flywheel")
    assert r.stdout.split() == ["table", "wide", "json", "yaml"]
    # `--show-completion` is a flag that detects the shell from the parent processes
    # (shellingham), which a CI runner may not have ("Shell  not supported"); typer's own test
    # switch makes it take the shell as its value, as `--show-completion bash` reads
    r = run("--show-completion", "bash", env={"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert r.returncode == 0 and "_FLYWHEEL_COMPLETE=complete_bash" in r.stdout, (r.stdout, r.stderr)
    assert "complete -o default -F _flywheel_completion flywheel" in r.stdout


def test_exit_codes_runtime_1_usage_2(fw_home):
    """Usage errors (unknown option, bad value) exit 2; state and runtime errors exit 1
    (``promote`` with no candidate on a real pod: ``tests/test_deploy_faults.py``)."""
    cases = [(["status", "--bogus"], 2), (["versions", "-o", "xml"], 2), (["canary", "start"], 2),
             (["rollback", "--yes", "--serving-timeout-s", "0"], 2), (["controller", "--once", "--steps", "x"], 2),
             (["canary", "abort", "--yes"], 1),  # no canary in progress: a state error
             (["canary", "start", "v000042", "--yes"], 1),  # not in the store
             (["promote", "--yes", "--serving", f"http://127.0.0.1:{free_port()}", "--serving-timeout-s", "1"], 1)]
    for args, code in cases:
        r = CliRunner().invoke(app, args)
        assert r.exit_code == code, (args, r.exit_code, r.output)
        assert "Traceback" not in r.output


def test_third_party_info_logs_only_with_verbose(broker):
    quiet = run("topics", "check", "--bootstrap", broker.bootstrap, "-o", "json")
    loud = run("-v", "topics", "check", "--bootstrap", broker.bootstrap, "-o", "json")
    assert quiet.returncode == loud.returncode == 0, quiet.stderr
    assert json.loads(quiet.stdout) == json.loads(loud.stdout)
    assert " INFO kafka" not in quiet.stderr and quiet.stderr.strip() == ""
    assert " INFO kafka." in loud.stderr


@pytest.fixture()
def restore_logging():
    saved = {n: logging.getLogger(n).level for n in THIRD_PARTY_LOGGERS}
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for n, lv in saved.items():
        logging.getLogger(n).setLevel(lv)
    root.handlers[:], root.level = handlers, level


def test_a_command_that_logs_info_still_hides_kafka_info(restore_logging):
    """``flywheel controller`` sets the root logger to INFO for its own lines: kafka-python's
    and aiokafka's INFO stay off unless ``-v``."""
    quiet_third_party(False)
    logging.basicConfig(level=logging.INFO, force=True)
    assert logging.getLogger("deploy.controller").isEnabledFor(logging.INFO)
    for name in ("kafka.conn", "kafka.net.manager", "aiokafka.consumer.group_coordinator", "httpx"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO), name
        assert logging.getLogger(name).isEnabledFor(logging.WARNING), name
    quiet_third_party(True)
    assert logging.getLogger("kafka.conn").isEnabledFor(logging.INFO)


def test_bad_kafka_settings_stop_kafka_commands_at_start(fw_home, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_KAFKA_SECURITY_PROTOCOL", "SASL_TLS")
    for args in (["serve", "--port", str(free_port())], ["ingest"], ["topics", "check"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 1, (args, r.output)
        assert "error: Kafka settings: FLYWHEEL_KAFKA_SECURITY_PROTOCOL: Input should be 'PLAINTEXT'" in r.stderr
    (fw_home / "store" / "versions").mkdir(parents=True)  # an empty model store (none: versions exits 1)
    r = CliRunner().invoke(app, ["versions", "-o", "json"])  # no Kafka client: not concerned
    assert r.exit_code == 0 and json.loads(r.stdout) == []


def test_the_command_starts_without_torch(fw_home):
    """Shell completion runs the entry point on every TAB, and --version, status, versions and
    runbook need no tensor: importing the CLI and running them must not import torch (seconds
    of start-up: `flywheel --version` took 5.6 s on 2 cores with it, 0.6 s without)."""
    (fw_home / "store" / "versions").mkdir(parents=True)  # an empty model store (none: versions exits 1)
    code = ("import sys; from typer.testing import CliRunner; from flywheel.cli import app\n"
            "codes = [CliRunner().invoke(app, a).exit_code for a in (['versions', '-o', 'json'], "
            "['runbook', '-o', 'yaml'], ['status', '-o', 'json', '--serving', 'http://127.0.0.1:9', "
            "'--serving-timeout-s', '1'])]\n"
            "print(codes, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "FLYWHEEL_HOME": str(fw_home)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[-2] == "[0, 0, 1] False", r.stdout[-2000:]
