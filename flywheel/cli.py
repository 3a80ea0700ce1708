"""The ``flywheel`` command line: one Typer app; each package registers its own commands.

Packages expose ``register(app: typer.Typer)`` in ``<package>/commands.py`` so that each
subcommand lives next to the code it drives (Flagger/Argo habit: a CLI records intent,
the component does the work).
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(help="Flywheel: keep a production MoE model learning from its users.",
                  no_args_is_help=True, add_completion=False)

_PACKAGES = ("flywheel.commands", "serving.commands", "ingest.commands", "learner.commands",
             "deploy.commands")


def _register_all() -> None:
    for mod in _PACKAGES:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as exc:  # a package not built yet must not break the rest
            if exc.name == mod:
                continue
            raise
        m.register(app)


_register_all()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
