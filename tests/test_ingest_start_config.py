"""``flywheel ingest`` refuses non-finite timings and reward shaping at start, naming the
option, exit 2: ``--seal-after-s inf``, ``--tick-s inf``, ``--reward-up nan``. A real broker;
the worker as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,env,flag", [
    (["--seal-after-s", "inf"], {}, "seal_after_s"),
    (["--tick-s", "inf"], {}, "tick_s"),
    (["--orphan-ttl-s", "nan"], {}, "orphan_ttl_s"),
    (["--reward-up", "nan"], {}, "--reward-up"),
    ([], {"FLYWHEEL_INGEST__REWARD_DOWN": "-inf"}, "FLYWHEEL_INGEST__REWARD_DOWN"),
    ([], {"FLYWHEEL_INGEST__SEAL_AFTER_S": "Infinity"}, "seal_after_s"),
], ids=["seal_inf", "tick_inf", "orphan_nan", "reward_up_nan", "reward_down_env_inf", "seal_env_inf"])
def test_non_finite_ingest_settings_refused_at_start(broker, tmp_path, args, env, flag):
    e = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    e.update(FLYWHEEL_HOME=str(tmp_path / "home"), FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap,
             PYTHONPATH=str(ROOT), **env)
    try:
        r = subprocess.run([sys.executable, "-m", "flywheel.cli", "ingest", *args], cwd=tmp_path, env=e,
                           capture_output=True, text=True, timeout=40)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ingest {args} {env} started a worker instead of refusing the value")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    text = " ".join(r.stderr.replace("│", " ").split())
    assert flag in text and "Traceback" not in r.stderr, text
    assert not (tmp_path / "home" / "data" / "samples").exists()


def test_reward_policy_bounds_hold_for_programs():
    from ingest.join import JoinConfig
    from schemas.reward import RewardPolicy

    for kw in ({"thumb_up": float("nan")}, {"thumb_down": float("-inf")}, {"thumb_up": 1e7}):
        with pytest.raises(ValueError, match="thumb_up|thumb_down"):
            RewardPolicy(**kw)
    with pytest.raises(ValueError, match="seal_after_s: must be > 0 seconds and finite"):
        JoinConfig(seal_after_s=float("inf"))
    # one up and one down vote: mean thumb t = 0, so 0.75 * (1 + 0) / 2 + (-0.25) * (1 - 0) / 2 = 0.25
    assert RewardPolicy(thumb_up=0.75, thumb_down=-0.25).combine(thumb=0.0) == 0.25
