"""The sample contract's reward bound is the reward policy's (D107): ``RewardedSample.reward``
and ``SampleNotice.reward`` in [-REWARD_LIMIT, REWARD_LIMIT] = [-1e6, 1e6], the largest reward
any policy's clip lets through, and a score's value within the same constant. A shard row
beyond it (hand-made: 3e38, finite as float32, once crashed the REINFORCE learner's metrics
with ``pg/adv_mean: non-finite``) is refused where the learner reads shards, the way a NaN
reward is: a ``BadShardError`` naming the file, row, completion_id, field and reason, the cycle
trains on nothing and consumes nothing, and once the shard is moved away the other shards'
samples are trained on.

Real parts: Parquet shards written by ``samplestore.shards`` (the bad value put into the
``reward`` column with pyarrow, since the model refuses to build such a sample), the learner's
read path (``SpilledSamples.from_shards``), ``flywheel learn --once`` on the tiny MoE in a real
model store (DeepSpeed on CPU), the exported JSON Schemas checked with ``jsonschema``.
"""

from __future__ import annotations

import math
import shutil
import uuid
from pathlib import Path

import jsonschema
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from flywheel.cli import app
from learner.cycle import count_new, load_state
from learner.data import SpilledSamples
from modelstore.store import ModelStore
from samplestore import shards as writer
from samplestore.shards import BadShardError
from schemas import events
from schemas.events import RewardedSample, SampleNotice, SamplingParams
from schemas.json_schema import contracts, schema_of
from schemas.reward import REWARD_LIMIT, RewardPolicy, ScoreSpec

T0 = 1_750_000_000_000
BAD = 3e38  # finite as float32 (the column's type), far beyond any policy's reward
BAD_AS_FLOAT32 = float(np.float32(BAD))  # what the row holds: 3.0000000054977558e+38


def _plain(i: int, reward: float) -> RewardedSample:
    """A small sample (no routes) with ``reward``; id ``i``, sealed at T0 + i."""
    return RewardedSample(
        completion_id=uuid.UUID(int=i), model_version="v000000", created_at=T0, user_hash="u",
        prompt_token_ids=[5, 6, 7], completion_token_ids=[8, 9], behavior_logprobs=[-0.5, -1.0],
        sampling=SamplingParams(), finish_reason="stop", reward=reward, label=reward > 0, n_votes=1,
        votes_up=0, votes_down=0, event_ids=[str(uuid.UUID(int=1000 + i))], sealed_at=T0 + i)


def _set_reward(path: Path, row: int, value: float) -> None:
    """Rewrite shard ``path`` with ``reward`` of ``row`` set to ``value`` (the writer's own
    settings, atomically): what a hand-made or foreign shard can hold."""
    t = pq.read_table(path)
    i = t.schema.get_field_index("reward")
    col = t.column("reward").to_pylist()
    col[row] = value
    writer.write_table(t.set_column(i, t.schema.field(i), pa.array(col, t.schema.field(i).type)), path)


# ----------------------------------------------------------------------------- the contract
def test_the_contract_bound_is_the_policy_constant():
    assert REWARD_LIMIT == 1e6 and events.SCORE_MAX_ABS is REWARD_LIMIT
    for name in ("RewardedSample", "SampleNotice"):
        c = next(c for c in contracts() if c.name == name)
        prop = schema_of(c)["properties"]["reward"]
        assert (prop["minimum"], prop["maximum"]) == (-1e6, 1e6), name
    # the largest reward a policy can make: every weight, the thumb value and the clip at the limit
    extreme = RewardPolicy(thumb_up=REWARD_LIMIT, thumb_weight=REWARD_LIMIT, clip=REWARD_LIMIT,
                           scores={"s": ScoreSpec(min=-REWARD_LIMIT, max=REWARD_LIMIT, weight=REWARD_LIMIT)},
                           thumb_overrides=False)
    top = extreme.combine(thumb=1.0, scores={"s": REWARD_LIMIT})  # 1e12 + 1e6 before the clip
    assert top == 1e6
    assert _plain(1, top).reward == 1e6  # the contract holds what the policy makes


@pytest.mark.parametrize("reward,ok", [(1e6, True), (-1e6, True), (0.25, True),
                                       (math.nextafter(1e6, math.inf), False),
                                       (math.nextafter(-1e6, -math.inf), False), (BAD, False), (-BAD, False)])
def test_reward_bound_in_models_and_exported_schema(reward, ok):
    sample = _plain(1, 0.5).model_dump(mode="json") | {"reward": reward}
    notice = {k: sample[k] for k in ("completion_id", "model_version", "split", "created_at", "sealed_at",
                                     "reward", "label", "n_votes", "votes_up", "votes_down", "event_ids")}
    notice |= {"shard": "date=2025-06-15/hour=15/part-1750000000001-a.parquet", "row": 0, "shard_format": 4}
    for model, obj in ((RewardedSample, sample), (SampleNotice, notice)):
        schema = schema_of(next(c for c in contracts() if c.name == model.__name__))
        valid = jsonschema.Draft202012Validator(schema).is_valid(obj)
        if ok:
            assert model.model_validate(obj).reward == reward and valid
        else:
            with pytest.raises(ValidationError) as e:
                model.model_validate(obj)
            assert e.value.errors()[0]["loc"] == ("reward",) and not valid


def test_a_score_value_has_the_same_bound():
    base = {"event_id": str(uuid.UUID(int=2)), "completion_id": str(uuid.UUID(int=1)), "user_hash": "u",
            "kind": "score", "name": "helpfulness", "created_at": T0}
    assert events.FeedbackEvent.model_validate(base | {"value": 1e6}).value == 1e6
    with pytest.raises(ValidationError, match="value"):
        events.FeedbackEvent.model_validate(base | {"value": math.nextafter(1e6, math.inf)})
    with pytest.raises(ValidationError, match="scores"):
        _plain(1, 0.5).model_validate(_plain(1, 0.5).model_dump() | {"scores": {"h": -2e6}})


# ----------------------------------------------------------------------------- the read path
def test_read_path_accepts_the_limit_and_names_a_row_beyond_it(tmp_path):
    good = writer.write_shard([_plain(1, 0.5), _plain(2, 1e6), _plain(3, -1e6)], tmp_path / "good.parquet")
    src = SpilledSamples.from_shards([good], tmp_path / "spill" / "a.arrow")
    assert src.meta.rewards == [0.5, 1e6, -1e6]  # exactly the limit is a reward (float32 holds 1e6 exactly)
    assert [s.reward for s in src.take([1, 2])] == [1e6, -1e6]

    bad = writer.write_shard([_plain(4, 0.5), _plain(5, 0.25), _plain(6, -0.5)], tmp_path / "bad.parquet")
    _set_reward(bad, 1, BAD)
    out = tmp_path / "spill" / "b.arrow"
    with pytest.raises(BadShardError) as e:
        SpilledSamples.from_shards([good, bad], out)
    err = e.value
    assert (err.path, err.row, err.completion_id, err.field) == (bad, 1, str(uuid.UUID(int=5)), "reward")
    assert err.reason == f"Input should be less than or equal to 1000000, got {BAD_AS_FLOAT32!r}"
    assert str(err).startswith(f"shard {bad}: row 1 (completion_id {uuid.UUID(int=5)}): reward: Input should "
                               f"be less than or equal to 1000000, got 3.0000000054977558e+38; not a valid "
                               f"RewardedSample")
    assert "move the shard out of the samples directory" in str(err)
    assert not out.exists() and list(out.parent.iterdir()) == [tmp_path / "spill" / "a.arrow"]  # no temp left


def test_a_nan_reward_is_named_the_same_way(tmp_path):
    """The rule a NaN reward already had (refused by the contract at read), now naming the file."""
    p = writer.write_shard([_plain(1, 0.5), _plain(2, 0.25)], tmp_path / "nan.parquet")
    _set_reward(p, 0, float("nan"))
    with pytest.raises(BadShardError) as e:
        SpilledSamples.from_shards([p], tmp_path / "x.arrow")
    assert (e.value.row, e.value.field) == (0, "reward")
    assert e.value.reason == "Input should be a finite number, got nan"


def test_the_bad_row_is_found_past_the_first_read_batch(tmp_path):
    """Row numbers count the whole shard, not the read batch (READ_ROWS rows each)."""
    from learner.data import READ_ROWS

    n = READ_ROWS + 5
    p = writer.write_shard([_plain(i + 1, 0.5) for i in range(n)], tmp_path / "long.parquet")
    _set_reward(p, READ_ROWS + 3, -BAD)
    with pytest.raises(BadShardError) as e:
        SpilledSamples.from_shards([p], tmp_path / "x.arrow")
    assert (e.value.row, e.value.completion_id) == (READ_ROWS + 3, str(uuid.UUID(int=READ_ROWS + 4)))
    assert e.value.reason == f"Input should be greater than or equal to -1000000, got {-BAD_AS_FLOAT32!r}"


# ----------------------------------------------------------------------------- flywheel learn
@pytest.fixture(scope="module")
def model(tiny_moe_dir):
    from schemas.modelspec import load_model

    return load_model(tiny_moe_dir)


def test_learn_once_refuses_the_shard_then_trains_on_the_others(tiny_moe_dir, model, tmp_path, fw_home):
    """``flywheel learn --once --objective reinforce`` with a good shard (one reward exactly 1e6)
    and a shard whose row 1 holds 3e38: exit 1 naming the file, row, field and reason, no
    traceback, nothing consumed or published, every sample still waiting. With the bad shard
    moved out of the samples directory, the next cycle trains on the good shard's three
    samples (finite metrics) and consumes it."""
    from test_learner_reward_kinds import _sample

    rng = np.random.default_rng(3)
    V = model.config.vocab_size
    mk = [_sample(model, rng.integers(3, V, 4).tolist(), rng.integers(3, V, 3).tolist(), r, i)
          for i, r in enumerate([1e6, -1.0, 0.5, 0.5, 0.25])]
    ModelStore(tmp_path / "store").init_base(tiny_moe_dir)
    samples, state = tmp_path / "samples", tmp_path / "state"
    good = writer.write_shard(mk[:3], writer.shard_path(samples, mk[0].sealed_at, "good"))
    bad = writer.write_shard(mk[3:], writer.shard_path(samples, mk[3].sealed_at, "bad"))
    _set_reward(bad, 1, BAD)
    args = ["learn", "--once", "--objective", "reinforce", "--steps", "1", "--batch-size", "3", "--lr", "1e-3",
            "--store", str(tmp_path / "store"), "--samples", str(samples), "--state", str(state)]

    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1, r.output
    want = (f"learn: shard {bad}: row 1 (completion_id {mk[4].completion_id}): reward: Input should be less "
            f"than or equal to 1000000, got 3.0000000054977558e+38; not a valid RewardedSample")
    assert want in r.output and "Traceback" not in r.output, r.output
    assert load_state(state)["consumed"] == {} and load_state(state)["watermark_ms"] == 0
    assert ModelStore(tmp_path / "store").versions() == ["v000000"]
    assert count_new(samples, state, 600_000) == 5  # nothing lost: all still waiting

    aside = tmp_path / "quarantine" / bad.name
    aside.parent.mkdir()
    shutil.move(bad, aside)  # what the message asks of the operator
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    st = ModelStore(tmp_path / "store")
    assert st.versions() == ["v000000", "v000001"]
    met = st.manifest("v000001").metrics
    assert met["data/n_candidates"] == 3 and met["data/n_samples"] == 3
    assert all(math.isfinite(v) for k, v in met.items() if k.startswith("pg/") and isinstance(v, float))
    assert list(load_state(state)["consumed"]) == ["/".join(good.parts[-3:])]
