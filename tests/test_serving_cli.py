"""``flywheel serve`` as a real subprocess: empty store initialised from the base model dir,
OpenAI client request, CompletionEvent on Kafka, clean shutdown on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import openai

from schemas.events import CompletionEvent
from schemas.settings import free_port, topic_names
from tests.test_serving_app import consume


def test_flywheel_serve_subprocess(tiny_moe_dir, broker, fw_home, tmp_path):
    port = free_port()
    env = dict(os.environ, FLYWHEEL_HOME=str(fw_home), FLYWHEEL_MODEL_DIR=str(tiny_moe_dir),
               FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap, FLYWHEEL_ADMIN_TOKEN="t", FLYWHEEL_API_KEYS="x",
               FLYWHEEL_FEEDBACK_KEYS="fb-key", FLYWHEEL_EVAL_SHARE="1")
    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "serve", "--port", str(port),
                             "--store", str(store), "--pod", "cli-pod", "--max-batch", "4",
                             "--served-model-name", "fw"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            time.sleep(0.3)
        else:
            raise AssertionError("flywheel serve did not become healthy in 300 s")
        assert (store / "versions" / "v000000" / "manifest.json").exists()  # init_base on empty store
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="fw", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
        assert r.model == "v000000"
        recs = [x for x in consume(broker.bootstrap, topic_names().completions, 1) if x.key == r.id.encode()]
        ev = CompletionEvent.from_bytes(recs[0].value)
        assert len(recs) == 1 and ev.pod == "cli-pod" and ev.split == "eval"  # FLYWHEEL_EVAL_SHARE=1
        fb = {"Authorization": "Bearer fb-key"}
        assert httpx.post(url + "/v1/feedback", json={"completion_id": r.id, "value": 1}, headers=fb).status_code == 200
        assert httpx.post(url + "/v1/completions", json={"model": "fw", "prompt": "x"}, headers=fb).status_code == 403
        assert httpx.get(url + "/admin/slots").status_code == 401  # FLYWHEEL_ADMIN_TOKEN honoured
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    out = proc.stdout.read().decode()
    assert proc.returncode == 0, out[-3000:]
    # a SIGTERM's wait is announced, and with the broker up every event reached it
    assert "stopping: delivering" in out and "every event delivered to Kafka" in out, out[-3000:]


def test_serve_engine_flag_errors_name_the_flag(tmp_path):
    import importlib.util

    from typer.testing import CliRunner

    from flywheel.cli import app

    r = CliRunner().invoke(app, ["serve", "--engine", "tpu", "--model-dir", str(tmp_path)])
    assert r.exit_code != 0 and "--engine" in r.output and "torch or vllm" in r.output
    if importlib.util.find_spec("vllm") is None:  # the main venv: vLLM lives in its own
        r = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--model-dir", str(tmp_path)])
        assert r.exit_code != 0 and "--engine" in r.output and "vllm is not installed" in r.output


@pytest.mark.parametrize("value", ["1.5", "nan", "-0.1"])
def test_serve_eval_share_out_of_range_names_the_flag(tmp_path, value):
    from typer.testing import CliRunner

    from flywheel.cli import app

    r = CliRunner().invoke(app, ["serve", "--eval-share", value, "--model-dir", str(tmp_path), "--port",
                                 str(free_port())])
    assert r.exit_code == 2 and "--eval-share" in r.output, r.output


def _flat(text: str) -> str:
    """CLI output with rich's box characters and line wraps removed."""
    return " ".join(text.replace("│", " ").replace("╭", " ").replace("╰", " ").replace("─", " ").split())


def test_serve_port_errors_name_the_flag(tmp_path):
    import socket

    from typer.testing import CliRunner

    from flywheel.cli import app

    for bad, reason in (("-1", "greater than or equal to 1"), ("99999", "less than or equal to 65535"),
                        ("0", "greater than or equal to 1"), ("http", "valid integer")):
        r = CliRunner().invoke(app, ["serve", "--port", bad, "--model-dir", str(tmp_path)])
        out = _flat(r.output)
        assert r.exit_code == 2 and "--port" in out and reason in out, (bad, out)
        assert "Traceback" not in r.output
    with socket.socket() as s:  # a port that is taken: refused before the model load
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        r = CliRunner().invoke(app, ["serve", "--port", str(taken), "--model-dir", str(tmp_path)])
    out = _flat(r.output)
    assert r.exit_code == 2 and "--port" in out and f"cannot listen on 127.0.0.1:{taken}" in out, out


def test_serve_without_a_model_says_to_run_model_init(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from flywheel.broker import free_port
    from flywheel.cli import app

    monkeypatch.setenv("FLYWHEEL_MODEL_DIR", str(tmp_path / "no-model"))
    r = CliRunner().invoke(app, ["serve", "--port", str(free_port()), "--store", str(tmp_path / "store")])
    out = _flat(r.output)
    assert r.exit_code == 2 and "flywheel model init" in out and "--model-dir" in out, out
    assert "Traceback" not in r.output


def test_serve_bad_setups_are_usage_errors(tmp_path, tiny_moe_dir, monkeypatch):
    """Each mistake names its flag (exit 2, no traceback) before any model load; a store URL in
    FLYWHEEL_STORE is opened as the URL, not as a local directory named after it."""
    from typer.testing import CliRunner

    from modelstore.store import ModelStore
    from flywheel.broker import free_port
    from flywheel.cli import app

    monkeypatch.delenv("FLYWHEEL_ADMIN_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)
    url = "memory://serve-cli-test/store"
    ModelStore(url).init_base(tiny_moe_dir)
    monkeypatch.setenv("FLYWHEEL_STORE", url)
    (tmp_path / "empty").mkdir()
    cases = [(["--host", "0.0.0.0"], "--host", "set FLYWHEEL_ADMIN_TOKEN"),
             (["--model-dir", str(tmp_path / "empty")], "--model-dir", "no config.json"),
             (["--api-keys-file", str(tmp_path / "nope.txt")], "--api-keys-file", "does not exist"),
             (["--version", "v000099"], "--version", "it has v000000"),
             (["--waiting-served-ratio", "inf"], "--waiting-served-ratio", "finite"),
             (["--waiting-served-ratio", "nan"], "--waiting-served-ratio", "greater than or equal to 0"),
             (["--waiting-served-ratio", "-1"], "--waiting-served-ratio", "greater than or equal to 0"),
             (["--engine", "vllm", "--waiting-served-ratio", "0.3"], "--waiting-served-ratio", "torch engine only"),
             (["--engine", "vllm", "--max-waiting-tokens", "5"], "--max-waiting-tokens", "torch engine only"),
             (["--max-waiting-tokens", "0"], "--max-waiting-tokens", "greater than or equal to 1"),
             (["--fused-join-pad-tokens", "-1"], "--fused-join-pad-tokens", "greater than or equal to 0"),
             (["--engine", "vllm", "--fused-join-pad-tokens", "8"], "--fused-join-pad-tokens",
              "torch engine only")]
    for args, flag, why in cases:
        r = CliRunner().invoke(app, ["serve", "--port", str(free_port()), *args])
        out = _flat(r.output)
        assert r.exit_code == 2 and flag in out and why in out and "Traceback" not in r.output, (args, out)
    assert not (tmp_path / "memory:").exists()  # the URL was not taken for a local path


def test_vllm_venv_installs_the_pods_packages_at_pyprojects_pins():
    import tomllib

    from serving.vllm_env import serving_pins

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + [d for extra in project.get("optional-dependencies", {}).values() for d in extra]
    pinned = dict(d.split("==") for d in deps if "==" in d)  # core and per-role extras ([serve], [ingest], ...)
    pins = dict(p.split("==") for p in serving_pins())
    assert {n: v for n, v in pins.items() if n in pinned} == {n: pinned[n] for n in pins if n in pinned}
    assert {"kafka-python", "aiokafka", "zstandard", "duckdb", "pyarrow"} <= set(pins) & set(pinned)


def test_vllm_venv_names_the_failed_step(tmp_path, monkeypatch):
    from serving.vllm_env import ensure_vllm_venv

    with pytest.raises(RuntimeError, match="create venv failed"):
        ensure_vllm_venv(tmp_path / "v", python="/bin/false", log=lambda m: None)
    repo_venv = Path(__file__).resolve().parents[1] / ".venv-vllm"
    if repo_venv.exists():  # built by the README's test line: found, not rebuilt
        said = []
        assert ensure_vllm_venv(repo_venv, log=said.append) == repo_venv / "bin" / "python"
        assert said == [f"vllm-venv: {repo_venv} already has vllm"]
        # as `flywheel vllm-venv` calls it: a path relative to the repo
        monkeypatch.chdir(repo_venv.parent)
        assert ensure_vllm_venv(Path(".venv-vllm"), log=said.append) == repo_venv / "bin" / "python"
