"""Model store: versions as full snapshots or bit-exact deltas on their exact parent.

``root`` is a local directory or any fsspec URL (``memory://``, ``s3://``, ...; ``file://``
is local); see :class:`ModelStore` for what is atomic where. Layout under ``root``::

    base/                      HF checkpoint (config, tokenizer, weights) consumers build from
    versions/v000007/
        index.json             one entry per tensor: dtype, shape, mode, offset, length,
                               sha256 of the stored payload bytes, parent tensor sha256
        payload.bin            concatenated entries (zstd frames)
        manifest.json          schemas.manifest.VersionManifest; written last
    fleet/desired.json         the fleet's desired-state record (modelstore.desired): what every
                               pod serves, the one record of which version is stable
    stable.json                the stable record of a store that has no fleet record yet
                               (version, at, actor, reason, history); once fleet/desired.json
                               exists, a copy derived from it at every change, which nothing
                               reads while the record exists

The bytes of each version are :mod:`modelstore.codec`'s (a snapshot, or a bit-exact XOR delta on
its exact parent, zstd compressed, every tensor verified against the manifest's sha256).

This module knows nothing about serving or training: it stores ``{name: tensor}`` dicts.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import threading
import uuid
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING


from modelstore.codec import CorruptVersionError, decode_state, encode_state
from modelstore.desired import stable_record_of
from schemas.events import now_ms
from schemas.manifest import (BASE_VERSION, StatusChange, TensorMeta, VersionManifest, tensor_sha256,
                              version_name, version_number)

if TYPE_CHECKING:  # torch is imported where tensors are handled: the `flywheel` command imports this
    import torch   # module, and torch's import (seconds) would delay --version and every TAB completion

log = logging.getLogger(__name__)

INDEX_FORMAT = 1
STABLE_FILE = "stable.json"
DESIRED_FILE = ("fleet", "desired.json")  # modelstore.desired.DESIRED_FILE
STABLE_HISTORY_MAX = 200  # changes kept in the stable record (the ledger keeps them all)
BAD_STATUSES = frozenset({"rejected", "rolled_back", "failed", "aborted"})


class StoreUnusableError(OSError):
    """The store's root cannot be a model store (a file, a directory that cannot be written,
    an unreachable URL): the message names the root and the reason, for one line of the CLI."""


class StoreMissingError(StoreUnusableError):
    """No model store at the root a reader opened (``ModelStore(root, create=False)``): no
    ``versions`` directory there. ``strerror`` names the root and how a store is started."""


class CorruptManifestError(CorruptVersionError):
    """A version's ``manifest.json`` cannot be parsed (bad bytes, not JSON, fails the schema).

    Attributes as :class:`CorruptVersionError` (``tensor`` is ``"manifest.json"``); ``path``
    is the file relative to the store's root.
    """

    def __init__(self, version: str, reason: str):
        self.version, self.tensor, self.reason = version, "manifest.json", reason
        self.path = f"versions/{version}/manifest.json"
        ValueError.__init__(self, f"version {version}: {self.path} is corrupt: {reason}")


def nonfinite_tensors(state: dict[str, "torch.Tensor"]) -> list[tuple[str, int, int]]:
    """The floating and complex tensors of ``state`` holding NaN or infinite values, as
    ``(name, count, numel)`` in the state's order; empty when every value is finite. One pass
    over the weights (a boolean mask per tensor at a time).

    ``count`` is the elements that are NaN or infinite; for a complex tensor, the elements whose
    real or imaginary part is. Per dtype: float8_e8m0fnu's one non-finite value is NaN, the byte
    0xFF (read as bytes: ``torch.isfinite`` says True for it); float8 e4m3fn, e4m3fnuz and
    e5m2fnuz have no infinity and NaN is their one non-finite value (torch has no ``isfinite``
    for them); float4_e2m1fn_x2 has no non-finite value. Integer and bool tensors are skipped
    (the codec names a dtype the store does not hold)."""
    import torch

    bad = []
    for name, t in state.items():
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
            continue
        if t.dtype == torch.float8_e8m0fnu:
            finite = t.view(torch.uint8) != 0xFF
        else:
            try:
                finite = torch.isfinite(t)  # complex: False where either part is NaN or infinite
            except NotImplementedError:
                finite = ~torch.isnan(t)
        if not bool(finite.all()):
            bad.append((name, int(finite.numel() - finite.sum()), t.numel()))
    return bad


def describe_nonfinite(bad: list[tuple[str, int, int]], shown: int = 5) -> str:
    """``"2 tensors hold NaN or infinite values: 'a': 1 of 64; 'b': 3 of 64"`` (``"1 tensor
    holds ..."`` for one) for :func:`nonfinite_tensors`' list: the first ``shown`` named, then a
    count. Names are quoted with ``repr`` (as the checkpoint checks quote them), so a name
    holding a newline or a terminal escape prints as its escaped text."""
    names = "; ".join(f"{k!r}: {n} of {total}" for k, n, total in bad[:shown])
    more = f"; and {len(bad) - shown} more" if len(bad) > shown else ""
    subject = "1 tensor holds" if len(bad) == 1 else f"{len(bad)} tensors hold"
    return f"{subject} NaN or infinite values: {names}{more}"


class NonFiniteWeightsError(ValueError):
    """A state the store refuses: floating or complex tensors holding NaN or infinite values
    (a version whose weights serve NaN logits is never stored; D101).

    Attributes:
        bad: :func:`nonfinite_tensors`' list, ``[(name, count, numel), ...]`` in the state's
            order (``count`` the NaN and infinite values together).
        reason: :func:`describe_nonfinite`'s text for ``bad``; ``str()`` is ``"state: " + reason``.
    """

    def __init__(self, bad: list[tuple[str, int, int]]):
        self.bad = list(bad)
        self.reason = describe_nonfinite(self.bad)
        super().__init__(f"state: {self.reason}")


def _refuse_nonfinite(state: dict[str, "torch.Tensor"]) -> None:
    """The store's one finiteness check of a state it is asked to write (:meth:`ModelStore.publish`,
    :meth:`ModelStore.init_base`), before anything is written.

    Raises:
        NonFiniteWeightsError: a floating tensor of ``state`` holds NaN or infinite values.
    """
    bad = nonfinite_tensors(state)
    if bad:
        raise NonFiniteWeightsError(bad)


def _is_url(root) -> bool:
    return isinstance(root, str) and "://" in root



_FILE_TYPES = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"))


def read_regular(path: Path, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (its first ``limit`` bytes when given), read
    without ever blocking on what is not a regular file: ``os.stat`` first, then an open with
    ``O_NONBLOCK`` whose ``fstat`` must show the same kind of file (one swapped in between the
    two is refused too).

    Raises:
        FileNotFoundError: no such file. IsADirectoryError: a directory (errno EISDIR).
        OSError: errno EINVAL, "not a regular file (a FIFO)" (or a socket, a device), naming
            ``path``; or the read failed.
    """
    def check(mode: int) -> None:
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            what = next((name for test, name in _FILE_TYPES if test(mode)), "no regular file")
            raise OSError(errno.EINVAL, f"not a regular file ({what}): not read", str(path))

    check(os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        check(os.fstat(fd).st_mode)
        return f.read() if limit is None else f.read(limit)

class ModelStore:
    """Versions of one model's weights on a local directory or any fsspec URL.

    Args:
        root: store directory (created), or an fsspec URL (``memory://store``,
            ``s3://bucket/store``, ``file:///srv/store``; ``file://`` is handled as a local
            directory).
        snapshot_every: every K-th version (by number) is stored as a full snapshot,
            which bounds delta chains to K-1 links.
        storage_options: passed to ``fsspec.core.url_to_fs`` for URLs (credentials, ...).
        create: create ``root/versions`` when missing (a writer). False opens an existing store
            and creates nothing (a read command: ``flywheel versions``, ``flywheel status``).

    Raises:
        ValueError: ``snapshot_every`` < 1.
        StoreMissingError: ``create`` is False and ``root`` holds no ``versions`` directory
            (the message names ``root``).
        StoreUnusableError: ``root`` cannot be a store (a file, a read-only mount, no
            permission; the message names the path and the reason).

    Atomicity: on a local directory a version is written to a temp dir and renamed into
    place, manifests are replaced with ``os.replace``, and writers hold an ``flock`` on
    ``<root>/.lock`` (several processes may publish). On other filesystems there is no
    rename or lock: a version's payload and index are written first and its
    ``manifest.json`` last, in one put, so readers never see a half-written version (a
    version counts only once its manifest exists), and a status change rewrites the manifest
    in one put (atomic on object stores: S3/GCS/Azure PUT). Concurrent *writers* are only
    serialised within one process there: run one publisher (the learner) per remote store.
    """

    def __init__(self, root: str | Path, snapshot_every: int = 10, storage_options: dict | None = None, *,
                 create: bool = True):
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every: must be >= 1, got {snapshot_every}")
        self.snapshot_every = snapshot_every
        self.fs = None  # fsspec filesystem for non-local URLs, else None (local Path I/O)
        if _is_url(root):
            import fsspec
            from fsspec.implementations.local import LocalFileSystem

            fs, path = fsspec.core.url_to_fs(root, **(storage_options or {}))
            if isinstance(fs, LocalFileSystem):
                root = path
            else:
                self.fs, self._fs_root = fs, path.rstrip("/")
        self.root: Path | str = root if self.fs is not None else Path(root)
        try:
            if not create:
                self._check_exists(root)
            elif self.fs is None:
                (self.root / "versions").mkdir(parents=True, exist_ok=True)
            else:
                self.fs.makedirs(self._p("versions"), exist_ok=True)
        except StoreMissingError:
            raise
        except OSError as exc:  # a file, a read-only mount, no permission: say which, no traceback
            why = exc.strerror or str(exc) or type(exc).__name__
            raise StoreUnusableError(exc.errno, f"model store {root}: cannot use it as a store ({why}: "
                                                f"{exc.filename or root}); set FLYWHEEL_STORE (or --store) "
                                                "to a directory or an fsspec URL") from None
        # version -> (identity at load time, reconstructed state); see _identity
        self._cache: OrderedDict[str, tuple[tuple, dict[str, torch.Tensor]]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._write_lock = threading.Lock()

    def _check_exists(self, root: str | Path) -> None:
        """Creates nothing. Raises StoreMissingError when ``versions`` is missing under the
        root; an OSError (NotADirectoryError: the root is a file) when it cannot be looked at."""
        if self.fs is None:
            versions = self.root / "versions"
            try:
                st = os.stat(versions)  # NotADirectoryError: the root is a file; PermissionError
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISDIR(st.st_mode):
                return
            if st is not None:
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(versions))
        elif self.fs.isdir(self._p("versions")):
            return
        raise StoreMissingError(errno.ENOENT, f"no model store at {root} (no versions directory there); start one "
                                              "with `flywheel serve` (the default model) or `flywheel model init "
                                              "--from DIR` (your checkpoint), or set FLYWHEEL_HOME or FLYWHEEL_STORE "
                                              "to an existing one")

    # -- storage (local Path or fsspec) -------------------------------------------------
    def _p(self, *parts: str) -> str:
        """Path on the fsspec filesystem of ``root/parts``."""
        return "/".join((self._fs_root, *parts))

    def _read(self, *parts: str) -> bytes:
        """One file's bytes. Locally only a regular file is read (:func:`read_regular`): a FIFO,
        socket or device in its place is an OSError, never a read that blocks.

        Raises:
            FileNotFoundError: no such file. IsADirectoryError: a directory in its place.
            OSError: not a regular file (names the file and what it is), or a failed read.
        """
        if self.fs is None:
            return read_regular(self.root.joinpath(*parts))
        return self.fs.cat_file(self._p(*parts))

    def _exists(self, *parts: str) -> bool:
        if self.fs is None:
            return self.root.joinpath(*parts).exists()
        return self.fs.exists(self._p(*parts))

    def _file_id(self, *parts: str) -> tuple:
        """What tells one content of a file from another without reading it: (size, mtime
        in ns, inode) locally; (size, ETag or mtime) on fsspec. ``("missing",)`` if absent."""
        try:
            if self.fs is None:
                st = self.root.joinpath(*parts).stat()
                return (st.st_size, st.st_mtime_ns, st.st_ino)
            info = self.fs.info(self._p(*parts))
        except FileNotFoundError:
            return ("missing",)
        stamp = next((info[k] for k in ("ETag", "etag", "mtime", "LastModified", "last_modified", "created")
                      if info.get(k)), "")
        return (info.get("size"), str(stamp))

    def _read_head(self, limit: int, *parts: str) -> bytes:
        """The first ``limit`` bytes of one file (all of it when shorter): a reader that bounds
        what it accepts never reads a huge file whole. Locally only a regular file is read
        (:func:`read_regular`: a FIFO in its place is an OSError, never a read that blocks).

        Raises:
            FileNotFoundError: no such file. IsADirectoryError: a directory in its place.
            OSError: not a regular file (names the file and what it is), or a failed read.
        """
        if self.fs is None:
            return read_regular(self.root.joinpath(*parts), limit)
        with self.fs.open(self._p(*parts), "rb") as f:
            return f.read(limit)

    def _put_atomic(self, data: bytes, *parts: str) -> None:
        """Replace one file: local temp + ``os.replace``; fsspec one ``pipe`` (one PUT).

        Raises:
            OSError: the file could not be written or replaced (a full disk, a directory in its
                place, no permission), naming the file, not the temp file; the temp file is
                removed, so a write retried at every poll leaves nothing behind.
        """
        if self.fs is None:
            f = self.root.joinpath(*parts)
            tmp = f.with_name(f".{f.name}.tmp-{uuid.uuid4().hex}")
            try:
                tmp.write_bytes(data)
                os.replace(tmp, f)
            except BaseException as exc:
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:  # the directory itself unwritable: nothing was created there
                    pass
                if isinstance(exc, OSError) and exc.errno is not None:
                    raise OSError(exc.errno, exc.strerror or type(exc).__name__, str(f)) from exc
                raise
        else:
            self.fs.pipe_file(self._p(*parts), data)

    # -- layout -------------------------------------------------------------------------
    @property
    def base_dir(self) -> Path:
        """Local HF checkpoint dir to build the module from (``schemas.modelspec.load_model``)
        before ``load_state_dict(store.load(version))``. For a URL store, ``base/`` is
        downloaded once into ``schemas.settings.home()/store-cache/<hash>/base``."""
        if self.fs is None:
            return self.root / "base"
        from schemas import settings

        key = hashlib.sha256(str(self.root).encode()).hexdigest()[:16]
        local = settings.home() / "store-cache" / key / "base"
        if not (local / ".complete").exists():
            tmp = local.with_name(f".tmp-base-{uuid.uuid4().hex}")
            tmp.mkdir(parents=True)
            for f in self.fs.ls(self._p("base"), detail=False):
                name = f.rstrip("/").rsplit("/", 1)[-1]
                (tmp / name).write_bytes(self.fs.cat_file(f))
            (tmp / ".complete").write_text(str(self.root))
            if local.exists():
                shutil.rmtree(local)
            os.rename(tmp, local)
        return local

    def _vdir(self, version: str) -> Path:
        version_number(version)
        return self.root / "versions" / version

    @contextmanager
    def _lock(self):
        with self._write_lock:
            if self.fs is not None:  # no cross-process lock on object stores (see class doc)
                yield
                return
            with open(self.root / ".lock", "w") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)

    # -- queries ------------------------------------------------------------------------
    def versions(self) -> list[str]:
        """All complete versions (manifest present), sorted."""
        if self.fs is None:
            names = [p.name for p in (self.root / "versions").iterdir()]
        else:
            try:
                names = [f.rstrip("/").rsplit("/", 1)[-1] for f in self.fs.ls(self._p("versions"), detail=False)]
            except FileNotFoundError:
                names = []
        return sorted(n for n in names
                      if n.startswith("v") and n[1:].isdigit() and self._exists("versions", n, "manifest.json"))

    def manifest(self, version: str) -> VersionManifest:
        """The manifest of ``version``.

        Raises:
            KeyError: the version is not in the store.
            CorruptManifestError: the file cannot be parsed; names the version, the file and
                the first error (pydantic's location and message, or the decode error).
        """
        from pydantic import ValidationError

        version_number(version)
        try:
            raw = self._read("versions", version, "manifest.json")
        except FileNotFoundError:
            raise KeyError(f"version {version} is not in the store at {self.root}") from None
        try:
            return VersionManifest.model_validate_json(raw)
        except ValidationError as exc:
            e = exc.errors()[0]
            where = ".".join(str(x) for x in e.get("loc", ())) or "(document)"
            raise CorruptManifestError(version, f"{where}: {e.get('msg')} ({exc.error_count()} error(s))") from None
        except ValueError as exc:  # bytes that are not UTF-8
            raise CorruptManifestError(version, str(exc)) from None

    def latest(self) -> str:
        """Newest version; raises LookupError on an empty store."""
        vs = self.versions()
        if not vs:
            raise LookupError(f"model store at {self.root} is empty (run init_base)")
        return vs[-1]

    # -- writes -------------------------------------------------------------------------
    def init_base(self, model_dir: Path, state: dict[str, torch.Tensor] | None = None) -> VersionManifest:
        """Copy the HF checkpoint to ``base/`` and register it as ``schemas.manifest.BASE_VERSION`` (snapshot,
        status ``promoted``) in the checkpoint's own dtype (``schemas.modelspec.load_model``).
        Idempotent: returns the existing manifest if present.

        Args:
            state: the checkpoint's weights already loaded by the caller, as the model
                names them (saves loading them again); default: loaded here.

        Raises:
            ValueError: ``model_dir`` has no config.json.
            NonFiniteWeightsError: (a ValueError) a weight is NaN or infinite; checked before
                ``base/`` is copied, so the store is left as it was.
        """
        from schemas.modelspec import load_model

        v0 = BASE_VERSION
        with self._lock():
            if self._exists("versions", v0, "manifest.json"):
                return self.manifest(v0)
            model_dir = Path(model_dir)
            if not (model_dir / "config.json").exists():
                raise ValueError(f"model_dir: {model_dir} has no config.json")
            if state is None:
                state = load_model(model_dir).state_dict()
            _refuse_nonfinite(state)  # before base/ is copied: a refusal leaves the store as it was
            if self.fs is None:
                tmp_base = self.root / f".tmp-base-{uuid.uuid4().hex}"
                shutil.copytree(model_dir, tmp_base)
                if self.base_dir.exists():
                    shutil.rmtree(self.base_dir)
                os.rename(tmp_base, self.base_dir)
            else:
                for f in sorted(model_dir.iterdir()):
                    if f.is_file():
                        self.fs.pipe_file(self._p("base", f.name), f.read_bytes())
            m = self._write(v0, None, state, None, {}, {}, "promoted", "base model")
            self._write_stable(v0, "init_base", "base model")
            return m

    def publish(self, state: dict[str, torch.Tensor], parent: str, metrics: dict | None = None,
                eval: dict | None = None) -> VersionManifest:
        """Store ``state`` as the next version, a delta on ``parent`` (or a snapshot every
        ``snapshot_every`` versions), status ``published``.

        Raises:
            KeyError: ``parent`` is not in the store.
            ValueError: ``state`` holds a non-tensor or an unsupported dtype; nothing is
                written then.
            NonFiniteWeightsError: (a ValueError) ``state`` holds NaN or infinite values
                (``.bad`` names the tensors, :func:`nonfinite_tensors`); checked before the
                parent is read, nothing is written.
        """
        _refuse_nonfinite(state)  # a version whose weights serve NaN logits is never stored
        with self._lock():
            self.manifest(parent)
            n = version_number(self.latest()) + 1
            # the parent only serves as the delta's base here: reconstructed without caching and
            # without a copy (a cycle's learner holds the new weights beside it; caching a delta's
            # chain would add one model per ancestor to its peak)
            parent_state = None if n % self.snapshot_every == 0 else self.load(parent, cache=False)
            return self._write(version_name(n), parent, state, parent_state, metrics or {}, eval or {},
                               "published", "")

    def _write(self, version, parent, state, parent_state, metrics, eval_, status, reason):
        """Write ``state`` as ``version`` (its callers, publish and init_base, have run
        :func:`_refuse_nonfinite` on it)."""
        entries, payload = encode_state(state, parent_state)
        tensors = {k: TensorMeta(dtype=str(v.dtype), shape=list(v.shape), sha256=tensor_sha256(v))
                   for k, v in sorted(state.items())}
        snapshot_bytes = sum(v.numel() * v.element_size() for v in state.values())
        index = json.dumps({"format": INDEX_FORMAT, "version": version,
                            "parent": parent if parent_state is not None else None, "entries": entries}).encode()
        m = VersionManifest(version=version, parent=parent, created_at=now_ms(),
                            kind="delta" if parent_state is not None else "snapshot", tensors=tensors,
                            metrics=metrics, eval=eval_,
                            status_history=[StatusChange(status=status, at=now_ms(), reason=reason)],
                            size_bytes=len(payload) + len(index), snapshot_bytes=snapshot_bytes)
        manifest = m.model_dump_json(indent=1).encode()
        if self.fs is None:
            tmp = self.root / "versions" / f".tmp-{version}-{uuid.uuid4().hex}"
            tmp.mkdir()
            (tmp / "payload.bin").write_bytes(payload)
            (tmp / "index.json").write_bytes(index)
            (tmp / "manifest.json").write_bytes(manifest)  # last
            os.rename(tmp, self._vdir(version))
        else:  # no rename on object stores: the manifest, written last in one put, commits
            self.fs.pipe_file(self._p("versions", version, "payload.bin"), payload)
            self.fs.pipe_file(self._p("versions", version, "index.json"), index)
            self.fs.pipe_file(self._p("versions", version, "manifest.json"), manifest)
        return m

    def set_status(self, version: str, status: str, reason: str = "", actor: str = "") -> VersionManifest:
        """Append ``status`` (published|canary|promoted|rolled_back|rejected|...) to the
        version's status history (atomic rewrite of its manifest).

        ``promoted`` means "is now stable": on a store with no fleet record yet it also moves
        ``stable.json`` to ``version``, with ``actor`` and ``reason``; once
        ``fleet/desired.json`` exists, that record alone says what is stable.
        """
        with self._lock():
            m = self.manifest(version)
            m.status_history.append(StatusChange(status=status, at=now_ms(), reason=reason))
            self._put_atomic(m.model_dump_json(indent=1).encode(), "versions", version, "manifest.json")
            if status == "promoted" and not self._exists(*DESIRED_FILE):
                self._write_stable(version, actor, reason)
            return m

    # -- the stable record --------------------------------------------------------------
    def _write_stable(self, version: str, actor: str, reason: str) -> dict:
        """Replace ``stable.json`` (caller holds the write lock)."""
        rec = self.stable_record() or {"history": []}
        change = {"version": version, "at": now_ms(), "actor": actor, "reason": reason}
        history = (rec.get("history") or [])[-(STABLE_HISTORY_MAX - 1):] + [change]
        rec = {**change, "history": history}
        self._put_atomic(json.dumps(rec, indent=1).encode(), STABLE_FILE)
        return rec

    def set_stable(self, version: str, actor: str = "", reason: str = "") -> dict:
        """Make ``version`` the stable record without a status change (e.g. a store written
        before the record existed). Returns the record. KeyError if not in the store."""
        with self._lock():
            self.manifest(version)
            return self._write_stable(version, actor, reason)

    def write_stable_copy(self, rec: dict) -> None:
        """Write ``stable.json`` as a copy of the stable record derived from the fleet record
        (:func:`modelstore.desired.stable_record_of`: version, at, actor, reason, generation,
        history). Never read while ``fleet/desired.json`` exists; if that record is removed
        (a repair), the next record starts from this copy's stable version and generation."""
        self._put_atomic(json.dumps(rec, indent=1).encode(), STABLE_FILE)

    def stable_record(self) -> dict | None:
        """The stable record (``{"version", "at" (ms), "actor", "reason", "history": [...]}``,
        history oldest first): derived from the fleet's desired-state record
        (``fleet/desired.json``, :mod:`modelstore.desired`) when it exists, else ``stable.json``;
        None if neither names a version or the one that exists is unreadable."""
        if self._exists(*DESIRED_FILE):
            try:
                return stable_record_of(self._read(*DESIRED_FILE))
            except (OSError, ValueError) as exc:
                log.warning("fleet record %s unreadable (%s): no stable record", "/".join(DESIRED_FILE), exc)
                return None
        try:
            rec = json.loads(self._read(STABLE_FILE))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("stable record %s unreadable (%s): ignored", STABLE_FILE, exc)
            return None
        return rec if isinstance(rec, dict) and isinstance(rec.get("version"), str) else None

    def stable(self) -> str | None:
        """The version every pod serves at start: the stable record's version.

        The record moves only when a version becomes stable (promote by the controller or
        an operator, ``rollback``, ``rollback --to``; all of them are in the ledger too), so
        a restart never undoes an operator's action. A store without a record (written
        before it existed) falls back to the version most recently marked ``promoted`` that
        is still ``promoted``. None on an empty store.
        """
        rec = self.stable_record()
        vs = self.versions()
        if rec is not None:
            if rec["version"] in vs:
                return rec["version"]
            log.warning("stable record names %s, which is not in the store: falling back to status "
                        "history", rec["version"])
        best, best_at = None, -1
        for v in vs:
            try:
                hist = self.manifest(v).status_history
            except Exception:  # noqa: BLE001 - an unreadable manifest is not a candidate
                continue
            if hist and hist[-1].status == "promoted" and hist[-1].at >= best_at:
                best, best_at = v, hist[-1].at
        return best

    def previous_stable(self, stable: str) -> str | None:
        """The version that was stable before ``stable`` (newest first in the stable
        record's history, skipping ``stable`` itself and versions rolled back, failed,
        rejected or aborted since); without a history, the newest older version still
        ``promoted``. None if there is none."""
        def ok(v: str) -> bool:
            try:
                h = self.manifest(v).status_history
            except (KeyError, CorruptVersionError):
                return False
            return not (h and h[-1].status in BAD_STATUSES)

        rec = self.stable_record()
        if rec and rec.get("history"):
            for ch in reversed(rec["history"]):
                if ch["version"] != stable and ok(ch["version"]):
                    return ch["version"]
            return None
        for v in reversed(self.versions()):
            if version_number(v) < version_number(stable) and ok(v):
                h = self.manifest(v).status_history
                if h and h[-1].status == "promoted":
                    return v
        return None

    # -- reads --------------------------------------------------------------------------
    def load(self, version: str, *, resident: dict[str, dict[str, torch.Tensor]] | None = None,
             cache: bool = True) -> dict[str, torch.Tensor]:
        """Reconstruct ``version``'s tensors (fresh copies; safe to modify).

        Walks back to the nearest snapshot (or a cached ancestor), applies each delta on
        its exact parent and verifies every tensor's sha256 against the manifest.

        Args:
            resident: ``{version: state}`` the caller already holds, equal to those versions'
                manifests *now* (the caller checks the digest: files can change under the
                same id) and never modified (a serving pod's weight slots): used as delta
                parents instead of reconstructing them; never modified here.
            cache: False reconstructs without keeping anything in the in-memory cache and
                returns the reconstructed tensors themselves (no copy): one model's memory
                per load, for a process that keeps the result (serving).

        Raises:
            KeyError: the version is not in the store.
            CorruptVersionError: truncated/corrupt payload, hash mismatch or wrong parent.
        """
        if not cache or resident:
            state = self._reconstruct(version, resident or {}, cache)
            return state if not cache else {k: v.clone() for k, v in state.items()}
        state = self._load_cached(version)
        return {k: v.clone() for k, v in state.items()}

    def _reconstruct(self, version: str, resident: dict, cache: bool) -> dict[str, torch.Tensor]:
        """:meth:`_load_cached` with ``resident`` states as parents and, when not ``cache``,
        nothing cached (a cached ancestor is still used when there is one)."""
        if version in resident:
            return resident[version]
        if cache:
            return self._load_cached(version)
        m = self.manifest(version)
        with self._cache_lock:
            hit = self._cache.get(version)
        if hit is not None and hit[0] == self._identity(version, m):
            return {k: v.clone() for k, v in hit[1].items()}
        try:
            index = json.loads(self._read("versions", version, "index.json"))
            payload = self._read("versions", version, "payload.bin")
        except (OSError, json.JSONDecodeError) as exc:
            raise CorruptVersionError(version, "*", f"unreadable index/payload: {exc}") from exc
        parent_state = parent_hashes = None
        if m.kind == "delta":
            if index.get("parent") != m.parent:
                raise CorruptVersionError(version, "*", f"wrong parent: delta was encoded against "
                                          f"{index.get('parent')}, manifest says {m.parent}")
            parent_state = self._reconstruct(m.parent, resident, cache)
            parent_hashes = {k: t.sha256 for k, t in self.manifest(m.parent).tensors.items()}
        expected = {k: meta.sha256 for k, meta in m.tensors.items()}
        state = decode_state(version, index["entries"], payload, parent_state, parent_hashes, expected)
        del parent_state, payload
        if set(state) != set(m.tensors):
            raise CorruptVersionError(version, "*", "tensor names differ from the manifest: "
                                      f"missing {sorted(set(m.tensors) - set(state))[:3]}, "
                                      f"extra {sorted(set(state) - set(m.tensors))[:3]}")
        return state

    def _identity(self, version: str, m: VersionManifest) -> tuple:
        """What the reconstructed tensors of ``version`` depend on: the manifest's weights
        digest, kind and parent, and the identity of ``index.json`` and ``payload.bin``
        (:meth:`_file_id`). A status change (a manifest rewrite) does not change it."""
        return (m.weights_digest, m.kind, m.parent, self._file_id("versions", version, "index.json"),
                self._file_id("versions", version, "payload.bin"))

    def invalidate(self, version: str, why: str = "") -> bool:
        """Named step: drop ``version`` from the in-memory cache (True if it was cached).
        :meth:`load` calls it when the version's files or manifest digest changed under the
        same id, so new files are never checked against stale tensors."""
        with self._cache_lock:
            hit = self._cache.pop(version, None) is not None
        if hit:
            log.info("store cache: %s dropped%s", version, f" ({why})" if why else "")
        return hit

    def _load_cached(self, version: str) -> dict[str, torch.Tensor]:
        m = self.manifest(version)
        ident = self._identity(version, m)
        with self._cache_lock:
            hit = self._cache.get(version)
            if hit is not None and hit[0] == ident:
                self._cache.move_to_end(version)
                return hit[1]
        if hit is not None:
            self.invalidate(version, f"files changed under the same id: identity {hit[0]} -> {ident}")
        try:
            index = json.loads(self._read("versions", version, "index.json"))
            payload = self._read("versions", version, "payload.bin")
        except (OSError, json.JSONDecodeError) as exc:
            raise CorruptVersionError(version, "*", f"unreadable index/payload: {exc}") from exc
        parent_state = None
        if m.kind == "delta":
            if index.get("parent") != m.parent:
                raise CorruptVersionError(version, "*", f"wrong parent: delta was encoded against "
                                          f"{index.get('parent')}, manifest says {m.parent}")
            parent_state = self._load_cached(m.parent)  # verified against its manifest
            parent_hashes = {k: t.sha256 for k, t in self.manifest(m.parent).tensors.items()}
        else:
            parent_hashes = None
        expected = {k: meta.sha256 for k, meta in m.tensors.items()}
        state = decode_state(version, index["entries"], payload, parent_state, parent_hashes, expected)
        if set(state) != set(m.tensors):
            raise CorruptVersionError(version, "*", "tensor names differ from the manifest: "
                                      f"missing {sorted(set(m.tensors) - set(state))[:3]}, "
                                      f"extra {sorted(set(state) - set(m.tensors))[:3]}")
        # every tensor's sha256 was checked against the manifest inside decode_state
        with self._cache_lock:
            self._cache[version] = (ident, state)
            self._cache.move_to_end(version)
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return state

    def clear_cache(self) -> None:
        """Drop the in-memory cache of reconstructed versions (named step; e.g. after
        files were replaced underneath the store)."""
        with self._cache_lock:
            self._cache.clear()
