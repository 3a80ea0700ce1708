"""A JIT-build lock left by a killed builder does not block later learners forever.

``torch.utils.cpp_extension`` builds DeepSpeed's shm comm op under a ``FileBaton`` lock file
that other processes wait on with no timeout. The builder holds the file open while it
builds; :func:`learner.extensions.clear_stale_locks` removes a lock nobody holds.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from learner.extensions import clear_stale_locks, lock_holders

ROOT = Path(__file__).resolve().parents[1]


def _old(path: Path, age_s: float) -> None:
    t = time.time() - age_s
    os.utime(path, (t, t))


def test_lock_of_a_dead_builder_removed_held_and_fresh_kept(tmp_path, caplog):
    ext = tmp_path / "ext"
    dead, held, fresh = (ext / n / "lock" for n in ("deepspeed_shm_comm", "held_op", "fresh_op"))
    for p in (dead, held, fresh):
        p.parent.mkdir(parents=True)
    # a builder killed mid-build: it created the lock (O_CREAT|O_EXCL as FileBaton does) and died
    code = "import os,sys,time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('ok', flush=True); time.sleep(600)"
    builder = subprocess.Popen([sys.executable, "-c", code, str(dead)], stdout=subprocess.PIPE)
    assert builder.stdout.readline() == b"ok\n"
    assert lock_holders(dead) == {builder.pid}
    builder.kill()
    builder.wait()
    assert lock_holders(dead) == set()
    # a live builder still holds its lock
    holder = subprocess.Popen([sys.executable, "-c", code, str(held)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"ok\n"
        fresh.touch()
        for p in (dead, held):
            _old(p, 120)
        with caplog.at_level(logging.WARNING, logger="flywheel.learner.extensions"):
            removed = clear_stale_locks(ext)
        assert removed == [dead]
        assert not dead.exists() and held.exists() and fresh.exists()  # fresh: younger than min_age_s
        assert "removed stale JIT-build lock" in caplog.text and str(dead) in caplog.text
        assert "no live process holds it" in caplog.text
    finally:
        holder.kill()
        holder.wait()
    assert clear_stale_locks(tmp_path / "missing") == []


def test_without_proc_only_old_locks_are_removed(tmp_path):
    ext = tmp_path / "ext"
    young, old = ext / "a" / "lock", ext / "b" / "lock"
    for p in (young, old):
        p.parent.mkdir(parents=True)
        p.touch()
    _old(young, 60)
    _old(old, 700)
    assert clear_stale_locks(ext, proc=tmp_path / "no-proc") == [old]
    assert young.exists()


@pytest.mark.timeout(300)
def test_learner_init_passes_a_stale_shm_comm_lock(tmp_path):
    """``ensure_dist_env`` (what every learner cycle runs) with a stale lock in the real
    build directory of ``deepspeed_shm_comm``: the lock is removed (a multi-rank learner would
    otherwise wait on it forever) and the process group comes up."""
    ext = tmp_path / "torch_extensions"
    cached = Path.home() / ".cache" / "flywheel" / "torch_extensions" / "deepspeed_shm_comm"
    if (cached / "deepspeed_shm_comm.so").exists():  # reuse the built op (else a ~40 s cold build)
        shutil.copytree(cached, ext / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock"))
    lock = ext / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    _old(lock, 30)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext), PYTHONPATH=str(ROOT))
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-c", "from learner.trainer import ensure_dist_env; ensure_dist_env(); "
                        "import torch; print('initialized', torch.distributed.is_initialized())"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "initialized True" in r.stdout
    assert "removed stale JIT-build lock" in r.stderr
    assert not lock.exists()


@pytest.mark.timeout(300)
def test_one_rank_learner_builds_no_shm_comm_op(tmp_path):
    """With one rank the shm all-reduce op has no peer: ``ensure_dist_env`` skips its JIT
    build (40-110 s per learner process on 2 cores) and gloo collectives still work."""
    ext = tmp_path / "torch_extensions"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext), PYTHONPATH=str(ROOT))
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-c", "from learner.trainer import ensure_dist_env; ensure_dist_env(); "
                        "import torch, deepspeed.comm as dist; t = torch.tensor([2.5]); dist.all_reduce(t); "
                        "print('sum', t.item(), 'backend', dist.get_world_size())"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "terminate called" not in r.stderr, r.stderr[-3000:]
    assert "sum 2.5 backend 1" in r.stdout
    assert "built successfully" not in r.stdout + r.stderr
    assert not (ext / "deepspeed_shm_comm").exists()


# Native threads of a gloo process group: its workers and the TCPStore's server (started with
# the group), and gloo's TCP loop (started when the group first connects; may not exist yet).
STARTED_WITH_GROUP = ("pt_gloo_runloop", "pt_tcpstore_uv")
GROUP_THREADS = (*STARTED_WITH_GROUP, "gloo_tcp_loop")

TEARDOWN_CHILD = """
import atexit, os, torch
from learner.trainer import ensure_dist_env
def threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
ensure_dist_env()
t = torch.tensor([1.5]); torch.distributed.all_reduce(t)
print("before", threads())
atexit._run_exitfuncs()  # what the interpreter runs first when the process ends
print("after", threads(), torch.distributed.is_initialized())
"""


@pytest.mark.timeout(300)
def test_learner_process_joins_the_process_group_threads_before_exit(tmp_path):
    """A process that initialised the learner's process group (``ensure_dist_env``) and
    ends without destroying it must not leave gloo's native threads running into
    interpreter finalisation (SIGABRT, exit -6, ``terminate called without an active
    exception`` on a busy box): the exit hooks destroy the group, so by the time the
    interpreter tears down no group thread is left, and the process exits 0 with no abort
    message."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"), PYTHONPATH=str(ROOT))
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-c", TEARDOWN_CHILD], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "terminate called" not in r.stderr, r.stderr[-3000:]
    lines = {ln.split(" ", 1)[0]: ln for ln in r.stdout.splitlines() if ln.startswith(("before", "after"))}
    assert all(name in lines["before"] for name in STARTED_WITH_GROUP), lines["before"]  # what the hook must end
    assert not any(name in lines["after"] for name in GROUP_THREADS), lines["after"]
    assert lines["after"].endswith("False")  # the group is gone
