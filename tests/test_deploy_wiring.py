"""Issue 21 item 2: the controller is assembled by ``deploy.wiring.build_controller`` and the
status gathered by ``deploy.status.gather_status``, both callable without the CLI; the
controller's settings are declared once, in its three config models."""

from __future__ import annotations

import socket

import pytest

from deploy.analysis import AnalysisConfig
from deploy.controller import DEFAULT_STEPS, ControllerConfig, RolloutController, format_steps
from modelstore.desired import FleetRecord
from deploy.status import gather_status
from modelstore.store import ModelStore
from deploy.wiring import ControllerRunConfig, SetupError, build_controller
from schemas import settings


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_build_controller_without_the_cli_records_its_pods(fw_home):
    url = _dead_url()
    policy = ControllerConfig(steps="0.5,1", analysis=AnalysisConfig(min_votes=3))
    ctl = build_controller(ControllerRunConfig(serving=[url]), policy, serving_timeout_s=0.5)
    assert isinstance(ctl, RolloutController) and ctl.config.steps == (0.5, 1.0)
    assert ctl.config.step_policy().min_votes_per_step == 3  # None: the analysis' min_votes
    assert FleetRecord(ModelStore(settings.store_dir())).read().pods == [url]  # operator commands reach them


def test_build_controller_setup_errors_name_the_setting(fw_home, monkeypatch):
    monkeypatch.delenv("FLYWHEEL_KAFKA_BOOTSTRAP", raising=False)
    run = ControllerRunConfig(serving=[_dead_url()], guards_from="completions", reply_judge="nope")
    with pytest.raises(SetupError) as e:
        build_controller(run, ControllerConfig(), 0.5)
    assert e.value.usage and e.value.param_hint == "--reply-judge"
    with pytest.raises(SetupError) as e:
        build_controller(ControllerRunConfig(serving=["dns+http://no-port"]), ControllerConfig(), 0.5)
    assert e.value.usage
    with pytest.raises(ValueError, match="guards_from"):
        ControllerRunConfig(guards_from="everything")


def test_policy_accepts_its_earlier_names_and_the_cli_text():
    c = ControllerConfig(step_deadline_s=60, steps=format_steps(DEFAULT_STEPS))
    assert c.deadline_s == c.step_deadline_s == 60 and c.steps == DEFAULT_STEPS
    with pytest.raises(ValueError, match="not a comma-separated list"):
        ControllerConfig(steps="x")
    with pytest.raises(ValueError, match="deadline_s"):
        ControllerConfig(deadline_s=0)


def test_gather_status_reports_an_unreachable_pod(fw_home):
    ModelStore(settings.store_dir())  # a fleet's store (status creates none: D99)
    url = _dead_url()
    s = gather_status([url], timeout_s=0.5, last=3)
    assert s.failed() and s.err and [r[0] for r in s.rows] == [url]
    doc = s.to_dict()
    assert doc["pods"][0]["url"] == url and doc["converged"] is False and doc["serving"] is None
