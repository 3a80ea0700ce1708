"""Rollout controller, ledger, admin client and on-call CLI against a real HTTP admin server.

The admin server below is a minimal real FastAPI/uvicorn implementation of
``schemas/admin.py`` backed by a real ModelStore (the stand-in for serving, which is not
under test here); votes come from real Parquet shards; the ledger is a real DuckDB file
and decisions go to a real Tansu broker.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import typer
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse
from typer.testing import CliRunner

from deploy import ledger
from deploy.analysis import AnalysisConfig
from deploy.commands import register
from deploy.controller import ControllerConfig, RolloutController, RolloutPhase
from samplestore.votes import canary_counts
from modelstore.desired import FleetRecord
from deploy.serving_client import ServingAdmin, ServingAdminError
from modelstore.store import CorruptVersionError, ModelStore
from flywheel.broker import free_port
from schemas import settings
from schemas.admin import LoadRequest, RollbackRequest, SlotInfo, SlotsStatus, WeightRequest
from schemas.arrow import samples_to_table
from schemas.events import RewardedSample, SamplingParams
from schemas.manifest import digest_of_hashes, state_sha256
from schemas.pod_target import PodState, PodTarget
from schemas.settings import topic_names
DEPLOYMENTS = topic_names().deployments

TOKEN = "s3cret"


# --------------------------------------------------------------------- fake serving admin
def make_admin_app(store: ModelStore) -> FastAPI:
    app = FastAPI()
    st: dict = {"candidate": None, "weight": 0.0, "pause": None}

    def slot(version: str) -> tuple[SlotInfo, dict]:
        t0 = time.perf_counter()
        try:
            state = store.load(version)
        except CorruptVersionError as exc:
            raise HTTPException(409, f"load {version} failed: {exc}") from exc
        except KeyError as exc:
            raise HTTPException(404, f"version {version} not in store") from exc
        return SlotInfo(version=version, weights_digest=digest_of_hashes(state_sha256(state)),
                        loaded_at=int(time.time() * 1000), load_ms=(time.perf_counter() - t0) * 1e3), state

    st["stable"], _ = slot("v000000")

    def auth(req: Request):
        if req.headers.get("authorization") != f"Bearer {TOKEN}":
            raise HTTPException(401, "bad admin token")

    def status() -> SlotsStatus:
        return SlotsStatus(pod="test-pod", stable=st["stable"], candidate=st["candidate"],
                           candidate_weight=st["weight"], last_swap_pause_ms=st["pause"])

    @app.get("/admin/slots")
    def slots(req: Request) -> SlotsStatus:
        auth(req)
        return status()

    @app.post("/admin/load")
    def load(body: LoadRequest, req: Request) -> SlotsStatus:
        auth(req)
        st["candidate"], _ = slot(body.version)
        st["weight"] = 0.0
        return status()

    @app.post("/admin/weight")
    def weight(body: WeightRequest, req: Request) -> SlotsStatus:
        auth(req)
        if st["candidate"] is None:
            raise HTTPException(409, "no candidate loaded")
        st["weight"] = body.candidate_weight
        return status()

    @app.post("/admin/promote")
    def promote(req: Request) -> SlotsStatus:
        auth(req)
        if st["candidate"] is None:
            raise HTTPException(409, "no candidate loaded")
        t0 = time.perf_counter()
        st["stable"], st["candidate"], st["weight"] = st["candidate"], None, 0.0
        st["pause"] = (time.perf_counter() - t0) * 1e3
        return status()

    @app.post("/admin/rollback")
    def rollback(body: RollbackRequest, req: Request) -> SlotsStatus:
        auth(req)
        if body.version:
            st["stable"], _ = slot(body.version)
        st["candidate"], st["weight"] = None, 0.0
        return status()

    # the declarative target (schemas/pod_target.py), what the controller calls
    st.update(gen=0, target=None, error=None, actions=[])

    def state() -> PodState:
        t = st["target"]
        s = status()
        conv = t is not None and s.stable.version == t.stable and \
            (s.candidate.version if s.candidate else None) == t.candidate and s.candidate_weight == t.weight
        return PodState(pod=s.pod, generation=st["gen"], target_generation=t.generation if t else 0, converged=conv,
                        error=st["error"], actions=st["actions"], slots=s)

    @app.put("/admin/desired")
    def put_desired(body: PodTarget, req: Request) -> PodState:
        auth(req)
        return apply(body)

    def apply(body: PodTarget) -> PodState:
        if st["target"] is not None and body.generation < st["target"].generation:
            raise HTTPException(409, f"generation: {body.generation} is older than generation "
                                     f"{st['target'].generation}, which this pod has taken")
        st["target"], actions = body, []
        try:
            cand = st["candidate"].version if st["candidate"] else None
            if st["stable"].version != body.stable:
                if cand == body.stable:
                    t0 = time.perf_counter()
                    st["stable"] = st["candidate"]
                    st["pause"] = (time.perf_counter() - t0) * 1e3
                    actions.append("promote")
                else:
                    st["stable"], _ = slot(body.stable)
                    actions.append(f"rollback to {body.stable}")
                st["candidate"], st["weight"], cand = None, 0.0, None
            elif body.reload_after_ms and st["stable"].loaded_at < body.reload_after_ms:
                st["stable"], _ = slot(body.stable)
                st["candidate"], st["weight"], cand = None, 0.0, None
                actions.append(f"reload {body.stable}")
            if cand is not None and cand != body.candidate:
                actions.append(f"drop {cand}")
                st["candidate"], st["weight"], cand = None, 0.0, None
            if body.candidate is not None and cand != body.candidate:
                st["candidate"], _ = slot(body.candidate)
                actions.append(f"load {body.candidate}")
            if st["weight"] != body.weight:
                st["weight"] = body.weight
                actions.append(f"weight {body.weight:g}")
        except HTTPException as exc:
            st["error"], st["actions"] = str(exc.detail), actions
            raise
        st["gen"], st["error"], st["actions"] = body.generation, None, actions
        return state()

    @app.get("/admin/desired")
    def get_desired(req: Request) -> PodState:
        auth(req)
        return state()

    def watch(poll_s: float = 0.1) -> None:
        """Watch the store's desired-state record as a real pod does (serving.pod.DesiredWatch)."""
        from modelstore.desired import FleetRecord

        def run():
            while not app.state.stop.wait(poll_s):
                d = FleetRecord(store).read()
                t = st["target"]
                if d.generation and (t is None or d.generation > t.generation):
                    try:
                        apply(PodTarget(generation=d.generation, stable=d.stable, candidate=d.candidate,
                                        weight=d.weight, reload_after_ms=d.reload_after_ms))
                    except HTTPException:
                        pass  # the state's error says why; retried at the next generation
        threading.Thread(target=run, daemon=True).start()

    app.state.stop = threading.Event()
    app.state.watch = watch
    app.state.metrics_text = "flywheel_requests_total 0\n"  # tests replace it

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(app.state.metrics_text)

    return app


def start_admin_server(store: ModelStore):
    """Run the admin app on a free port in a thread; returns (url, stop)."""
    port = free_port()
    app = make_admin_app(store)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)

    def stop():
        app.state.stop.set()
        server.should_exit = True
        th.join(10)

    stop.app = app
    return f"http://127.0.0.1:{port}", stop


@pytest.fixture()
def env(tmp_path, tiny_moe_dir, fw_home, broker_env, monkeypatch):
    store = ModelStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)
    url, stop = start_admin_server(store)
    monkeypatch.setenv("FLYWHEEL_STORE", str(store.root))
    monkeypatch.setenv("FLYWHEEL_SAMPLES", str(tmp_path / "samples"))
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", url)
    monkeypatch.setenv("FLYWHEEL_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("USER", "oncall-alice")
    ns = type("Env", (), {})()
    ns.store, ns.url, ns.samples, ns.broker = store, url, tmp_path / "samples", broker_env
    ns.app = stop.app
    ns.ledger, ns.status = settings.ledger_path(), fw_home / "deploy" / "rollout.json"  # the CLI's ledger too
    ns.admin = ServingAdmin(url, TOKEN)
    yield ns
    ns.admin.close()
    stop()


def _last_decision(env):
    """The last ledger row that is a decision (not an operator command's FLEET_* observation)."""
    return [d for d in ledger.decisions(env.ledger) if not d.decision.startswith("FLEET_")][-1]


def publish_v(store: ModelStore, parent: str, scale: float = 1.0001):
    state = store.load(parent)
    for v in state.values():
        if v.is_floating_point():
            v.mul_(scale)
    return store.publish(state, parent, metrics={"kto/loss": 0.5})


def write_votes(samples: Path, version: str, up: int, down: int, created_at: int, tokens: int = 1,
                finish_reason: str = "stop") -> None:
    rows = []
    for i in range(up + down):
        good = i < up
        rows.append(RewardedSample(
            completion_id=uuid.uuid4(), model_version=version, created_at=created_at, user_hash=f"u{i}",
            prompt_token_ids=[1, 2], completion_token_ids=[3] * tokens, behavior_logprobs=[-0.5] * tokens,
            sampling=SamplingParams(), finish_reason=finish_reason, reward=1.0 if good else -1.0, label=good,
            n_votes=1, votes_up=int(good), votes_down=int(not good), event_ids=[str(uuid.uuid4())],
            sealed_at=created_at))
    d = samples / f"model_version={version}" / "date=2026-11-30"
    d.mkdir(parents=True, exist_ok=True)
    pq.write_table(samples_to_table(rows), d / f"part-{uuid.uuid4().hex}.parquet")


class Clock:
    def __init__(self):
        self.t = int(time.time() * 1000)

    def __call__(self):
        return self.t


def controller(env, clock, **cfg) -> RolloutController:
    """A fresh controller object each time: state lives only in the persisted record."""
    # a wide relative margin (0.6, tau 1.0 on the log ratio) so that the few votes a test writes
    # can pass the sequential test (12/25 vs 11/25), and 8/48 vs 28/48 fails it
    analysis = AnalysisConfig(min_votes=cfg.pop("min_votes", 20), delta=cfg.pop("delta", 0.6), tau=1.0,
                              failure_limit=cfg.pop("failure_limit", 1))
    return RolloutController(env.store, env.admin, env.samples, env.ledger, env.status,
                             ControllerConfig(analysis=analysis, **cfg), bootstrap=env.broker.bootstrap,
                             clock=clock)


def deployments_on_kafka(bootstrap: str, n: int, timeout_s: float = 15.0) -> list[tuple[str, dict]]:
    from kafka import KafkaConsumer

    c = KafkaConsumer(DEPLOYMENTS, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                      consumer_timeout_ms=1000)
    out: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < n and time.monotonic() < deadline:
            for m in c:
                out.append((m.key.decode(), json.loads(m.value)))
    finally:
        c.close()
    return out


# --------------------------------------------------------------------------- tests
def test_good_candidate_is_canaried_and_promoted(env):
    m1 = publish_v(env.store, "v000000")
    clock = Clock()
    st = controller(env, clock, steps=(0.25, 0.5, 1.0)).reconcile()
    assert (st.phase, st.candidate, st.stable, st.weight) == (RolloutPhase.CANARY, "v000001", "v000000", 0.25)
    s = env.admin.slots()
    assert s.candidate.version == "v000001" and s.candidate_weight == 0.25
    assert s.candidate.weights_digest == m1.weights_digest  # hashes verified on the serving side
    # no votes yet: holds, never promotes on empty data
    clock.t += 1000
    st = controller(env, clock, steps=(0.25, 0.5, 1.0)).reconcile()
    assert st.phase == RolloutPhase.CANARY and st.last_outcome == "HOLD" and "too few votes" in st.last_reason
    write_votes(env.samples, "v000001", 12, 13, clock.t)
    write_votes(env.samples, "v000000", 11, 14, clock.t)
    clock.t += 1000
    st = controller(env, clock, steps=(0.25, 0.5, 1.0)).reconcile()
    assert (st.last_outcome, st.step, st.weight) == ("ADVANCE", 1, 0.5)
    assert env.admin.slots().candidate_weight == 0.5
    clock.t += 1000
    # serving restarted and lost its candidate: the controller re-loads it at the same weight
    env.admin.rollback()
    # step 1 needs new candidate votes of its own
    st = controller(env, clock, steps=(0.25, 0.5, 1.0)).reconcile()
    assert env.admin.slots().candidate.version == "v000001" and env.admin.slots().candidate_weight == 0.5
    assert st.last_outcome == "HOLD" and "0 new candidate votes" in st.last_reason
    write_votes(env.samples, "v000001", 10, 10, clock.t + 1)
    st = controller(env, clock, steps=(0.25, 0.5, 1.0)).reconcile()  # 50 % was the last analysed share
    assert st.phase == RolloutPhase.PROMOTED and st.phase.is_terminal()
    s = env.admin.slots()
    assert s.stable.version == "v000001" and s.candidate is None
    assert s.stable.weights_digest == m1.weights_digest
    assert [h.status for h in env.store.manifest("v000001").status_history] == ["published", "canary", "promoted"]
    rows = ledger.decisions(env.ledger, version="v000001")
    assert [r.decision for r in rows] == ["START", "HOLD", "ADVANCE", "RELOAD", "HOLD", "PROMOTE"]
    promote = rows[-1].numbers["thumbs_up"]
    # 22/45 vs 11/25 over the whole canary, counted independently here
    assert (promote["candidate_up"], promote["candidate_votes"], promote["stable_up"], promote["stable_votes"]) == (22, 45, 11, 25)
    final = ledger.Ledger(env.ledger).final_decision("v000001")
    assert final["decision"] == "PROMOTE" and final["numbers"]["swap_pause_ms"] >= 0
    msgs = deployments_on_kafka(env.broker.bootstrap, 6)
    assert [(k, v["decision"]) for k, v in msgs] == [
        ("v000001", d) for d in ["START", "HOLD", "ADVANCE", "RELOAD", "HOLD", "PROMOTE"]]
    # idle afterwards: nothing newer than stable
    st = controller(env, clock, steps=(0.25, 0.5, 1.0)).reconcile()
    assert st.phase == RolloutPhase.PROMOTED and env.admin.slots().stable.version == "v000001"


def test_worse_candidate_is_rolled_back(env):
    publish_v(env.store, "v000000")
    clock = Clock()
    controller(env, clock).reconcile()
    write_votes(env.samples, "v000001", 8, 32, clock.t + 1)  # 0.20
    write_votes(env.samples, "v000000", 20, 20, clock.t + 1)  # 0.50
    st = controller(env, clock).reconcile()  # relative [-85.5 %, +17.6 %]: not surely worse yet
    assert st.phase == RolloutPhase.CANARY and st.last_outcome == "HOLD" and "undecided" in st.last_reason
    write_votes(env.samples, "v000001", 0, 8, clock.t + 1)  # 8/48 vs ...
    write_votes(env.samples, "v000000", 8, 0, clock.t + 1)  # ... 28/48: upper bound < 0
    st = controller(env, clock).reconcile()
    assert st.phase == RolloutPhase.ROLLED_BACK and st.last_outcome == "ROLLBACK"
    assert "candidate surely worse" in st.last_reason and st.decided_by == "sequential_test"
    s = env.admin.slots()
    assert s.candidate is None and s.stable.version == "v000000"
    assert env.store.manifest("v000001").status_history[-1].status == "rolled_back"
    last = ledger.decisions(env.ledger)[-1]
    assert last.decision == "ROLLBACK" and last.numbers["thumbs_up"]["check"] == "FAIL"
    # a rolled-back version is never canaried again
    st = controller(env, clock).reconcile()
    assert env.admin.slots().candidate is None and st.phase == RolloutPhase.ROLLED_BACK


def test_corrupt_candidate_fails_to_load_and_slots_stay(env):
    publish_v(env.store, "v000000")
    p = env.store.root / "versions" / "v000001" / "payload.bin"
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    p.write_bytes(bytes(raw))
    env.store.clear_cache()
    before = env.admin.slots()
    st = controller(env, Clock()).reconcile()
    assert st.phase == RolloutPhase.FAILED and "could not load v000001" in st.last_reason
    assert "checksum" in st.last_reason
    after = env.admin.slots()
    assert after.candidate is None and after.stable == before.stable
    assert ledger.decisions(env.ledger)[-1].decision == "FAILED"
    with pytest.raises(ServingAdminError) as ei:
        env.admin.load("v000001")
    assert ei.value.status == 409 and "checksum" in ei.value.reason


def test_deadline_outcome_rollback_by_default_and_promote_when_configured(env):
    publish_v(env.store, "v000000")
    clock = Clock()
    kw = dict(steps=(0.25, 0.5, 1.0), step_deadline_s=600, delta=0.1)
    controller(env, clock, **kw).reconcile()
    write_votes(env.samples, "v000001", 12, 13, clock.t + 1)  # 25 votes per arm: undecided at delta 0.1
    write_votes(env.samples, "v000000", 11, 14, clock.t + 1)
    clock.t += 599_000
    st = controller(env, clock, **kw).reconcile()
    assert st.last_outcome == "HOLD" and "undecided" in st.last_reason
    clock.t += 2_000
    st = controller(env, clock, deadline_outcome="promote", **kw).reconcile()
    assert st.last_outcome == "ADVANCE" and "deadline outcome promote" in st.last_reason and st.weight == 0.5
    last = ledger.decisions(env.ledger)[-1]
    assert last.numbers["decided_by"] == "deadline"
    clock.t += 601_000  # step 1 stays undecided past its deadline: the default rolls back
    st = controller(env, clock, **kw).reconcile()
    assert st.phase == RolloutPhase.ROLLED_BACK and "deadline outcome rollback" in st.last_reason
    assert st.decided_by == "deadline" and env.admin.slots().candidate is None


def test_a_candidate_that_games_length_fails_a_guard_despite_more_thumbs(env):
    """Reward hacking: the candidate's replies are 4x longer and all cut at max_tokens. Its
    thumbs-up rate is higher, but the guards (read from the sample shards) roll it back."""
    publish_v(env.store, "v000000")
    clock = Clock()
    controller(env, clock, steps=(0.5, 1.0)).reconcile()
    write_votes(env.samples, "v000001", 30, 10, clock.t + 1, tokens=40, finish_reason="length")
    write_votes(env.samples, "v000000", 20, 20, clock.t + 1, tokens=10)
    st = controller(env, clock, steps=(0.5, 1.0)).reconcile()
    assert st.phase == RolloutPhase.ROLLED_BACK and st.decided_by == "guard", st.last_reason
    nums = ledger.decisions(env.ledger)[-1].numbers
    assert nums["completion_length"]["check"] == "FAIL" and nums["completion_length"]["ratio"] == pytest.approx(4.0)
    assert nums["truncated"]["check"] == "FAIL" and nums["truncated"]["candidate_share"] == 1.0
    assert nums["thumbs_up"]["check"] == "PASS"  # the naive reward alone would have promoted it


def test_deadline_never_promotes_on_empty_data(env):
    """deadline_outcome=promote still needs min_votes on both arms; else the step rolls back."""
    publish_v(env.store, "v000000")
    clock = Clock()
    kw = dict(steps=(0.5, 1.0), step_deadline_s=60, deadline_outcome="promote")
    controller(env, clock, **kw).reconcile()
    write_votes(env.samples, "v000001", 30, 0, clock.t + 1)  # candidate only: stable arm empty
    clock.t += 61_000
    st = controller(env, clock, **kw).reconcile()
    assert st.phase == RolloutPhase.ROLLED_BACK and "too few votes" in st.last_reason, st.last_reason
    assert env.admin.slots().candidate is None


def test_vote_counts_by_version_since(env):
    B = 1_700_000_000_000  # event times are ms since the epoch (schemas.events bounds)
    write_votes(env.samples, "v000001", 3, 1, B + 1000)
    write_votes(env.samples, "v000001", 2, 2, B + 5000)
    write_votes(env.samples, "v000000", 0, 4, B + 5000)
    assert canary_counts(env.samples, B, B).votes == {"v000001": (5, 3, 8), "v000000": (0, 4, 4)}
    assert canary_counts(env.samples, B + 2000, B + 2000).votes == {"v000001": (2, 2, 4), "v000000": (0, 4, 4)}
    assert canary_counts(env.samples / "nothing", 0, 0).votes == {}


def test_canary_counts_by_hand(env):
    """The controller's one query per poll: votes since the canary, votes since the step,
    guard figures and splits, each counted by hand from the shards written here."""
    B = 1_700_000_000_000  # event times are ms since the epoch (schemas.events bounds)
    write_votes(env.samples, "v000001", 3, 1, B + 1000, tokens=2)
    write_votes(env.samples, "v000001", 2, 2, B + 5000, tokens=40, finish_reason="length")
    write_votes(env.samples, "v000001", 1, 0, B + 9000, tokens=7)
    write_votes(env.samples, "v000000", 0, 4, B + 5000, tokens=1)
    write_votes(env.samples, "v000002", 2, 0, B + 9500, tokens=3)
    cc = canary_counts(env.samples, B + 2000, B + 8000)
    assert cc.votes == {"v000001": (3, 2, 5), "v000000": (0, 4, 4), "v000002": (2, 0, 2)}
    assert cc.step_votes == {"v000001": (1, 0), "v000002": (2, 0)}
    # v000001 since 2000: 4 replies of 40 tokens cut at max_tokens and 1 of 7; v000000: four
    # 1-token replies (no answer); v000002: two of 3 tokens
    assert cc.guards == {"v000001": {"completions": 5, "completion_tokens": 167, "no_answer": 0, "truncated": 4,
                                     "truncated_tokens": 160},
                         "v000000": {"completions": 4, "completion_tokens": 4, "no_answer": 4, "truncated": 0,
                                     "truncated_tokens": 0},
                         "v000002": {"completions": 2, "completion_tokens": 6, "no_answer": 0, "truncated": 0,
                                     "truncated_tokens": 0}}
    assert cc.by_split == {"train": {"v000001": (3, 5), "v000000": (0, 4), "v000002": (2, 2)}}
    assert canary_counts(env.samples / "nothing", 0, 0) == type(cc)()


def test_admin_client_errors(env):
    bad = ServingAdmin(env.url, "wrong")
    with pytest.raises(ServingAdminError) as ei:
        bad.slots()
    assert ei.value.status == 401 and "bad admin token" in ei.value.reason
    with pytest.raises(ServingAdminError, match="no candidate loaded"):
        env.admin.promote()
    with pytest.raises(ValueError, match="candidate_weight"):
        env.admin.set_weight(1.5)
    with pytest.raises(ServingAdminError) as ei:
        ServingAdmin(f"http://127.0.0.1:{free_port()}").slots()
    assert ei.value.status == 0
    assert "flywheel_requests_total" in env.admin.metrics_text()


def test_cli_status_versions_promote_rollback(env):
    env.app.state.watch()  # the pod converges to the record by itself: no controller runs here
    app = typer.Typer()
    register(app)
    run = CliRunner().invoke
    m1 = publish_v(env.store, "v000000")
    r = run(app, ["controller", "--once", "--steps", "0.25,1", "--min-votes", "5"])
    assert r.exit_code == 0, r.output
    assert "phase=canary" in r.output
    r = run(app, ["status", "--json"])
    j = json.loads(r.output)
    assert j["serving"]["candidate"]["version"] == "v000001" and j["serving"]["candidate_weight"] == 0.25
    assert j["rollout"]["phase"] == "canary" and [d["decision"] for d in j["decisions"]] == ["START", "HOLD"]
    r = run(app, ["status"])
    assert r.exit_code == 0 and "v000001" in r.output and "START" in r.output
    r = run(app, ["versions", "--json"])
    vs = json.loads(r.output)
    assert [v["version"] for v in vs] == ["v000000", "v000001"] and vs[1]["kind"] == "delta"
    assert vs[1]["delta_ratio"] == pytest.approx(m1.snapshot_bytes / m1.size_bytes)
    # confirmation is required without --yes
    r = run(app, ["promote"], input="n\n")
    assert r.exit_code == 1 and env.admin.slots().candidate is not None
    r = run(app, ["promote", "--yes"])
    assert r.exit_code == 0, r.output
    assert env.admin.slots().stable.weights_digest == m1.weights_digest
    assert json.loads(run(app, ["status", "--json"]).output)["rollout"]["phase"] == "promoted"
    # rollback with no candidate: restore the previous promoted version (v0) by hashes
    v0_digest = env.store.manifest("v000000").weights_digest
    r = run(app, ["rollback", "--yes"])
    assert r.exit_code == 0, r.output
    s = env.admin.slots()
    assert s.stable.version == "v000000" and s.stable.weights_digest == v0_digest
    last = _last_decision(env)
    assert (last.decision, last.actor, last.version, last.stable) == ("MANUAL_ROLLBACK", "oncall-alice", "v000000", "v000001")
    assert env.store.manifest("v000001").status_history[-1].status == "rolled_back"
    # no older promoted version left: a clear error
    r = run(app, ["rollback", "--yes"])
    assert r.exit_code == 1 and "no earlier stable version than v000000" in " ".join(r.output.split())
    # the fleet's candidate (here started by an operator's canary start) is dropped by rollback
    publish_v(env.store, "v000001")
    assert run(app, ["canary", "start", "v000002", "--yes"]).exit_code == 0
    assert run(app, ["controller", "--once", "--steps", "0.25,1"]).exit_code == 0
    assert env.admin.slots().candidate.version == "v000002"
    r = run(app, ["rollback", "--yes"])
    assert r.exit_code == 0 and "dropped candidate v000002" in r.output, r.output
    assert env.admin.slots().candidate is None
    # a candidate loaded by hand on a pod, outside the desired state, is drift: the controller drops it
    env.admin.load("v000002")
    assert run(app, ["controller", "--once", "--steps", "0.25,1"]).exit_code == 0
    assert env.admin.slots().candidate is None
    r = run(app, ["rollback", "--to", "v000009", "--yes"])
    assert r.exit_code == 1 and "v000009" in r.output
    r = run(app, ["controller", "--once", "--steps", "0.5,0.4,1"])
    assert r.exit_code == 2 and "steps" in r.output
    r = run(app, ["controller", "--once", "--steps", "1"])  # nothing left to compare at 100 % alone
    assert r.exit_code == 2 and "share below 1.0" in r.output


def test_two_pods_promote_to_the_same_hashes(env, tmp_path):
    m1 = publish_v(env.store, "v000000")
    url2, stop2 = start_admin_server(ModelStore(env.store.root))  # second pod, same store
    pod2 = ServingAdmin(url2, TOKEN)
    try:
        clock = Clock()
        ctl = lambda: RolloutController(env.store, [env.admin, pod2], env.samples, env.ledger, env.status,
                                        ControllerConfig(steps=(0.5, 1.0), analysis=AnalysisConfig(
                                            min_votes=5, delta=0.9, tau=0.3, min_guard_completions=5)),
                                        clock=clock)
        st = ctl().reconcile()
        assert st.phase == RolloutPhase.CANARY
        assert [a.slots().candidate_weight for a in (env.admin, pod2)] == [0.5, 0.5]
        write_votes(env.samples, "v000001", 5, 1, clock.t)
        write_votes(env.samples, "v000000", 5, 1, clock.t)
        st = ctl().reconcile()
        assert st.phase == RolloutPhase.PROMOTED, st.last_reason
        for a in (env.admin, pod2):
            s = a.slots()
            assert s.stable.version == "v000001" and s.stable.weights_digest == m1.weights_digest
    finally:
        pod2.close()
        stop2()


def test_pod_that_fails_to_load_aborts_the_rollout(env, tmp_path):
    import shutil

    publish_v(env.store, "v000000")
    bad_root = tmp_path / "store-pod2"
    shutil.copytree(env.store.root, bad_root)
    p = bad_root / "versions" / "v000001" / "payload.bin"
    p.write_bytes(p.read_bytes()[:-50])  # pod 2 sees a truncated delta
    url2, stop2 = start_admin_server(ModelStore(bad_root))
    pod2 = ServingAdmin(url2, TOKEN)
    try:
        st = RolloutController(env.store, [env.admin, pod2], env.samples, env.ledger, env.status,
                               clock=Clock()).reconcile()
        assert st.phase == RolloutPhase.FAILED
        assert url2 in st.last_reason and "truncated" in st.last_reason
        assert env.admin.slots().candidate is None and pod2.slots().candidate is None  # pod 1 dropped it too
        assert ledger.decisions(env.ledger)[-1].numbers["pod"].startswith(url2)
    finally:
        pod2.close()
        stop2()


def test_ledger_waits_for_another_process_holding_the_lock(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "ledger.duckdb"
    ledger.record(path, ledger.LedgerEntry(version="v000001", stable="v000000", step=0, weight=0.05,
                                           decision="START", reason="first"))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); print('held', flush=True); "
        "time.sleep(1.5); c.close()"), str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        ledger.record(path, ledger.LedgerEntry(version="v000001", stable="v000000", step=1, weight=0.25,
                                               decision="ADVANCE", reason="second", numbers={"z": 0.5}))
        waited = time.monotonic() - t0
    finally:
        holder.wait(10)
    assert waited > 0.5  # it really had to wait for the other process's lock
    rows = ledger.decisions(path)
    assert [(r.decision, r.step, r.numbers) for r in rows] == [("START", 0, {}), ("ADVANCE", 1, {"z": 0.5})]


def test_canary_abort_and_start_act_on_the_pod_and_the_controller_carries_on(env):
    """`canary abort|start` change the desired state and the pod before they return; the
    controller analyses and advances a canary the operator started, and does not restart one
    the operator aborted."""
    env.app.state.watch()  # the pod converges to the record by itself between controller steps
    app = typer.Typer()
    register(app)
    run = CliRunner().invoke
    publish_v(env.store, "v000000")
    r = run(app, ["canary", "abort", "--yes"])
    assert r.exit_code == 1 and "no canary in progress" in r.output
    clock = Clock()
    controller(env, clock).reconcile()
    assert env.admin.slots().candidate.version == "v000001"
    r = run(app, ["canary", "abort", "--yes"])
    out = " ".join(r.output.split())
    assert r.exit_code == 0 and "aborted the canary of v000001" in out and "on all 1 pods" in out, out
    assert env.admin.slots().candidate is None  # done by the command, not left for the controller
    row, seen = _last_decision(env), ledger.decisions(env.ledger)[-1]
    assert (row.decision, row.actor, row.version, row.stable) == ("MANUAL_CANARY_ABORT", "oncall-alice", "v000001",
                                                                 "v000000")
    assert seen.decision == "FLEET_CONVERGED" and seen.numbers["generation"] == row.numbers["generation"]
    assert seen.numbers["pods"]["converged"] == 1 and seen.numbers["pods"]["by_pod"][env.url]["actions"] == [
        "drop v000001"]
    # the controller sees the canary ended and does not start the aborted version again
    st = controller(env, clock).reconcile()
    assert st.phase == RolloutPhase.ABORTED and "aborted by oncall-alice" in st.last_reason
    assert env.admin.slots().candidate is None and FleetRecord(env.store).read().candidate is None
    for bad in ("v000007", "garbage"):
        r = run(app, ["canary", "start", bad, "--yes"])
        out = " ".join(r.output.split())
        assert r.exit_code == 1 and f"version: '{bad}' is not in the store (it has v000000, v000001)" in out, out
    r = run(app, ["canary", "start", "v000000", "--yes"])
    assert r.exit_code == 1 and "v000000 is the fleet's stable version" in " ".join(r.output.split())
    # an operator can start it: the pod serves it at --weight when the command returns
    r = run(app, ["canary", "start", "v000001", "--yes", "--weight", "0.25", "--reason", "retry"])
    out = " ".join(r.output.split())
    assert r.exit_code == 0 and "canary of v000001 at 25% started" in out and "on all 1 pods" in out, out
    s = env.admin.slots()
    assert (s.candidate.version, s.candidate_weight) == ("v000001", 0.25)
    row = _last_decision(env)
    assert (row.decision, row.version, row.stable, row.step, row.weight, row.numbers["why"]) == (
        "MANUAL_CANARY_START", "v000001", "v000000", 0, 0.25, "retry")
    assert env.store.manifest("v000001").status_history[-1].status == "canary"
    r = run(app, ["canary", "start", "v000001", "--yes"])  # one canary at a time
    out = " ".join(r.output.split())
    assert r.exit_code == 1 and "a canary of v000001 at 25% is in progress" in out, out
    assert ledger.decisions(env.ledger)[-1].decision == "MANUAL_CANARY_START_FAILED"
    # the controller takes it as its own canary at step 0: holds without votes, advances with them
    clock.t = int(time.time() * 1000) + 1000
    st = controller(env, clock, steps=(0.25, 0.5, 1.0)).reconcile()
    assert (st.phase, st.candidate, st.step, st.weight, st.last_outcome) == (
        RolloutPhase.CANARY, "v000001", 0, 0.25, "HOLD")
    write_votes(env.samples, "v000001", 12, 13, clock.t)
    write_votes(env.samples, "v000000", 11, 14, clock.t)
    clock.t += 1000
    st = controller(env, clock, steps=(0.25, 0.5, 1.0)).reconcile()
    assert (st.last_outcome, st.step, st.weight) == ("ADVANCE", 1, 0.5)
    assert env.admin.slots().candidate_weight == 0.5


def test_a_candidate_in_the_record_with_no_canary_in_the_ledger_is_opened_not_left_unjudged(env):
    """`canary start` changed the record and the pod but its ledger row was lost (the ledger
    could not be written): the controller opens the canary of that candidate, even one it
    would not pick itself (rolled back before), instead of leaving it serving unanalysed."""
    publish_v(env.store, "v000000")
    env.store.set_status("v000001", "rolled_back", "earlier canary")
    FleetRecord(env.store).change(lambda d: (setattr(d, "candidate", "v000001"), setattr(d, "weight", 0.3), d)[-1],
                                  "oncall-bob", "canary start of v000001")
    assert not ledger.decisions(env.ledger)
    st = controller(env, Clock(), steps=(0.25, 0.5, 1.0)).reconcile()
    assert (st.phase, st.candidate, st.step, st.weight) == (RolloutPhase.CANARY, "v000001", 0, 0.25)
    assert "started by oncall-bob" in st.last_reason
    s = env.admin.slots()
    assert (s.candidate.version, s.candidate_weight) == ("v000001", 0.25)
    row = ledger.decisions(env.ledger)[-1]
    assert (row.decision, row.actor, row.version) == ("START", "oncall-bob", "v000001")


def test_controller_processes_resume_from_the_persisted_phase(env):
    """Two separate `flywheel controller --once` processes: the second resumes the canary."""
    import os
    import subprocess
    import sys

    publish_v(env.store, "v000000")
    cmd = [sys.executable, "-c", "import typer; from deploy.commands import register; app = typer.Typer(); "
           "register(app); app()", "controller", "--once", "--steps", "0.25,0.5,1", "--min-votes", "5",
           "--deadline-s", "4", "--deadline-outcome", "promote"]
    envv = dict(os.environ)
    r1 = subprocess.run(cmd, env=envv, capture_output=True, text=True, timeout=120)
    assert r1.returncode == 0, r1.stderr
    assert "phase=canary" in r1.stdout and "step=0" in r1.stdout
    time.sleep(4.2)  # past the step deadline: the undecided step advances by the configured outcome
    now = int(time.time() * 1000)
    write_votes(env.samples, "v000001", 3, 2, now)  # min_votes on both arms, undecided at delta 0.1
    write_votes(env.samples, "v000000", 2, 3, now)
    r2 = subprocess.run(cmd, env=envv, capture_output=True, text=True, timeout=120)
    assert r2.returncode == 0, r2.stderr
    assert "step=1" in r2.stdout and "weight=0.5" in r2.stdout
    decs = [d.decision for d in ledger.decisions(env.ledger)]
    assert decs.count("START") == 1 and "ADVANCE" in decs
    adv = [d for d in ledger.decisions(env.ledger) if d.decision == "ADVANCE"]
    assert len(adv) == 1 and "deadline outcome promote" in adv[0].reason


def test_latency_metric_rolls_back_and_a_broken_source_holds(env):
    publish_v(env.store, "v000000")
    clock = Clock()

    def ctl(fn):
        return RolloutController(env.store, env.admin, env.samples, env.ledger, env.status,
                                 ControllerConfig(analysis=AnalysisConfig(min_votes=5, failure_limit=1)),
                                 clock=clock, arm_metrics=fn)

    ctl(None).reconcile()
    write_votes(env.samples, "v000001", 6, 4, clock.t)
    write_votes(env.samples, "v000000", 6, 4, clock.t)

    def broken(st):
        raise OSError("metrics endpoint down")

    st = ctl(broken).reconcile()
    assert st.last_outcome == "HOLD" and "HOLD (error)" in st.last_reason and "metrics endpoint down" in st.last_reason
    st = ctl(lambda st: ({"p99_ms": 900.0}, {"p99_ms": 300.0})).reconcile()
    assert st.phase == RolloutPhase.ROLLED_BACK and "p99_latency" in st.last_reason and "ratio 3.00" in st.last_reason


def _wait_for(pred, timeout_s: float, what: str, proc=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"controller exited ({proc.returncode}) while waiting for {what}: "
                                 f"{proc.stdout.read()[-2000:]}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_sigkilled_controller_resumes_from_the_ledger_at_the_same_step(env):
    """A real `flywheel controller` daemon is SIGKILLed mid-canary and its status file is
    deleted; the restarted daemon resumes from the ledger at step 1 and promotes once."""
    import os
    import signal
    import subprocess
    import sys

    publish_v(env.store, "v000000")
    cmd = [sys.executable, "-c", "import typer; from deploy.commands import register; app = typer.Typer(); "
           "register(app); app()", "controller", "--steps", "0.25,0.5,1", "--min-votes", "5", "--delta", "0.9",
           "--poll-s", "0.3"]

    def start():
        return subprocess.Popen(cmd, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    def decs():
        return [d.decision for d in ledger.decisions(env.ledger, version="v000001")]

    p = start()
    try:
        _wait_for(lambda: "START" in decs(), 60, "START", p)
        now = int(time.time() * 1000)
        write_votes(env.samples, "v000001", 6, 4, now)
        write_votes(env.samples, "v000000", 6, 4, now)
        _wait_for(lambda: "ADVANCE" in decs(), 30, "ADVANCE", p)
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
    assert env.admin.slots().candidate_weight == 0.5  # serving keeps the step-1 weight meanwhile
    env.status.unlink()  # the JSON cache is gone: only the ledger knows the step
    p = start()
    try:
        # resumed at step 1: it holds for new candidate votes instead of re-running step 0
        _wait_for(lambda: decs()[-1] == "HOLD" and "at step 1" in ledger.decisions(env.ledger)[-1].reason,
                  60, "HOLD at step 1", p)
        write_votes(env.samples, "v000001", 5, 0, int(time.time() * 1000) + 1)
        _wait_for(lambda: "PROMOTE" in decs(), 30, "PROMOTE", p)
        time.sleep(1.0)  # a few more polls: nothing is decided twice
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
    d = decs()
    assert d.count("START") == 1 and d.count("ADVANCE") == 1 and d.count("PROMOTE") == 1, d
    assert d.index("START") < d.index("ADVANCE") < d.index("PROMOTE")
    s = env.admin.slots()
    assert s.stable.version == "v000001" and s.candidate is None
    assert [h.status for h in env.store.manifest("v000001").status_history] == ["published", "canary", "promoted"]
