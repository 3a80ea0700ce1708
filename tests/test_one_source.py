"""Issue 21 item 1: every setting is declared once, in its component's config model.

Three checks, each independent of how a command was written:

* every CLI option generated from a config model (``schemas.options.config_options``) has
  the model's default, bounds and help (read back from the click command the user runs);
* no other declaration restates a model field's default: a ``typer.Option(<literal>)`` for a
  parameter named as a field, a field of another ``*Config``/``*Settings`` class, or a
  function parameter in the model's own package, with the same name and default (found by
  walking the source's syntax tree, so a copy added tomorrow fails too);
* every key of the k8s example ``deploy/k8s/flywheel.toml`` is an option of its command and
  differs from that option's default (an example sets what it changes).
"""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

import click
import pytest
import typer

from schemas.options import CONFIG_MODELS, cli_fields, field_default, model_fields

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("schemas", "serving", "ingest", "learner", "deploy", "flywheel")


def _root_command() -> click.Command:
    from flywheel.cli import app

    return typer.main.get_command(app)


def _walk(cmd: click.Command, path: str = ""):
    if hasattr(cmd, "commands"):  # a group (typer vendors click: no isinstance(click.Group))
        for name, sub in cmd.commands.items():
            yield from _walk(sub, f"{path} {name}".strip())
    else:
        yield path, cmd


def _configs_of(cmd: click.Command) -> dict[str, type]:
    fn = getattr(cmd.callback, "__wrapped__", None)
    return getattr(fn, "__flywheel_configs__", {}) or {}


def test_generated_options_carry_their_models_defaults():
    root = _root_command()
    generated = 0
    for path, cmd in _walk(root):
        for model in _configs_of(cmd).values():
            opts = {p.name: p for p in cmd.params if p.param_type_name == "option"}
            for name, info in cli_fields(model).items():
                assert name in opts, f"flywheel {path}: {model.__name__}.{name} has no option"
                assert opts[name].default == field_default(info), \
                    f"flywheel {path} --{name}: default {opts[name].default!r} != {model.__name__}'s {field_default(info)!r}"
                assert info.description, f"{model.__name__}.{name}: no help (Field(description=...))"
                generated += 1
    assert generated >= 20, f"only {generated} options come from config models"


def _models() -> dict[str, type]:
    _root_command()  # importing every commands module registers the models they take
    return dict(CONFIG_MODELS)


def _literal(node: ast.AST):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return ...


def _declarations(tree: ast.AST):
    """(line, name, default, kind) for typer.Option defaults, class-level fields and function
    parameter defaults in one module."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            pos = a.posonlyargs + a.args
            pairs = list(zip(pos[len(pos) - len(a.defaults):], a.defaults)) + \
                [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            for arg, d in pairs:
                if isinstance(d, ast.Call) and getattr(d.func, "attr", getattr(d.func, "id", "")) == "Option":
                    if d.args:
                        yield d.lineno, arg.arg, _literal(d.args[0]), "typer.Option"
                else:
                    yield d.lineno, arg.arg, _literal(d), f"parameter of {node.name}()"
        elif isinstance(node, ast.ClassDef) and node.name.endswith(("Config", "Settings")):
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
                    v = st.value
                    if isinstance(v, ast.Call) and getattr(v.func, "id", getattr(v.func, "attr", "")) == "Field":
                        v = v.args[0] if v.args else next((k.value for k in v.keywords if k.arg == "default"), None)
                        if v is None:
                            continue
                    yield st.lineno, st.target.id, _literal(v), f"field of {node.name}"


def test_no_default_is_declared_twice():
    models = _models()
    assert models, "no command takes a config model"
    fields: dict[str, list[tuple[str, object, str]]] = {}
    for qual, model in models.items():
        for name, info in model_fields(model).items():
            default = field_default(info)
            if default is not ... and default is not None and not isinstance(default, bool):
                fields.setdefault(name, []).append((qual, default, model.__module__.split(".")[0]))
    found = []
    for pkg in PRODUCT:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            mod = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            for line, name, default, kind in _declarations(ast.parse(f.read_text())):
                for qual, d, model_pkg in fields.get(name, ()):
                    if default is ... or type(default) is not type(d) or default != d:
                        continue
                    if kind.startswith("field of") and qual.rsplit(".", 1)[1] == kind.split()[-1] \
                            and qual.rsplit(".", 1)[0] == mod:
                        continue  # the declaration itself
                    if kind.startswith("parameter of") and pkg != model_pkg:
                        continue  # another package's function: a namesake, not a copy
                    found.append(f"{f.relative_to(ROOT)}:{line}: {kind} {name}={default!r} restates {qual}")
    assert not found, "defaults declared twice:\n" + "\n".join(found)


def test_k8s_example_sets_only_what_it_changes():
    doc = tomllib.loads((ROOT / "deploy" / "k8s" / "flywheel.toml").read_text())
    root = _root_command()
    cmds = dict(_walk(root))
    problems = []

    def visit(table: dict, path: str):
        for key, value in table.items():
            if not isinstance(value, dict) or key == "kafka":
                continue
            sub = f"{path} {key}".strip()
            if sub not in cmds:
                visit(value, sub)
                continue
            opts = {p.name: p for p in cmds[sub].params if p.param_type_name == "option"}
            for k, v in value.items():
                opt = opts.get(k.replace("-", "_"))
                if opt is None:
                    problems.append(f"[{sub}] {k}: no such option")
                elif opt.default == v or (isinstance(opt.default, (list, tuple)) and list(opt.default) == v):
                    problems.append(f"[{sub}] {k} = {v!r} restates the default")

    visit(doc, "")
    assert not problems, "\n".join(problems)


def _is_typer_function(node) -> bool:
    if node.name == "register":
        return True
    a = node.args
    for d in [*a.defaults, *(d for d in a.kw_defaults if d is not None)]:
        if isinstance(d, ast.Call) and getattr(d.func, "attr", getattr(d.func, "id", "")) in ("Option", "Argument"):
            return True
    return False


def test_no_typer_function_is_longer_than_a_screen():
    """Issue 21 item 2: a command parses, builds its config and calls its role's assembly;
    no typer function (nor a ``register``) is longer than a screen (60 lines)."""
    long = []
    for pkg in PRODUCT:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_typer_function(node):
                    n = node.end_lineno - node.lineno + 1
                    if n > 60:
                        long.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "\n".join(long)
