"""bench/ingest_floor.py compares the current JSON contract's body work with a candidate
binary body's. The comparison is fair only if the candidate's check refuses what the
contract refuses: here each bound is broken in turn, and both the contract
(``CompletionEvent``) and the candidate (``check_binary``) must refuse it; a valid event
round-trips through the candidate with its values intact."""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

import numpy as np
import pydantic
import pytest

from schemas.events import CompletionEvent, ExpertRoutes, SamplingParams, now_ms

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ingest_floor", ROOT / "bench" / "ingest_floor.py")
floor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(floor)


def _fields(**over) -> dict:
    p, c = [5, 6, 7], [8, 9]
    d = dict(completion_id=uuid.uuid4(), request_id="r-1", created_at=now_ms(), model_version="v0001",
             pod="pod-0", user_hash="u1", prompt_token_ids=p, completion_token_ids=c,
             behavior_logprobs=[-0.5, -1.25], sampling=dict(temperature=0.7, top_p=0.9),
             expert_routes=dict(shape=(4, 2, 1), data=ExpertRoutes.from_array(
                 np.arange(8, dtype=np.uint8).reshape(4, 2, 1)).data),
             finish_reason="stop", ttft_ms=1.0, latency_ms=2.0, split="train")
    d.update(over)
    return d


def _unvalidated(d: dict) -> CompletionEvent:
    """``d`` as an event without validation (to encode a value the contract refuses)."""
    d = dict(d)
    d["sampling"] = SamplingParams.model_construct(**{**SamplingParams().model_dump(), **d["sampling"]})
    d["expert_routes"] = ExpertRoutes.model_construct(**{"dtype": "uint8", "codec": "zstd", **d["expert_routes"]})
    return CompletionEvent.model_construct(**d)


def test_valid_event_round_trips():
    ev = CompletionEvent.model_validate(_fields())
    v = floor.check_binary(floor.to_binary(ev))
    assert uuid.UUID(bytes=v[1]) == ev.completion_id
    assert v[2:7] == [ev.request_id, ev.created_at, ev.model_version, ev.pod, ev.user_hash]
    assert np.frombuffer(v[12], "<i4").tolist() == [5, 6, 7]
    assert np.frombuffer(v[13], "<i4").tolist() == [8, 9]
    assert np.frombuffer(v[14], "<f4").tolist() == [-0.5, -1.25]
    assert v[15][0] == [4, 2, 1]


@pytest.mark.parametrize("over", [
    {"prompt_token_ids": []},
    {"prompt_token_ids": [1, -2, 3]},
    {"completion_token_ids": [8, -1]},
    {"behavior_logprobs": [-0.5]},
    {"behavior_logprobs": [-0.5, 0.25]},
    {"behavior_logprobs": [-0.5, float("nan")]},
    {"behavior_logprobs": [-0.5, float("-inf")]},
    {"created_at": 1_700_000_000},  # seconds, not ms
    {"pod": "pod\x00"},
    {"user_hash": ""},
    {"request_id": "x" * 257},
    {"split": "test"},
    {"finish_reason": "eos"},
    {"ttft_ms": -1.0},
    {"latency_ms": 86_400_001.0},
    {"sampling": {"temperature": 2.5}},
    {"sampling": {"top_p": 0.0}},
    {"expert_routes": {"shape": (3, 2, 1), "data": "AAAA"}},  # rows != prompt + completion - 1
], ids=lambda o: next(iter(o)))
def test_candidate_refuses_what_the_contract_refuses(over):
    d = _fields(**over)
    with pytest.raises(pydantic.ValidationError):
        CompletionEvent.model_validate(d)
    with pytest.raises(ValueError):
        floor.check_binary(floor.to_binary(_unvalidated(d)))


def test_efficiency_model():
    """``c / (c + F + S / r)``: 20 us to consume, 40 us to fold, 200 us per label of 4 records
    -> 20 / (20 + 40 + 50) = 2/11."""
    assert floor.efficiency(20.0, 40.0, 200.0, 4.0) == pytest.approx(2 / 11)
