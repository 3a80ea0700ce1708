"""Peak RSS of ``flywheel serve`` (torch engine) with stable, candidate and the previous stable
resident, against the budget of issue 14 item 7:
``peak RSS <= 1.3 x (resident versions x model bytes) + 1 GiB``.

``python bench/serve_memory.py [--layers 30] [--keep DIR]`` builds a random model with the
default model's shapes (SmolLM2-135M upcycled to 4 experts, top-2: 30 layers, hidden 576,
vocab 49152, fp32, ~1.5 GB; ``--layers`` scales it down), a model store holding v0 (the base),
v1 and v2 (deltas, as the learner publishes them), then runs ``flywheel serve`` as a
subprocess and walks it through: start on v0, 8 completions, load v1, promote (v0 is now the
previous stable), load v2 as candidate at weight 0.5, 16 completions. The serve process's
RSS (``VmRSS``) and peak (``VmHWM``, from ``/proc/<pid>/status``) are printed after each
stage; the last line is ``RESULT serve_peak_rss_vs_budget=<peak / budget>``.
"""

from __future__ import annotations

import sys
from pathlib import Path as _P

sys.path.insert(0, str(_P(__file__).resolve().parents[1]))  # run from a checkout

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

GIB = 1024 ** 3


def build_model(out: Path, layers: int) -> int:
    """Random Mixtral with the default model's shapes and the tests' small tokenizer;
    returns the model's bytes (unique parameter storage)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from tests.conftest import make_tiny_moe

    make_tiny_moe(out)  # tokenizer (and a tiny model, replaced below)
    cfg = MixtralConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
                        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True, sliding_window=None,
                        router_aux_loss_coef=0.0, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    m = MixtralForCausalLM(cfg).float()
    m.save_pretrained(out, safe_serialization=True)
    seen, total = set(), 0
    for p in m.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def build_store(model_dir: Path, root: Path) -> None:
    """v0 = the checkpoint; v1, v2 = deltas moving the experts and routers a little."""
    import torch

    from modelstore.store import ModelStore

    st = ModelStore(root)
    st.init_base(model_dir)
    g = torch.Generator().manual_seed(1)
    parent = "v000000"
    for _ in range(2):
        s = st.load(parent)
        for k in s:
            if "experts" in k or ".gate." in k:
                s[k] += 1e-3 * torch.randn(s[k].shape, generator=g)
        parent = st.publish(s, parent).version
        del s
    st.clear_cache()


def rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in bytes."""
    got = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            got[k] = int(v.split()[0]) * 1024
    return got["VmRSS"], got["VmHWM"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (30 = the default model's size)")
    ap.add_argument("--keep", type=Path, default=None, help="work dir to keep (default: a temp dir, removed)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the serve process")
    a = ap.parse_args()
    import httpx

    from schemas.settings import free_port

    work = a.keep or Path(tempfile.mkdtemp(prefix="fw-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model_bytes = build_model(work / "model", a.layers)
        build_store(work / "model", work / "store")
        port = free_port()
        env = dict(os.environ, FLYWHEEL_HOME=str(work / "home"), FLYWHEEL_USER_SALT="x")
        env.pop("FLYWHEEL_KAFKA_BOOTSTRAP", None)
        log = open(work / "serve.log", "w")
        p = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "serve", "--store", str(work / "store"),
                              "--version", "v000000", "--port", str(port), "--threads", str(a.threads)],
                             env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        stages = []

        def stage(name: str) -> None:
            cur, peak = rss(p.pid)
            stages.append((name, cur, peak))
            print(f"{name:<32} RSS {cur / GIB:6.2f} GiB   peak {peak / GIB:6.2f} GiB", flush=True)

        try:
            with httpx.Client(timeout=600) as c:
                deadline = time.monotonic() + 900
                while True:
                    try:
                        if c.get(url + "/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if p.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("serve did not start:\n" + (work / "serve.log").read_text()[-3000:])
                    time.sleep(1)
                stage("started (stable v0)")

                def complete(n: int) -> None:
                    for i in range(n):
                        c.post(url + "/v1/completions", json={"model": "flywheel", "prompt": [5, 6, 7, 8],
                                                              "max_tokens": 16, "temperature": 0},
                               headers={"x-flywheel-user": f"u{i}"}).raise_for_status()

                complete(8)
                stage("8 completions")
                c.post(url + "/admin/load", json={"version": "v000001"}).raise_for_status()
                stage("candidate v1 loaded")
                c.post(url + "/admin/promote").raise_for_status()
                stage("promoted (previous = v0)")
                c.post(url + "/admin/load", json={"version": "v000002"}).raise_for_status()
                c.post(url + "/admin/weight", json={"candidate_weight": 0.5}).raise_for_status()
                stage("candidate v2 loaded, weight 0.5")
                complete(16)
                stage("16 completions (3 resident)")
        finally:
            p.terminate()
            p.wait(60)
            log.close()
        peak = max(s[2] for s in stages)
        budget = 1.3 * 3 * model_bytes + GIB
        print(f"model {model_bytes / GIB:.3f} GiB ({model_bytes} bytes), 3 resident versions; budget "
              f"1.3 x 3 x model + 1 GiB = {budget / GIB:.2f} GiB; peak RSS {peak / GIB:.2f} GiB")
        print(f"RESULT serve_peak_rss_vs_budget={peak / budget:.3f} x target<=1.0")
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
