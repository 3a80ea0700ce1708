"""The demo's workload (issue 10 item 4): verifiers judged against answers known
independently (reasoning-gym's own answer field; HumanEval's canonical solution)."""

from __future__ import annotations

import random

import pytest

from flywheel.workload import GYM_FAMILIES, HumanEvalVerifier, Workload, last_number
from schemas.split import choose_split


def test_last_number():
    assert last_number("5 - 3 = 2.") == "2"
    assert last_number("it is -4, or 4.5") == "4.5"
    assert last_number("no idea") is None


@pytest.mark.parametrize("family", sorted(GYM_FAMILIES))
def test_gym_verifier_scores_the_true_answer_and_refuses_a_wrong_one(family):
    w = Workload(families=(family,), eval_share=0.0, seed=3)
    rng = random.Random(0)
    for _ in range(5):
        t = w.next_task(rng)
        entry = t.verifier.entry
        truth = str(entry["answer"])
        assert t.family == family and t.split == "train"
        assert t.messages[0]["content"].startswith(entry["question"].strip())
        assert t.verifier.score(f"Let me think. The answer is {truth}")
        assert t.verifier.score(truth)
        wrong = str(int(float(truth)) + 1)
        assert not t.verifier.score(f"The answer is {wrong}")
        assert not t.verifier.score("I do not know") and not t.verifier.has_answer("I do not know")


def test_every_request_is_a_fresh_instance_and_reproducible():
    a, b = Workload(families=("basic_arithmetic",), seed=1), Workload(families=("basic_arithmetic",), seed=1)
    qa = [a.next_task(random.Random(0)).key for _ in range(300)]
    qb = [b.next_task(random.Random(0)).key for _ in range(300)]
    assert qa == qb  # same seed, same stream
    assert len(set(qa)) > 30  # 1-digit sums repeat, but the stream is not one prompt


def test_split_held_out_family_and_stable_share():
    w = Workload(families=("basic_arithmetic", "gcd"), held_out=("gcd",), eval_share=0.3, seed=0)
    rng = random.Random(1)
    tasks = [w.next_task(rng) for _ in range(400)]
    assert all(t.split == "eval" for t in tasks if t.family == "gcd")
    arith = [t for t in tasks if t.family == "basic_arithmetic"]
    share = sum(t.split == "eval" for t in arith) / len(arith)
    assert 0.1 < share < 0.5
    for t in arith:  # the same prompt is always in the same split
        from flywheel.workload import _text_ids
        assert t.split == choose_split(_text_ids(t.key), 0.3)


def test_humaneval_verifier_runs_the_unit_tests():
    from flywheel.users import load_problems

    p = load_problems(1)[0]
    v = HumanEvalVerifier(p)
    good = f"```python\n{p['prompt']}{p['canonical_solution']}```"
    assert v.score(good) and v.has_answer(good)
    bad = f"```python\n{p['prompt']}    return True\n```"
    assert not v.score(bad)
    assert not v.has_answer("I cannot write that")


@pytest.mark.parametrize("kw,field", [({"families": ("nope",)}, "families"),
                                      ({"held_out": ("gcd",), "families": ("chain_sum",)}, "held_out"),
                                      ({"eval_share": 1.5}, "eval_share"),
                                      ({"families": ("gcd",), "weights": {"chain_sum": 1.0}}, "weights"),
                                      ({"families": ("gcd",), "weights": {"gcd": float("nan")}}, "weights"),
                                      ({"families": ("gcd",), "weights": {"gcd": -1.0}}, "weights"),
                                      ({"families": ("gcd",), "weights": {"gcd": 0.0}}, "weights")])
def test_bad_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        Workload(**kw)


def test_weights_set_the_family_mix():
    """9:1 weights: over 2,000 draws the light family's share is within 4 binomial standard
    deviations of 0.1 (sd = sqrt(0.1 * 0.9 / 2000) = 0.0067); a family of weight 0 is never drawn."""
    import random

    w = Workload(families=("chain_sum", "gcd", "basic_arithmetic"), seed=0,
                 weights={"chain_sum": 9.0, "gcd": 1.0, "basic_arithmetic": 0.0})
    rng = random.Random(0)
    fams = [w.next_task(rng).family for _ in range(2000)]
    assert "basic_arithmetic" not in fams
    assert abs(fams.count("gcd") / 2000 - 0.1) < 4 * (0.1 * 0.9 / 2000) ** 0.5


def test_reply_judge_is_the_verifiers_own_has_answer():
    """The canary's no-answer guard judges a served reply as the task's verifier does, from
    token ids alone (here one id per character), for HumanEval and reasoning-gym prompts."""
    from flywheel.workload import WorkloadReplyJudge

    def enc(text):
        return [ord(ch) for ch in text]

    judge = WorkloadReplyJudge(lambda ids: "".join(chr(i) for i in ids))
    w = Workload(families=("humaneval", "basic_arithmetic", "letter_counting"), eval_share=0.0, seed=2,
                 humaneval_problems=(0, 1))
    rng = random.Random(1)
    replies = ["The answer is 12.", "I do not know", "```python\ndef f():\n    return 1\n```", "", "twelve"]
    seen = set()
    for _ in range(12):
        t = w.next_task(rng)
        seen.add(t.family)
        prompt = "\n".join(m["content"] for m in t.messages)
        for r in replies:
            assert judge.has_answer(enc(prompt), enc(r)) == t.verifier.has_answer(r), (t.family, r)
    assert seen == {"humaneval", "basic_arithmetic", "letter_counting"}


def test_three_kinds_of_never_trained_prompts():
    """fresh (eval-split instances of a trained family), harder (a 3-term variant of a trained
    family) and unseen (a held-out family) are all in the eval split and told apart."""
    from flywheel.workload import GYM_VARIANTS

    w = Workload(families=("chain_sum", "chain_sum_3terms", "gcd"), held_out=("gcd",), eval_share=0.3, seed=0)
    rng = random.Random(4)
    tasks = [w.next_task(rng) for _ in range(300)]
    kinds = {t.kind for t in tasks}
    assert kinds == {"train", "fresh", "harder", "unseen"}
    for t in tasks:
        want = {"gcd": "unseen", "chain_sum_3terms": "harder"}.get(t.family) or ("fresh" if t.split == "eval"
                                                                                else "train")
        assert t.kind == want and (t.split == "train") == (t.kind == "train")
        if t.kind == "harder":  # three one-digit terms, scored by the family's own verifier
            truth = str(t.verifier.entry["answer"])
            assert t.verifier.score(f"so {truth}") and t.verifier.entry["question"].count("+") + \
                t.verifier.entry["question"].count("-") >= 2
    assert GYM_VARIANTS["chain_sum_3terms"][0] == "chain_sum"
    with pytest.raises(ValueError, match="harder variant"):
        Workload(families=("chain_sum_3terms",))


def test_fixed_eval_set_is_fixed_and_never_asked_by_the_users():
    """The same prompts for a seed; HumanEval from the eval split (120..); the users' workload
    never draws a reserved key, and redraws the family's next instance instead."""
    from flywheel.workload import FIXED_HUMANEVAL, fixed_eval_set, fixed_kind

    fams = ("basic_arithmetic", "chain_sum", "humaneval", "chain_sum_3terms", "gcd")
    a, b = fixed_eval_set(fams, 6, 2, seed=4), fixed_eval_set(fams, 6, 2, seed=4)
    assert [t.key for t in a] == [t.key for t in b] and len(a) == 4 * 6 + 2
    assert len({t.key for t in a}) == len(a) and all(t.split == "eval" for t in a)
    assert [t.key for t in a if t.family == "humaneval"] == [f"HumanEval/{i}" for i in FIXED_HUMANEVAL[:2]]
    assert [fixed_kind(f, ("gcd",)) for f in ("gcd", "chain_sum_3terms", "chain_sum")] == ["unseen", "harder", "fresh"]
    reserved = frozenset(t.key for t in a)
    w = Workload(families=("basic_arithmetic", "chain_sum"), seed=4, reserved=reserved)
    rng = random.Random(0)
    drawn = [w.next_task(rng).key for _ in range(600)]
    assert not reserved & set(drawn)
    free = Workload(families=("basic_arithmetic", "chain_sum"), seed=4)
    assert reserved & {free.next_task(random.Random(0)).key for _ in range(600)}  # the reservation mattered
