"""``flywheel learn`` refuses NaN and +-Infinity in its float settings, naming where the value
came from (the flag, or the ``FLYWHEEL_LEARN__*`` variable: D111), exit 2. Real CLI
subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args,env,flag", [
    (["--once", "--lr", "inf"], {}, "--lr"),
    (["--once", "--beta", "inf"], {}, "--beta"),
    (["--once", "--weight-decay", "inf"], {}, "--weight-decay"),
    (["--once", "--lateness-s", "inf"], {}, "--lateness-s"),
    (["--once"], {"FLYWHEEL_LEARN__KL_COEF": "Infinity"}, "FLYWHEEL_LEARN__KL_COEF"),
    ([], {"FLYWHEEL_LEARN__POLL_S": "inf"}, "FLYWHEEL_LEARN__POLL_S"),
], ids=["lr", "beta", "weight_decay", "lateness", "kl_env", "poll_env"])
def test_non_finite_learner_settings_refused(tmp_path, args, env, flag):
    e = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    e.update(PYTHONPATH=str(ROOT), FLYWHEEL_HOME=str(tmp_path / "home"), COLUMNS="200", **env)
    r = subprocess.run([sys.executable, "-m", "flywheel.cli", "learn", *args], cwd=tmp_path, env=e,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert flag in r.stderr and "finite" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_programs_get_the_same_check():
    from learner.config import LearnerConfig
    from learner.daemon import DaemonConfig

    with pytest.raises(ValueError, match="lr"):
        LearnerConfig(lr=float("inf"))
    with pytest.raises(ValueError, match="every_h"):
        DaemonConfig(every_h=float("inf"))
    assert LearnerConfig(lr=1e-4, grad_clip=5.0).lr == 1e-4
