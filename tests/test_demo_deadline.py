"""The demo's canary step deadline follows the box's measured speed, and the counts a reader
sees during and after a canary say what they count.

The deadline: at least ``DEADLINE_REQUESTS`` (4) times the median request time of the first
traffic phase, never under the configured ``deadline_s`` (45 s in ``--quick``). Expected
values are worked by hand from the given request times.

The counts: the traffic line counts the phase's replies that got feedback the API accepted, by
version; the line after a canary's decision sets those of the canary phase beside what the
decision counted (replies sealed into samples, from the ledger row's numbers as the real
analysis writes them).
"""

from __future__ import annotations

import io
import math

import pytest
from rich.console import Console

from deploy.analysis import AnalysisConfig, ArmStats, analyze
from deploy.controller import ControllerConfig
from flywheel.demo import DEADLINE_REQUESTS, Demo, canary_counts_line, feedback_by_version, step_deadline_s
from flywheel.demo_config import QUICK, DemoConfig


def test_the_rule_is_four_median_request_times_with_the_configured_deadline_as_floor():
    assert DEADLINE_REQUESTS == 4 and QUICK["controller"]["deadline_s"] == 45.0
    # median 12 s: 4 x 12 = 48 s > 45 s
    assert step_deadline_s(45.0, [10.0, 30.0, 12.0]) == 48.0
    # median 6 s: 4 x 6 = 24 s < 45 s, the floor holds
    assert step_deadline_s(45.0, [5.0, 6.0, 7.0]) == 45.0
    # an even count: median (20 + 30) / 2 = 25 s -> 100 s
    assert step_deadline_s(45.0, [40.0, 10.0, 30.0, 20.0]) == 100.0
    # exactly at the floor: 4 x 11.25 = 45
    assert step_deadline_s(45.0, [11.25]) == 45.0
    # a busy 2-core box (8 requests in flight, each over 45 s): median (60 + 61) / 2 = 60.5 s -> 242 s
    assert step_deadline_s(45.0, [50, 52, 55, 60, 61, 70, 75, 80]) == 242.0
    # nothing measured: the configured deadline; the full run's 600 s floor is rarely passed
    assert step_deadline_s(45.0, []) == 45.0
    assert step_deadline_s(600.0, [30.0, 40.0, 50.0]) == 600.0
    assert step_deadline_s(600.0, [200.0]) == 800.0
    assert step_deadline_s(45.0, [20.0], k=3) == 60.0
    assert isinstance(step_deadline_s(45.0, [12]), float)


@pytest.mark.parametrize("args, field", [
    ((0.0, [1.0]), "floor_s"), ((-45.0, [1.0]), "floor_s"), ((math.inf, [1.0]), "floor_s"),
    ((math.nan, [1.0]), "floor_s"), ((True, [1.0]), "floor_s"),
    ((45.0, [1.0, math.nan]), "request_s[1]"), ((45.0, [-0.5]), "request_s[0]"),
    ((45.0, [1.0, 2.0, math.inf]), "request_s[2]"), ((45.0, ["3"]), "request_s[0]"),
])
def test_bad_input_names_the_value(args, field):
    with pytest.raises(ValueError) as ei:
        step_deadline_s(*args)
    assert str(ei.value).startswith(f"{field}: must be a finite number of seconds"), str(ei.value)


def test_bad_k_names_k():
    for k in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"^k: must be a finite number > 0"):
            step_deadline_s(45.0, [1.0], k=k)


def test_the_quick_demo_starts_its_controller_with_the_measured_deadline_and_logs_it(tmp_path):
    """The controller starts after the first phase, with ``--deadline-s`` from its request
    times; the process start is recorded instead of run (no controller process in this test)."""
    out = io.StringIO()
    demo = Demo(DemoConfig.for_mode(tmp_path / "out", quick=True), console=Console(file=out, width=300))
    demo.url, demo.home, demo.bootstrap = "http://127.0.0.1:9", tmp_path / "home", "127.0.0.1:9"
    started = []
    demo._start = lambda name, args, env: started.append((name, args)) or "proc"
    first = [{"latency_s": t} for t in (50, 52, 55, 60, 61, 70, 75, 80)]
    demo.start_controller(first)
    assert demo.deadline_s == 242.0 and demo.controller == "proc"
    (name, args), = started
    i = args.index("--deadline-s")
    assert name == "controller" and args[i + 1] == "242.0" and args.count("--deadline-s") == 1
    assert ControllerConfig(deadline_s=float(args[i + 1])).deadline_s == 242.0
    assert args[args.index("--serving") + 1] == demo.url
    log = " ".join(out.getvalue().split())
    assert ("canary step deadline 242 s: the larger of the configured 45 s and 4 x the median request time of the "
            "first phase (60.5 s over 8 requests)") in log, log


def test_with_no_request_measured_the_configured_deadline_is_used_and_said(tmp_path):
    out = io.StringIO()
    demo = Demo(DemoConfig.for_mode(tmp_path / "out", quick=True), console=Console(file=out, width=300))
    demo.url, demo.home, demo.bootstrap = "http://127.0.0.1:9", tmp_path / "home", "127.0.0.1:9"
    started = []
    demo._start = lambda name, args, env: started.append(args)
    demo.start_controller([])
    assert demo.deadline_s == 45.0 and started[0][started[0].index("--deadline-s") + 1] == "45.0"
    assert "canary step deadline 45 s (configured; no request of the first phase was answered" in \
        " ".join(out.getvalue().split())


def test_the_traffic_line_counts_this_phases_replies_with_feedback_by_version():
    results = [{"version": "v000001", "completion_id": "a"}, {"version": "v000000", "completion_id": "b"},
               {"version": "v000001", "completion_id": "c"}, {"version": "v000001", "completion_id": "d"},
               {"version": "v000000", "completion_id": "e"}]
    # "x" is a reply of an earlier phase: not this phase's, not counted
    assert feedback_by_version(results, {"a", "c", "e", "x"}) == {"v000000": 1, "v000001": 2}
    assert list(feedback_by_version(results, {"a", "e"})) == ["v000000", "v000001"]  # sorted by version
    assert feedback_by_version(results, set()) == {}
    assert feedback_by_version([], {"a"}) == {}


def _decision(c: ArmStats, s: ArmStats) -> tuple[dict, str]:
    """A deadline decision's ledger row as the controller writes it (the analysis's numbers),
    and the analysis's reason."""
    d = analyze(c, s, AnalysisConfig(min_votes=2, quality="thumbs"))
    return {"version": "v000001", "stable": "v000000", "decision": "ROLLBACK",
            "numbers": {**d.numbers(), "decided_by": "deadline"}}, d.reason


def test_the_line_after_a_decision_sets_the_controllers_counts_beside_the_users_feedback():
    # the newcomer's busy run: nothing sealed by the deadline, while the users' votes were accepted
    row, reason = _decision(ArmStats(), ArmStats())
    assert "too few votes: candidate 0, stable 0" in reason
    line = canary_counts_line(row, {"v000001": 3, "v000000": 5, "v000009": 7}, 3.0)
    assert line.startswith("the decision counted replies sealed into samples since the canary started "
                           "(votes candidate 0, stable 0); the users' feedback was accepted on 3 candidate and 5 "
                           "stable replies of the canary's traffic"), line
    assert "3 s after its last feedback" in line and "so the decision can count fewer" in line
    # counted votes: 3 up + 1 down on the candidate, 2 + 2 on the stable
    row, _ = _decision(ArmStats(votes_up=3, votes_down=1), ArmStats(votes_up=2, votes_down=2))
    line = canary_counts_line(row, {"v000001": 4, "v000000": 4}, None)
    assert "(votes candidate 4, stable 4)" in line and "accepted on 4 candidate and 4 stable" in line
    assert "seal_after_s after its last feedback" in line


def test_the_line_names_rewarded_samples_when_the_reward_test_ran_and_unknown_counts_as_question_marks():
    row = {"version": "v000002", "stable": "v000001", "numbers": {
        "thumbs_up": {"candidate_votes": 1, "stable_votes": 2},
        "reward": {"candidate_samples": 6, "stable_samples": 9}}}
    line = canary_counts_line(row, {}, 3.0)
    assert "(votes candidate 1, stable 2; rewarded samples candidate 6, stable 9)" in line
    assert "accepted on 0 candidate and 0 stable replies" in line
    line = canary_counts_line({"version": "v000002", "stable": "v000001", "numbers": {}}, {}, 3.0)
    assert "(votes candidate ?, stable ?)" in line
