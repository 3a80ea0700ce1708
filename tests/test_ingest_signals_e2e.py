"""Every feedback kind through the real worker (``python -m ingest`` subprocess) and a real
Tansu broker: thumbs, scores, copies, regenerates (serving-derived, deterministic ids, sent
twice), edits by kept share and by final text (decoded with a real ``tokenizers`` tokenizer),
followups, under a ``[reward]`` table read from ``flywheel.toml``. Each sample's components and
reward are checked against values worked out by hand below."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from schemas.settings import topic_names
from schemas.events import CompletionEvent, FeedbackEvent, SamplingParams, now_ms, signal_event_id
from schemas.reward import RewardPolicy, ScoreSpec
from test_ingest_e2e import ROOT, produce, read_dead, start_worker, stop, wait_for

WORDS = ["[UNK]", "alpha", "beta", "gamma", "delta"]
POLICY = RewardPolicy(thumb_overrides=False, clip=10, scores={"helpfulness": ScoreSpec(min=1, max=5, weight=0.5)})
TOML = """[reward]
thumb_overrides = false
clip = 10
[reward.scores.helpfulness]
min = 1
max = 5
weight = 0.5
"""


def _tokenizer(model_dir):
    """A word-level tokenizer.json (the WORDS vocabulary): decode joins words with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    model_dir.mkdir(parents=True)
    tok.save(str(model_dir / "tokenizer.json"))


def _completion(i: int, tokens: list[int], t: int) -> CompletionEvent:
    return CompletionEvent(
        completion_id=uuid.UUID(int=1000 + i), request_id=f"r{i}", created_at=t, model_version="v0001", pod="p0",
        user_hash="author", prompt_token_ids=[1, 2], completion_token_ids=tokens,
        behavior_logprobs=[-0.5] * len(tokens), sampling=SamplingParams(), finish_reason="stop",
        ttft_ms=1.0, latency_ms=2.0)


def _fb(c, user, kind, value=None, t=0, name=None, final_text=None, eid=None, metadata=None) -> FeedbackEvent:
    return FeedbackEvent(event_id=eid or uuid.uuid4(), completion_id=c.completion_id, user_hash=user, kind=kind,
                         value=value, created_at=t, name=name, final_text=final_text, metadata=metadata)


@pytest.mark.timeout(180)
def test_every_kind_becomes_its_component_and_the_reward(broker, fw_home, tmp_path):
    t0 = now_ms() - 60_000  # in the past: a time ahead of the worker's clock would be clamped
    cs = {i: _completion(i, toks, t0) for i, toks in
          [(1, [1, 2]), (2, [1]), (3, [2]), (4, [3]), (5, [4]), (6, [1, 2, 1, 3]), (7, [2, 2]), (8, [1, 3])]}
    later = uuid.UUID(int=9999)  # the completion whose request showed the regenerate / followup
    regen = signal_event_id("regenerate", cs[4].completion_id, later)
    serving = {"source": "serving"}
    fb = [
        # 1: thumbs, u2 flips to up later: thumb (1 + 1) / 2 = 1 -> reward 1 * 1 = 1
        _fb(cs[1], "u1", "thumb", 1, t0), _fb(cs[1], "u2", "thumb", -1, t0), _fb(cs[1], "u2", "thumb", 1, t0 + 5000),
        # 2: helpfulness 2 and 5, mean 3.5 -> 2 * 2.5 / 4 - 1 = 0.25, * 0.5 = 0.125; "tone" is not declared
        _fb(cs[2], "u1", "score", 2, t0, name="helpfulness"), _fb(cs[2], "u2", "score", 5, t0, name="helpfulness"),
        _fb(cs[2], "u1", "score", 3, t0, name="tone"),
        # 3: two users copied (u1's copy delivered twice), u3 asked again: 0.5 - 0.5 = 0
        *([_fb(cs[3], "u1", "copy", 1, t0, eid=uuid.UUID(int=31))] * 2), _fb(cs[3], "u2", "copy", 1, t0),
        _fb(cs[3], "u3", "regenerate", 1, t0),
        # 4: a regenerate serving saw, sent by two pods with the same deterministic id: -0.5
        _fb(cs[4], "u1", "regenerate", 1, t0, eid=regen, metadata=serving),
        _fb(cs[4], "u1", "regenerate", 1, t0, eid=regen, metadata=serving),
        # 5: kept 0.8 -> 0.5 * 0.6 = 0.3; followup -1 -> -0.5: -0.2
        _fb(cs[5], "u1", "edit", 0.8, t0),
        _fb(cs[5], "u1", "followup", -1, t0, eid=signal_event_id("followup", cs[5].completion_id, later),
            metadata=serving),
        # 6: "alpha beta alpha gamma" edited to "alpha gamma delta" (kept alpha, gamma: 2 / 4 = 0.5)
        # and, by u2, to the same text plus a word (4 / 4 = 1): mean 0.75 -> 0.5 * 0.5 = 0.25
        _fb(cs[6], "u1", "edit", None, t0, final_text="alpha gamma delta"),
        _fb(cs[6], "u2", "edit", None, t0, final_text="alpha beta alpha gamma delta"),
        # 7: followups +1, +1 then -1 (u2's last), +1: mean 1/3 -> 0.5 / 3
        _fb(cs[7], "u1", "followup", 1, t0), _fb(cs[7], "u2", "followup", 1, t0),
        _fb(cs[7], "u2", "followup", -1, t0 + 5000), _fb(cs[7], "u3", "followup", 1, t0),
        # 8: every kind from two users: thumb 1, copy 0.5, regenerate -0.5, edit 0.5 -> 0,
        # followup 0.5, helpfulness 1 -> 0.5 * -1 = -0.5: total 1.0
        _fb(cs[8], "u1", "thumb", 1, t0), _fb(cs[8], "u1", "copy", 1, t0), _fb(cs[8], "u2", "regenerate", 1, t0),
        _fb(cs[8], "u1", "edit", 0.5, t0), _fb(cs[8], "u1", "followup", 1, t0),
        _fb(cs[8], "u2", "score", 1, t0, name="helpfulness"),
    ]
    # completion -> (thumb, copied, regenerated, kept_share, followup, scores, reward, n_votes, votes_up, votes_down)
    want = {1: (1.0, 0, 0, None, None, {}, 1.0, 2, 2, 0),
            2: (None, 0, 0, None, None, {"helpfulness": 3.5}, 0.125, 2, 0, 0),
            3: (None, 2, 1, None, None, {}, 0.0, 3, 0, 0),
            4: (None, 0, 1, None, None, {}, -0.5, 1, 0, 0),
            5: (None, 0, 0, 0.8, -1.0, {}, -0.2, 2, 0, 0),
            6: (None, 0, 0, 0.75, None, {}, 0.25, 2, 0, 0),
            7: (None, 0, 0, None, 1 / 3, {}, 0.5 / 3, 3, 0, 0),
            8: (1.0, 1, 1, 0.5, 1.0, {"helpfulness": 1.0}, 1.0, 6, 1, 0)}
    cfg = tmp_path / "flywheel.toml"
    cfg.write_text(TOML)
    model_dir = tmp_path / "model"
    _tokenizer(model_dir)
    env = dict(os.environ, FLYWHEEL_HOME=str(fw_home), FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap,
               PYTHONPATH=str(ROOT), FLYWHEEL_CONFIG=str(cfg), FLYWHEEL_MODEL_DIR=str(model_dir))
    env = {k: v for k, v in env.items() if not k.startswith("FLYWHEEL_REWARD__")}
    samples_dir = fw_home / "data" / "samples"
    log = tmp_path / "worker.log"
    produce(broker.bootstrap, list(cs.values()), fb)
    proc = start_worker(env, log)
    try:
        from samplestore.catalog import read_samples

        wait_for(lambda: samples_dir.exists() and len(read_samples(samples_dir)) >= len(cs), 120,
                 "every completion sealed", proc, log)
        got = {s.completion_id.int - 1000: s for s in read_samples(samples_dir)}
    finally:
        stop(proc)
    assert sorted(got) == sorted(cs)
    eids = {i: {str(e.event_id) for e in fb if e.completion_id == cs[i].completion_id and e.name != "tone"}
            for i in cs}
    for i, (thumb, copied, regenerated, kept, follow, scores, reward, n, up, down) in want.items():
        s = got[i]
        assert (s.copied, s.regenerated, s.n_votes, s.votes_up, s.votes_down) == (copied, regenerated, n, up, down), i
        for have, exp in ((s.thumb, thumb), (s.kept_share, kept), (s.followup, follow)):
            assert (have is None) == (exp is None) and (exp is None or have == pytest.approx(exp)), (i, have, exp)
        assert s.scores == pytest.approx(scores), i
        assert s.reward == pytest.approx(reward, abs=1e-6), (i, s.reward)  # (the column is float32)
        assert s.label is (reward > 1e-9) and s.reward_policy == POLICY.digest(), i
        assert set(s.event_ids) == eids[i], i
    # the undeclared score is a dead letter with its reason, nothing else is
    dead = [d for d in read_dead(broker.bootstrap) if d.source_topic == topic_names().feedback]
    assert [(d.field, json.loads(d.payload)["name"]) for d in dead] == [("name", "tone")], dead
    assert "score 'tone' is not declared in the reward policy" in dead[0].reason
