"""Fuzzing both topics the ingest worker reads (issue 11): 5,000 records in CI mixing valid
events with adversarial ones, through a real worker subprocess on the real Tansu broker.

The worker must never stop; every bad record ends as a dead letter naming a field and a
reason; every valid event ends in exactly one sample (checked against the independent
reference join of ``tests/test_ingest_e2e.py``, and every implicit signal, copy, regenerate,
edit and followup, in its sample's component columns as :func:`reference_signals` computes
them); the dead letters per source topic equal the count computed here from what was produced.
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from schemas.settings import topic_names
from schemas.events import now_ms

from test_ingest_e2e import ROOT, check, make_traffic, read_dead, reference_join, stop, wait_for  # noqa: I001
from flywheel.supervise import die_with_parent

N_RECORDS = 10_000  # run_fuzz's default size; bench/ingest.py --fuzz runs 50,000


def _completion_obj(cid: str, **kw) -> dict:
    d = dict(schema_version=1, completion_id=cid, request_id="r", created_at=now_ms(), model_version="v0000",
             pod="p0", user_hash="a", prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5, 6],
             behavior_logprobs=[-0.5, -1.25, -0.3],
             sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": None},
             finish_reason="stop", ttft_ms=1.0, latency_ms=2.0)
    d.update(kw)
    return d


def _vote_obj(cid: str, **kw) -> dict:
    d = dict(schema_version=1, event_id=str(uuid.uuid4()), completion_id=cid, user_hash="fuzz", kind="thumb",
             value=1, created_at=now_ms())
    d.update(kw)
    return d


def _compact(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()  # serving's layout (NaN/Infinity as literals)


def bad_feedback(rng: random.Random) -> bytes | None:
    """One adversarial value for flywheel.feedback (every one must be dead-lettered)."""
    cid = str(uuid.uuid4())
    # the big ones (deep nesting up to 250 KB) are rare: a few dozen of them, not megabytes each second
    kind = rng.choices(range(12), weights=[1, 1] + [30] * 10)[0]
    if kind == 0:
        return b"[" * rng.randint(1_000, 100_000)  # deep nesting
    if kind == 1:
        return b'{"a":' * 50_000  # deep nesting, objects
    if kind == 2:
        return b"\xff\xfe\x80" + os.urandom(rng.randint(1, 64))  # invalid UTF-8
    if kind == 3:
        return _compact(_vote_obj(cid, value=float(rng.choice(["nan", "inf", "-inf"]))))  # non-finite
    if kind == 4:
        return _compact(_vote_obj(cid))[:-1] + b',"value":-1}'  # duplicate key
    if kind == 5:
        return _compact(_vote_obj(cid, value=rng.choice(["up", True, None, [1]])))  # wrong type
    if kind == 6:
        return _compact(_vote_obj(cid, created_at=now_ms() // 1000))  # wrong unit: seconds
    if kind == 7:
        return _compact(_vote_obj(cid, schema_version=rng.choice([0, 2, 99, "1"])))  # unknown schema
    if kind == 8:
        return None  # tombstone
    if kind == 9:
        return _compact(_vote_obj(cid))[: rng.randint(1, 60)]  # truncated
    if kind == 10:
        return _compact(_vote_obj(cid, extra_field=1))  # unknown field
    return rng.choice([b"", b"null", b"42", b'"x"', b"[]", b"{}"])


def bad_completion(rng: random.Random) -> tuple[bytes | None, bytes | None]:
    """One adversarial value for flywheel.completions, and a valid vote for it when its head
    is valid (a bad body is found when its label is sealed: the body and the vote are both
    dead-lettered)."""
    cid = str(uuid.uuid4())
    kind = rng.choices(range(8), weights=[20, 20, 20, 20, 1, 1, 20, 20])[0]  # 4, 5: ~300 KB / 100 KB, rare
    vote = _compact(_vote_obj(cid))
    if kind == 0:
        return _compact(_completion_obj(cid, behavior_logprobs=[float("nan"), float("inf"), -0.3])), vote
    if kind == 1:
        return _compact(_completion_obj(cid, behavior_logprobs=[-0.1])), vote  # wrong length
    if kind == 2:
        return _compact(_completion_obj(cid, prompt_token_ids="abc")), vote  # wrong type in the body
    if kind == 3:
        return _compact(_completion_obj(cid, created_at=now_ms() // 1000)), None  # seconds: refused at once
    if kind == 4:
        huge = _completion_obj(cid, completion_token_ids=[1] * 60_000, behavior_logprobs=[0.0] * 59_999)
        return _compact(huge), vote  # ~300 KB and inconsistent
    if kind == 5:
        return b"[" * 100_000, None  # the record that stopped the join forever
    if kind == 6:
        return None, None  # tombstone
    return _compact(_completion_obj(cid, schema_version=7)), None


# -- schema-driven generation (Hardening II): the published JSON Schemas decide the fields ----------
INT_EDGES = [2**63 - 1, -(2**63), 2**64, 10**19, -1, 0, 2**31]
FLOAT_EDGES = [float("inf"), float("-inf"), float("nan"), 1e308, -1e308]
STR_EDGES = ["\ud800", "a\udfffb", "a\x00b", "x" * 1_000_000, ""]
WRONG_TYPES = [None, True, "1", [], {}, [[1]], 1.5]
DEEP = 5_000  # nesting depth of a field's value (the C JSON decoders refuse far less)
_POOL_N = 6  # schema-valid values drawn per field by hypothesis-jsonschema


def _resolve(sub: dict, defs: dict) -> dict:
    """A property's schema with one ``$ref`` / nullable ``anyOf`` level resolved."""
    if "$ref" in sub:
        sub = defs[sub["$ref"].rsplit("/", 1)[1]]
    if "anyOf" in sub:
        sub = next((x for x in sub["anyOf"] if x.get("type") != "null"), sub["anyOf"][0])
        if "$ref" in sub:
            sub = defs[sub["$ref"].rsplit("/", 1)[1]]
    return sub


def schema_pools(seed: int = 0) -> dict[str, dict[str, list]]:
    """``{contract: {field path: [values]}}``: for every leaf field of the CompletionEvent and
    FeedbackEvent JSON Schemas (``schemas.json_schema``, nested objects walked), values that
    hypothesis-jsonschema draws from that field's schema (valid under the *schema*; the contract
    may still refuse them, e.g. a uuid format or a bound the schema cannot express).
    hypothesis-jsonschema's object strategy does not run on this hypothesis release, so objects
    are assembled here and only leaves are drawn."""
    import warnings

    from hypothesis import strategies as st
    from hypothesis_jsonschema import from_schema

    from schemas.events import TEXT_PATTERN
    from schemas.json_schema import contracts, schema_of

    out: dict[str, dict[str, list]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for c in contracts():
            if c.name not in ("CompletionEvent", "FeedbackEvent"):
                continue
            schema = schema_of(c)
            defs = schema.get("$defs", {})
            leaves: dict = {}
            todo = [("", schema)]
            while todo:
                prefix, obj = todo.pop()
                for k, sub in obj.get("properties", {}).items():
                    r = _resolve(sub, defs)
                    path = f"{prefix}{k}"
                    if r.get("type") == "object" and "properties" in r:
                        todo.append((path + ".", r))
                    elif r.get("type") != "object":
                        leaf = {x: y for x, y in r.items() if x not in ("title", "description", "default")}
                        if leaf.get("pattern") == TEXT_PATTERN:
                            # the same rule (no NUL, valid UTF-8: no lone surrogate) as generator options:
                            # drawing against the regex and the length together takes ~5 s per field
                            del leaf["pattern"]
                        strategy = from_schema(leaf, allow_x00=False, codec="utf-8")
                        leaves[path] = st.lists(strategy, min_size=_POOL_N, max_size=_POOL_N)
            out[c.name] = st.fixed_dictionaries(leaves).example()  # one draw: example() costs ~0.1 s a call
    return out


def _set(obj: dict, path: str, value) -> None:
    *head, last = path.split(".")
    for k in head:
        obj = obj.setdefault(k, {}) if isinstance(obj.get(k), dict) or k not in obj else obj[k]
        if not isinstance(obj, dict):
            return
    obj[last] = value


def _dumps(obj) -> bytes:
    # serving's layout (compact, head first); NaN/Infinity as literals; lone surrogates as \u escapes
    return json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()


def hostile(model_name: str, base: dict, pools: dict[str, list], rng: random.Random) -> tuple[bytes, str]:
    """One record of ``model_name`` built from the valid ``base`` with one field changed,
    and the name of that field (``"value"`` for changes to the record as a whole): a value
    drawn from the field's JSON Schema, an edge value for its type, a wrong type, the field
    missing, repeated or nested ``DEEP`` levels, an unknown field."""
    obj = json.loads(json.dumps(base))
    path = rng.choice(sorted(pools))
    top = path.split(".")[0]
    kind = rng.choices(["schema", "edge", "wrong", "missing", "duplicate", "deep", "unknown", "whole"],
                       weights=[30, 30, 10, 6, 6, 2, 4, 2])[0]
    if kind == "schema":
        v = rng.choice(pools[path])
        if path in ("event_id", "completion_id") and _is_uuid(v):
            v = str(uuid.UUID(int=rng.getrandbits(128), version=4))  # a valid id is the record's own, never shared
        _set(obj, path, v)
    elif kind == "edge":
        cur = pools[path][0]
        edges = (INT_EDGES if isinstance(cur, int) and not isinstance(cur, bool) else
                 FLOAT_EDGES + INT_EDGES[:2] if isinstance(cur, float) else
                 STR_EDGES if isinstance(cur, str) else INT_EDGES + FLOAT_EDGES)
        v = rng.choice(edges[:-2] if path.endswith("created_at") else edges) if edges is not STR_EDGES else rng.choice(
            [e for e in STR_EDGES if len(e) < 100] if rng.random() < 0.98 else STR_EDGES)
        _set(obj, path, [v, 1] if isinstance(cur, list) else v)
    elif kind == "wrong":
        _set(obj, path, rng.choice(WRONG_TYPES))
    elif kind == "missing":
        if top in obj:
            del obj[top]
    elif kind == "deep":
        return _dumps(obj)[:-1] + f',"{top}":'.encode() + b"[" * DEEP + b"]" * DEEP + b"}", top
    elif kind == "duplicate":
        return _dumps(obj)[:-1] + f',"{top}":'.encode() + _dumps(obj.get(top)) + b"}", top
    elif kind == "unknown":
        obj["x_unknown"] = 1
        return _dumps(obj), "x_unknown"
    else:
        return rng.choice([b"[]", b"null", b"42", b"\xff\xfe", _dumps(obj)[:50]]), "value"
    return _dumps(obj), top


def _is_uuid(v) -> bool:
    try:
        uuid.UUID(str(v))
    except ValueError:
        return False
    return True


def oracle(model_name: str, raw: bytes, now: int) -> bool:
    """Whether ``raw`` is a valid event under the contract as declared: the pydantic model
    (``model_validate_json``, strict JSON: a lone surrogate escape is not text), one copy of
    every key, and ``created_at`` within ``MAX_FUTURE_SKEW_MS`` of ``now``. Independent of
    the worker's fast paths (head-only parse, regex duplicate check, lenient fallback)."""
    from schemas.events import MAX_FUTURE_SKEW_MS, CompletionEvent, FeedbackEvent

    model = CompletionEvent if model_name == "CompletionEvent" else FeedbackEvent
    try:
        ev = model.model_validate_json(raw)
        pairs = []
        json.loads(raw, object_pairs_hook=lambda kv: pairs.append([k for k, _ in kv]) or dict(kv))
    except (ValueError, RecursionError):
        return False
    if any(len(ks) != len(set(ks)) for ks in pairs):
        return False
    return ev.created_at <= now + MAX_FUTURE_SKEW_MS


def schema_fuzz(n_completions: int, n_feedback: int, seed: int, now: int, pools=None):
    """Hostile records for both topics: ``(completions, feedback)``, each a list of
    ``(key, raw, field changed, valid per the oracle)``; every hostile completion comes with
    a valid vote for it (``(key, raw)`` in the third element returned), produced after it."""
    rng = random.Random(seed)
    pools = pools or schema_pools(seed)
    comps, votes, fb = [], [], []
    for _ in range(n_completions):
        cid = str(uuid.uuid4())
        raw, fld = hostile("CompletionEvent", _completion_obj(cid, created_at=now), pools["CompletionEvent"], rng)
        comps.append((cid.encode(), raw, fld, oracle("CompletionEvent", raw, now)))
        votes.append((cid.encode(), _compact(_vote_obj(cid, created_at=now))))
    for _ in range(n_feedback):
        cid = str(uuid.uuid4())
        raw, fld = hostile("FeedbackEvent", _vote_obj(cid, created_at=now), pools["FeedbackEvent"], rng)
        fb.append((cid.encode(), raw, fld, oracle("FeedbackEvent", raw, now)))
    return comps, fb, votes


def signal_traffic(comps, expected: dict, seed: int):
    """Implicit signals for the voted completions of ``expected`` (the reference join's keys):
    copies, regenerates, edits by kept share, followups (with flips, later) from several users,
    some delivered twice; and signals the default reward policy refuses: a score it does not
    declare (field ``name``), an edit by ``final_text`` on a worker without a tokenizer (field
    ``final_text``). Returns ``(valid in produce order, refused)``."""
    from schemas.events import FeedbackEvent

    rng = random.Random(seed)
    base = now_ms() - 60_000
    valid, refused = [], []
    by_id = {str(c.completion_id): c for c in comps}
    for cid in sorted(expected):
        c = by_id[cid]
        if rng.random() < 0.4:
            continue

        def ev(kind, user, value=None, t=0, **kw):
            return FeedbackEvent(event_id=uuid.UUID(int=rng.getrandbits(128), version=4), completion_id=c.completion_id,
                                 user_hash=user, kind=kind, value=value, created_at=base + t, **kw)
        for u in range(rng.randint(1, 3)):
            kind = rng.choice(["copy", "regenerate", "edit", "followup"])
            value = {"copy": 1, "regenerate": 1, "edit": rng.choice([0.0, 0.25, 0.5, 1.0]),
                     "followup": rng.choice([1, -1])}[kind]
            e = ev(kind, f"user{u}", value, rng.randint(0, 1000))
            valid.append(e)
            if rng.random() < 0.3:
                valid.append(e)  # duplicate delivery
            if kind in ("edit", "followup") and rng.random() < 0.3:  # the user's later judgement wins
                valid.append(ev(kind, f"user{u}", 1 - value if kind == "edit" else -value, e.created_at - base + 5000))
        if rng.random() < 0.2:
            refused.append(ev("score", "user0", 3.0, name="fuzz_score"))
        if rng.random() < 0.2:
            refused.append(ev("edit", "user1", final_text="a user's own words"))
    return valid, refused


def reference_signals(signals) -> dict:
    """Independent of the join: ``{completion_id: (copied, regenerated, kept_share,
    followup, users' last signals)}`` from implicit signals in produce order (dedupe by
    event_id; per user and kind the largest ``(created_at, produce order)`` wins; means over
    users, None when none)."""
    seen, last = set(), {}
    for i, e in enumerate(signals):
        if e.event_id in seen:
            continue
        seen.add(e.event_id)
        k = (str(e.completion_id), e.kind, e.user_hash)
        if k not in last or (e.created_at, i) > last[k][0]:
            last[k] = ((e.created_at, i), e.value)
    out = {}
    for cid in {k[0] for k in last}:
        vals = {kind: [v for (c, kd, _), (_, v) in last.items() if c == cid and kd == kind]
                for kind in ("copy", "regenerate", "edit", "followup")}
        out[cid] = (len(vals["copy"]), len(vals["regenerate"]),
                    sum(vals["edit"]) / len(vals["edit"]) if vals["edit"] else None,
                    sum(vals["followup"]) / len(vals["followup"]) if vals["followup"] else None,
                    sum(map(len, vals.values())))
    return out


def names_field(d, fld: str) -> bool:
    """Whether dead letter ``d`` names the changed field ``fld`` (or a field inside it; a
    change to the record as a whole, or one the JSON decoders refuse outright, e.g. nesting
    beyond their depth or an invalid escape, is named ``value``)."""
    return d.field == fld or d.field.startswith(fld + ".") or d.field == "value"


def run_fuzz(bootstrap: str, home: Path, log: Path, n_valid: int = 400, n_bad_c: int = 300, n_sc: int = 300,
             n_sf: int = 2000, n_records: int = N_RECORDS, seed: int = 11, timeout_s: float = 300,
             seal_after_s: float = 4.0, orphan_ttl_s: float = 8.0) -> dict:
    """Produce valid traffic (``n_valid`` completions with votes, duplicates and flips),
    hand-picked hostile records (``n_bad_c`` completions, the rest of ``n_records`` feedback)
    and records generated from the JSON Schemas (``n_sc`` completions with a vote each,
    ``n_sf`` feedback; :func:`schema_fuzz`), interleaved on both topics, into one real worker
    (``python -m ingest``, home ``home``, log ``log``, ``seal_after_s``/``orphan_ttl_s``: longer
    than the records of one completion take to arrive, or valid votes are dead-lettered as
    late/orphans by design) on the broker at ``bootstrap``; wait until
    every record is decided and check (``AssertionError`` otherwise):

    * the worker never stops;
    * every valid event is in exactly one sample (the reference join), a schema-valid
      completion with its own id and a time inside the label's life is joined with its vote
      (or quarantined, naming the field);
    * every record the contract refuses (:func:`oracle`) is dead-lettered naming the field it
      was changed in; the hand-picked ones per source topic exactly as many as produced;
    * every schema-generated vote is in exactly one sample or dead letter;
    * no shard write failed and was retried (one bad record never holds back another's shard).

    Returns figures: ``records``, ``produced_s``, ``decided_s`` (from the worker's start),
    ``worker_cpu_s``, ``samples``, ``dead``, ``refused``, ``quarantined``."""
    import subprocess
    import sys

    from kafka import KafkaProducer

    from schemas.events import CompletionEvent

    t0 = time.perf_counter()
    rng = random.Random(seed)
    now = now_ms()
    comps, fb = make_traffic(n_valid, seed=seed + 1)
    expected = reference_join(comps, fb)
    sig, sig_refused = signal_traffic(comps, expected, seed + 3)
    want_signals = reference_signals(sig)
    for e in sig:  # a voted completion's sample holds its signals' events too
        expected[str(e.completion_id)][2].add(str(e.event_id))
    n_bad_f = n_records - (len(comps) + len(fb)) - n_bad_c - 2 * n_sc - n_sf
    assert n_bad_f > 1_000, n_bad_f
    bad_c = [bad_completion(rng) for _ in range(n_bad_c)]
    bad_f = [bad_feedback(rng) for _ in range(n_bad_f)]
    sc, sf, sv = schema_fuzz(n_sc, n_sf, seed=seed + 2, now=now)
    assert sum(v for *_, v in sc) > n_sc // 15 and sum(not v for *_, v in sc) > n_sc // 3  # both kinds
    assert sum(v for *_, v in sf) > n_sf // 20 and sum(not v for *_, v in sf) > n_sf // 4
    # a schema-valid completion with its own id and a time inside the label's life must become a
    # sample (or be quarantined, naming the field); others may be dropped, expired or late (their
    # vote then dead-lettered)
    strict = set()
    for k, raw, _, ok in sc:
        if ok:
            ev = CompletionEvent.model_validate_json(raw)
            if str(ev.completion_id) == k.decode() and ev.created_at >= now - 3_000_000:
                strict.add(k.decode())

    p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=1 << 20, max_request_size=4 << 20)
    items = [(topic_names().completions, str(c.completion_id).encode(), c.to_bytes()) for c in comps]
    items += [(topic_names().completions, str(uuid.uuid4()).encode(), v) for v, _ in bad_c]
    items += [(topic_names().feedback, b"fuzz", v) for v in bad_f]
    items += [(topic_names().completions, k, raw) for k, raw, _, _ in sc] + [(topic_names().feedback, k, raw) for k, raw, _, _ in sf]
    rng.shuffle(items)  # valid and adversarial records interleaved on every partition
    for t, k, v in items:
        p.send(t, key=k, value=v)
    p.flush()
    for e in fb + sig + sig_refused:  # votes after their completions (no orphans among the valid events)
        p.send(topic_names().feedback, key=str(e.completion_id).encode(), value=e.to_bytes())
    for _, vote in bad_c:
        if vote is not None:
            p.send(topic_names().feedback, key=json.loads(vote)["completion_id"].encode(), value=vote)
    for k, vote in sv:
        p.send(topic_names().feedback, key=k, value=vote)
    p.flush()
    p.close()
    records = len(items) + len(fb) + len(sig) + len(sig_refused) + sum(1 for _, v in bad_c if v is not None) + len(sv)
    produced_s = time.perf_counter() - t0

    # (no tokenizer: an edit's final_text is refused; none of the machine's model directories)
    env = dict(os.environ, FLYWHEEL_HOME=str(home), FLYWHEEL_KAFKA_BOOTSTRAP=bootstrap, PYTHONPATH=str(ROOT),
               FLYWHEEL_MODEL_DIR=str(home / "no-model"))
    env = {k: v for k, v in env.items() if not k.startswith("FLYWHEEL_REWARD__") and k != "FLYWHEEL_STORE"}
    t_start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ingest", "--seal-after-s", str(seal_after_s), "--orphan-ttl-s", str(orphan_ttl_s),
         "--tick-s", "0.5"],
        cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent())
    samples_dir = home / "data" / "samples"
    want_dead = Counter({topic_names().feedback: n_bad_f + n_sf, topic_names().completions: n_bad_c})
    want_dead[topic_names().feedback] += sum(1 for _, v in bad_c if v is not None)  # a bad body's vote
    want_dead[topic_names().feedback] += len(sig_refused)  # refused by the reward policy
    sc_keys = {k.decode() for k, *_ in sc}
    sv_eids = [json.loads(v)["event_id"] for _, v in sv]

    def outcome():
        from samplestore.catalog import read_samples

        samples = read_samples(samples_dir) if any(samples_dir.glob("**/*.parquet")) else []
        return samples, read_dead(bootstrap), {e for s in samples for e in s.event_ids}

    state: dict = {}

    def done():
        samples, dead, in_samples = outcome()
        n = Counter(d.source_topic for d in dead if d.key not in sc_keys)
        votes_dead = sum(1 for d in dead if d.source_topic == topic_names().feedback and d.key in sc_keys)
        state.update(dead=dict(n), want=dict(want_dead), missing_samples=len(set(expected) - {
            str(s.completion_id) for s in samples}), schema_votes=sum(e in in_samples for e in sv_eids) + votes_dead)
        return (all(n[t] >= m for t, m in want_dead.items()) and not state["missing_samples"]
                and state["schema_votes"] >= n_sc)

    try:
        try:
            wait_for(done, timeout_s, "every sample and every dead letter", proc, log)
        except AssertionError as exc:
            raise AssertionError(f"{state} (schema votes wanted {n_sc}); {str(exc)[-1500:]}") from None
        decided_s = time.perf_counter() - t_start
        time.sleep(2)  # anything more (a second copy) would show now
        assert proc.poll() is None, "the worker stopped"
    finally:
        worker_cpu_s = _cpu_s(proc.pid)
        stop(proc)
    samples, dead, in_samples = outcome()
    by_cid = {str(s.completion_id): s for s in samples}
    for (k, *_), eid in zip(sc, sv_eids):  # schema-generated completions joined: each with its one vote
        if k.decode() in by_cid:
            expected[k.decode()] = (1, 0, {eid})
    check(samples_dir, expected)  # every valid event in exactly one sample
    for cid, (copied, regenerated, kept, follow, n) in want_signals.items():  # each signal in its column
        smp = by_cid[cid]
        assert (smp.copied, smp.regenerated, smp.n_votes) == (copied, regenerated, smp.votes_up + smp.votes_down + n)
        assert (smp.kept_share, smp.followup) == (pytest.approx(kept), pytest.approx(follow)), cid
    refused_ids = {str(e.event_id): "name" if e.kind == "score" else "final_text" for e in sig_refused}
    got_refused = {json.loads(d.payload)["event_id"]: d.field for d in dead
                   if d.source_topic == topic_names().feedback and d.key in {str(e.completion_id) for e in sig_refused}
                   and '"event_id"' in d.payload and json.loads(d.payload).get("event_id") in refused_ids}
    assert got_refused == refused_ids
    others = [d for d in dead if d.key not in sc_keys]
    assert Counter(d.source_topic for d in others) == want_dead
    assert all(d.field and d.reason for d in dead)
    fields = Counter(d.field for d in others if d.source_topic == topic_names().feedback)
    for f in ("value", "created_at", "schema_version", "extra_field"):
        assert fields[f] > 0, (f, fields)
    dead_by_key: dict = {}
    for d in dead:
        dead_by_key.setdefault((d.source_topic, d.key), []).append(d)
    quarantined = 0
    for (k, raw, fld, ok), eid in zip(sc, sv_eids):
        cid = k.decode()
        dc = dead_by_key.get((topic_names().completions, cid), [])
        df = [d for d in dead_by_key.get((topic_names().feedback, cid), []) if eid in d.payload]
        assert len(dc) <= 1 and not (dc and cid in by_cid), (cid, fld, dc)
        if not ok:  # refused: dead-lettered once, naming the changed field
            assert len(dc) == 1 and names_field(dc[0], fld), (fld, raw[:300], dc)
        elif dc:  # valid under the contract, refused by the shard: quarantined, naming the field
            assert names_field(dc[0], fld) and dc[0].reason.startswith("unwritable sample:"), dc
            quarantined += 1
        elif cid in strict:
            assert cid in by_cid, (fld, raw[:300])
        assert (eid in in_samples) + len(df) == 1, (cid, fld, df)  # its vote: one sample or dead letter
    for k, raw, fld, ok in sf:  # one dead letter each: refused, or an orphan (no such completion)
        df = dead_by_key.get((topic_names().feedback, k.decode()), [])
        assert len(df) == 1, (fld, raw[:300], df)
        if not ok:
            assert names_field(df[0], fld), (fld, raw[:300], df)
        else:  # no such completion, refused by the reward policy (a kind of weight 0, a score it does not
            # declare or outside its range, an edit's final_text without a tokenizer), or older than the horizon
            assert df[0].reason.startswith(("orphan:", "expired:")) or df[0].field in ("kind", "name", "value",
                                                                                        "final_text"), (fld, raw[:300], df)
    assert "labels released" not in log.read_text(errors="replace"), "a shard write failed and was retried"
    return {"records": records, "produced_s": produced_s, "decided_s": decided_s, "worker_cpu_s": worker_cpu_s,
            "samples": len(samples), "dead": len(dead), "quarantined": quarantined,
            "refused": sum(not ok for *_, ok in sc) + sum(not ok for *_, ok in sf) + n_bad_c + n_bad_f}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all threads; 0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError):
        return 0.0


@pytest.mark.timeout(420)
def test_fuzzed_topics_never_stop_the_join_and_lose_nothing(broker, fw_home, tmp_path):
    """CI-sized :func:`run_fuzz`: 5,000 records (200 valid completions with their votes, 150
    hand-picked and 150 schema-generated hostile completions, 1,000 schema-generated and the
    rest hand-picked hostile feedback). ``python bench/ingest.py --fuzz 50000`` runs it at
    benchmark size."""
    r = run_fuzz(broker.bootstrap, fw_home, tmp_path / "worker.log", n_valid=200, n_bad_c=150, n_sc=150, n_sf=1000,
                 n_records=5_000)
    print(f"fuzz figures: {r}")
    assert r["records"] >= 5_000
