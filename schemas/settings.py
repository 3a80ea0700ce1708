"""Where things live: the shared paths and addresses every package agrees on.

Environment:
    FLYWHEEL_HOME: root of all local state (default ``./.flywheel``).
    FLYWHEEL_KAFKA_BOOTSTRAP: ``host:port[,host:port]`` of an external Kafka cluster.
        When unset, the embedded broker started by ``flywheel broker start`` is used
        (its address is read from ``$FLYWHEEL_HOME/broker.json``).
    FLYWHEEL_SERVING_URL: base URL of the serving pod (default ``http://127.0.0.1:8000``).
    FLYWHEEL_KAFKA_*: security, topic prefix and topic settings of the Kafka cluster
        (:class:`KafkaSettings`); every Kafka client Flywheel runs takes its connection
        keywords from :func:`kafka_client_config`.
    FLYWHEEL_USER_SALT / FLYWHEEL_USER_SALT_FILE: the fleet's user-id salt, given inline or
        as a file (a mounted Kubernetes Secret) (:func:`user_salt`).
    FLYWHEEL_LEARNER_STATE: the learner's state dir (watermark, consumed shards, resume
        checkpoint); shared storage in a fleet (:func:`learner_state_dir`).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from schemas.topics import INGEST_APP_ID, SPECS, TopicNames


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` now (the kernel's choice; another process may
    take it before the caller binds it)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class HomeUnusableError(RuntimeError):
    """``FLYWHEEL_HOME`` cannot hold Flywheel's state (a file, or a directory that cannot be
    created); the message names the variable and the reason. Commands print it in one line."""


def home(create: bool = True) -> Path:
    """Root of Flywheel's local state; created on first use (``create``; False: a path to
    read from, created by whatever writes there first).

    Raises:
        HomeUnusableError: ``FLYWHEEL_HOME`` names a file, or a directory that cannot be
            created (the message names the variable and the reason).
    """
    p = Path(os.environ.get("FLYWHEEL_HOME", ".flywheel")).absolute()
    if not create:
        if p.exists() and not p.is_dir():
            raise HomeUnusableError(f"FLYWHEEL_HOME={p}: cannot be used as Flywheel's home: not a directory")
        return p
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file there (FileExistsError), no permission, read-only disk
        raise HomeUnusableError(f"FLYWHEEL_HOME={p}: cannot be used as Flywheel's home: "
                           f"{'not a directory' if p.exists() else exc.strerror or exc}") from None
    return p


def broker_state_file() -> Path:
    return home() / "broker.json"


def bootstrap() -> str:
    """Kafka bootstrap servers.

    Raises:
        RuntimeError: no external cluster is configured and no embedded broker runs.
    """
    env = os.environ.get("FLYWHEEL_KAFKA_BOOTSTRAP")
    if env:
        return env
    f = broker_state_file()
    if f.exists():
        return json.loads(f.read_text())["bootstrap"]
    raise RuntimeError(
        "no Kafka broker: set FLYWHEEL_KAFKA_BOOTSTRAP or run `flywheel broker start`")


def store_dir() -> Path | str:
    """The model store (versions, manifests, snapshots, deltas): ``$FLYWHEEL_STORE`` as given
    when it is an fsspec URL (``s3://bucket/fw``, ``memory://fw``; ``modelstore.store.ModelStore``
    opens it), else a local directory (``$FLYWHEEL_STORE`` or ``$FLYWHEEL_HOME/store``)."""
    raw = os.environ.get("FLYWHEEL_STORE", "")
    return raw if "://" in raw else Path(raw or home(create=False) / "store")  # ModelStore creates it


def samples_dir(create_home: bool = True) -> Path:
    """Parquet shards of RewardedSamples written by ingest: ``$FLYWHEEL_SAMPLES``, else
    ``$FLYWHEEL_HOME/data/samples``. ``create_home`` False: a path to read from (the home is
    not created; see :func:`home`)."""
    raw = os.environ.get("FLYWHEEL_SAMPLES")
    return Path(raw) if raw else home(create=create_home) / "data" / "samples"


def catalog_path() -> Path:
    """DuckDB catalog over the sample shards."""
    return home() / "catalog.duckdb"


def ledger_path() -> Path:
    """DuckDB ledger of deployment decisions: ``fleet/ledger.duckdb`` beside the fleet's
    desired-state record when the model store is a directory (shared storage: every operator's
    machine and the controller write one audit log); ``$FLYWHEEL_HOME/ledger.duckdb`` when the
    store is an fsspec URL (DuckDB cannot write to an object store; the ``flywheel.deployments``
    topic is the shared copy there)."""
    store = store_dir()
    return store / "fleet" / "ledger.duckdb" if isinstance(store, Path) else home() / "ledger.duckdb"


def learner_state_dir() -> Path:
    """The learner's state: ``learner_state.json`` (watermark, consumed shards, cycles) and
    ``ckpt/`` (the resumable DeepSpeed checkpoint): ``$FLYWHEEL_LEARNER_STATE``, else
    ``$FLYWHEEL_HOME/learner``. A learner rescheduled onto another node finds its position only
    if this is on storage that outlives the pod (the manifests put it on the shared volume)."""
    raw = os.environ.get("FLYWHEEL_LEARNER_STATE")
    return Path(raw) if raw else home() / "learner"


def serving_url() -> str:
    return os.environ.get("FLYWHEEL_SERVING_URL", "http://127.0.0.1:8000")


def base_model_dir() -> Path:
    """Where ``flywheel model init`` writes the upcycled MoE checkpoint.

    Shared by every run on the machine (``~/.cache/flywheel/models/...``) so the
    one-time conversion is cached; override with ``FLYWHEEL_MODEL_DIR``.
    """
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flywheel"
    return Path(os.environ.get("FLYWHEEL_MODEL_DIR", cache / "models" / "smollm2-135m-moe"))


SALT_MIN_CHARS = 16  # a fleet's salt: shorter ones make user ids guessable from their hashes


class SaltError(ValueError):
    """The user-id salt is missing or unusable; the message starts with the setting to fix
    (``FLYWHEEL_USER_SALT`` or ``FLYWHEEL_USER_SALT_FILE``)."""


def user_salt(fleet: bool = False, why: str = "") -> str:
    """The user-id salt that :func:`schemas.events.hash_user` mixes into every ``user_hash``.

    The sticky stable/candidate split and the join's one-vote-per-user rule both key on
    ``user_hash``, so every pod of a fleet (and the feedback SDK's Kafka mode) must use one
    salt, and it must survive restarts. Sources, first found wins:

    1. ``FLYWHEEL_USER_SALT``: the salt itself.
    2. ``FLYWHEEL_USER_SALT_FILE``: a file whose content (surrounding whitespace stripped) is
       the salt: a Kubernetes Secret mounted as a file (``deploy/k8s/serving.yaml``).
    3. One box only (``fleet=False``): ``$FLYWHEEL_HOME/user_salt``, generated once (32 hex
       characters, mode 0600) and read back at every start.

    Args:
        fleet: the caller serves a fleet (``flywheel serve --fleet``, or a ``--host`` reachable
            from other machines): a per-home generated salt is refused, and the salt must have
            at least :data:`SALT_MIN_CHARS` characters.
        why: what made the caller a fleet member, quoted in the error (``--host 0.0.0.0 ...``).

    Raises:
        SaltError: both variables set; the file missing, unreadable or empty; in a fleet, no
            salt configured or one shorter than :data:`SALT_MIN_CHARS`. The message names the
            variable.
    """
    inline, path = os.environ.get("FLYWHEEL_USER_SALT", ""), os.environ.get("FLYWHEEL_USER_SALT_FILE", "")
    if inline and path:
        raise SaltError("FLYWHEEL_USER_SALT: set one of FLYWHEEL_USER_SALT and FLYWHEEL_USER_SALT_FILE, not both")
    if path:
        try:
            salt, name = Path(path).read_text().strip(), "FLYWHEEL_USER_SALT_FILE"
        except OSError as exc:
            raise SaltError(f"FLYWHEEL_USER_SALT_FILE: cannot read {path}: {exc.strerror or exc}") from None
        if not salt:
            raise SaltError(f"FLYWHEEL_USER_SALT_FILE: {path} is empty")
    elif inline:
        salt, name = inline, "FLYWHEEL_USER_SALT"
    elif fleet:
        raise SaltError(
            f"FLYWHEEL_USER_SALT: this pod serves a fleet{f' ({why})' if why else ''}, and every pod must hash "
            "users with the same salt or users get a different arm and a different identity on each pod: set "
            "FLYWHEEL_USER_SALT, or FLYWHEEL_USER_SALT_FILE to a file holding it (a mounted Secret), to the "
            f"fleet's secret of at least {SALT_MIN_CHARS} characters (docs/deploy.md)")
    else:
        return _generated_salt()
    if fleet and len(salt) < SALT_MIN_CHARS:
        raise SaltError(f"{name}: a fleet's salt needs at least {SALT_MIN_CHARS} characters, got {len(salt)} "
                        "(a short salt lets anyone who sees a user_hash guess the user id)")
    return salt


def _generated_salt() -> str:
    """``$FLYWHEEL_HOME/user_salt``, created once (mode 0600; a salt already there is kept)."""
    import secrets

    f = home() / "user_salt"
    if not f.exists():
        tmp = f.with_name(f"user_salt.{os.getpid()}.tmp")
        tmp.write_text(secrets.token_hex(16))
        tmp.chmod(0o600)
        try:
            os.link(tmp, f)  # never replaces: of two first starts, both read the one salt that won
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return f.read_text().strip()


SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


class KafkaSettings(BaseSettings):
    """How Flywheel talks to Kafka, read from ``FLYWHEEL_KAFKA_<FIELD>`` environment variables.

    Connection:
        bootstrap: ``host:port[,host:port]``; unset = the embedded broker (:func:`bootstrap`).
        security_protocol: ``PLAINTEXT`` | ``SSL`` | ``SASL_PLAINTEXT`` | ``SASL_SSL``
            (Kafka's ``security.protocol``).
        sasl_mechanism: ``PLAIN`` | ``SCRAM-SHA-256`` | ``SCRAM-SHA-512``; required with SASL_*.
        sasl_username: SASL user; required with SASL_*.
        sasl_password / sasl_password_file: the SASL password, given inline or as a file whose
            content (trailing newline stripped) is the password (a Kubernetes Secret mounted as
            a file); exactly one of them with SASL_*.
        ssl_cafile: PEM CA bundle that signed the brokers' certificates (default: the system's).
        ssl_certfile / ssl_keyfile: client certificate and key (PEM) for mutual TLS.
        ssl_check_hostname: verify that the broker's certificate names its host (default on).

    Topics (``flywheel topics create|check``; ``schemas.topics``):
        topic_prefix: prepended to every topic name (``team-a.`` gives ``team-a.flywheel.completions``).
        partitions: partitions of every Flywheel topic (>= 1).
        replication_factor: replicas of every topic (>= 1; 3 on a production cluster).
        retention_ms: per-topic ``retention.ms`` overrides keyed by the topic's short name
            (``completions``, ``feedback``, ``samples``, ``deadletter``, ``rekeyed``, ``deployments``), JSON
            in the environment: ``FLYWHEEL_KAFKA_RETENTION_MS='{"completions": 86400000}'``;
            -1 keeps records forever.
        max_message_bytes: ``max.message.bytes`` of every topic and the producers'
            ``max_request_size`` (bytes, >= 1024).

    Raises:
        pydantic.ValidationError: an unknown protocol or mechanism, SASL without user or
            password, both or neither of password and password file, a TLS file that does not
            exist; the message names the ``FLYWHEEL_KAFKA_*`` field.
    """

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_KAFKA_", extra="ignore")

    bootstrap: str | None = None
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    sasl_password_file: Path | None = None
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    ssl_check_hostname: bool = True
    topic_prefix: str = Field("", pattern=r"^[A-Za-z0-9._-]*$", max_length=200)
    partitions: int = Field(6, ge=1)
    replication_factor: int = Field(1, ge=1)
    # NoDecode: the JSON text is parsed by _retention_json, so a malformed value is a
    # ValidationError naming the field (pydantic-settings' own decoding raised a bare
    # SettingsError: a traceback at every command's start)
    retention_ms: Annotated[dict[str, int], NoDecode] = Field(default_factory=dict)
    max_message_bytes: int = Field(16 * 1024 * 1024, ge=1024)

    @field_validator("sasl_password_file", "ssl_cafile", "ssl_certfile", "ssl_keyfile")
    @classmethod
    def _file_exists(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_file():
            raise ValueError(f"{v} is not a readable file")
        return v

    @field_validator("retention_ms", mode="before")
    @classmethod
    def _retention_json(cls, v):
        if isinstance(v, (str, bytes)):
            try:
                v = json.loads(v)
            except ValueError as exc:
                raise ValueError(f'not a JSON object of topic -> ms ({{"completions": 86400000}}): {exc}') from None
            if not isinstance(v, dict):
                raise ValueError(f'a JSON object of topic -> ms is expected ({{"completions": 86400000}}), '
                                 f"got {type(v).__name__}")
        return v

    @field_validator("retention_ms")
    @classmethod
    def _retention(cls, v: dict[str, int]) -> dict[str, int]:
        for name, ms in v.items():
            if name not in SPECS:
                raise ValueError(f"unknown topic {name!r}; topics are {', '.join(SPECS)}")
            if ms < -1 or ms == 0:
                raise ValueError(f"{name}: retention.ms must be -1 (forever) or > 0, got {ms}")
        return v

    @model_validator(mode="after")
    def _sasl_complete(self):
        if self.security_protocol.startswith("SASL_"):
            missing = [f"FLYWHEEL_KAFKA_{n.upper()}" for n in ("sasl_mechanism", "sasl_username")
                       if getattr(self, n) is None]
            if missing:
                raise ValueError(f"security_protocol={self.security_protocol} needs {' and '.join(missing)}")
            if (self.sasl_password is None) == (self.sasl_password_file is None):
                raise ValueError("sasl_password: set exactly one of FLYWHEEL_KAFKA_SASL_PASSWORD and "
                                 "FLYWHEEL_KAFKA_SASL_PASSWORD_FILE")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile: a client certificate needs its key (FLYWHEEL_KAFKA_SSL_CERTFILE "
                             "and FLYWHEEL_KAFKA_SSL_KEYFILE go together)")
        return self

    def password(self) -> str | None:
        """The SASL password (from the file when one is given), or None without SASL."""
        if self.sasl_password_file is not None:
            return self.sasl_password_file.read_text().rstrip("\r\n")
        return self.sasl_password.get_secret_value() if self.sasl_password is not None else None


def _kafka_env() -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("FLYWHEEL_KAFKA_")))


@lru_cache(maxsize=8)
def _kafka_settings_for(env: tuple[tuple[str, str], ...]) -> KafkaSettings:
    return KafkaSettings()


def kafka_settings() -> KafkaSettings:
    """The current :class:`KafkaSettings` (re-read whenever a ``FLYWHEEL_KAFKA_*`` variable changes)."""
    return _kafka_settings_for(_kafka_env())


def topic_names(settings: KafkaSettings | None = None, app_id: str = INGEST_APP_ID) -> TopicNames:
    """The topics' full names and the ingest group under the settings' ``topic_prefix``
    (``FLYWHEEL_KAFKA_TOPIC_PREFIX``), resolved now: a process calls this once and passes the
    result to what produces or consumes.

    Other ``FLYWHEEL_KAFKA_*`` values that do not validate do not stop the names from being
    resolved: the prefix is then taken as the environment gives it, and the first Kafka client
    or the CLI's settings check reports the bad value.
    """
    if settings is not None:
        prefix = settings.topic_prefix
    else:
        try:
            prefix = kafka_settings().topic_prefix
        except ValidationError:
            prefix = os.environ.get("FLYWHEEL_KAFKA_TOPIC_PREFIX", "")
    return TopicNames.for_prefix(prefix, app_id)


KafkaLibrary = Literal["kafka-python", "aiokafka"]


def kafka_client_config(bootstrap_servers: str | None = None, library: KafkaLibrary = "kafka-python",
                        settings: KafkaSettings | None = None) -> dict:
    """Connection keywords for a Kafka client: bootstrap, ``security_protocol``, SASL and TLS.

    Every producer, consumer and admin client Flywheel constructs starts from this dict, so one
    set of ``FLYWHEEL_KAFKA_*`` variables secures them all. Callers add their own tuning
    keywords (acks, linger, group); this dict never contains those.

    Args:
        bootstrap_servers: the cluster (default :func:`bootstrap`).
        library: ``kafka-python`` (``KafkaProducer``, ``KafkaConsumer``, ``KafkaAdminClient``:
            TLS as ``ssl_cafile``/``ssl_certfile``/``ssl_keyfile``) or ``aiokafka``
            (``AIOKafkaProducer``/``AIOKafkaConsumer``: TLS as one ``ssl_context``).
        settings: default :func:`kafka_settings`.

    Raises:
        ValueError: unknown ``library``.
        RuntimeError: no bootstrap given, configured or running (:func:`bootstrap`).
    """
    s = settings or kafka_settings()
    if library not in ("kafka-python", "aiokafka"):
        raise ValueError(f"library: kafka-python or aiokafka, got {library!r}")
    kw: dict = {"bootstrap_servers": bootstrap_servers or bootstrap(),
                "security_protocol": s.security_protocol}
    if s.security_protocol.startswith("SASL_"):
        kw.update(sasl_mechanism=s.sasl_mechanism, sasl_plain_username=s.sasl_username,
                  sasl_plain_password=s.password())
    if s.security_protocol in ("SSL", "SASL_SSL"):
        files = {"cafile": s.ssl_cafile, "certfile": s.ssl_certfile, "keyfile": s.ssl_keyfile}
        files = {k: str(v) for k, v in files.items() if v is not None}
        if library == "aiokafka":
            from aiokafka.helpers import create_ssl_context

            ctx = create_ssl_context(**files)
            ctx.check_hostname = s.ssl_check_hostname
            kw["ssl_context"] = ctx
        else:
            kw.update({f"ssl_{k}": v for k, v in files.items()}, ssl_check_hostname=s.ssl_check_hostname)
    return kw
