"""The serving pod's settings (serving/config.py) and its assembly out of the CLI (serving/pod.py):
each default is declared once, in its model; the engines and ``build_pod`` take the models or
their fields by name; the checks ``flywheel serve`` makes before the model load are callable
without the command line and name the flag."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving.config import EngineConfig, ServeConfig, SettingError, VLLMConfig, split_settings
from serving.pod import check_serve, engine_mismatch


def test_the_serve_commands_options_are_the_models_fields():
    import typer

    from flywheel.cli import app
    from schemas.options import cli_fields, field_default

    cmd = typer.main.get_command(app).commands["serve"]
    opts = {p.name: p for p in cmd.params}
    for model in (ServeConfig, EngineConfig, VLLMConfig):
        for name, info in cli_fields(model).items():
            assert opts[name].default == field_default(info), (model.__name__, name)
    assert opts["eval_share"].envvar == "FLYWHEEL_EVAL_SHARE" and opts["fleet"].envvar == "FLYWHEEL_FLEET"
    assert "max_queue" not in opts and "scheduler" not in opts  # programs only (benchmarks)


def test_settings_by_name_reach_their_model_and_an_unknown_one_is_refused():
    eng, vllm = split_settings({"max_batch": 2, "dtype": "bfloat16"}, EngineConfig(), VLLMConfig(), where="t")
    assert eng.max_batch == 2 and vllm.dtype == "bfloat16" and eng.device == EngineConfig().device
    with pytest.raises(TypeError, match="t: unexpected setting.*max_bacth"):
        split_settings({"max_bacth": 2}, EngineConfig(), where="t")
    with pytest.raises(ValidationError, match="scheduler"):
        split_settings({"scheduler": "fifo"}, EngineConfig(), where="t")


@pytest.mark.parametrize("kw,word", [({"waiting_served_ratio": float("inf")}, "finite"),
                                     ({"waiting_served_ratio": -1.0}, "greater than or equal to 0"),
                                     ({"max_waiting_tokens": 0}, "greater than or equal to 1"),
                                     ({"max_batch": 0}, "greater than or equal to 1")])
def test_engine_config_bounds(kw, word):
    with pytest.raises(ValidationError, match=word):
        EngineConfig(**kw)


def test_serve_config_checks_engine_eval_share_and_key_files(tmp_path):
    with pytest.raises(ValidationError, match="must be torch or vllm"):
        ServeConfig(engine="tpu")
    with pytest.raises(ValidationError, match=r"must be in \[0, 1\]"):
        ServeConfig(eval_share=1.5)
    with pytest.raises(ValidationError, match="does not exist"):
        ServeConfig(api_keys_file=tmp_path / "nope")
    with pytest.raises(ValidationError, match="is a directory"):
        ServeConfig(feedback_keys_file=tmp_path)


def test_pod_name_is_the_flag_else_hostname_else_pod_0(monkeypatch):
    monkeypatch.setenv("HOSTNAME", "serving-7")
    assert ServeConfig().pod_name() == "serving-7" and ServeConfig(pod="p").pod_name() == "p"
    monkeypatch.delenv("HOSTNAME")
    assert ServeConfig().pod_name() == "pod-0"


def test_a_setting_of_the_other_engine_is_named():
    assert engine_mismatch("torch", EngineConfig(), VLLMConfig()) is None
    assert engine_mismatch("vllm", EngineConfig(), VLLMConfig()) is None
    name, why = engine_mismatch("vllm", EngineConfig(prefix_caching=True), VLLMConfig())
    assert name == "prefix_caching" and why.startswith("torch engine only")
    name, why = engine_mismatch("vllm", EngineConfig(max_waiting_tokens=5), VLLMConfig())
    assert name == "max_waiting_tokens" and "vLLM schedules prefills" in why
    name, why = engine_mismatch("torch", EngineConfig(), VLLMConfig(tensor_parallel_size=2))
    assert name == "tensor_parallel_size" and why == "vLLM engine only (this pod runs --engine torch)"


def test_check_serve_is_callable_without_the_command_line(monkeypatch):
    from schemas.settings import free_port

    port = free_port()
    with pytest.raises(SettingError) as exc:
        check_serve(ServeConfig(port=port, admin_port=port), EngineConfig(), VLLMConfig())
    assert exc.value.flag == "--admin-port" and "must differ from --port" in exc.value.reason
    with pytest.raises(SettingError) as exc:
        check_serve(ServeConfig(port=port), EngineConfig(aligned_logprobs=True), VLLMConfig(dtype="x"))
    assert exc.value.flag == "--dtype"
    monkeypatch.delenv("FLYWHEEL_ADMIN_TOKEN", raising=False)
    with pytest.raises(SettingError) as exc:
        check_serve(ServeConfig(host="0.0.0.0", port=port), EngineConfig(), VLLMConfig())
    assert exc.value.flag == "--host" and "FLYWHEEL_ADMIN_TOKEN" in exc.value.reason


def test_build_pod_takes_the_engine_config(tiny_moe_dir):
    from serving.pod import build_pod
    from serving.slots import CheckpointStore

    p = build_pod(CheckpointStore(tiny_moe_dir), pod="cfg", log_events=False,
                  engine_config=EngineConfig(max_batch=3, fused_join_pad_tokens=8), max_waiting_tokens=7)
    try:
        e = p.engine
        assert (e.max_batch, e.fused_join_pad_tokens, e.max_waiting_tokens) == (3, 8, 7)
        assert e.config.max_queue == EngineConfig().max_queue
    finally:
        p.close()
    with pytest.raises(ValueError, match="tensor_parallel_size: vLLM engine only"):
        build_pod(CheckpointStore(tiny_moe_dir), pod="cfg", log_events=False, tensor_parallel_size=2)
