"""The reward policy (schemas.reward): validation names the field, the combination formula on
hand-computed cases, the digest's stability, and [reward] through flywheel.toml and the
environment."""

from __future__ import annotations

import hashlib
import json

import pytest
from pydantic import ValidationError

from schemas.reward import RewardPolicy, RewardPolicyError, ScoreSpec


@pytest.mark.parametrize("kw,field", [
    ({"copy_weight": -0.1}, "copy_weight"),
    ({"edit_weight": float("nan")}, "edit_weight"),
    ({"thumb_up": 1e7}, "thumb_up"),
    ({"clip": 0}, "clip"),
    ({"followup_horizon_s": -1}, "followup_horizon_s"),
    ({"thumb_overrides": "maybe"}, "thumb_overrides"),
    ({"bogus": 1}, "bogus"),
    ({"scores": {"helpfulness": {"min": 5, "max": 1}}}, "scores.helpfulness"),
    ({"scores": {"helpfulness": {"min": 1, "max": 5, "weight": -1}}}, "scores.helpfulness.weight"),
    ({"scores": {"bad name!": {"min": 1, "max": 5}}}, "scores"),
])
def test_validation_names_the_field(kw, field):
    with pytest.raises(ValidationError) as e:
        RewardPolicy(**kw)
    err = e.value.errors()[0]
    where = ".".join(map(str, err["loc"])) or err["msg"].removeprefix("Value error, ").split(":")[0]
    assert where == field, e.value
    with pytest.raises(RewardPolicyError, match=rf"^reward\.{field.split('.')[0]}"):
        RewardPolicy.from_table(kw)


def test_defaults_thumbs_alone_are_the_mean_thumb():
    p = RewardPolicy()
    assert p.combine(thumb=1.0) == 1.0 and p.combine(thumb=-1 / 3) == pytest.approx(-1 / 3)
    assert p.combine() == 0.0  # nothing present
    # defaults: copy 0.5, regenerate -0.5, edit 0.5 * (2k - 1), followup 0.5 * f
    assert p.combine(copied=3) == 0.5 and p.combine(regenerated=1) == -0.5
    assert p.combine(copied=1, regenerated=2) == 0.0
    assert p.combine(kept_share=0.9, followup=1.0) == pytest.approx(0.5 * 0.8 + 0.5)
    # clipped to [-1, 1]: 0.5 + 0.5 * 1 + 0.5 * 1 = 1.5 -> 1
    assert p.combine(copied=1, kept_share=1.0, followup=1.0) == 1.0
    assert p.combine(regenerated=1, kept_share=0.0, followup=-1.0) == -1.0
    # thumb_overrides (default on): a thumb replaces copy, regenerate, edit, followup
    assert p.combine(thumb=-1.0, copied=1, kept_share=1.0, followup=1.0) == -1.0


def test_combine_hand_cases():
    p = RewardPolicy(thumb_up=0.75, thumb_down=-0.25, thumb_weight=2.0, copy_weight=0.25,
                     scores={"stars": ScoreSpec(min=1, max=5, weight=0.5), "tone": ScoreSpec(min=-2, max=2)},
                     thumb_overrides=False, clip=3.0)
    # thumb mean 1/3 (2 up, 1 down): 0.75 * (4/3) / 2 - 0.25 * (2/3) / 2 = 5/12, weight 2 -> 5/6
    # stars mean 4: 2 * 3 / 4 - 1 = 0.5, weight 0.5 -> 0.25; tone 0: 0; copy 0.25
    got = p.combine(thumb=1 / 3, copied=2, scores={"stars": 4.0, "tone": 0.0, "unknown": 9.0})
    assert got == pytest.approx(5 / 6 + 0.25 + 0 + 0.25)
    comps = p.components(thumb=1 / 3, copied=2, scores={"stars": 4.0, "unknown": 9.0})
    assert comps == {"thumb": pytest.approx(5 / 12), "copy": 1.0, "score:stars": 0.5}
    # clip 3: 2 * 0.75 + 0.25 + 0.5 * 1 + 1 * 1 = 3.25 -> 3
    assert p.combine(thumb=1.0, copied=1, scores={"stars": 5.0, "tone": 2.0}) == 3.0
    # with thumb_overrides the scores stay, the implicit kinds go
    q = p.model_copy(update={"thumb_overrides": True})
    assert q.combine(thumb=-1.0, copied=5, kept_share=0.0, scores={"stars": 1.0}) == pytest.approx(2 * -0.25 - 0.5)


def test_horizon_is_the_slowest_weighted_kind():
    p = RewardPolicy(edit_horizon_s=600, copy_horizon_s=900, copy_weight=0,
                     scores={"stars": ScoreSpec(min=1, max=5, horizon_s=700)})
    assert (p.horizon_s(), p.slowest(), p.horizon_ms) == (700.0, "scores.stars.horizon_s", 700_000)
    assert RewardPolicy().horizon_s() == 0.0


def test_refusal_reasons():
    p = RewardPolicy(regenerate_weight=0, scores={"stars": ScoreSpec(min=1, max=5)})
    assert p.refusal("regenerate", None, 1.0) == ("kind", "kind 'regenerate' is not used: weight 0 in the reward policy")
    assert p.refusal("score", "tone", 1.0)[0] == "name"
    assert p.refusal("score", "stars", 5.5)[0] == "value"
    assert p.refusal("score", "stars", 5.0) is None and p.refusal("copy", None, 1.0) is None


def test_digest_is_stable_and_canonical():
    p = RewardPolicy()
    want = hashlib.sha256(json.dumps(p.model_dump(mode="json"), sort_keys=True,
                                     separators=(",", ":")).encode()).hexdigest()[:16]
    assert p.digest() == want and len(want) == 16
    # the digest of the defaults is pinned: a change of a default is a new policy, on purpose
    assert p.digest() == RewardPolicy.from_table({}).digest() == "81e148a4dca0f9e0"
    # the same policy however it is written (key order, int vs float, table vs model)
    a = RewardPolicy.from_table({"scores": {"b": {"min": 0, "max": 1}, "a": {"max": 2, "min": 1}}, "copy_weight": 1})
    b = RewardPolicy(copy_weight=1.0, scores={"a": ScoreSpec(min=1.0, max=2.0), "b": ScoreSpec(min=0.0, max=1.0)})
    assert a.digest() == b.digest()
    assert RewardPolicy(copy_weight=0.25).digest() != p.digest()


def test_from_env_names_the_variable():
    env = {"FLYWHEEL_REWARD__EDIT_WEIGHT": "0.25", "FLYWHEEL_REWARD__THUMB_OVERRIDES": "false",
           "FLYWHEEL_REWARD__SCORES": '{"stars": {"min": 1, "max": 5, "weight": 0.5}}', "OTHER": "x"}
    p = RewardPolicy.from_env(env, thumb_up=0.5, thumb_down=None)
    assert (p.edit_weight, p.thumb_overrides, p.scores["stars"].weight, p.thumb_up, p.thumb_down) == (
        0.25, False, 0.5, 0.5, -1.0)
    with pytest.raises(RewardPolicyError, match="^FLYWHEEL_REWARD__COPY_WEIGHT: Input should be greater"):
        RewardPolicy.from_env({"FLYWHEEL_REWARD__COPY_WEIGHT": "-1"})
    with pytest.raises(RewardPolicyError, match="^FLYWHEEL_REWARD__COPYWEIGHT: names no field"):
        RewardPolicy.from_env({"FLYWHEEL_REWARD__COPYWEIGHT": "1"})
    with pytest.raises(RewardPolicyError, match="^FLYWHEEL_REWARD__SCORES: not a JSON object"):
        RewardPolicy.from_env({"FLYWHEEL_REWARD__SCORES": "{nope"})
    with pytest.raises(RewardPolicyError, match=r"^reward\.thumb_up"):  # a flag's value: named as the field
        RewardPolicy.from_env({}, thumb_up=2e6)


def test_reward_table_in_flywheel_toml(tmp_path):
    from schemas.config import ConfigError, load_config

    f = tmp_path / "flywheel.toml"
    f.write_text('[reward]\nedit_weight = 0.25\nthumb_overrides = false\n'
                 '[reward.scores.stars]\nmin = 1\nmax = 5\nweight = 0.5\n')
    env = {"FLYWHEEL_REWARD__COPY_WEIGHT": "0.125", "FLYWHEEL_REWARD__EDIT_WEIGHT": "0.75"}
    load_config(f).apply_env(env)
    p = RewardPolicy.from_env(env)  # the environment wins over the file
    assert (p.edit_weight, p.copy_weight, p.thumb_overrides, p.scores["stars"]) == (
        0.75, 0.125, False, ScoreSpec(min=1, max=5, weight=0.5))
    f.write_text("[reward]\nclip = -1\n")
    with pytest.raises(ConfigError, match=r"flywheel.toml: reward\.clip: Input should be greater than 0"):
        load_config(f).apply_env({})
    f.write_text("[reward]\nweight = 1\n")
    with pytest.raises(ConfigError, match=r"flywheel.toml: reward\.weight: names no field"):
        load_config(f).apply_env({})


@pytest.mark.parametrize("toml,msg", [
    ("[reward]\nthumb_weight = true\n", r"reward\.thumb_weight: Input should be a valid number"),
    ('[reward]\nedit_weight = "0.5"\n', r"reward\.edit_weight: Input should be a valid number"),
    ("[reward]\nthumb_overrides = 1\n", r"reward\.thumb_overrides: Input should be a valid boolean"),
    ('[reward]\nthumb_overrides = "yes"\n', r"reward\.thumb_overrides: Input should be a valid boolean"),
    ("[reward.scores.stars]\nmin = 1\nmax = 5\nweight = true\n", r"reward\.scores\.stars\.weight: Input should be a valid number"),
    ("[reward.scores.stars]\nmin = 5\nmax = 1\n", r"reward\.scores\.stars\.max: must be above min \(5\), got 1"),
    ("[reward.scores.stars]\nmin = 1\nmax = 5\nwieght = 1\n",
     r"reward\.scores\.stars\.wieght: unknown key; keys are min, max, weight, horizon_s$"),
])
def test_reward_table_values_keep_their_toml_types(tmp_path, toml, msg):
    """A ``[reward]`` value of the wrong TOML type (a boolean or a string for a weight, a number
    or a string for ``thumb_overrides``) is refused, never read as 1 or parsed; an unknown key
    of a score lists the score's keys."""
    from schemas.config import ConfigError, load_config

    f = tmp_path / "flywheel.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError, match=r"flywheel.toml: " + msg):
        load_config(f).apply_env({})


@pytest.mark.parametrize("text,msg", [
    ('{"stars": {"min": 1, "max": 5, "weight": true}}', r"stars\.weight: Input should be a valid number"),
    ('{"stars": {"min": "1", "max": 5}}', r"stars\.min: Input should be a valid number"),
    ('{"stars": {"min": 5, "max": 1}}', r"stars\.max: must be above min \(5\), got 1"),
    ('{"stars": {"min": 1, "max": 5, "x": 1}}', r"stars\.x: unknown key; keys are min, max, weight, horizon_s"),
])
def test_scores_variable_names_the_score_and_refuses_non_numbers(text, msg):
    with pytest.raises(RewardPolicyError, match=r"^FLYWHEEL_REWARD__SCORES: " + msg):
        RewardPolicy.from_env({"FLYWHEEL_REWARD__SCORES": text})
    # text values of the other variables are still read as numbers and booleans
    p = RewardPolicy.from_env({"FLYWHEEL_REWARD__EDIT_WEIGHT": "0.25", "FLYWHEEL_REWARD__THUMB_OVERRIDES": "false"})
    assert (p.edit_weight, p.thumb_overrides) == (0.25, False)
