"""The eval split end to end through the data path: the join copies a completion's split into
its sample, the shard and the catalog keep it (feedback counted apart by split), and the
learner's trainable count and training skip eval samples."""

from __future__ import annotations

import uuid

from samplestore import catalog, shards as writer
from ingest.join import JoinConfig, Joiner
from ingest.state import StateStore
from learner.cycle import count_new, new_state, save_state
from schemas.events import CompletionEvent, FeedbackEvent, SamplingParams

T0 = 1_767_225_600_000


def test_split_flows_from_completion_to_catalog_and_learner(tmp_path):
    j = Joiner(StateStore(":memory:"), JoinConfig(seal_after_s=10, max_label_age_s=100, orphan_ttl_s=20))
    want = {}
    for i, (split, up) in enumerate([("train", 1), ("train", -1), ("eval", 1), ("eval", 1), ("eval", -1)]):
        cid = uuid.uuid4()
        j.on_completion(CompletionEvent(
            completion_id=cid, request_id="r", created_at=T0, model_version="v000001", pod="p", user_hash="a",
            prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5], behavior_logprobs=[-0.5, -1.0],
            sampling=SamplingParams(), finish_reason="stop", ttft_ms=1.0, latency_ms=2.0, split=split), now=T0)
        j.on_feedback(FeedbackEvent(event_id=uuid.uuid4(), completion_id=cid, user_hash=f"u{i}", value=up,
                                    created_at=T0 + 1), now=T0 + 1)
        want[str(cid)] = split
    sd = tmp_path / "samples"
    res = j.tick(T0 + 20_000, shard_for=writer.shard_namer(sd))
    assert {str(s.completion_id): s.split for s in res.samples} == want
    for path, samples in res.shards.items():
        writer.write_shard(samples, path)
    rows = catalog.query("SELECT split, samples, votes_up, votes_down FROM votes_by_split", sd)
    assert rows == [{"split": "eval", "samples": 3, "votes_up": 2, "votes_down": 1},
                    {"split": "train", "samples": 2, "votes_up": 1, "votes_down": 1}]
    save_state(tmp_path / "state", new_state())
    assert count_new(sd, tmp_path / "state", 600_000) == 2  # only train samples can trigger a cycle
