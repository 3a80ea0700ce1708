"""Pilot for experiment 3 (docs/experiments.md): does learning on train-split arithmetic
prompts carry over to fresh eval-split prompts, without Kafka, the join or the canary?

Each round serves ``--n-eval`` fixed eval-split tasks (flywheel.workload, families
``--families``) with the current version and scores them with the family's verifier (one
exact vote per completion), then serves ``--n-train`` fresh train-split tasks, writes their
verdicts as RewardedSample shards and runs one real learner cycle (``flywheel learn --once``,
the objective and sizes given). Prints each version's eval count per family; writes
``<out>/rows.json``. It picked the demo's learner settings; the claim is made by the demo.

    python docs/pilots/transfer_pilot.py --out /tmp/pilot --rounds 2
"""
import json, random, sys, time, uuid, argparse, os
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from pathlib import Path
ap = argparse.ArgumentParser()
ap.add_argument("--out", default="/tmp/pilot")
ap.add_argument("--families", default="basic_arithmetic,chain_sum")
ap.add_argument("--n-train", type=int, default=192)
ap.add_argument("--n-eval", type=int, default=160)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--objective", default="reinforce")
ap.add_argument("--baseline", default="batch")
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--lr", type=float, default=3e-5)
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--max-tokens", type=int, default=48)
ap.add_argument("--temp", type=float, default=0.8)
ap.add_argument("--extra", default="")
a = ap.parse_args()
out = Path(a.out); (out/"logs").mkdir(parents=True, exist_ok=True)
os.environ["FLYWHEEL_HOME"] = str(out/"home")
from flywheel.experiment import ExperimentConfig, _setup, _learn, wilson
from flywheel.workload import Workload
from serving.engine import TorchEngine
from serving.params import GenRequest
from schemas.events import SamplingParams, ExpertRoutes, RewardedSample, now_ms
from samplestore.shards import shard_path, write_shard
from schemas import settings
from rich.console import Console
con = Console()
cfg = ExperimentConfig(out=out, rounds=a.rounds,
                       learner={"steps": a.steps, "batch_size": a.batch, "lr": a.lr, "train_layers": a.layers,
                                "objective": a.objective, "baseline": a.baseline,
                                **({"balance_classes": True} if a.objective == "kto" else {})})
store, model_dir = _setup(cfg)
eng = TorchEngine(model_dir, max_batch=32, max_queue=10000)
tok = eng.tokenizer
fams = tuple(a.families.split(","))
wl = Workload(families=fams, seed=11)
rng = random.Random(3)
def draw(split, n):
    out_ = []
    while len(out_) < n:
        t = wl.next_task(rng)
        if t.split == split: out_.append(t)
    return out_
eval_tasks = draw("eval", a.n_eval)
def ids_of(t):
    enc = tok.apply_chat_template(t.messages, add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)
def serve(lm, tasks, seed0):
    sps = [SamplingParams(temperature=a.temp, top_p=0.95, max_tokens=a.max_tokens, seed=seed0+i) for i in range(len(tasks))]
    prompts = [ids_of(t) for t in tasks]
    futs = [eng.submit(GenRequest(prompt_token_ids=p, sampling=sp, model=lm, stop_token_ids=(eng.eos_id,))) for p, sp in zip(prompts, sps)]
    res = [f.result() for f in futs]
    texts = [tok.decode(g.completion_token_ids, skip_special_tokens=True) for g in res]
    ok = [t.verifier.score(x) for t, x in zip(tasks, texts)]
    return prompts, sps, res, texts, ok
def load(v):
    if v == "v000000": return eng.load_base(v)
    m = store.manifest(v)
    return eng.load_weights(store.load(v), v, expected_hashes={k: t.sha256 for k, t in m.tensors.items()})
version = "v000000"; rows = []
t0 = time.time()
for r in range(a.rounds + 1):
    lm = load(version)
    _, _, res, texts, ok = serve(lm, eval_tasks, 999_000)
    fam = {}
    for t, o in zip(eval_tasks, ok): fam.setdefault(t.family, [0,0]); fam[t.family][0]+=o; fam[t.family][1]+=1
    mlen = sum(len(g.completion_token_ids) for g in res)/len(res)
    rows.append({"version": version, "eval_up": sum(ok), "n": len(ok), "fam": fam, "mean_len": mlen, "t": time.time()-t0,
                 "examples": texts[:6]})
    con.print(f"{version}: eval {sum(ok)}/{len(ok)} {fam} len {mlen:.1f} t={time.time()-t0:.0f}s ex={texts[:3]}")
    json.dump(rows, open(out/"rows.json","w"), indent=1)
    if r == a.rounds: break
    tr = draw("train", a.n_train)
    prompts, sps, res, texts, okt = serve(lm, tr, 10_000*r)
    con.print(f"{version}: train {sum(okt)}/{len(okt)}")
    samples = []
    for p, sp, g, o in zip(prompts, sps, res, okt):
        tt = now_ms()
        samples.append(RewardedSample(completion_id=uuid.uuid4(), model_version=version, created_at=tt, user_hash="x",
            prompt_token_ids=p, completion_token_ids=g.completion_token_ids, behavior_logprobs=g.behavior_logprobs, sampling=sp,
            expert_routes=ExpertRoutes.from_array(g.expert_routes) if g.expert_routes is not None else None,
            finish_reason=g.finish_reason, reward=1.0 if o else -1.0, label=o, n_votes=1, votes_up=int(o), votes_down=int(not o),
            event_ids=[str(uuid.uuid4())], sealed_at=tt))
    write_shard(samples, shard_path(settings.samples_dir(), min(s.sealed_at for s in samples), f"x-{r}"))
    version = _learn(cfg, r, out/"logs", store, con)
eng.close()
con.print(f"done {time.time()-t0:.0f}s")
