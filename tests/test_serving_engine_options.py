"""``flywheel serve`` engine options: each is refused with the flag named when it does not
apply (vLLM options on the torch engine, --device on vLLM, cuda without a CUDA device), and
``build_pod`` hands the torch device and scheduler to the engine."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flywheel.cli import app


@pytest.mark.parametrize("args,flag", [
    (["--dtype", "bfloat16"], "--dtype"),
    (["--max-model-len", "512"], "--max-model-len"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization"),
    (["--quantization", "fp8"], "--quantization"),
])
def test_vllm_options_refused_on_torch_engine(args, flag):
    r = CliRunner().invoke(app, ["serve", "--port", "1", *args])
    assert r.exit_code == 2 and flag in r.output and "vLLM engine only" in r.output


def test_cuda_device_needs_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = CliRunner().invoke(app, ["serve", "--device", "cuda"])
    assert r.exit_code == 2 and "--device" in r.output and "no CUDA device" in r.output


def test_build_pod_passes_device_and_scheduler(tiny_moe_dir):
    from serving.pod import build_pod
    from serving.slots import CheckpointStore

    p = build_pod(CheckpointStore(tiny_moe_dir), pod="t", log_events=False, device="cpu", scheduler="static")
    try:
        assert str(p.engine.device) == "cpu" and p.engine.scheduler == "static"
        assert p.engine.check_health()["scheduler"] == "static"
    finally:
        p.close()
