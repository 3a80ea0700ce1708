"""The ``flywheel`` command line: one Typer app; each package registers its own commands.

Packages expose ``register(app: typer.Typer)`` in ``<package>/commands.py`` so that each
subcommand lives next to the code it drives (Flagger/Argo habit: a CLI records intent,
the component does the work).

Conventions (kubectl, the Argo Rollouts plugin):
    * read commands take ``-o json|yaml|wide`` (:mod:`schemas.output`; ``--json`` kept);
    * ``flywheel --version``; shell completion (``--install-completion`` / ``--show-completion``);
    * every command's help ends with an example (its docstring's ``Example:`` or :data:`EXAMPLES`);
    * exit status 0 ok, 1 a runtime or state error (unreachable pod, nothing to promote,
      a mismatch), 2 a usage error only (bad or missing option or argument);
    * third-party INFO logs (kafka-python, aiokafka, httpx) are off unless ``-v``.
"""

from __future__ import annotations

import importlib
import logging
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

import typer

from flywheel import DISTRIBUTION

app = typer.Typer(help="Flywheel: keep a production MoE model learning from its users.",
                  no_args_is_help=True, add_completion=True,
                  context_settings={"help_option_names": ["-h", "--help"]})  # every command's context inherits it

_PACKAGES = ("flywheel.commands", "flywheel.kafka_commands", "serving.commands", "ingest.commands",
             "learner.commands", "deploy.commands")

# loggers of libraries whose INFO lines (one per connection, request or rebalance) drown ours
THIRD_PARTY_LOGGERS = ("kafka", "aiokafka", "httpx", "httpcore", "urllib3")

# one example per command path; a command's own docstring may carry its ``Example:`` instead
EXAMPLES: dict[str, str] = {
    "demo": "flywheel demo --quick --out flywheel-demo",
    "experiment": "flywheel experiment --rounds 2 --problems 40 --out flywheel-experiment",
    "vllm-venv": "flywheel vllm-venv --path .venv-vllm",
    "serve": "flywheel serve --port 8000",
    "ingest": "flywheel ingest",
    "learn": "flywheel learn --once",
    "pause": "flywheel pause --reason 'bad labels from app X' --yes",
    "resume": "flywheel resume --yes",
    "runbook": "flywheel runbook --json",
    "controller": "flywheel controller --serving http://pod-0:8000 --serving http://pod-1:8000",
    "status": "flywheel status -o wide",
    "versions": "flywheel versions -o yaml",
    "promote": "flywheel promote --yes",
    "rollback": "flywheel rollback --to v000002 --yes",
    "broker start": "flywheel broker start --partitions 6",
    "broker stop": "flywheel broker stop",
    "broker status": "flywheel broker status -o json",
    "model init": "flywheel model init --experts 4 --top-k 2",
    "data stats": "flywheel data stats -o json",
    "data migrate": "flywheel data migrate --dry-run",
    "canary start": "flywheel canary start v000003 --yes",
    "canary abort": "flywheel canary abort --yes",
    "topics create": "FLYWHEEL_KAFKA_BOOTSTRAP=kafka:9093 FLYWHEEL_KAFKA_TOPIC_PREFIX=team-a. "
                     "FLYWHEEL_KAFKA_REPLICATION_FACTOR=3 flywheel topics create",
    "topics check": "flywheel topics check -o wide",
    "schemas export": "flywheel schemas export docs/schemas",
}


def _version_callback(value: bool) -> None:
    if value:
        try:
            v = version(DISTRIBUTION)
        except PackageNotFoundError:  # running from a checkout that was never installed
            v = "unknown"
        typer.echo(f"flywheel {v}")
        raise typer.Exit()


def quiet_third_party(verbose: bool) -> None:
    """Third-party loggers at WARNING (INFO with ``verbose``), whatever level a command gives
    the root logger later; with ``verbose`` a stderr handler shows INFO lines."""
    level = logging.INFO if verbose else logging.WARNING
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(level)
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")


# commands that open Kafka clients: a bad FLYWHEEL_KAFKA_* stops them at start, named (exit 1),
# instead of a pod that journals every event because its producer cannot be built
KAFKA_COMMANDS = frozenset({"serve", "ingest", "controller", "demo", "experiment", "promote", "rollback", "pause",
                            "resume", "canary", "topics"})


def check_kafka_settings() -> None:
    """Validate ``FLYWHEEL_KAFKA_*`` now; on a bad value print each variable and reason, exit 1."""
    from pydantic import ValidationError

    from schemas.settings import kafka_settings

    try:
        kafka_settings()
    except ValidationError as exc:
        errs = "; ".join(f"FLYWHEEL_KAFKA_{'_'.join(str(p) for p in e['loc']).upper() or '*'}: {e['msg']}"
                         for e in exc.errors())
        typer.echo(f"error: Kafka settings: {errs}", err=True)
        raise typer.Exit(1) from None


@app.callback()
def _root(ctx: typer.Context,
          verbose: bool = typer.Option(False, "-v", "--verbose",
                                       help="Show INFO logs of kafka-python, aiokafka and httpx."),
          _version: Optional[bool] = typer.Option(None, "--version", callback=_version_callback, is_eager=True,
                                                  help="Print the version and exit."),
          config: Optional[Path] = typer.Option(
              None, "--config", envvar="FLYWHEEL_CONFIG", dir_okay=False,
              help="flywheel.toml: paths, \\[kafka] and one table of options per command (schemas/config.py); "
                   "a flag or an environment variable overrides it.")) -> None:
    """Flywheel: keep a production MoE model learning from its users."""
    quiet_third_party(verbose)
    if not ctx.resilient_parsing:
        from schemas.config import configure_cli, configure_env

        if config is None:
            configure_env(ctx)
        else:
            try:
                configure_cli(ctx, config)
            except (UnicodeDecodeError, OSError) as exc:  # not UTF-8 text, unreadable: named, exit 2
                why = f"not UTF-8 text ({exc.reason} at byte {exc.start})" if isinstance(exc, UnicodeDecodeError) \
                    else f"cannot read it ({exc.strerror or exc})"
                raise typer.BadParameter(f"{config}: {why}", ctx=ctx,
                                         param_hint="'--config' / FLYWHEEL_CONFIG") from None
    if ctx.invoked_subcommand in KAFKA_COMMANDS and not ctx.resilient_parsing:
        check_kafka_settings()


def _command_name(info) -> str:
    from typer.main import get_command_name

    return info.name or get_command_name(info.callback.__name__)


def _add_examples(t: typer.Typer, prefix: str = "") -> None:
    """Append ``Example:`` to every command's epilog from :data:`EXAMPLES` unless its help has one."""
    for info in t.registered_commands:
        path = (prefix + " " + _command_name(info)).strip()
        doc = (info.help or "") + (info.callback.__doc__ or "") + (info.epilog or "")
        if "Example" not in doc and path in EXAMPLES:
            info.epilog = f"Example: {EXAMPLES[path]}"
    for g in t.registered_groups:
        name = g.name if isinstance(g.name, str) else g.typer_instance.info.name
        _add_examples(g.typer_instance, (prefix + " " + str(name)).strip())


def _register_all() -> None:
    for mod in _PACKAGES:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as exc:  # a package not built yet must not break the rest
            if exc.name == mod:
                continue
            raise
        m.register(app)
    _add_examples(app)


_register_all()


def main() -> None:
    from modelstore.store import StoreUnusableError
    from schemas.settings import HomeUnusableError

    try:
        app()
    except SystemExit as exc:
        pod = sys.modules.get("serving.pod")  # loaded only by a command that ran a pod
        if pod is not None and pod.exit_after_close_requested():
            pod.exit_now(exc.code)  # the pod is closed: no interpreter teardown (D112)
        raise
    except StoreUnusableError as exc:  # FLYWHEEL_STORE names a file or an unwritable place
        typer.echo(f"error: {exc.strerror}", err=True)
        raise SystemExit(1) from None
    except HomeUnusableError as exc:  # FLYWHEEL_HOME names a file or an uncreatable place
        typer.echo(f"error: {exc}", err=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
