"""Pilot for experiments 4 and 5 (docs/experiments.md): which learner settings learn from
implicit feedback alone? Arms of learner settings train on the SAME reward-labelled samples
and are judged paired on one fixed held-out prompt set, without Kafka, serving's HTTP layer
or the canary.

What it does (each step is the demo's own code where the demo has one):

1. Draws ``--n-train`` train-split tasks from :class:`flywheel.workload.Workload` with the
   demo's families, held-out family, weights and eval share (``flywheel.demo_config.DemoConfig``),
   serves them with v000000 in process (:class:`serving.engine.TorchEngine`, the demo's
   temperature, top_p and max tokens) and judges each reply with its task's verifier.
2. Lets the demo's simulated users react (``UserBehaviour().plan(passed, rng,
   signals="implicit", code=<HumanEval>)``: copy, regenerate, edit with a kept share,
   follow-up, on 70 % of replies; duplicates share an event_id) and turns the completions and
   the events into RewardedSamples with the real join (:class:`ingest.join.Joiner` in an
   in-memory :class:`ingest.state.StateStore`, the demo's ingest timings and the reward
   policy ingest reads, ``RewardPolicy.from_env()``): components, reward, label, dedupe and
   unlabelled completions are the join's, not this file's. The completion events are built by
   serving's own :class:`serving.http.completion_log.CompletionLogger`.
   With ``--reask N`` (0..3, default 0: none) a user who regenerates a reply is served the
   same prompt again, as a product's user who presses "regenerate" is: the same task and
   prompt token ids, by the same user (one user hash in the join), a sampling seed of its own
   (``derived_seed("pilot-reask", seed, round, i, k)`` for task ``i``'s ``k``-th re-ask);
   the new reply is judged by the verifier and planned by the user with an RNG of its own
   (``"pilot-user-reask"``, same parts); a user who regenerates again is asked again, up to
   N re-asks per task. First and re-asked completions go through the join together (first
   replies in task order, then re-asks by ``(k, i)``), so a regenerated prompt carries 2 to
   N + 1 completions for the learner's per-prompt baseline (``baseline: prompt``, RLOO).
   Both rounds (``--rounds 2``) re-ask alike; each round's summary counts the re-asks, their right
   replies, the prompts with 2+ completions and with 2+ samples, and those of mixed reward
   (its ``replies``, ``right``, ``samples`` and ``mean_reward`` count first and re-asked replies).
   ``--signals thumbs`` sends no regenerate, so it re-asks nothing.
3. Each arm (``--arms``, default ``demo`` = ``flywheel.demo_config.DEMO_LEARNER`` and ``more`` = the
   same with 16 steps) trains one real learner cycle (``flywheel learn --once``) from v000000
   on those samples (its first ``n_samples`` when given) in a FLYWHEEL_HOME of its own, with
   the learner seed ``--seed``. With ``--rounds 2`` each arm then serves a second batch of
   train tasks (the same tasks and seeds in every arm) with its own v000001 and trains
   v000002.
4. Every version answers the fixed eval set (``flywheel.workload.fixed_eval_set``,
   ``--fixed-per-family`` per reasoning-gym family and ``--fixed-humaneval`` HumanEval
   problems) with the same per-prompt sampling seeds (as the demo's fixed eval); reports each
   version's right count by kind (fresh / harder / unseen) and each arm's version against
   v000000 paired by prompt (``flywheel.report.paired_comparison``: mean difference, exact
   McNemar p, 95 % paired bootstrap with 4000 resamples, seed 0).

Writes ``<out>/pilot.json`` and ``<out>/pilot.png`` (when matplotlib is installed); each
arm's store, samples and learner logs are under ``<out>/arms/<name>/``.

    python docs/pilots/implicit_pilot.py --out /tmp/implicit-pilot
    python docs/pilots/implicit_pilot.py --out /tmp/ip --arms '[{"name": "demo"},
        {"name": "lr1e-4", "learner": {"lr": 1e-4}}, {"name": "half", "n_samples": 40}]'
    python docs/pilots/implicit_pilot.py --out /tmp/ip-reask --reask 2 --arms '[{"name": "reask_batch"},
        {"name": "reask_prompt", "learner": {"baseline": "prompt"}}]'

An arm's ``learner`` holds LearnerConfig fields that change DEMO_LEARNER (the demo's
settings are the base); ``--model-dir`` picks a checkpoint other than the project's
default model (``FLYWHEEL_MODEL_DIR``, ``schemas.settings.base_model_dir``).

This is a tuning tool with its own seeds (``--seed 7`` by default: workload, users, sampling
and learner seeds): it picks settings for the demo to try; the claim is made by the demo.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MARKER = ".implicit-pilot"  # in <out>/arms: made by this pilot, so a later run may replace it
BASE = "v000000"
ARM_NAME = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
USERS = 256  # simulated users, as DemoConfig.users
JOIN_TOPIC = "flywheel.completions"
MAX_REASK = 3  # --reask: at most this many re-asks per train task


# ------------------------------------------------------------------ settings
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/implicit-pilot", help="Output directory.")
    ap.add_argument("--n-train", type=int, default=288, help="Train-split tasks served per round.")
    ap.add_argument("--rounds", type=int, default=1, choices=(1, 2), help="Learner cycles per arm.")
    ap.add_argument("--arms", default=None, help="JSON list of {name, learner: {LearnerConfig overrides of "
                                                 "DEMO_LEARNER}, n_samples: optional int}.")
    ap.add_argument("--fixed-per-family", type=int, default=40, help="Fixed eval prompts per reasoning-gym family.")
    ap.add_argument("--fixed-humaneval", type=int, default=8, help="Fixed eval HumanEval problems (from 120).")
    ap.add_argument("--signals", default="implicit", help="What the users send (flywheel.users.SIGNALS).")
    ap.add_argument("--seed", type=int, default=7, help="Workload, users, sampling and learner seed.")
    ap.add_argument("--eval-seed", type=int, default=None, help="Seed of the fixed eval set and its sampling "
                                                                "seeds (default: --seed; the demo's is 0).")
    ap.add_argument("--model-dir", default=None, help="Checkpoint to start from (default: the project's "
                                                      "default model, schemas.settings.base_model_dir).")
    ap.add_argument("--max-batch", type=int, default=32, help="Engine batch size (the demo's concurrency).")
    ap.add_argument("--reask", type=int, default=0, help=f"Re-asks per train task whose user regenerates, "
                                                         f"0..{MAX_REASK} (default 0: none).")
    a = ap.parse_args(argv)
    if not 0 <= a.reask <= MAX_REASK:
        ap.error(f"--reask: must be in 0..{MAX_REASK}, got {a.reask}")
    for name in ("n_train", "max_batch"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(a, name)}")
    for name in ("fixed_per_family", "fixed_humaneval"):
        if getattr(a, name) < 0:
            ap.error(f"--{name.replace('_', '-')}: must be >= 0, got {getattr(a, name)}")
    if a.eval_seed is None:
        a.eval_seed = a.seed
    return a


def default_arms() -> list[dict]:
    """The two default arms: the demo's learner settings, and the same with 16 steps."""
    return [{"name": "demo", "learner": {}}, {"name": "more", "learner": {"steps": 16}}]


def resolve_arms(text: str | None, model_layers: int | None = None) -> list[dict]:
    """``--arms`` (JSON text, None: :func:`default_arms`) -> ``[{"name", "learner",
    "n_samples"}]`` where ``learner`` is DEMO_LEARNER with the arm's overrides, less the values
    that equal LearnerConfig's defaults (what ``flywheel learn`` flags must not restate).

    Raises:
        ValueError: not a JSON list of objects, a name that is not 1-40 letters, digits, ``_``
            or ``-`` or is repeated, an unknown key, ``n_samples`` not an int >= 1, learner
            settings the learner refuses, or ``train_layers`` above ``model_layers``; the
            message names ``arms[i].<field>``.
    """
    from flywheel.demo_config import DEMO_LEARNER
    from learner.config import LearnerConfig, check_learner

    arms = default_arms() if text is None else json.loads(text)
    if not isinstance(arms, list) or not arms or not all(isinstance(x, dict) for x in arms):
        raise ValueError("arms: must be a non-empty JSON list of objects")
    out, names = [], set()
    for i, arm in enumerate(arms):
        where = f"arms[{i}]"
        extra = set(arm) - {"name", "learner", "n_samples"}
        if extra:
            raise ValueError(f"{where}: unknown key(s) {sorted(extra)}; keys are name, learner, n_samples")
        name = arm.get("name")
        if not isinstance(name, str) or not ARM_NAME.match(name) or name in names:
            raise ValueError(f"{where}.name: must be a new name of 1-40 letters, digits, '_' or '-', got {name!r}")
        names.add(name)
        n = arm.get("n_samples")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"{where}.n_samples: must be an int >= 1, got {n!r}")
        over = arm.get("learner") or {}
        if not isinstance(over, dict):
            raise ValueError(f"{where}.learner: must be an object of LearnerConfig fields, got {over!r}")
        merged = {k: v for k, v in {**DEMO_LEARNER, **over}.items()
                  if not hasattr(LearnerConfig, k) or v != getattr(LearnerConfig, k)}
        check_learner(merged, where=f"{where}.learner")
        layers = merged.get("train_layers", LearnerConfig.train_layers)
        if model_layers is not None and layers > model_layers:
            raise ValueError(f"{where}.learner.train_layers: {layers} > {model_layers} layers in the model")
        out.append({"name": name, "learner": merged, "n_samples": n})
    return out


def demo_config(seed: int):
    """The demo's default DemoConfig (families, held-out family, weights, eval share, sampling,
    users) with ``seed``."""
    from flywheel.demo_config import DemoConfig

    return DemoConfig(seed=seed)


def derived_seed(*parts) -> int:
    """A 30-bit seed from ``parts`` (the demo's fixed-eval formula: sha256, first 4 bytes >> 2)."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "big") >> 2


def model_dir_of(arg: str | None) -> Path:
    """The checkpoint to start from: ``--model-dir`` (also exported as FLYWHEEL_MODEL_DIR for
    the learner), else ``schemas.settings.base_model_dir()``.

    Raises:
        ValueError: the directory holds no config.json.
    """
    from schemas import settings

    if arg:
        os.environ["FLYWHEEL_MODEL_DIR"] = str(Path(arg).absolute())
    d = settings.base_model_dir()
    if not (d / "config.json").is_file():
        raise ValueError(f"model dir: {d} holds no checkpoint; run 'flywheel model init' or pass --model-dir")
    return d


# ------------------------------------------------------------------ tasks and serving
def fixed_tasks(dc, per_family: int, humaneval: int, seed: int) -> list:
    """The fixed eval set (the demo's construction) with each task's kind set."""
    from flywheel.workload import fixed_eval_set, fixed_kind

    tasks = fixed_eval_set(dc.families, per_family, humaneval if "humaneval" in dc.families else 0, seed)
    for t in tasks:
        t.kind = fixed_kind(t.family, dc.held_out)
    return tasks


def train_workload(dc, fixed: list):
    """The demo's Workload (its families, held-out family, eval share, HumanEval problems and
    weights), never asking a fixed-set prompt."""
    from flywheel.workload import Workload

    return Workload(families=dc.families, held_out=dc.held_out, eval_share=dc.eval_share,
                    humaneval_problems=tuple(range(dc.problems)), seed=dc.seed, weights=dc.weights(),
                    reserved=frozenset(t.key for t in fixed))


def draw_train(wl, rng: random.Random, n: int) -> list:
    """The next ``n`` train-split tasks the workload draws (eval-split draws are skipped)."""
    out = []
    while len(out) < n:
        t = wl.next_task(rng)
        if t.split == "train":
            if t.family in wl.held_out or t.kind != "train":  # the workload's split rule, checked
                raise RuntimeError(f"workload: a train-split task of {t.family!r} has kind {t.kind!r}")
            out.append(t)
    return out


def chat_ids(tok, messages: list[dict]) -> list[int]:
    """The chat prompt's token ids, as serving builds them."""
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def serve(eng, lm, tasks: list, seeds: list[int], dc) -> list[dict]:
    """Serve ``tasks`` with ``lm`` (one request each, sampling seed ``seeds[i]``, the demo's
    temperature, top_p and max tokens) and judge each reply with its task's verifier.

    Returns per task ``{"prompt", "sampling", "result", "text", "passed", "has_answer"}``.
    """
    from schemas.events import SamplingParams
    from serving.params import GenRequest

    tok = eng.tokenizer
    reqs = []
    for t, seed in zip(tasks, seeds):
        mt = dc.max_tokens if t.family == "humaneval" else dc.max_tokens_short
        sp = SamplingParams(temperature=dc.temperature, top_p=dc.top_p, max_tokens=mt, seed=seed)
        reqs.append((chat_ids(tok, t.messages), sp))
    futs = [eng.submit(GenRequest(prompt_token_ids=p, sampling=sp, model=lm, stop_token_ids=(eng.eos_id,)))
            for p, sp in reqs]
    out = []
    for t, (p, sp), f in zip(tasks, reqs, futs):
        g = f.result()
        text = tok.decode(g.completion_token_ids, skip_special_tokens=True)
        out.append({"prompt": p, "sampling": sp, "result": g, "text": text,
                    "passed": bool(t.verifier.score(text)), "has_answer": bool(t.verifier.has_answer(text))})
    return out


def load_version(eng, store, version: str):
    """``version`` of ``store`` in the engine, hash-verified (v000000: the base checkpoint)."""
    if version == BASE:
        return eng.load_base(version)
    m = store.manifest(version)
    return eng.load_weights(store.load(version), version, expected_hashes={k: t.sha256 for k, t in m.tensors.items()})


# ------------------------------------------------------------------ users and the join
def plan_feedback(tasks: list, served: list[dict], behaviour, signals: str, seed: int, rnd: int) -> list:
    """The users' VotePlans, one per served reply, each from an RNG of its own
    (``seed``, round ``rnd``, index): the same reply verdicts give the same plans in every arm."""
    plans = []
    for i, (t, s) in enumerate(zip(tasks, served)):
        rng = random.Random(derived_seed("pilot-user", seed, rnd, i))
        plans.append(behaviour.plan(s["passed"], rng, signals=signals, code=t.family == "humaneval"))
    return plans


class Reask(NamedTuple):
    """One re-ask: train task ``i`` (index in the round's tasks) asked again for the ``k``-th
    time (1-based), sampling seed ``seed``, its user's plan drawn from
    ``random.Random(user_seed)``."""

    i: int
    k: int
    seed: int
    user_seed: int


def regenerates(plan) -> bool:
    """The plan's action is ``regenerate``: the user asked for another reply."""
    return bool(plan.action) and plan.action[0] == "regenerate"


def reask_loop(plans: list, n: int, seed: int, rnd: int, ask) -> list[tuple]:
    """Ask again every train task whose user regenerates, up to ``n`` re-asks per task.

    ``plans[i]`` is the plan for task ``i``'s first reply. Wave ``k`` (1..n) re-asks, in task
    order, the tasks whose latest plan regenerates (wave 1: the first plans; wave k: the plans
    of wave k-1's replies), task ``i`` with sampling seed ``derived_seed("pilot-reask", seed,
    rnd, i, k)`` and user RNG seed ``derived_seed("pilot-user-reask", seed, rnd, i, k)``.
    ``ask(wave)`` serves and plans one wave (a list of :class:`Reask`) and returns
    ``[(served, plan)]`` aligned with it. Stops after wave ``n`` or when no plan regenerates.

    Returns:
        ``[(Reask, served, plan)]`` ordered by ``(k, i)``; empty for ``n == 0``.

    Raises:
        ValueError: ``n`` outside 0..MAX_REASK, or ``ask`` answered a wave with another length.
    """
    if not 0 <= n <= MAX_REASK:
        raise ValueError(f"reask: must be in 0..{MAX_REASK}, got {n}")
    out: list[tuple] = []
    latest = list(enumerate(plans))
    for k in range(1, n + 1):
        wave = [Reask(i, k, derived_seed("pilot-reask", seed, rnd, i, k),
                      derived_seed("pilot-user-reask", seed, rnd, i, k)) for i, p in latest if regenerates(p)]
        if not wave:
            break
        got = list(ask(wave))
        if len(got) != len(wave):
            raise ValueError(f"reask: ask answered {len(got)} of {len(wave)} re-asks in wave {k}")
        out += [(r, s, p) for r, (s, p) in zip(wave, got)]
        latest = [(r.i, p) for r, (_, p) in zip(wave, got)]
    return out


def reask_plans(tasks: list, wave: list, served: list[dict], behaviour, signals: str) -> list:
    """The users' VotePlans for re-asked replies ``served`` (aligned with ``wave``), each from
    ``random.Random(Reask.user_seed)``."""
    return [behaviour.plan(s["passed"], random.Random(r.user_seed), signals=signals,
                           code=tasks[r.i].family == "humaneval") for r, s in zip(wave, served)]


def with_reasks(served: list[dict], plans: list, users: list[str], asked: list[tuple]) -> tuple:
    """The first replies followed by the re-asked ones (:func:`reask_loop`'s order), each
    re-ask with its task's user: ``(served, plans, users, reasks)``.

    Raises:
        RuntimeError: a re-asked reply's prompt token ids differ from its task's first reply's.
    """
    for r, s, _ in asked:
        if list(s["prompt"]) != list(served[r.i]["prompt"]):
            raise RuntimeError(f"reask: task {r.i} re-ask {r.k} was served another prompt")
    return (served + [s for _, s, _ in asked], plans + [p for _, _, p in asked],
            users + [users[r.i] for r, _, _ in asked], [r for r, _, _ in asked])


class _Captured:
    """An event log that keeps what serving's CompletionLogger emits (the event's bytes)."""

    def __init__(self):
        self.values: list[bytes] = []

    def emit(self, topic: str, key: str, value: bytes, durable: bool = False):
        self.values.append(value)


def completion_events(served: list[dict], users: list[str], created_ms: int, salt: str = "implicit-pilot") -> list:
    """Serving's CompletionEvent bytes for each served reply (CompletionLogger.emit, split
    ``train``), with ``(completion_id, user_hash)``; returns ``[(raw, cid, user_hash)]``."""
    from schemas.events import hash_user
    from serving.http.completion_log import CompletionLogger

    cap = _Captured()
    logger = CompletionLogger(cap, pod="implicit-pilot", topic=JOIN_TOPIC)
    out = []
    try:
        for s, user in zip(served, users):
            cid, uh = uuid.uuid4(), hash_user(user, salt)
            logger.emit(cid, f"req-{cid.hex[:16]}", uh, s["prompt"], s["sampling"], s["result"], created_ms, "train")
            out.append((cap.values[-1], cid, uh))
    finally:
        logger.close()
    return out


def join_samples(events: list, plans: list, created_ms: int, policy=None) -> list:
    """The join's RewardedSamples for completions ``events`` (:func:`completion_events`) and
    their users' ``plans``, in the order of ``events`` (a completion with no event gets no
    sample, as in the demo). Each plan event is a FeedbackEvent created ``delay`` seconds after
    its completion and folded at that time; a repeated event_id folds once. The demo's ingest
    timings (``DEMO_INGEST``) and ``policy`` (default: ``RewardPolicy.from_env()``, ingest's).

    Raises:
        ValueError: a completion event the join refuses (field and reason).
    """
    from flywheel.demo_config import DEMO_INGEST
    from ingest.join import JoinConfig, Joiner, parse_completion
    from ingest.state import StateStore
    from schemas.events import DeadLetter, FeedbackEvent
    from schemas.reward import RewardPolicy

    cfg = JoinConfig(seal_after_s=DEMO_INGEST["seal_after_s"], max_label_age_s=DEMO_INGEST["max_label_age_s"],
                     orphan_ttl_s=DEMO_INGEST["orphan_ttl_s"], reward=policy or RewardPolicy.from_env())
    j = Joiner(StateStore(":memory:"), cfg)
    heads = [parse_completion(raw, JOIN_TOPIC, str(cid)) for raw, cid, _ in events]
    bad = next((h for h in heads if isinstance(h, DeadLetter)), None)
    if bad is not None:
        raise ValueError(f"completion {bad.field}: {bad.reason}")
    j.on_completions([(h, raw) for h, (raw, _, _) in zip(heads, events)], now=created_ms)
    fbs = []
    for (_, cid, uh), plan in zip(events, plans):
        for delay, eid, kind, value in plan.events:
            at = created_ms + int(delay * 1000)
            ev = FeedbackEvent(event_id=eid, completion_id=cid, user_hash=uh, kind=kind, value=float(value),
                               created_at=at)
            fbs.append((at, ev))
    for at, ev in sorted(fbs, key=lambda x: x[0]):
        j.on_feedbacks([(ev, ev.to_bytes())], now=at)
    last = max([at for at, _ in fbs], default=created_ms)
    res = j.tick(last + int(cfg.seal_after_s * 1000) + 1, limit=len(events) + 1)
    order = {str(cid): i for i, (_, cid, _) in enumerate(events)}
    return sorted(res.samples, key=lambda s: order[str(s.completion_id)])


def sample_summary(samples: list, plans: list, served: list[dict], reasks: list = ()) -> dict:
    """Counts of one round's training data: replies (first and re-asked), right replies,
    actions, samples, their mean reward and positive share, the join's dedupe (events sent vs
    folded) and the re-asks (:func:`reask_summary`; ``reasks`` aligned with the last
    ``len(reasks)`` of ``served``)."""
    actions: dict[str, int] = {}
    for p in plans:
        if p.action:
            key = p.action[0] if p.action[0] != "followup" else f"followup{'+' if p.action[1] > 0 else '-'}"
            actions[key] = actions.get(key, 0) + 1
    n = len(samples)
    return {"replies": len(served), "right": sum(s["passed"] for s in served), "actions": actions,
            "noisy": sum(p.noisy for p in plans), "samples": n,
            "mean_reward": (sum(s.reward for s in samples) / n) if n else None,
            "positive": sum(s.label for s in samples),
            "events_sent": sum(len(p.events) for p in plans),
            "events_in_samples": sum(len(s.event_ids) for s in samples),
            **reask_summary(samples, served, list(reasks))}


def _repeated(keys) -> int:
    """How many distinct keys occur 2+ times in ``keys``."""
    return sum(n > 1 for n in Counter(keys).values())


def reask_summary(samples: list, served: list[dict], reasks: list) -> dict:
    """The re-asks of a round: ``reasks`` served and right (in all and by re-ask number ``k``),
    the tasks re-asked, the prompts (by token ids) with 2+ served completions and with 2+
    samples, and those of the latter whose samples' rewards differ (the prompts where a
    per-prompt baseline gives a non-zero advantage)."""
    again = served[len(served) - len(reasks):] if reasks else []
    by_k: dict[str, dict] = {}
    for r, s in zip(reasks, again):
        d = by_k.setdefault(str(r.k), {"served": 0, "right": 0})
        d["served"] += 1
        d["right"] += int(s["passed"])
    rewards: dict = {}
    for s in samples:
        rewards.setdefault(tuple(s.prompt_token_ids), set()).add(s.reward)
    return {"reasks": len(reasks), "reasks_right": sum(int(s["passed"]) for s in again), "reasks_by_k": by_k,
            "tasks_reasked": len({r.i for r in reasks}),
            "prompts_2plus": _repeated(tuple(s["prompt"]) for s in served),
            "prompts_2plus_in_samples": _repeated(tuple(s.prompt_token_ids) for s in samples),
            "prompts_mixed_reward": sum(len(v) > 1 for v in rewards.values())}


# ------------------------------------------------------------------ arms
def prepare_arms_dir(out: Path) -> Path:
    """``<out>/arms``, new (an earlier pilot's is replaced; anything else there is refused).

    Raises:
        ValueError: FLYWHEEL_STORE or FLYWHEEL_SAMPLES is set (the arms would share them), or
            ``<out>/arms`` exists and was not made by this pilot.
    """
    for var in ("FLYWHEEL_STORE", "FLYWHEEL_SAMPLES"):
        if os.environ.get(var):
            raise ValueError(f"{var}: unset it; each arm keeps its store and samples under its own FLYWHEEL_HOME")
    d = out / "arms"
    if d.exists():
        if not (d / MARKER).exists():
            raise ValueError(f"out: {d} exists and was not made by this pilot; choose another --out")
        shutil.rmtree(d)
    d.mkdir(parents=True)
    (d / MARKER).write_text("made by docs/pilots/implicit_pilot.py; the next run with this --out replaces it\n")
    return d


def arm_store(arms_dir: Path, arm: dict, model_dir: Path):
    """Point FLYWHEEL_HOME at the arm's home (the learner subprocess inherits it) and return
    its model store, with v000000 registered."""
    from modelstore.store import ModelStore
    from schemas import settings

    home = arms_dir / arm["name"] / "home"
    os.environ["FLYWHEEL_HOME"] = str(home)
    store = ModelStore(settings.store_dir())
    if not store.versions():
        store.init_base(model_dir)
    return store


def learn_arm(arms_dir: Path, arm: dict, rnd: int, samples: list, model_dir: Path, seed: int, con) -> dict:
    """Write the arm's share of ``samples`` (the first ``n_samples``) to its samples dir and
    run one learner cycle (``flywheel.experiment._learn``: ``flywheel learn --once --parent
    latest``, learner seed ``seed + rnd``, the same in every arm).
    Returns ``{"version", "samples_written", "n_samples", "metrics"}``."""
    from flywheel.experiment import ExperimentConfig, _learn
    from samplestore.shards import shard_path, write_shard
    from schemas import settings

    store = arm_store(arms_dir, arm, model_dir)
    mine = samples[: arm["n_samples"]] if arm["n_samples"] else samples
    if not mine:
        raise RuntimeError(f"arm {arm['name']}: no samples to train on in round {rnd}")
    write_shard(mine, shard_path(settings.samples_dir(), min(s.sealed_at for s in mine), f"pilot-{rnd}"))
    cfg = ExperimentConfig(out=arms_dir / arm["name"], rounds=1, seed=seed, learner=arm["learner"])
    logs = arms_dir / arm["name"] / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    version = _learn(cfg, rnd, logs, store, con)
    metrics = store.manifest(version).metrics or {}
    return {"version": version, "samples_written": len(mine),
            "n_samples": log_n_samples(logs / f"learner-{rnd}.log", metrics),
            "metrics": {k: v for k, v in metrics.items() if k.split("/")[0] in ("data", "pg", "kto", "is", "mismatch")}}


def log_n_samples(log: Path, metrics: dict):
    """``data/n_samples`` from the learner log's ``learn: published`` line (else the manifest's)."""
    try:
        for line in reversed(log.read_text(errors="replace").splitlines()):
            m = re.search(r"learn: published \S+ .*?(\{.*\})\s*$", line)
            if m:
                return json.loads(m.group(1)).get("data/n_samples")
    except (OSError, ValueError):
        pass
    return metrics.get("data/n_samples")


# ------------------------------------------------------------------ evaluation and report
def fixed_eval(eng, lm, name: str, fixed: list, seeds: list[int], dc) -> list[dict]:
    """One version's fixed-eval rows (``flywheel.demo.Demo.fixed_eval``'s fields), the version
    named ``name``."""
    got = serve(eng, lm, fixed, seeds, dc)
    return [{"version": name, "key": t.key, "family": t.family, "kind": t.kind, "passed": g["passed"],
             "has_answer": g["has_answer"], "finish_reason": g["result"].finish_reason,
             "tokens": len(g["result"].completion_token_ids)} for t, g in zip(fixed, got)]


def compare(rows: list[dict], arm_versions: dict[str, list[str]]) -> dict:
    """Per arm, each of its versions against v000000, and the arms' last versions against the
    first arm's, paired by prompt (``flywheel.report.paired_comparison``, bootstrap seed 0,
    4000 resamples)."""
    from flywheel.report import paired_comparison

    out: dict = {"vs_base": {}, "vs_first_arm": {}}
    for arm, versions in arm_versions.items():
        out["vs_base"][arm] = {v: paired_comparison(rows, BASE, v, seed=0, n_boot=4000) for v in versions}
    names = list(arm_versions)
    for arm in names[1:]:
        a, b = arm_versions[names[0]][-1], arm_versions[arm][-1]
        out["vs_first_arm"][arm] = paired_comparison(rows, a, b, seed=0, n_boot=4000)
    return out


def build_report(args, arms: list[dict], dc, fixed: list, rows: list[dict], rounds: list[dict],
                 learned: dict, arm_versions: dict, wall_s: float, policy) -> dict:
    """The pilot's JSON report (``pilot.json``)."""
    from dataclasses import asdict

    from flywheel.report import fixed_figures
    from schemas.reward import RewardPolicy

    return {
        "settings": {**vars(args), "arms": arms, "families": list(dc.families), "held_out": list(dc.held_out),
                     "weights": dc.weights(), "eval_share": dc.eval_share, "temperature": dc.temperature,
                     "top_p": dc.top_p, "max_tokens": dc.max_tokens, "max_tokens_short": dc.max_tokens_short,
                     "behaviour": asdict(dc.behaviour), "reward_policy": json.loads(policy.canonical_json()),
                     "reward_policy_digest": policy.digest(),
                     "reward_policy_is_default": policy.digest() == RewardPolicy().digest()},
        "fixed_prompts": len(fixed),
        "fixed_by_kind": {k: sum(t.kind == k for t in fixed) for k in sorted({t.kind for t in fixed})},
        "rounds": rounds, "learner": learned,
        "versions": fixed_figures(rows),
        "comparison": compare(rows, arm_versions),
        "note": "a tuning pilot with its own seeds; not a claim (the demo makes the claim)",
        "wall_s": wall_s,
    }


def write_plot(report: dict, path: Path) -> bool:
    """Right rate on the fixed set by kind per version, 95 % Wilson intervals; False when
    matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vs = report["versions"]
    kinds = ["all"] + sorted({k for v in vs.values() for k in v["by_kind"]})
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(kinds) + 2), 3.8))
    width = 0.8 / max(len(vs), 1)
    for j, (name, v) in enumerate(vs.items()):
        figs = [v["all"] if k == "all" else v["by_kind"].get(k) for k in kinds]
        xs = [i + (j - (len(vs) - 1) / 2) * width for i, f in enumerate(figs) if f]
        ok = [f for f in figs if f]
        rate = [f["rate"] for f in ok]
        err = [[r - f["ci95"][0] for r, f in zip(rate, ok)], [f["ci95"][1] - r for r, f in zip(rate, ok)]]
        ax.errorbar(xs, rate, yerr=err, fmt="o", capsize=3, label=name)
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_ylabel("right on the fixed set (95% Wilson)")
    title = "; ".join(f"{arm}: {c['diff']:+.3f} [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}] p={c['mcnemar_p']:.2f}"
                      for arm, per in report["comparison"]["vs_base"].items()
                      for c in list(per.values())[-1:] if c)
    ax.set_title(f"vs {BASE}: {title}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def print_summary(report: dict, con) -> None:
    """Per version the right count by kind; per arm the paired comparison with v000000."""
    for v, f in report["versions"].items():
        kinds = " ".join(f"{k} {x['votes_up']}/{x['votes']}" for k, x in f["by_kind"].items())
        con.print(f"{v}: right {f['all']['votes_up']}/{f['all']['votes']} ({kinds})")
    for arm, per in report["comparison"]["vs_base"].items():
        for v, c in per.items():
            if c:
                con.print(f"{arm} {v} vs {BASE}: diff {c['diff']:+.3f} 95% [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}] "
                          f"McNemar p {c['mcnemar_p']:.3f} (only {BASE} {c['only_from']}, only {v} {c['only_to']})")


# ------------------------------------------------------------------ the run
class Pilot:
    """One pilot run: the engine, the demo's config and the phases (see the module docstring)."""

    def __init__(self, args, con):
        from flywheel.users import SIGNALS

        if args.signals not in SIGNALS:
            raise ValueError(f"signals: one of {', '.join(SIGNALS)}, got {args.signals!r}")
        self.args, self.con, self.t0 = args, con, time.time()
        self.out = Path(args.out).absolute()
        self.model_dir = model_dir_of(args.model_dir)
        layers = json.loads((self.model_dir / "config.json").read_text()).get("num_hidden_layers")
        self.arms = resolve_arms(args.arms, layers)
        self.dc = demo_config(args.seed)
        self.arms_dir = prepare_arms_dir(self.out)
        from schemas.reward import RewardPolicy

        self.policy = RewardPolicy.from_env()
        self.fixed = fixed_tasks(self.dc, args.fixed_per_family, args.fixed_humaneval, args.eval_seed)
        self.wl = train_workload(self.dc, self.fixed)
        self.rng = random.Random(args.seed)
        self.rows: list[dict] = []
        self.rounds: list[dict] = []
        self.learned: dict = {a["name"]: [] for a in self.arms}
        self.arm_versions: dict = {a["name"]: [] for a in self.arms}

    def say(self, msg: str) -> None:
        self.con.print(f"[{time.time() - self.t0:6.0f} s] {msg}")

    def samples_for(self, lm, tasks: list, rnd: int, label: str) -> tuple[list, dict]:
        """Serve ``tasks`` with ``lm``, let the users react, re-ask the regenerated ones
        (``--reask``, :meth:`reask`) and join: ``(samples, summary)``."""
        seeds = [derived_seed("pilot-train", self.args.seed, rnd, i) for i in range(len(tasks))]
        served = serve(self.eng, lm, tasks, seeds, self.dc)
        plans = plan_feedback(tasks, served, self.dc.behaviour, self.args.signals, self.args.seed, rnd)
        users = [f"user-{random.Random(derived_seed('pilot-who', self.args.seed, rnd, i)).randrange(USERS)}"
                 for i in range(len(tasks))]
        served, plans, users, reasks = self.reask(lm, tasks, rnd, served, plans, users)
        created = int(time.time() * 1000)
        samples = join_samples(completion_events(served, users, created), plans, created, self.policy)
        summary = {"round": rnd, "served_by": label, **sample_summary(samples, plans, served, reasks)}
        again = (f", re-asked {summary['reasks']} (right {summary['reasks_right']}; by k {summary['reasks_by_k']}), "
                 f"prompts with 2+ completions {summary['prompts_2plus']}, with 2+ samples "
                 f"{summary['prompts_2plus_in_samples']} ({summary['prompts_mixed_reward']} of mixed reward)"
                 if self.args.reask else "")
        self.say(f"round {rnd} {label}: right {summary['right']}/{summary['replies']}, actions {summary['actions']}, "
                 f"{summary['samples']} samples, mean reward {summary['mean_reward']}{again}")
        self.rounds.append(summary)
        return samples, summary

    def reask(self, lm, tasks: list, rnd: int, served: list[dict], plans: list, users: list[str]) -> tuple:
        """``--reask``: the round's re-asks (:func:`reask_loop`) served by ``lm`` and planned by
        the same users, appended after the first replies: ``(served, plans, users, reasks)``."""
        def ask(wave: list) -> list:
            got = serve(self.eng, lm, [tasks[r.i] for r in wave], [r.seed for r in wave], self.dc)
            return list(zip(got, reask_plans(tasks, wave, got, self.dc.behaviour, self.args.signals)))

        asked = reask_loop(plans, self.args.reask, self.args.seed, rnd, ask)
        return with_reasks(served, plans, users, asked)

    def train(self, arm: dict, rnd: int, samples: list) -> str:
        got = learn_arm(self.arms_dir, arm, rnd, samples, self.model_dir, self.args.seed, self.con)
        self.learned[arm["name"]].append({"round": rnd, **got})
        self.arm_versions[arm["name"]].append(f"{arm['name']}:{got['version']}")
        self.say(f"arm {arm['name']}: published {got['version']} from {got['samples_written']} samples "
                 f"(learner data/n_samples {got['n_samples']})")
        return got["version"]

    def run(self) -> dict:
        from serving.engine import TorchEngine

        self.say(f"fixed eval set: {len(self.fixed)} prompts; arms {[a['name'] for a in self.arms]}; "
                 f"model {self.model_dir}")
        self.eng = TorchEngine(self.model_dir, max_batch=self.args.max_batch, max_queue=100_000)
        try:
            batches = [draw_train(self.wl, self.rng, self.args.n_train) for _ in range(self.args.rounds)]
            base = self.eng.load_base(BASE)
            samples, _ = self.samples_for(base, batches[0], 0, BASE)
            del base
            for arm in self.arms:
                self.train(arm, 0, samples)
            if self.args.rounds == 2:
                for arm in self.arms:
                    self.round_two(arm, batches[1])
            self.evaluate()
        finally:
            self.eng.close()
        return self.finish()

    def round_two(self, arm: dict, tasks: list) -> None:
        """The arm's v000001 serves ``tasks`` (the same in every arm) and trains v000002."""
        store = arm_store(self.arms_dir, arm, self.model_dir)
        lm = load_version(self.eng, store, "v000001")
        samples, _ = self.samples_for(lm, tasks, 1, f"{arm['name']}:v000001")
        del lm
        self.train(arm, 1, samples)

    def evaluate(self) -> None:
        """Every version on the fixed set, with the same per-prompt sampling seeds."""
        seeds = [derived_seed("fixed-seed", self.args.eval_seed, i) for i in range(len(self.fixed))]
        todo = [(BASE, None, BASE)] + [(v, a, v.split(":", 1)[1])
                                       for a in self.arms for v in self.arm_versions[a["name"]]]
        for name, arm, version in todo:
            store = arm_store(self.arms_dir, arm, self.model_dir) if arm else None
            lm = self.eng.load_base(BASE) if arm is None else load_version(self.eng, store, version)
            got = fixed_eval(self.eng, lm, name, self.fixed, seeds, self.dc)
            del lm
            self.rows += got
            self.say(f"fixed eval {name}: right {sum(r['passed'] for r in got)}/{len(got)}")

    def finish(self) -> dict:
        from flywheel.report import write_fixed

        report = build_report(self.args, self.arms, self.dc, self.fixed, self.rows, self.rounds, self.learned,
                              self.arm_versions, time.time() - self.t0, self.policy)
        (self.out / "pilot.json").write_text(json.dumps(report, indent=1, default=str))
        write_fixed(self.rows, self.out / "fixed_eval.jsonl")
        plotted = write_plot(report, self.out / "pilot.png")
        print_summary(report, self.con)
        self.say(f"wrote {self.out / 'pilot.json'}" + (f" and {self.out / 'pilot.png'}" if plotted else ""))
        return report


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    con = Console()
    try:
        pilot = Pilot(args, con)
    except ValueError as exc:  # a setting refused: named, before any work
        con.print(f"[red]error: {exc}")
        return 2
    pilot.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
