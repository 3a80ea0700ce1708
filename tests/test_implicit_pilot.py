"""docs/pilots/implicit_pilot.py without a model: the users' plans become samples through the
real join (rewards worked out by hand under the default reward policy), the arms' settings,
and the report's paired fields (values worked out by hand)."""

from __future__ import annotations

import importlib.util
import json
import math
import types
import uuid
from pathlib import Path

import pytest

from flywheel.users import VotePlan
from schemas.events import SamplingParams
from schemas.reward import RewardPolicy
from serving.params import GenResult

PILOT = Path(__file__).resolve().parents[1] / "docs" / "pilots" / "implicit_pilot.py"
T0 = 1_700_000_000_000  # ms


@pytest.fixture(scope="module")
def pilot():
    spec = importlib.util.spec_from_file_location("implicit_pilot", PILOT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def served_reply(i: int) -> dict:
    res = GenResult(completion_token_ids=[4, 5 + i], behavior_logprobs=[-0.5, -1.25], top_logprobs=[],
                    expert_routes=None, finish_reason="stop", ttft_ms=1.0, latency_ms=2.0, version="v000000")
    return {"prompt": [1, 2, 3], "sampling": SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seed=i),
            "result": res, "text": "", "passed": False, "has_answer": False}


def test_plans_become_the_joins_samples_with_hand_worked_rewards(pilot):
    e = [str(uuid.uuid4()) for _ in range(6)]
    plans = [
        # an edit keeping 30 %, delivered twice with one event_id: counted once
        VotePlan(events=[(0.2, e[0], "edit", 0.3), (0.4, e[0], "edit", 0.3)], action=("edit", 0.3)),
        VotePlan(events=[(0.1, e[1], "copy", 1.0)], action=("copy", 1.0)),
        VotePlan(),  # the user did nothing: no sample
        VotePlan(events=[(1.0, e[2], "regenerate", 1.0)], action=("regenerate", 1.0)),
        VotePlan(events=[(0.5, e[3], "followup", 1.0)], action=("followup", 1.0)),
        # a thumb first down, then up (the last one counts), the up one duplicated
        VotePlan(events=[(0.1, e[4], "thumb", -1.0), (0.3, e[5], "thumb", 1.0), (0.5, e[5], "thumb", 1.0)], final=1),
    ]
    served = [served_reply(i) for i in range(len(plans))]
    events = pilot.completion_events(served, [f"user-{i}" for i in range(len(plans))], T0)
    samples = pilot.join_samples(events, plans, T0, RewardPolicy())
    # by hand, default policy: implicit kinds weigh 0.5; edit = 2 * kept - 1; a thumb weighs 1
    want = [(-0.2, 0.3, 0, 0, None, [e[0]]), (0.5, None, 1, 0, None, [e[1]]), (-0.5, None, 0, 1, None, [e[2]]),
            (0.5, None, 0, 0, 1.0, [e[3]]), (1.0, None, 0, 0, None, [e[4], e[5]])]
    assert [str(s.completion_id) for s in samples] == [str(events[i][1]) for i in (0, 1, 3, 4, 5)]
    for s, (reward, kept, copied, regen, follow, eids) in zip(samples, want):
        assert math.isclose(s.reward, reward, abs_tol=1e-12) and s.label == (reward > 0)
        assert (s.kept_share, s.copied, s.regenerated, s.followup) == (kept, copied, regen, follow)
        assert sorted(s.event_ids) == sorted(eids) and s.split == "train"
        assert s.reward_policy == RewardPolicy().digest() and s.model_version == "v000000"
    assert samples[-1].thumb == 1.0 and (samples[-1].votes_up, samples[-1].votes_down) == (1, 0)
    assert samples[0].completion_token_ids == [4, 5] and samples[0].behavior_logprobs == [-0.5, -1.25]
    summary = pilot.sample_summary(samples, plans, served)
    assert (summary["samples"], summary["events_sent"], summary["events_in_samples"]) == (5, 8, 6)
    assert math.isclose(summary["mean_reward"], (-0.2 + 0.5 - 0.5 + 0.5 + 1.0) / 5)


def test_arms_are_demo_learner_with_overrides(pilot):
    from flywheel.demo import DEMO_LEARNER

    demo, more = pilot.resolve_arms(None)
    assert demo == {"name": "demo", "learner": DEMO_LEARNER, "n_samples": None}
    assert more["learner"] == {**DEMO_LEARNER, "steps": 16}
    (arm,) = pilot.resolve_arms('[{"name": "x", "learner": {"baseline": "batch", "lr": 1e-4}, "n_samples": 40}]')
    assert arm["learner"] == {**DEMO_LEARNER, "lr": 1e-4} and arm["n_samples"] == 40  # the default is not restated
    for text, field in (('[{"name": "x", "n_samples": 0}]', "arms[0].n_samples"),
                        ('[{"name": "x"}, {"name": "x"}]', "arms[1].name"),
                        ('[{"name": "x", "learner": {"steps": 0}}]', "arms[0].learner"),
                        ('[{"name": "x", "colour": 1}]', "arms[0]")):
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            pilot.resolve_arms(text)
    with pytest.raises(ValueError, match=r"arms\[0\].learner.train_layers: 8 > 2"):
        pilot.resolve_arms('[{"name": "x"}]', model_layers=2)


def test_report_has_the_paired_fields(pilot):
    # 6 prompts: v000000 right on none; the arm right on the first five
    rows = [{"version": v, "key": f"k{i}", "family": "chain_sum", "kind": "fresh" if i < 4 else "unseen",
             "passed": v != "v000000" and i < 5} for v in ("v000000", "a:v000001") for i in range(6)]
    args = types.SimpleNamespace(out="/x", n_train=1, arms=None, seed=7)
    fixed = [types.SimpleNamespace(kind="fresh")] * 4 + [types.SimpleNamespace(kind="unseen")] * 2
    dc = pilot.demo_config(7)
    report = pilot.build_report(args, [{"name": "a"}], dc, fixed, rows, [], {}, {"a": ["a:v000001"]}, 1.0,
                                RewardPolicy())
    c = report["comparison"]["vs_base"]["a"]["a:v000001"]
    assert math.isclose(c["diff"], 5 / 6) and (c["only_from"], c["only_to"], c["neither"]) == (0, 5, 1)
    assert math.isclose(c["mcnemar_p"], 2 / 2 ** 5)  # exact McNemar: 2 * P[Bin(5, 1/2) <= 0]
    assert len(c["ci95"]) == 2 and c["ci95"][0] <= 5 / 6 <= c["ci95"][1]
    assert math.isclose(c["by_kind"]["unseen"]["diff"], 0.5) and c["by_kind"]["fresh"]["diff"] == 1.0
    assert report["versions"]["a:v000001"]["by_kind"]["fresh"]["votes_up"] == 4
    assert report["fixed_by_kind"] == {"fresh": 4, "unseen": 2}
    assert report["settings"]["reward_policy_is_default"] is True
    json.dumps(report, default=str)
