"""CLI options generated from config models: each setting is declared once, in its model.

A component's configuration is one validated model (a pydantic ``BaseModel`` or a
``pydantic.dataclasses.dataclass``) whose fields carry default, type, bounds (``ge``, ``gt``,
``le``, ``lt``), unit and help (``Field(..., description=...)``). :func:`config_options`
turns a typer command that takes such a model into one whose options are the model's fields,
the way vLLM's ``EngineArgs.add_cli_args`` and TRL's ``HfArgumentParser`` derive arguments
from a dataclass. ``flywheel.toml``'s ``[command]`` tables and ``FLYWHEEL_<COMMAND>__<OPTION>``
variables reach the same options through click's ``default_map`` (``schemas.config``), so a
file, a variable, a flag and a program that builds the model directly all meet one default.

A field's ``json_schema_extra`` may hold:
    ``flags``: the option's declarations instead of ``--field-name`` (a bool field may say
        ``"--replay/--no-replay"``; a bool field whose default is True and that declares no
        off switch gets ``--no-field-name`` beside its flag, so the command line can turn it
        off);
    ``unit``: shown after the help text (``"s"``, ``"ms"``, ``"h"``, ``"tokens"``);
    ``objectives``: the learner objectives that read the field (``("kto",)``), shown after
        the help text as ``(kto only)`` (``learner.config.OBJECTIVE_ONLY`` is built from it);
    ``cli``: ``False`` keeps the field off the command line (set by programs only);
    ``envvar``: an environment variable click reads for the option (a flag wins over it, it
        wins over ``flywheel.toml``), for a setting that had one before it was a field.

Help: a boolean flag takes no value, so ``--help`` lists it as click and typer users know it
(``--quick``, ``--cuped / --no-cuped``), with no value placeholder: Typer 0.29's rich help
prints the type column (``<bool>``) for every option, flags included; importing this module
makes it print none for a flag (:func:`_flag_type_column`), for every command of the process.
"""

from __future__ import annotations

import functools
import inspect
import os
import typing
from typing import Annotated, Any, Callable, Sequence

import typer
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from schemas.config import CONFIG_HINT, env_var

CONFIG_MODELS: dict[str, type] = {}  # qualified name -> model, every model a command takes

_typer_type_column = typer.core.TyperOption.display_type_rich


def _flag_type_column(self: typer.core.TyperOption, ctx) -> str | None:
    """The type column of ``--help`` for one option: None (nothing shown) for a boolean flag,
    which takes no value (``--quick``, ``--cuped/--no-cuped``); Typer's ``<int range>``,
    ``<path>``, ... for an option that takes one. A counting flag (``-vvv``) is no boolean."""
    if self.is_flag and not self.count:
        return None
    return _typer_type_column(self, ctx)


typer.core.TyperOption.display_type_rich = _flag_type_column


def model_fields(model: type) -> dict[str, FieldInfo]:
    """``{name: FieldInfo}`` of a pydantic model or pydantic dataclass.

    Raises:
        TypeError: ``model`` is neither.
    """
    if isinstance(model, type) and issubclass(model, BaseModel):
        return dict(model.model_fields)
    fields = getattr(model, "__pydantic_fields__", None)
    if fields is None:
        raise TypeError(f"{model!r}: not a pydantic model or pydantic dataclass")
    return dict(fields)


def field_default(info: FieldInfo) -> Any:
    """The field's default (a ``default_factory`` is called); ``...`` when it is required."""
    if info.default_factory is not None:
        return info.default_factory()
    return ... if info.is_required() else info.default


def _extra(info: FieldInfo) -> dict:
    extra = info.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def cli_fields(model: type) -> dict[str, FieldInfo]:
    """The fields of ``model`` that are command-line options (``cli`` not ``False``)."""
    return {k: v for k, v in model_fields(model).items() if _extra(v).get("cli", True) is not False}


def _bounds(info: FieldInfo) -> dict[str, Any]:
    """click's ``min``/``max`` for ``ge``/``le`` bounds; an open bound (``gt``, ``lt``) is left
    to the model, whose error names the flag (click has no open interval)."""
    out: dict[str, Any] = {}
    for m in info.metadata:
        if getattr(m, "ge", None) is not None:
            out["min"] = m.ge
        if getattr(m, "le", None) is not None:
            out["max"] = m.le
    return out


def _help(info: FieldInfo) -> str:
    """The option's help: the field's description, then ``(unit: s)`` and ``(kto only)`` (its
    ``objectives``) where the field declares them."""
    text = (info.description or "").strip()
    unit, objectives = _extra(info).get("unit"), _extra(info).get("objectives")
    text = f"{text} (unit: {unit})" if unit else text
    return f"{text} ({' and '.join(objectives)} only)" if objectives else text


def _declarations(name: str, info: FieldInfo, annotation: Any) -> tuple[str, ...]:
    """The option's declarations: the field's ``flags`` or ``--field-name``; a bool field that
    is on by default and declares no off switch gets ``--x/--no-x`` (a flag alone could never
    turn it off)."""
    flags = _extra(info).get("flags") or ("--" + name.replace("_", "-"),)
    if isinstance(flags, str):
        flags = (flags,)
    if annotation is bool and field_default(info) is True and not any("/" in f for f in flags):
        on = next((f for f in flags if f.startswith("--")), None)
        if on is not None:
            flags = (*(f for f in flags if f != on), f"{on}/--no-{on[2:]}")
    return tuple(flags)


def option_for(name: str, info: FieldInfo, annotation: Any) -> typer.models.OptionInfo:
    """The ``typer.Option`` of one field: its default, flag(s), help (with unit) and bounds.
    A bool field is a flag (no value on the command line); on by default it also has its
    ``--no-`` form (:func:`_declarations`)."""
    flags = _declarations(name, info, annotation)
    base = typing.get_origin(annotation)
    numeric = annotation in (int, float) or (base is typing.Union and set(typing.get_args(annotation)) <= {int, float, type(None)})
    return typer.Option(field_default(info), *flags, help=_help(info), show_default=True,
                        envvar=_extra(info).get("envvar"), **(_bounds(info) if numeric else {}))


def _annotation(model: type, name: str, info: FieldInfo) -> Any:
    hints = typing.get_type_hints(model)
    return hints.get(name, info.annotation)


def config_options(**configs: type) -> Callable[[Callable], Callable]:
    """Decorator: a typer command ``f(cfg: Model, ..., other options)`` becomes one whose
    command-line options are the fields of each ``Model`` (keyword name -> model class), and
    which receives the validated model instances.

    The decorated function keeps its other parameters (flags of the command itself, such as
    ``--once``). Two models, or a model and the function, may not share an option name.

    Raises:
        TypeError: a model is not a pydantic model or dataclass, or option names collide
            (at decoration time).
        typer.BadParameter: at run time, a value the model refuses; the message names where
            the value came from (the flag, the environment variable, or ``flywheel.toml``'s
            file and key: :func:`value_origin`) and the model's reason (exit code 2).
    """

    def wrap(func: Callable) -> Callable:
        sig = inspect.signature(func)
        try:  # string annotations (``from __future__ import annotations``), resolved where written
            hints = typing.get_type_hints(func, include_extras=True)
        except NameError:
            hints = {}
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()
               if p.name not in configs]
        params: list[inspect.Parameter] = []
        owner: dict[str, str] = {}
        flags: dict[str, Any] = {}  # each option's declarations, for naming it in a usage error
        for key, model in configs.items():
            CONFIG_MODELS[f"{model.__module__}.{model.__qualname__}"] = model
            for name, info in cli_fields(model).items():
                if name in owner or name in sig.parameters:
                    raise TypeError(f"{func.__name__}: option {name!r} of {model.__name__} is declared twice")
                owner[name] = key
                ann = _annotation(model, name, info)
                flags[name] = _declarations(name, info, ann)
                params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=ann,
                                                default=option_for(name, info, ann)))
        ctx_name, added_ctx = _context_param(own)

        @functools.wraps(func)
        def command(**kwargs):
            ctx = kwargs.pop(ctx_name) if added_ctx else kwargs[ctx_name]
            built = {}
            for key, model in configs.items():
                values = {k: kwargs.pop(k) for k in list(kwargs) if owner.get(k) == key}
                try:
                    built[key] = model(**values)
                except ValidationError as exc:
                    e = exc.errors()[0]
                    msg = e["msg"].removeprefix("Value error, ")
                    raise _refused(ctx, flags, str(e["loc"][0]) if e["loc"] else "", msg) from None
                except ValueError as exc:  # a model's own __post_init__ check
                    raise _refused(ctx, flags, "", str(exc)) from None
                except RuntimeError as exc:  # its surroundings are missing (no Kafka broker): one line
                    typer.echo(f"error: {exc}", err=True)
                    raise typer.Exit(1) from None
            return func(**kwargs, **built)

        command.__signature__ = sig.replace(parameters=[*(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own),
                                                        *params])
        command.__annotations__ = {p.name: p.annotation for p in command.__signature__.parameters.values()}
        del command.__wrapped__  # typer reads __signature__, never the wrapped function's
        command.__flywheel_configs__ = dict(configs)
        return command

    return wrap


def _context_param(own: list[inspect.Parameter]) -> tuple[str, bool]:
    """The name of the ``typer.Context`` parameter the click context reaches a command through:
    the function's own when it declares one (it still receives it), else ``_flywheel_ctx``,
    appended to ``own`` here. Returns ``(name, added)``."""
    name = next((p.name for p in own if p.annotation is typer.Context), None)
    if name is not None:
        return name, False
    own.append(inspect.Parameter("_flywheel_ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))
    return "_flywheel_ctx", True


def _refused(ctx, flags: dict[str, Any], name: str, msg: str) -> typer.BadParameter:
    """The usage error for a value a model refused: it names where the value of field ``name``
    (else of the field a ``"field: reason"`` message names) came from (:func:`value_origin`);
    ``flags`` maps each field to its option declarations."""
    name = name or msg.split(":", 1)[0].strip()
    decl = flags.get(name)
    flag = None if decl is None else (decl if isinstance(decl, str) else decl[0]).split("/")[0]
    hint, where = value_origin(ctx, name, flag)
    if where is not None:
        msg = f"{where}: {msg.removeprefix(name + ': ')}"
    return typer.BadParameter(msg, param_hint=hint)


def value_origin(ctx, name: str, flag: str | None) -> tuple[str | None, str | None]:
    """Where the value of option ``name`` (its Python name) of the command running in ``ctx``
    (a click context) came from, as a usage error names it: ``(param_hint, where)``, the
    message then being ``"<where>: <reason>"`` when ``where`` is not None.

    * the command line, or no value given (the default): ``(flag, None)``;
    * the option's own environment variable (a field's ``envvar``): ``(that variable, None)``;
    * a ``FLYWHEEL_<COMMAND>__<OPTION>`` variable: ``(the variable as set, "learn.beta")``;
    * ``flywheel.toml`` (``--config`` or ``FLYWHEEL_CONFIG``): ``("'--config' /
      FLYWHEEL_CONFIG", "<file>: learn.beta")``, the form ``schemas.config`` gives the file's
      other refused values.

    The variable wins over the file for one option, as ``schemas.config`` merges them.
    """
    source = ctx.get_parameter_source(name) if ctx is not None else None
    kind = getattr(source, "name", None)
    if kind == "ENVIRONMENT":
        param = next((p for p in ctx.command.params if p.name == name), None)
        envvar = getattr(param, "envvar", None)
        envvar = next((v for v in ([envvar] if isinstance(envvar, str) else envvar or ()) if v in os.environ), None)
        return (envvar or flag), None
    if kind != "DEFAULT_MAP":
        return flag, None
    names, c = [], ctx
    while c.parent is not None:  # the command's path below the root: ["learn"], ["broker", "start"]
        names.append(c.info_name)
        c = c.parent
    path = ".".join(reversed(names)) or str(ctx.info_name)
    head = env_var(path) + "__"
    var = next((k for k in sorted(os.environ)
                if k.startswith(head) and k[len(head):].lower().replace("-", "_") == name), None)
    if var is not None:
        return var, f"{path}.{name}"
    config = ctx.find_root().params.get("config") or os.environ.get("FLYWHEEL_CONFIG")
    return (CONFIG_HINT, f"{config}: {path}.{name}") if config else (flag, None)


def overrides(model: type, values: dict[str, Any], *, where: str) -> dict[str, Any]:
    """Check a demo's or experiment's overrides of ``model`` by field name and return them.

    Raises:
        ValueError: a key that is no field of ``model`` (``where`` names the override), or a
            value equal to the model's default (a restated default is a second declaration).
    """
    fields = model_fields(model)
    for k, v in values.items():
        if k not in fields:
            raise ValueError(f"{where}: {k!r} is no setting of {model.__name__}")
        if v == field_default(fields[k]):
            raise ValueError(f"{where}: {k}={v!r} restates {model.__name__}'s default; drop it")
    return dict(values)


def _field_owner(models: Sequence[type], name: str) -> tuple[type, FieldInfo] | None:
    for model in models:
        info = model_fields(model).get(name)
        if info is not None:
            return model, info
    return None


def check_overrides(models: Sequence[type], values: dict[str, Any], *, where: str) -> dict[str, Any]:
    """Check a program's changes to a role's settings (a demo's, an experiment's), by field
    name across the role's models (``[ControllerRunConfig, ControllerConfig, AnalysisConfig]``
    for ``flywheel controller``): each key a field of one of them, no value restating its
    default (:func:`overrides`), and each model accepting its share. Returns ``values``.

    Raises:
        ValueError: the first problem, prefixed with ``where`` (``"controller: delta: must be
            in (0, 1), got 2"``).
    """
    shares: dict[type, dict[str, Any]] = {}
    for name, value in values.items():
        owner = _field_owner(models, name)
        if owner is None:
            raise ValueError(f"{where}: {name!r} is no setting of {', '.join(m.__name__ for m in models)}")
        shares.setdefault(owner[0], {})[name] = value
    for model, share in shares.items():
        overrides(model, share, where=where)
        fields = model_fields(model)
        try:
            for name, value in share.items():  # each value by its own field's type and bounds
                info = fields[name]
                adapter = TypeAdapter(Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation)
                try:
                    adapter.validate_python(value)
                except ValidationError as exc:
                    msg = exc.errors()[0]["msg"].removeprefix("Value error, ")
                    msg = msg if msg.startswith(f"{name}:") else f"{name}: {msg}"
                    raise ValueError(msg if "got " in msg else f"{msg}, got {value!r}") from None
            model(**share)  # and the model's checks across fields
        except ValidationError as exc:
            e = exc.errors()[0]
            loc = ".".join(map(str, e["loc"]))
            msg = e["msg"].removeprefix("Value error, ")
            raise ValueError(f"{where}: {loc + ': ' if loc and not msg.startswith(loc) else ''}{msg}") from None
        except ValueError as exc:  # a model's own __post_init__ check
            raise ValueError(f"{where}: {exc}") from None
        except RuntimeError:  # the model also reads its surroundings (a broker's address): fields checked
            pass
    return dict(values)


def flags_for(models: Sequence[type], values: dict[str, Any]) -> list[str]:
    """The command-line arguments that set these fields (by name) as the options generated
    from ``models`` spell them: ``{"max_batch": 32, "prefix_caching": True}`` ->
    ``["--max-batch", "32", "--prefix-caching"]``. A bool uses the field's ``flags``
    declaration (``"--replay/--no-replay"``); one off by default and given False adds nothing.

    Raises:
        ValueError: a key that is no field of ``models``, or a bool with no flag for its value.
    """
    out: list[str] = []
    for name, value in values.items():
        owner = _field_owner(models, name)
        if owner is None:
            raise ValueError(f"{name}: no setting of {', '.join(m.__name__ for m in models)}")
        info = owner[1]
        decls = _declarations(name, info, _annotation(owner[0], name, info))
        decl = next((d for d in decls if "/" in d), decls[0])
        if isinstance(value, bool):
            on, _, off = decl.partition("/")
            if value or off:
                out.append(on if value else off)
            elif info.default is not False:
                raise ValueError(f"{name}: no flag turns it off")
        else:
            out += [decl.split("/")[0], str(value)]
    return out
