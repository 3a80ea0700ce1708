"""``flywheel.toml``: one file configures a deployment; environment variables override it.

The file has three kinds of entries (``deploy/k8s/flywheel.toml`` is a complete example)::

    home = "/var/lib/flywheel"             # paths and addresses: the FLYWHEEL_* variables of
    store = "s3://models/flywheel"         # schemas.settings (home, store, samples,
    serving_url = "http://serving:8000"    # model_dir, serving_url)

    [kafka]                                # schemas.settings.KafkaSettings' fields
    bootstrap = "kafka-0.kafka:9092"
    replication_factor = 3

    [reward]                               # the reward policy: schemas.reward.RewardPolicy's
    edit_weight = 0.25                     # fields (every role that reads rewards reads it)
    [reward.scores.helpfulness]
    min = 1
    max = 5
    weight = 0.5

    [serve]                                # one table per command: its options, by their
    host = "0.0.0.0"                       # Python names (``api_keys_file``) or flag names
    engine = "vllm"                        # (``api-keys-file``)
    [controller]
    serving = ["dns+http://flywheel-serving-pods:8000"]

Precedence, highest first: a flag on the command line; an environment variable
(``FLYWHEEL_HOME``, ``FLYWHEEL_KAFKA_PARTITIONS``, ``FLYWHEEL_SERVE__PORT`` for the ``port``
option of ``[serve]``, ``FLYWHEEL_REWARD__EDIT_WEIGHT`` for a ``[reward]`` field: ``__``
separates table and key); the file; the built-in default.

``flywheel --config PATH`` or ``FLYWHEEL_CONFIG=PATH`` names the file; no file is read
otherwise (the environment variables still apply: :func:`configure_env`). Secrets never go in the file: ``kafka.sasl_password`` is refused (use
``sasl_password_file`` or ``FLYWHEEL_KAFKA_SASL_PASSWORD``), as are API keys and the admin
token (``serve.api_keys_file`` names a file; ``FLYWHEEL_ADMIN_TOKEN`` is an environment
variable).
"""

from __future__ import annotations

import json
import os
import tomllib
import typing
from pathlib import Path
from typing import Any, MutableMapping

from pydantic import PrivateAttr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, TomlConfigSettingsSource

# top-level key -> the environment variable schemas.settings reads
PATH_VARS = {"home": "FLYWHEEL_HOME", "store": "FLYWHEEL_STORE", "samples": "FLYWHEEL_SAMPLES",
             "model_dir": "FLYWHEEL_MODEL_DIR", "serving_url": "FLYWHEEL_SERVING_URL"}
SECRET_KAFKA_KEYS = ("sasl_password",)


class ConfigError(ValueError):
    """The config file or an override is wrong; the message names the file and the key."""


class FlywheelConfig(BaseSettings):
    """The parsed ``flywheel.toml`` with environment overrides applied.

    Fields:
        home, store, samples, model_dir, serving_url: see :data:`PATH_VARS`.
        kafka: :class:`schemas.settings.KafkaSettings` fields (checked by :meth:`apply_env`).
        reward: :class:`schemas.reward.RewardPolicy` fields (checked by :meth:`apply_env`).
        commands: ``{command: {option: value}}`` for every other table (``serve``,
            ``ingest``, ``learn``, ``controller``, nested ones such as ``[broker.start]``),
            checked against the CLI by :func:`command_defaults`.
    """

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_", env_nested_delimiter="__", extra="allow")

    home: str | None = None
    store: str | None = None
    samples: str | None = None
    model_dir: str | None = None
    serving_url: str | None = None
    kafka: dict[str, Any] = {}
    reward: dict[str, Any] = {}
    _source: Path | str = PrivateAttr("flywheel.toml")

    @model_validator(mode="after")
    def _tables_only(self):
        for k, v in (self.model_extra or {}).items():
            if not isinstance(v, dict):
                raise ValueError(f"{k}: a top-level key is one of {', '.join([*PATH_VARS, 'kafka', 'reward'])} "
                                 f"or a [command] table, got {type(v).__name__}")
        for k in SECRET_KAFKA_KEYS:
            if k in self.kafka:
                raise ValueError(f"kafka.{k}: secrets do not go in the config file; use "
                                 f"kafka.{k}_file or FLYWHEEL_KAFKA_{k.upper()}")
        return self

    @property
    def commands(self) -> dict[str, dict]:
        return dict(self.model_extra or {})

    def apply_env(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Put the paths and the ``[kafka]`` and ``[reward]`` tables into the environment, where
        every part of Flywheel reads them, without replacing a variable already set (the
        environment wins): ``FLYWHEEL_KAFKA_<KEY>`` and ``FLYWHEEL_REWARD__<FIELD>`` (a table
        value, ``scores``, as JSON), read back by ``schemas.reward.RewardPolicy.from_env``.

        Raises:
            ConfigError: an unknown ``[kafka]`` or ``[reward]`` key, or a value KafkaSettings
                or RewardPolicy refuses (named as ``kafka.<key>`` / ``reward.<field>``).
        """
        from schemas.settings import KafkaSettings

        env = os.environ if environ is None else environ
        for key, var in PATH_VARS.items():
            v = getattr(self, key)
            if v is not None:
                env.setdefault(var, str(v))
        fields = KafkaSettings.model_fields
        for k in self.kafka:
            if k not in fields:
                raise ConfigError(f"{self._source}: kafka.{k}: unknown key; keys are {', '.join(fields)}")
        try:
            KafkaSettings(**self.kafka)
        except ValidationError as exc:
            e = exc.errors()[0]
            loc = ".".join(map(str, e["loc"]))
            raise ConfigError(f"{self._source}: kafka{'.' + loc if loc else ''}: "
                              f"{e['msg'].removeprefix('Value error, ')}") from None
        for k, v in self.kafka.items():
            env.setdefault(f"FLYWHEEL_KAFKA_{k.upper()}", _env_text(v))
        from schemas.reward import ENV_PREFIX, RewardPolicy, RewardPolicyError

        # (``reward`` also holds the FLYWHEEL_REWARD__* variables, as text: they stay as set)
        before = {k for k in env if k.startswith(ENV_PREFIX)}
        try:  # the file's own values first, with their TOML types (true is no weight, "0.5" none either)
            RewardPolicy.from_table({k: v for k, v in self.reward.items() if k in RewardPolicy.model_fields
                                     and f"{ENV_PREFIX}{k.upper()}" not in before}, where="reward")
        except RewardPolicyError as exc:
            raise ConfigError(f"{self._source}: {exc}") from None
        for k, v in self.reward.items():
            env.setdefault(f"{ENV_PREFIX}{k.upper()}", _env_text(v))
        try:
            RewardPolicy.from_env(env)
        except RewardPolicyError as exc:
            var, msg = str(exc).split(": ", 1)
            if var.startswith(ENV_PREFIX) and var not in before:  # the file's value: named as its key
                raise ConfigError(f"{self._source}: reward.{var[len(ENV_PREFIX):].lower()}: {msg}") from None
            raise ConfigError(f"environment: {exc}") from None


def _env_text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


def load_config(path: str | os.PathLike) -> FlywheelConfig:
    """Read ``path`` (TOML) with environment overrides.

    Raises:
        ConfigError: the file is missing or not TOML (line and column named), or a key is
            wrong (named as ``table.key``).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None

    class _FromFile(FlywheelConfig):
        @classmethod
        def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                       file_secret_settings):
            return init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=p)

    try:
        cfg = _FromFile()
    except ValidationError as exc:
        e = exc.errors()[0]
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{p}: {loc + ': ' if loc else ''}{msg}") from None
    cfg._source = p
    return cfg


def _norm(key: str) -> str:
    return key.replace("-", "_")


def command_defaults(cfg: FlywheelConfig, group, ctx=None, environ=None) -> dict[str, Any]:
    """The click ``default_map`` for ``group`` (the ``flywheel`` command) from the command
    tables, with ``FLYWHEEL_<COMMAND>__<OPTION>`` environment variables over them (nested
    groups: ``FLYWHEEL_BROKER__START__PARTITIONS``; a list option takes a JSON list or
    comma-separated values). Each value is checked and converted by its option's own type
    (``ctx``: the root command's context, for the options' error messages).

    Raises:
        ConfigError: a table that is no command, a key that is no option of its command
            (the command's options are listed), or a value its option refuses.
    """
    env = os.environ if environ is None else environ
    return _defaults(cfg.commands, group, "", cfg._source, ctx, env)


def _is_group(cmd) -> bool:
    return hasattr(cmd, "commands")  # click (or typer's vendored click) Group


def _env_tables(group, path: str, env) -> dict[str, Any]:
    """``{command: {option: text}}`` from ``FLYWHEEL_<PATH>__<COMMAND>__<OPTION>`` variables."""
    prefix = "FLYWHEEL_" + "".join(f"{p.upper().replace('-', '_')}__" for p in path.split(".") if p)
    out: dict[str, Any] = {}
    for name, cmd in group.commands.items():
        head = prefix + name.upper().replace("-", "_") + "__"
        if _is_group(cmd):
            sub = _env_tables(cmd, f"{path}{name}.", env)
            if sub:
                out[name] = sub
            continue
        vals = {k[len(head):].lower(): v for k, v in env.items() if k.startswith(head)}
        if vals:
            out[name] = vals
    return out


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _leaf_paths(d: dict, where: str = "") -> set[str]:
    out: set[str] = set()
    for k, v in d.items():
        out |= _leaf_paths(v, f"{where}{k}.") if isinstance(v, dict) else {f"{where}{k}"}
    return out


CONFIG_HINT = "'--config' / FLYWHEEL_CONFIG"  # how a usage error names the file


def env_var(path: str) -> str:
    """``FLYWHEEL_BROKER__START__PARTITIONS`` for ``broker.start.partitions``."""
    return "FLYWHEEL_" + "__".join(p.upper().replace("-", "_") for p in path.split("."))


def _unknown_env(group, env) -> str | None:
    """The first ``FLYWHEEL_<COMMAND>__<OPTION>`` variable whose ``<COMMAND>`` part names no
    command (``FLYWHEEL_INGES__TICK_S``) or a group instead of one of its commands
    (``FLYWHEEL_BROKER__PARTITIONS``), with what it should name; None when all name one.
    Variables of the file's own keys (``FLYWHEEL_KAFKA__...``, ``FLYWHEEL_HOME``) are not
    command options and are left alone."""
    heads: list[str] = []

    def walk(g, prefix: str) -> None:
        for name, cmd in g.commands.items():
            head = prefix + name.upper().replace("-", "_") + "__"
            walk(cmd, head) if _is_group(cmd) else heads.append(head)

    walk(group, "FLYWHEEL_")
    own = tuple(f"FLYWHEEL_{k.upper()}__" for k in (*PATH_VARS, "kafka", "reward"))
    for var in sorted(env):
        if not var.startswith("FLYWHEEL_") or "__" not in var[9:] or var.startswith(own):
            continue
        if any(var.startswith(h) and len(var) > len(h) for h in heads):
            continue
        return (f"{var}: names no command's option; a variable is FLYWHEEL_<COMMAND>__<OPTION> "
                f"(commands: {', '.join(sorted(h[9:-2] for h in heads))})")
    return None


def _defaults(tables: dict, group, where: str, src, ctx, env, env_keys: set[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tables = {k: {_norm(o): v for o, v in t.items()} if isinstance(t, dict) and not _is_group(
        group.commands.get(k)) else t for k, t in tables.items()}
    if not where:
        bad = _unknown_env(group, env)
        if bad is not None:
            raise ConfigError(f"environment: {bad}")
        from_env = _env_tables(group, where, env)
        env_keys = _leaf_paths(from_env)
    else:
        from_env = {}
    for name, table in _merge(tables, from_env).items():
        path = f"{where}{name}"
        cmd = group.commands.get(name)
        if cmd is None:
            raise ConfigError(f"{src}: [{path}]: no such command (commands: {', '.join(sorted(group.commands))})")
        if not isinstance(table, dict):
            raise ConfigError(f"{src}: {path}: a table of options is expected, got {type(table).__name__}")
        if _is_group(cmd):
            out[name] = _defaults(table, cmd, path + ".", src, ctx, env, env_keys)
            continue
        params = {p.name: p for p in cmd.params if p.param_type_name == "option" and p.name}
        vals = {}
        for key, value in table.items():
            # a value from a FLYWHEEL_<COMMAND>__<OPTION> variable is named as that variable
            origin = f"environment: {env_var(f'{path}.{key}')}" if f"{path}.{key}" in (env_keys or ()) else src
            p = params.get(key)
            if p is None:
                raise ConfigError(f"{origin}: {path}.{key}: not an option of `flywheel {path.replace('.', ' ')}` "
                                  f"(options: {', '.join(sorted(params))})")
            vals[p.name] = _convert(p, value, f"{origin}: {path}.{key}", ctx)
        out[name] = vals
    return out


def _annotation_of(param) -> Any:
    return getattr(getattr(param, "type_descriptor", None), "annotation", None)


def _takes_bool(param) -> bool:
    """Whether the option's value may be a boolean (a flag, or a bool field)."""
    ann = _annotation_of(param)
    if ann is None:  # a plain click option
        return getattr(getattr(param, "type", None), "name", "") == "boolean" or bool(getattr(param, "is_flag", False))
    return ann is bool or bool in typing.get_args(ann) or bool(getattr(param, "is_flag", False))


def _type_name(param) -> str:
    ann = _annotation_of(param)
    args = [a for a in typing.get_args(ann) if a is not type(None)] if ann is not None else []
    ann = args[0] if len(args) == 1 else ann
    return {int: "an integer", float: "a number", str: "a string"}.get(ann, "a value of another type")


def _convert(param, value: Any, where: str, ctx) -> Any:
    if param.multiple and isinstance(value, str):  # from the environment: JSON list or a,b,c
        try:
            value = json.loads(value) if value.lstrip().startswith("[") else [v for v in value.split(",") if v]
        except ValueError as exc:  # (json.JSONDecodeError)
            raise ConfigError(f"{where}: not a JSON list: {exc}") from None
    if param.multiple and not isinstance(value, list):
        raise ConfigError(f"{where}: a list is expected, got {type(value).__name__}")
    if not _takes_bool(param) and any(isinstance(v, bool) for v in (value if isinstance(value, list) else [value])):
        # TOML's true/false for a number or a text: the option's own type took true as 1
        # (`seal_after_s = true` sealed after 1 s, `port = true` served on port 1)
        raise ConfigError(f"{where}: {_type_name(param)} is expected, got a boolean ({value!r})")
    try:
        return param.process_value(ctx, value)  # the option's own type, range and callback
    except Exception as exc:  # noqa: BLE001 - click's BadParameter (typer vendors its own click)
        raise ConfigError(f"{where}: {getattr(exc, 'message', exc)}") from None


class _OneCommand:
    """A stand-in group holding one command (:func:`one_command_defaults`)."""

    def __init__(self, name: str, cmd):
        self.commands = {name: cmd}


def one_command_defaults(name: str, cmd, environ: MutableMapping[str, str] | None = None) -> dict[str, Any]:
    """The click ``default_map`` of one command run on its own, outside the ``flywheel``
    group (``python -m ingest`` runs ``flywheel ingest``'s command): the ``[name]`` table of
    the file ``FLYWHEEL_CONFIG`` names, with ``FLYWHEEL_<NAME>__<OPTION>`` variables over it,
    each checked as :func:`command_defaults` checks it; the file's paths and ``[kafka]`` go to
    the environment (:meth:`FlywheelConfig.apply_env`). Other tables and other commands'
    variables are left to the commands they name. A flag still wins.

    Raises:
        ConfigError: the file or a value is wrong (the message names the file or variable,
            and ``name.option``).
    """
    env = os.environ if environ is None else environ
    path = env.get("FLYWHEEL_CONFIG")
    cfg = load_config(path) if path else None
    tables = {name: cfg.commands[name]} if cfg is not None and name in cfg.commands else {}
    head = f"FLYWHEEL_{name.upper().replace('-', '_')}__"
    own_env = {k: v for k, v in env.items() if k.startswith(head)}
    out = _defaults(tables, _OneCommand(name, cmd), "", cfg._source if cfg is not None else "environment",
                    None, own_env).get(name, {})
    if cfg is not None:
        cfg.apply_env(env)
    return out


def configure_env(ctx) -> None:
    """Without a config file: the ``FLYWHEEL_<COMMAND>__<OPTION>`` variables alone become the
    click context's ``default_map`` (a flag still wins), checked as :func:`command_defaults`
    checks them. Called by the root command's callback when no file is named.

    Raises:
        typer.BadParameter: a variable names no command or option, or its value is refused
            (exit status 2; the message names ``command.option``).
    """
    import typer

    try:
        defaults = _defaults({}, ctx.command, "", "environment", ctx, os.environ)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), ctx=ctx, param_hint="FLYWHEEL_<COMMAND>__<OPTION>") from None
    if defaults:
        ctx.default_map = {**(ctx.default_map or {}), **defaults}


def configure_cli(ctx, path: str | os.PathLike) -> FlywheelConfig:
    """Load ``path`` for one ``flywheel`` invocation: the paths and ``[kafka]`` go to the
    environment (:meth:`FlywheelConfig.apply_env`), the command tables become the click
    context's ``default_map`` (so a flag still wins). Called by the root command's callback.

    Raises:
        typer.BadParameter: any :class:`ConfigError` (exit status 2, ``--config`` named).
    """
    import typer

    try:
        cfg = load_config(path)
        defaults = command_defaults(cfg, ctx.command, ctx)
        cfg.apply_env()
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), ctx=ctx, param_hint=CONFIG_HINT) from None
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return cfg
