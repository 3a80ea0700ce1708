"""Stale JIT-build locks under ``TORCH_EXTENSIONS_DIR``.

DeepSpeed JIT-builds its ``deepspeed_shm_comm`` op through ``torch.utils.cpp_extension``,
which guards each build directory with ``torch.utils.file_baton.FileBaton``: the builder
creates ``<dir>/<name>/lock`` (``O_CREAT | O_EXCL``, no content), keeps it open during the
build and deletes it at the end; every other process polls until the file is gone, with no
timeout. A builder killed mid-build (a SIGKILLed learner cycle) leaves the file behind and
every later learner waits on it forever.

:func:`clear_stale_locks` removes such a lock, with a warning, when no live process holds it
open (the builder holds its descriptor for the whole build; found through ``/proc/*/fd``)
and it is older than ``min_age_s`` (a lock created a moment ago may belong to a builder that
has not been seen yet). Where ``/proc`` cannot be read, a lock counts as stale only when
older than ``max_age_s`` (a cold build takes ~40 s; DESIGN §3). A build directory shared by
processes this host cannot see (a volume shared across PID namespaces) is outside what the
``/proc`` check can prove: give each learner its own directory.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger("flywheel.learner.extensions")

LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton file in each build directory
MIN_AGE_S = 2.0  # a lock younger than this is never touched (s)
MAX_AGE_S = 600.0  # without /proc: a lock older than this counts as abandoned (s)


def lock_holders(path: Path, proc: Path = Path("/proc")) -> set[int] | None:
    """PIDs of the processes (of those this process may inspect) holding ``path`` open.

    Returns:
        The set of PIDs (possibly empty), or None when ``proc`` cannot be read at all.
    """
    try:
        pids = [p for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return None
    target = os.path.realpath(path)
    out: set[int] = set()
    for p in pids:
        try:
            fds = list((p / "fd").iterdir())
        except OSError:  # gone, or another user's process
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    out.add(int(p.name))
                    break
            except OSError:
                continue
    return out


def clear_stale_locks(ext_dir: str | Path, min_age_s: float = MIN_AGE_S, max_age_s: float = MAX_AGE_S,
                      proc: Path = Path("/proc")) -> list[Path]:
    """Remove abandoned build locks ``ext_dir/*/lock``; returns the removed paths.

    A lock is abandoned when it is at least ``min_age_s`` old (s) and no live process holds
    it open, or, where ``proc`` is unreadable, when it is older than ``max_age_s`` (s).
    Each removal is logged as a warning naming the file and its age. A missing ``ext_dir``
    is not an error (nothing was built yet).
    """
    removed: list[Path] = []
    root = Path(ext_dir)
    if not root.is_dir():
        return removed
    for lock in sorted(root.glob(f"*/{LOCK_NAME}")):
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # released meanwhile
            continue
        if age < min_age_s:
            continue
        holders = lock_holders(lock, proc)
        if holders:
            continue
        if holders is None and age <= max_age_s:
            continue
        try:
            lock.unlink()
        except FileNotFoundError:
            continue
        why = "no live process holds it" if holders is not None else f"older than {max_age_s:g} s"
        log.warning("removed stale JIT-build lock %s (age %.0f s, %s): its builder died mid-build; "
                    "the op is built again", lock, age, why)
        removed.append(lock)
    return removed
