"""Weight slots through the admin API (schemas/admin.py) on a real server and a real
modelstore.store.ModelStore: verified loads, sticky split, hot swap under load, rollback."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from schemas.modelspec import load_model
from serving.pod import build_pod, default_version
from servers import ServerThread

ModelStore = pytest.importorskip("modelstore.store").ModelStore
TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _perturb(state: dict, seed: int, scale: float = 0.5) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        if k.startswith("model.layers.") and v.is_floating_point():
            v = v + scale * v.std() * torch.randn(v.shape, generator=g)
        out[k] = v
    return out


@pytest.fixture(scope="module")
def env(tiny_moe_dir, tmp_path_factory):
    import os

    os.environ["FLYWHEEL_USER_SALT"] = "s"
    root = tmp_path_factory.mktemp("store")
    store = ModelStore(root)
    store.init_base(tiny_moe_dir)
    store.publish(_perturb(store.load("v000000"), 1), parent="v000000")  # v000001
    store.publish(_perturb(store.load("v000001"), 2), parent="v000001")  # v000002, delta
    assert default_version(store) == "v000000"
    p = build_pod(store, pod="pod-slots", admin_token=TOKEN, log_events=False, max_batch=8)
    srv = ServerThread(p.app).start()
    yield {"url": srv.url, "store": store, "pod": p}
    srv.stop()
    p.close()
    os.environ.pop("FLYWHEEL_USER_SALT", None)


def _admin(env, method, path, json=None, headers=AUTH):
    return httpx.request(method, env["url"] + path, json=json, headers=headers, timeout=60)


def _complete(env, user: str, prompt=(5, 6, 7, 8), logprobs=None, max_tokens=6):
    r = httpx.post(env["url"] + "/v1/completions", timeout=60, headers={"x-flywheel-user": user},
                   json={"model": "flywheel", "prompt": list(prompt), "max_tokens": max_tokens,
                         "temperature": 0, "logprobs": logprobs})
    r.raise_for_status()
    return r


def test_admin_auth(env):
    assert _admin(env, "GET", "/admin/slots", headers={}).status_code == 401
    assert _admin(env, "GET", "/admin/slots", headers={"Authorization": "Bearer nope"}).status_code == 401
    st = _admin(env, "GET", "/admin/slots").json()
    assert st["stable"]["version"] == "v000000"
    assert st["stable"]["weights_digest"] == env["store"].manifest("v000000").weights_digest


def test_bad_loads_are_409_and_change_nothing(env, tmp_path):
    before = _admin(env, "GET", "/admin/slots").json()
    r = _admin(env, "POST", "/admin/load", {"version": "v000099"})
    assert r.status_code == 409 and "v000099" in r.json()["error"]["message"]
    # corrupt v000002's payload on disk: the store's (and serving's) hash check must refuse it
    store = env["store"]
    pay = store.root / "versions" / "v000002" / "payload.bin"
    good = pay.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    pay.write_bytes(bytes(bad))
    store.clear_cache()
    try:
        r = _admin(env, "POST", "/admin/load", {"version": "v000002"})
        assert r.status_code == 409, r.text
        assert _admin(env, "GET", "/admin/slots").json() == before
    finally:
        pay.write_bytes(good)
        store.clear_cache()
    assert _admin(env, "POST", "/admin/weight", {"candidate_weight": 1.5}).status_code == 400
    assert _admin(env, "POST", "/admin/weight", {"candidate_weight": 0.5}).status_code == 409  # no candidate


def test_load_split_swap_under_load_rollback(env):
    store = env["store"]
    st0 = _admin(env, "GET", "/admin/slots").json()
    st = _admin(env, "POST", "/admin/load", {"version": "v000001"}).json()
    assert st["candidate"]["version"] == "v000001"
    assert st["candidate"]["weights_digest"] == store.manifest("v000001").weights_digest
    assert st["candidate_weight"] == 0.0
    assert {_complete(env, f"u{i}").headers["x-flywheel-model-version"] for i in range(5)} == {"v000000"}

    _admin(env, "POST", "/admin/weight", {"candidate_weight": 0.5}).raise_for_status()
    seen = {f"u{i}": _complete(env, f"u{i}", max_tokens=1).headers["x-flywheel-model-version"]
            for i in range(24)}
    assert set(seen.values()) == {"v000000", "v000001"}
    for u in list(seen)[:6]:  # sticky
        assert _complete(env, u, max_tokens=1).headers["x-flywheel-model-version"] == seen[u]

    # hot swap under load: clients keep sending; none may fail
    failures, done, stop = [], [0], threading.Event()

    def client(i):
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                try:
                    r = c.post(env["url"] + "/v1/completions", headers={"x-flywheel-user": f"l{i}"},
                               json={"model": "flywheel", "prompt": [9, 10, 11], "max_tokens": 4})
                    if r.status_code != 200:
                        failures.append(r.status_code)
                    done[0] += 1
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    st = _admin(env, "POST", "/admin/promote").json()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert failures == [] and done[0] > 4
    assert st["stable"]["version"] == "v000001" and st["candidate"] is None and st["candidate_weight"] == 0
    assert 0 <= st["last_swap_pause_ms"] < 50

    # after the swap: logprobs equal a fresh full-forward recompute with v000001's weights
    prompt = [5, 6, 7, 8]
    r = _complete(env, "after", prompt=prompt, logprobs=1, max_tokens=6)
    assert r.headers["x-flywheel-model-version"] == "v000001"
    body = r.json()
    lps = body["choices"][0]["logprobs"]["token_logprobs"]
    model = load_model(store.base_dir)
    model.load_state_dict(store.load("v000001"))
    ev_ids = env["pod"].engine.tokenizer(body["choices"][0]["logprobs"]["tokens"], add_special_tokens=False)
    assert len(ev_ids["input_ids"]) == len(lps)
    # recompute from the greedy tokens: argmax of the fresh model, step by step
    seq = list(prompt)
    ref = []
    with torch.no_grad():
        for _ in range(len(lps)):
            logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, -1].float(), -1)
            t = int(logp.argmax())
            ref.append(float(logp[t]))
            seq.append(t)
    assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-4

    # rollback to v000000 by version: verified load, stable replaced
    st = _admin(env, "POST", "/admin/rollback", {"version": "v000000"}).json()
    assert st["stable"]["version"] == "v000000"
    assert st["stable"]["weights_digest"] == store.manifest("v000000").weights_digest
    # the version stable before the promote stayed resident: a pointer flip, not a reload
    assert st["stable"]["loaded_at"] == st0["stable"]["loaded_at"] and st["last_swap_pause_ms"] < 50
    assert _complete(env, "after").headers["x-flywheel-model-version"] == "v000000"
    assert [m["id"] for m in httpx.get(env["url"] + "/v1/models").json()["data"]] == ["flywheel", "v000000"]
