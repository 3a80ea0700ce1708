"""docs/pilots/implicit_pilot.py without a model: the users' plans become samples through the
real join (rewards worked out by hand under the default reward policy), the arms' settings,
and the report's paired fields (values worked out by hand)."""

from __future__ import annotations

import hashlib
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
    from flywheel.demo_config import DEMO_LEARNER

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


# ------------------------------------------------------------------ --reask
def seed_of(*parts) -> int:
    """The pilot's derived seed, worked out here: sha256 of the ':'-joined parts, first 4 bytes >> 2."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "big") >> 2


def regen() -> VotePlan:
    return VotePlan(events=[(0.5, str(uuid.uuid4()), "regenerate", 1.0)], action=("regenerate", 1.0))


def copy() -> VotePlan:
    return VotePlan(events=[(0.5, str(uuid.uuid4()), "copy", 1.0)], action=("copy", 1.0))


def test_reask_loop_picks_the_regenerated_tasks_with_their_seeds_up_to_the_cap(pilot):
    # task 1 and 3 regenerate; 0 copies, 2 does nothing, 4 follows up dissatisfied
    first = [copy(), regen(), VotePlan(), regen(),
             VotePlan(events=[(0.5, str(uuid.uuid4()), "followup", -1.0)], action=("followup", -1.0))]
    # the users' plans for the re-asks: task 1 regenerates every time, task 3 copies its first re-ask
    then = {(1, 1): regen, (3, 1): copy, (1, 2): regen, (1, 3): regen}
    waves = []

    def ask(wave):
        waves.append([(r.i, r.k) for r in wave])
        return [({"prompt": [r.i], "k": r.k}, then[(r.i, r.k)]()) for r in wave]

    got = pilot.reask_loop(first, 2, 7, 0, ask)
    assert waves == [[(1, 1), (3, 1)], [(1, 2)]]  # wave 3 is past the cap N = 2
    assert [(r.i, r.k) for r, _, _ in got] == [(1, 1), (3, 1), (1, 2)]  # ordered by (k, i)
    for r, s, p in got:
        assert r.seed == seed_of("pilot-reask", 7, 0, r.i, r.k)
        assert r.user_seed == seed_of("pilot-user-reask", 7, 0, r.i, r.k)
        assert s == {"prompt": [r.i], "k": r.k} and p.action == then[(r.i, r.k)]().action
    assert len({r.seed for r, _, _ in got}) == 3  # each re-ask samples with a seed of its own
    waves.clear()
    got3 = pilot.reask_loop(first, 3, 7, 1, ask)
    assert waves == [[(1, 1), (3, 1)], [(1, 2)], [(1, 3)]]
    assert got3[0][0].seed == seed_of("pilot-reask", 7, 1, 1, 1)  # the round is part of the seed
    waves.clear()
    assert pilot.reask_loop(first, 0, 7, 0, ask) == [] and waves == []  # --reask 0: nothing is asked again
    assert pilot.reask_loop([copy(), VotePlan()], 3, 7, 0, ask) == [] and waves == []
    with pytest.raises(ValueError, match="reask: ask answered 1 of 2"):
        pilot.reask_loop(first, 1, 7, 0, lambda wave: [({}, copy())])
    with pytest.raises(ValueError, match=r"reask: must be in 0\.\.3, got 4"):
        pilot.reask_loop(first, 4, 7, 0, ask)


def test_reask_option_is_validated_and_recorded(pilot, capsys):
    assert pilot.parse_args([]).reask == 0
    assert pilot.parse_args(["--reask", "3"]).reask == 3
    for bad in ("-1", "4"):
        with pytest.raises(SystemExit) as exc:
            pilot.parse_args(["--reask", bad])
        assert exc.value.code == 2
        assert f"--reask: must be in 0..3, got {bad}" in capsys.readouterr().err
    args = pilot.parse_args(["--reask", "2", "--out", "/x"])
    report = pilot.build_report(args, [], pilot.demo_config(7), [], [], [], {}, {}, 1.0, RewardPolicy())
    assert report["settings"]["reask"] == 2


def test_reasked_completions_share_prompt_and_user_through_the_join(pilot):
    def reply(prompt, passed, tok):
        res = GenResult(completion_token_ids=[4, tok], behavior_logprobs=[-0.5, -1.0], top_logprobs=[],
                        expert_routes=None, finish_reason="stop", ttft_ms=1.0, latency_ms=2.0, version="v000000")
        sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seed=tok)
        return {"prompt": list(prompt), "sampling": sp, "result": res, "text": "", "passed": passed,
                "has_answer": passed}

    prompts = [[1, 2, 3], [1, 2, 9], [7, 8]]
    served = [reply(prompts[0], True, 10), reply(prompts[1], False, 11), reply(prompts[2], False, 12)]
    plans = [copy(), regen(), regen()]
    users = ["user-0", "user-1", "user-2"]
    # task 1: re-ask 1 wrong and regenerated again, re-ask 2 right and copied; task 2: re-ask 1 gets no feedback
    then = {(1, 1): (False, regen), (2, 1): (False, VotePlan), (1, 2): (True, copy)}
    asked = pilot.reask_loop(plans, 3, 7, 0, lambda wave: [
        (reply(prompts[r.i], then[(r.i, r.k)][0], 20 + 10 * r.k + r.i), then[(r.i, r.k)][1]()) for r in wave])
    served2, plans2, users2, reasks = pilot.with_reasks(served, plans, users, asked)
    assert [(r.i, r.k) for r in reasks] == [(1, 1), (2, 1), (1, 2)]
    assert users2 == users + ["user-1", "user-2", "user-1"] and plans2[:3] == plans
    events = pilot.completion_events(served2, users2, T0)
    samples = pilot.join_samples(events, plans2, T0, RewardPolicy())
    # by hand, default policy: copy +0.5, regenerate -0.5; the re-ask of task 2 has no event: no sample
    assert [s.completion_token_ids[-1] for s in samples] == [10, 11, 12, 31, 41]
    assert [s.reward for s in samples] == [0.5, -0.5, -0.5, -0.5, 0.5]
    task1 = [s for s in samples if s.prompt_token_ids == prompts[1]]
    assert len(task1) == 3 and len({s.user_hash for s in task1}) == 1
    assert task1[0].user_hash not in {samples[0].user_hash, samples[2].user_hash}
    summary = pilot.sample_summary(samples, plans2, served2, reasks)
    assert (summary["replies"], summary["right"], summary["samples"]) == (6, 2, 5)
    assert (summary["reasks"], summary["reasks_right"], summary["tasks_reasked"]) == (3, 1, 2)
    assert summary["reasks_by_k"] == {"1": {"served": 2, "right": 0}, "2": {"served": 1, "right": 1}}
    # prompts 1 (3 completions) and 2 (2) repeat; only prompt 1 has 2+ samples, and of mixed reward
    assert (summary["prompts_2plus"], summary["prompts_2plus_in_samples"], summary["prompts_mixed_reward"]) == (2, 1, 1)
    assert pilot.sample_summary(samples[:3], plans, served)["reasks"] == 0  # --reask 0: no re-asks counted
    bad = [(asked[0][0], reply([5], False, 1), copy())]
    with pytest.raises(RuntimeError, match="task 1 re-ask 1 was served another prompt"):
        pilot.with_reasks(served, plans, users, bad)


def test_reask_serves_the_same_prompt_again_deterministically_on_a_tiny_engine(pilot, tiny_moe_dir):
    import random

    from flywheel.users import UserBehaviour
    from serving.engine import TorchEngine

    never_right = types.SimpleNamespace(score=lambda text: 0.0, has_answer=lambda text: False)
    tasks = [types.SimpleNamespace(family="chain_sum", verifier=never_right,
                                   messages=[{"role": "user", "content": f"hello world {i}"}]) for i in range(6)]
    # every reply is wrong and every user acts without noise: each re-ask regenerates or follows up
    dc = types.SimpleNamespace(temperature=1.0, top_p=1.0, max_tokens=6, max_tokens_short=6,
                               behaviour=UserBehaviour(p_act=1.0, p_wrong_action=0.0))
    eng = TorchEngine(tiny_moe_dir, max_batch=8)
    try:
        run = types.SimpleNamespace(eng=eng, dc=dc, args=types.SimpleNamespace(reask=3, seed=7, signals="implicit"))
        lm = eng.load_base("v000000")
        served = pilot.serve(eng, lm, tasks, [100 + i for i in range(6)], dc)
        plans, users = [regen() for _ in tasks], [f"user-{i}" for i in range(6)]
        got = [pilot.Pilot.reask(run, lm, tasks, 0, served, plans, users) for _ in range(2)]
    finally:
        eng.close()
    (s1, p1, u1, r1), (s2, p2, u2, r2) = got
    assert [(r.i, r.k) for r in r1[:6]] == [(i, 1) for i in range(6)] and len(r1) <= 6 * 3
    assert [(r.k, r.i) for r in r1] == sorted((r.k, r.i) for r in r1)
    for r, s, p in zip(r1, s1[6:], p1[6:]):
        assert s["prompt"] == served[r.i]["prompt"] and s["sampling"].seed == seed_of("pilot-reask", 7, 0, r.i, r.k)
        want = dc.behaviour.plan(False, random.Random(seed_of("pilot-user-reask", 7, 0, r.i, r.k)), signals="implicit")
        assert (p.action, p.noisy, [e[0] for e in p.events]) == (want.action, want.noisy, [e[0] for e in want.events])
        # a task is asked again only while its user regenerates
        later = [x for x in r1 if x.i == r.i and x.k == r.k + 1]
        assert bool(later) == (p.action[0] == "regenerate" and r.k < 3)
    assert u1 == users + [users[r.i] for r in r1]
    # two calls with the same arguments: the same re-asks, token ids and plans (event ids are fresh uuids)
    assert r1 == r2 and u1 == u2
    assert [s["result"].completion_token_ids for s in s1] == [s["result"].completion_token_ids for s in s2]
    assert [(p.action, [e[0] for e in p.events]) for p in p1] == [(p.action, [e[0] for e in p.events]) for p in p2]
