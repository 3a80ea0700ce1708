"""Issue 24's cheaper paths give the answers of the ones they replaced (D65): the routes'
base64 check without a regex refuses exactly what the contract's pattern refuses, and the
shard's list columns built through numpy hold the same values and refuse the same ones."""

from __future__ import annotations

import random
import uuid
from typing import Annotated

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import Field, TypeAdapter, ValidationError

from schemas.arrow import samples_to_table, unwritable_column
from schemas.events import BASE64_PATTERN, ExpertRoutes, RewardedSample, SamplingParams

# the contract's rule as it was written: pydantic's own pattern check (its regex engine)
PATTERN = TypeAdapter(Annotated[str, Field(pattern=BASE64_PATTERN)])
NEW = TypeAdapter(ExpertRoutes)


def pattern_ok(v: str) -> bool:
    try:
        PATTERN.validate_python(v)
    except ValidationError:
        return False
    return True


def new_ok(v: str) -> bool:
    try:
        NEW.validate_python({"shape": [0, 0, 0], "data": v})
    except ValidationError as exc:
        assert [e["loc"] for e in exc.errors()] == [("data",)]
        return False
    return True


EDGES = ["", "=", "==", "===", "A", "A=", "A==", "A===", "AB=C", "AB==\n", "\nAB", "AB\n", "A B", "AB==A",
         "ab+/09==", "é", "AB\x00", "AB==\x00", "\u0660", "ＡＢ", "A-_", "A=B=", "====", "A\r\n"]


@pytest.mark.parametrize("v", EDGES)
def test_base64_check_refuses_what_the_pattern_refuses_edges(v):
    assert new_ok(v) == pattern_ok(v)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ABZaz09+/=\n\r -_é\x00\u0660")), max_size=12))
def test_base64_check_refuses_what_the_pattern_refuses(v):
    assert new_ok(v) == pattern_ok(v)


def sample(rng: random.Random, **kw) -> RewardedSample:
    P, C = rng.randint(1, 40), rng.randint(0, 40)
    d = dict(completion_id=uuid.uuid4(), model_version="v1", created_at=1_767_225_600_000, user_hash="u",
             prompt_token_ids=[rng.randrange(2**31) for _ in range(P)],
             completion_token_ids=[rng.randrange(2**31) for _ in range(C)],
             behavior_logprobs=[-rng.random() * 10 ** rng.randint(-3, 30) for _ in range(C)],
             sampling=SamplingParams(), finish_reason="stop", reward=1.0, label=True, n_votes=1, votes_up=1,
             votes_down=0, event_ids=[str(uuid.uuid4())], sealed_at=1_767_225_600_001)
    d.update(kw)
    return RewardedSample.model_construct(**d)


def test_list_columns_hold_the_values_pyarrow_makes_of_the_lists():
    rng = random.Random(7)
    samples = [sample(rng) for _ in range(60)]
    t = samples_to_table(samples)
    for name, typ in (("prompt_token_ids", pa.list_(pa.int32())), ("completion_token_ids", pa.list_(pa.int32())),
                      ("behavior_logprobs", pa.list_(pa.float32()))):
        want = pa.array([getattr(s, name) for s in samples], typ)  # Arrow's own conversion of the lists
        assert t.column(name).combine_chunks().equals(want), name


@pytest.mark.parametrize("name,bad", [("prompt_token_ids", [1, 2**31, 3]), ("completion_token_ids", [-2**31 - 1]),
                                      ("prompt_token_ids", [1, 2**70])])
def test_a_token_id_beyond_int32_is_refused_and_named(name, bad):
    rng = random.Random(1)
    s = sample(rng, **{name: bad, **({"behavior_logprobs": [-0.5]} if name == "completion_token_ids" else {})})
    with pytest.raises((OverflowError, pa.ArrowInvalid, ValueError, TypeError)):
        samples_to_table([sample(rng), s])
    assert unwritable_column(s)[0] == name
