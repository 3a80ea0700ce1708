"""The simulated users' signals (flywheel.users.UserBehaviour.plan): thumbs-only keeps the
draws it always made; implicit sends no thumb; the action follows the verdict except for the
noise share; shares measured over many seeded plans against the configured probabilities."""

from __future__ import annotations

import random

import pytest

from flywheel.users import UserBehaviour


def _old_plan(b: UserBehaviour, passed: bool, rng: random.Random):
    """The thumbs-only plan as it was written before implicit signals (a reference)."""
    if rng.random() >= b.p_vote:
        return []
    value = 1 if passed else -1
    out = []
    t = rng.uniform(0, b.max_delay_s)
    if rng.random() < b.p_flip:
        out.append(-value)
        t += rng.uniform(0.05, b.max_delay_s / 2 + 0.05)
    out.append(value)
    if rng.random() < b.p_duplicate:
        rng.uniform(0.01, 0.3)
        out.append(value)
    return out


def test_thumbs_only_draws_as_before():
    b = UserBehaviour(p_flip=0.0)  # no flip: the reference's extra draw never happens
    r1, r2 = random.Random(5), random.Random(5)
    for i in range(300):
        plan = b.plan(i % 3 == 0, r1, signals="thumbs")
        assert [e[3] for e in plan.events] == _old_plan(b, i % 3 == 0, r2)
        assert all(e[2] == "thumb" for e in plan.events) and plan.action is None
    assert r1.random() == r2.random()  # the same stream position afterwards


def test_implicit_sends_no_thumb_and_acts_by_the_verdict():
    b = UserBehaviour(p_act=1.0, p_wrong_action=0.0, p_duplicate=0.0)
    rng = random.Random(1)
    for _ in range(200):
        right = b.plan(True, rng, signals="implicit")
        assert right.final is None and right.action[0] in ("copy", "followup") and right.action[1] > 0
        wrong = b.plan(False, rng, signals="implicit")
        assert wrong.action in (("regenerate", 1.0), ("followup", -1.0))
        code = b.plan(False, rng, signals="implicit", code=True)
        kind, v = code.action
        assert kind in ("edit", "regenerate", "followup")
        if kind == "edit":
            assert b.kept_wrong[0] <= v <= b.kept_wrong[1]
        for p in (right, wrong, code):
            assert [e[2] for e in p.events] == [p.action[0]]


def test_shares_match_the_probabilities():
    b = UserBehaviour()  # p_vote_sparse 0.1, p_act 0.7, p_wrong_action 0.1
    rng = random.Random(2)
    n = 4000
    plans = [b.plan(True, rng, signals="all") for _ in range(n)]
    thumbs = sum(p.final is not None for p in plans) / n
    acted = [p for p in plans if p.action]
    noisy = sum(p.noisy for p in acted) / len(acted)
    # binomial sd: sqrt(.1 * .9 / 4000) = 0.0047; sqrt(.7 * .3 / 4000) = 0.0072; 5 sd bounds
    assert abs(thumbs - 0.1) < 0.024 and abs(len(acted) / n - 0.7) < 0.036
    assert abs(noisy - 0.1) < 0.03
    for p in acted:  # a noisy action is a wrong reply's
        assert (p.action in (("regenerate", 1.0), ("followup", -1.0))) == p.noisy


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="signals"):
        UserBehaviour().plan(True, random.Random(0), signals="votes")
    with pytest.raises(ValueError, match="p_act"):
        UserBehaviour(p_act=1.5)
    with pytest.raises(ValueError, match="kept_wrong"):
        UserBehaviour(kept_wrong=(0.6, 0.2))
