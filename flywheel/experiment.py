"""Does the loop improve the model? Rounds of serve -> vote -> learn on the demo workload.

Each round r serves every selected HumanEval problem ``samples_per_problem`` times with
version v_r (the serving :class:`serving.engine.TorchEngine`: batched sampling, raw behavior
logprobs, expert routes), lets the demo's users vote on each completion by running its
code against the problem's unit tests in the sandbox (:func:`flywheel.users.run_tests`),
writes the votes as RewardedSample Parquet shards (``samplestore.shards``), and runs one real
learner cycle on them (``flywheel learn --once --parent latest``: DeepSpeed, KTO, router
replay, importance correction), which publishes v_{r+1} to the model store. The next round
serves v_{r+1}, hash-verified from the store. A version's thumbs-up rate is the share of its
completions that passed; the last version is compared with the first by

* the Newcombe hybrid-score interval for the difference of two proportions (Newcombe 1998,
  method 10; Wilson intervals per arm), which treats completions as independent; and
* a cluster bootstrap over problems (completions of one problem are correlated), 2,000
  resamples, percentile 95 % interval of the difference;

and a one-sided pooled two-proportion z-test (the canary's test, :mod:`deploy.analysis`).

What it leaves out on purpose: Kafka, the join and the canary (tested on their own, and in
``flywheel demo``); here every completion gets exactly one vote, so the figure is the model's
pass rate on the workload, not the noise of sparse feedback.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import typing
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from pydantic import Field, create_model, model_validator
from pydantic.dataclasses import dataclass
from pydantic.fields import FieldInfo

from deploy.stats import newcombe_interval, two_proportion_z, wilson_interval
from flywheel.demo_config import HUMANEVAL_MAX_TOKENS, HUMANEVAL_PROBLEMS, TEMPERATURE, TOP_P
from learner.config import LearnerConfig, check_learner, learn_flags, readable_errors
from schemas.options import model_fields


# The learner's settings the experiment changes, by LearnerConfig field name (`flywheel learn`
# flags of the same names); every other learner setting is LearnerConfig's default.
EXPERIMENT_LEARNER = {"steps": 8, "batch_size": 16, "lr": 2e-5, "train_layers": 4, "measure_free_max": 2}
# The experiment's settings of the KTO-only learner fields (learner.config.OBJECTIVE_ONLY), applied
# only when the objective is kto: the learner refuses them with any other objective.
EXPERIMENT_KTO_LEARNER = {"balance_classes": True}
# the learner settings `flywheel experiment` takes as flags (EXPERIMENT_LEARNER's values, or
# LearnerConfig's, are their defaults)
LEARNER_FLAGS = ("steps", "batch_size", "lr", "train_layers", "beta", "balance_classes", "objective", "baseline")
_PROGRAM = {"cli": False}  # set by programs (ExperimentConfig(...)), not a flag of `flywheel experiment`


@dataclass
class ExperimentConfig:
    """Knobs of one experiment; validated on construction.

    Each field's ``description`` is its help (``flywheel experiment --help``). The sampling
    (``max_tokens``, ``temperature``, ``top_p``) and ``problems`` default to the demo's
    (``flywheel.demo``): the experiment serves the demo's users. ``learner`` holds the
    ``LearnerConfig`` fields the experiment changes (:data:`EXPERIMENT_LEARNER`).

    Raises:
        pydantic.ValidationError: (a ``ValueError``) a value out of bounds, or ``learner``
            names no ``LearnerConfig`` field, restates its default or is refused by it; the
            message starts with the field's name.
    """

    out: Path = Field(Path("flywheel-experiment"), description="Output directory (store, samples, logs, "
                                                               "experiment.json, the plot).")
    rounds: int = Field(2, ge=1, description="Learner cycles (versions evaluated = rounds + 1).")
    problems: int = Field(HUMANEVAL_PROBLEMS, ge=1, le=164, description="The first N HumanEval problems.")
    problem_ids: Optional[list[int]] = Field(None, description="HumanEval indices (0..163), instead of the first "
                                                               "`problems`.", json_schema_extra=_PROGRAM)
    samples_per_problem: int = Field(4, ge=1, description="Completions per problem per round.")
    max_tokens: int = Field(HUMANEVAL_MAX_TOKENS, ge=1, description="New tokens per completion.")
    temperature: float = Field(TEMPERATURE, description="Sampling temperature, in (0, 2] (sampling, not greedy).")
    top_p: float = Field(TOP_P, description="Nucleus sampling, in (0, 1].")
    seed: Optional[int] = Field(None, ge=0, le=10**12,
                                description="Sampling seeds, 0 to 10**12: the request seeds seed x 1000003 + offsets "
                                            "stay signed 64-bit ints; learner cycle r trains with seed + r (default: "
                                            "the learner's seed, LearnerConfig.seed).")
    max_batch: int = Field(16, ge=1, description="Engine batch size (requests per batch).")
    learner: dict[str, Any] = Field(default_factory=lambda: experiment_learner({}),
                                    description="LearnerConfig fields the experiment changes, by name.",
                                    json_schema_extra=_PROGRAM)
    extra: dict = Field(default_factory=dict, description="Free-form notes kept with the config.",
                        json_schema_extra=_PROGRAM)

    _readable = model_validator(mode="wrap")(classmethod(readable_errors))

    def __post_init__(self):
        self.out = Path(self.out)
        if self.seed is None:  # the experiment's seed starts where the learner's does
            self.seed = LearnerConfig.seed
        checks = [("temperature", 0 < self.temperature <= 2, "must be in (0, 2] (sampling, not greedy)"),
                  ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
                  ("problem_ids", self.problem_ids is None or all(0 <= i < 164 for i in self.problem_ids),
                   "each must be in 0..163")]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")
        check_learner(self.learner)

    def learner_setting(self, name: str):
        """The learner's value of LearnerConfig field ``name`` in this experiment."""
        return self.learner.get(name, getattr(LearnerConfig, name))


def _learner_options() -> type:
    """The model of ``flywheel experiment``'s learner flags (:data:`LEARNER_FLAGS`): each
    LearnerConfig field as declared there (type, bounds, help), with the experiment's value
    (:data:`EXPERIMENT_LEARNER`) as its default where it has one, else None (the learner's
    own default, not declared a second time)."""
    fields, hints = model_fields(LearnerConfig), typing.get_type_hints(LearnerConfig)
    spec = {}
    for n in LEARNER_FLAGS:
        if n not in EXPERIMENT_LEARNER:
            info = FieldInfo.merge_field_infos(fields[n], default=None, description=(
                f"{fields[n].description} Default: the learner's ({fields[n].default!r})."))
            if n in EXPERIMENT_KTO_LEARNER:  # the experiment's value with kto, the learner's otherwise
                flag = n.replace("_", "-")
                info = FieldInfo.merge_field_infos(fields[n], default=None, description=(
                    f"{fields[n].description} Default: {EXPERIMENT_KTO_LEARNER[n]!r} with objective kto, the "
                    f"learner's ({fields[n].default!r}) with any other (which refuses a value other than that)."),
                    json_schema_extra={**(fields[n].json_schema_extra or {}), "flags": f"--{flag}/--no-{flag}"})
            spec[n] = (Optional[hints[n]], info)
            continue
        info = FieldInfo.merge_field_infos(fields[n], default=EXPERIMENT_LEARNER[n])
        if info.default is True and "flags" not in (info.json_schema_extra or {}):  # on by default: --no-x turns it off
            flag = n.replace("_", "-")
            info = FieldInfo.merge_field_infos(info, json_schema_extra={**(info.json_schema_extra or {}),
                                                                        "flags": f"--{flag}/--no-{flag}"})
        spec[n] = (hints[n], info)
    return create_model("ExperimentLearnerOptions", __module__=__name__, **spec)


ExperimentLearnerOptions = _learner_options()


def experiment_learner(changes: dict) -> dict:
    """``ExperimentConfig.learner`` for these ``LearnerConfig`` field values (by name):
    :data:`EXPERIMENT_LEARNER`, then :data:`EXPERIMENT_KTO_LEARNER` when the objective (``changes``'
    or the learner's default) is kto, then ``changes``; less what equals LearnerConfig's default."""
    kto = changes.get("objective", LearnerConfig.objective) == "kto"
    values = {**EXPERIMENT_LEARNER, **(EXPERIMENT_KTO_LEARNER if kto else {}), **changes}
    return {k: v for k, v in values.items() if v != getattr(LearnerConfig, k)}


def learner_changes(options) -> dict:
    """``ExperimentConfig.learner`` from the learner flags (an ``ExperimentLearnerOptions``):
    :func:`experiment_learner` of the flags given (a flag left at None is the experiment's or
    the learner's default)."""
    return experiment_learner({k: v for k, v in options.model_dump().items() if v is not None})


# ------------------------------------------------------------------ statistics
def wilson(up: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval (Wilson 1927): :func:`deploy.stats.wilson_interval`."""
    return wilson_interval(up, n, z)


def newcombe_diff(up1: int, n1: int, up2: int, n2: int) -> tuple[float, float, float]:
    """``p2 - p1`` and its 95 % Newcombe interval: :func:`deploy.stats.newcombe_interval`."""
    return newcombe_interval(up1, n1, up2, n2)


def one_sided_z(up1: int, n1: int, up2: int, n2: int) -> tuple[float, float]:
    """Pooled two-proportion z-test of ``p2 > p1``: ``(z, one-sided p-value)`` with
    ``z = (p2 - p1) / se`` (:func:`deploy.stats.two_proportion_z` tests H1 p1 < p2 as
    ``z' = (p1 - p2) / se = -z`` with the same p-value ``Phi(z')``)."""
    z, pv = two_proportion_z(up1, n1, up2, n2)
    return -z, pv


def cluster_bootstrap_diff(first: dict[int, list[bool]], last: dict[int, list[bool]], n_boot: int = 2000,
                           seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of ``rate(last) - rate(first)`` resampling problems (the
    clusters) with replacement; both versions use the same resampled problems."""
    rng = random.Random(seed)
    ids = sorted(set(first) & set(last))
    if not ids:
        raise ValueError("first, last: no problem in common")
    diffs = []
    for _ in range(n_boot):
        pick = [rng.choice(ids) for _ in ids]
        a = [x for i in pick for x in first[i]]
        b = [x for i in pick for x in last[i]]
        diffs.append(sum(b) / len(b) - sum(a) / len(a))
    diffs.sort()
    return diffs[int(0.025 * n_boot)], diffs[int(0.975 * n_boot) - 1]


# ------------------------------------------------------------------ the run
def _samples_for(cfg: ExperimentConfig, version: str, problems: list[dict], results: dict, passed: list[bool],
                 prompts: list[list[int]], sampling) -> list:
    from schemas.events import ExpertRoutes, RewardedSample, now_ms

    out = []
    for (pi, _j), res, ok, sp in zip(results["keys"], results["res"], passed, sampling):
        t = now_ms()
        out.append(RewardedSample(
            completion_id=uuid.uuid4(), model_version=version, created_at=t, user_hash="experiment",
            prompt_token_ids=prompts[pi], completion_token_ids=res.completion_token_ids,
            behavior_logprobs=res.behavior_logprobs, sampling=sp,
            expert_routes=ExpertRoutes.from_array(res.expert_routes) if res.expert_routes is not None else None,
            finish_reason=res.finish_reason, reward=1.0 if ok else -1.0, label=ok, n_votes=1,
            votes_up=int(ok), votes_down=int(not ok), event_ids=[str(uuid.uuid4())], sealed_at=t))
    return out


class _Workload:
    """The served problems, their chat prompts, and the engine (one per experiment run)."""

    def __init__(self, cfg: ExperimentConfig, model_dir: Path):
        from flywheel.users import build_messages, load_problems
        from serving.engine import TorchEngine

        allp = load_problems()
        self.ids = cfg.problem_ids if cfg.problem_ids is not None else list(range(cfg.problems))
        self.problems = [allp[i] for i in self.ids]
        self.engine = TorchEngine(model_dir, max_batch=cfg.max_batch, max_queue=10_000)
        tok = self.engine.tokenizer
        self.prompts = []
        for p in self.problems:
            enc = tok.apply_chat_template(build_messages(p), add_generation_prompt=True, tokenize=True)
            self.prompts.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))

    def load(self, store, version: str):
        """``version`` from ``store`` into the engine, hash-verified (v000000: the base checkpoint)."""
        if version == "v000000":
            return self.engine.load_base(version)
        m = store.manifest(version)
        return self.engine.load_weights(store.load(version), version,
                                        expected_hashes={k: t.sha256 for k, t in m.tensors.items()})

    def serve_and_vote(self, cfg: ExperimentConfig, lm, label: str, seed_base: int, console) -> dict:
        """Serve every problem ``samples_per_problem`` times with ``lm`` and let the users vote.

        Returns ``{"version", "thumbs_up", "n", "rate", "ci95", "by_problem", "serve_vote_s",
        "completion_tokens", "keys", "res", "passed", "sampling"}`` (the last four for training).
        """
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from flywheel.users import extract_code, run_tests
        from schemas.events import SamplingParams
        from serving.params import GenRequest

        eng, tok = self.engine, self.engine.tokenizer
        keys = [(pi, j) for pi in range(len(self.problems)) for j in range(cfg.samples_per_problem)]
        sampling = [SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                                   seed=seed_base + i) for i in range(len(keys))]
        t0 = time.time()
        with Progress(TextColumn(f"{label} {lm.version}: serve + vote"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TextColumn("{task.fields[up]} up"), console=console) as bar:
            task = bar.add_task("gen", total=len(keys), up=0)
            futs = [eng.submit(GenRequest(prompt_token_ids=self.prompts[pi], sampling=sp, model=lm,
                                          stop_token_ids=(eng.eos_id,)))
                    for (pi, _j), sp in zip(keys, sampling)]
            res = []
            with ThreadPoolExecutor(2) as pool:
                votes = []
                for (pi, _j), f in zip(keys, futs):
                    g = f.result()
                    res.append(g)
                    code = extract_code(tok.decode(g.completion_token_ids, skip_special_tokens=True))
                    votes.append(pool.submit(lambda c=code, p=self.problems[pi]: bool(c) and run_tests(p, c)[0]))
                    done = [v.result() for v in votes if v.done()]
                    bar.update(task, completed=len(res), up=sum(done))
                    if not console.is_terminal and len(res) % max(len(keys) // 10, 1) == 0:
                        # piped to a log: a status line every 10 % instead of the live bar
                        console.print(f"{label} {lm.version}: {len(res)}/{len(keys)} served, "
                                      f"{sum(done)} up so far, {time.time() - t0:.0f} s")
                passed = [bool(v.result()) for v in votes]
                bar.update(task, completed=len(res), up=sum(passed))
        by_problem: dict[int, list[bool]] = {}
        for (pi, _j), ok in zip(keys, passed):
            by_problem.setdefault(self.ids[pi], []).append(ok)
        up, n = sum(passed), len(passed)
        lo, hi = wilson(up, n)
        console.print(f"{label}: {lm.version} thumbs-up {up}/{n} = {up / n:.3f} (95% CI {lo:.3f}-{hi:.3f}), "
                      f"{time.time() - t0:.0f} s")
        return {"version": lm.version, "thumbs_up": up, "n": n, "rate": up / n, "ci95": [lo, hi],
                "by_problem": by_problem, "serve_vote_s": time.time() - t0,
                "completion_tokens": sum(len(g.completion_token_ids) for g in res),
                "keys": keys, "res": res, "passed": passed, "sampling": sampling}


_PUBLIC = ("version", "thumbs_up", "n", "rate", "ci95", "by_problem", "serve_vote_s", "completion_tokens")


def compare(first: dict, last: dict, seed: int = 0) -> dict:
    """Last vs first version: difference, Newcombe and problem-bootstrap 95 % intervals, z-test."""
    d, dlo, dhi = newcombe_diff(first["thumbs_up"], first["n"], last["thumbs_up"], last["n"])
    z, pv = one_sided_z(first["thumbs_up"], first["n"], last["thumbs_up"], last["n"])
    blo, bhi = cluster_bootstrap_diff(first["by_problem"], last["by_problem"], seed=seed)
    return {"first": first["version"], "last": last["version"], "diff": d, "newcombe_ci95": [dlo, dhi],
            "cluster_bootstrap_ci95": [blo, bhi], "z": z, "p_one_sided": pv, "improved": dlo > 0 and blo > 0}


def _store_root(cfg: ExperimentConfig):
    """The experiment's model store root (``out/home/store`` unless ``FLYWHEEL_STORE`` names
    one); points ``FLYWHEEL_HOME`` at ``out/home``. Creates nothing."""
    from schemas import settings

    os.environ["FLYWHEEL_HOME"] = str(cfg.out / "home")
    return settings.store_dir()


def _setup(cfg: ExperimentConfig):
    """Create ``out/logs`` and the store (with the base checkpoint as v000000 when empty).
    Returns ``(store, model_dir)``. Raises ValueError ("model dir: ...") without a checkpoint."""
    from modelstore.store import ModelStore
    from schemas import settings

    root = _store_root(cfg)
    (cfg.out / "logs").mkdir(parents=True, exist_ok=True)
    store = ModelStore(root)
    model_dir = settings.base_model_dir()
    if not store.versions():
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"model dir: {model_dir} holds no checkpoint; run 'flywheel model init' first "
                             "(or set FLYWHEEL_MODEL_DIR)")
        store.init_base(model_dir)
    return store, model_dir


def run(cfg: ExperimentConfig, console=None) -> dict:
    """Run the experiment; returns (and writes to ``out/experiment.json``) the report.

    Raises:
        RuntimeError: a learner cycle failed or published nothing (its log is named).
    """
    from rich.console import Console

    from samplestore.shards import shard_path, write_shard
    from schemas import settings

    console = console or Console()
    out = cfg.out
    store, model_dir = _setup(cfg)
    wl = _Workload(cfg, model_dir)
    versions: list[dict] = []
    version = store.versions()[-1]
    t_start = time.time()
    try:
        for r in range(cfg.rounds + 1):
            lm = wl.load(store, version)
            got = wl.serve_and_vote(cfg, lm, f"round {r}", cfg.seed * 1_000_003 + r * 10_007, console)
            versions.append({**{k: got[k] for k in _PUBLIC}, "round": r})
            (out / "experiment.partial.json").write_text(json.dumps({"versions": versions}, indent=2, default=str))
            if r == cfg.rounds:
                break
            samples = _samples_for(cfg, version, wl.problems, got, got["passed"], wl.prompts, got["sampling"])
            write_shard(samples, shard_path(settings.samples_dir(), min(s.sealed_at for s in samples),
                                            f"experiment-{r}"))
            del lm, got
            version = _learn(cfg, r, out / "logs", store, console)
            versions[-1]["learner"] = {k: v for k, v in store.manifest(version).metrics.items()
                                       if k.split("/")[0] in ("kto", "pg", "data", "mismatch", "is", "perf")}
    finally:
        wl.engine.close()

    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
              "versions": versions, "wall_s": time.time() - t_start,
              "comparison": compare(versions[0], versions[-1], cfg.seed)}
    (out / "experiment.json").write_text(json.dumps(report, indent=2, default=str))
    write_plot(report, out / "learning_curve.png")
    return report


def evaluate(cfg: ExperimentConfig, versions: list[str], console=None) -> dict:
    """More votes for already-trained ``versions`` of ``cfg.out``'s store (no training): each
    is served ``samples_per_problem`` more times per problem with seeds from ``cfg.seed`` (use
    a seed the experiment did not use, so the draws are new and independent). With
    ``out/experiment.json`` present and the same problems served, the new votes are pooled with
    the experiment's votes for the same version, and first vs last of ``versions`` is compared
    on the pooled counts (other problems: not pooled, the pooled figures equal the new ones).
    Writes ``out/eval-seed<seed>.json`` and ``out/learning_curve_pooled.png``.

    Everything is checked before anything is created or served: a refusal leaves ``cfg.out``
    as it was.

    Raises:
        ValueError: ``versions`` is empty, there is no store, a version is not in the store, the
            base model directory holds no checkpoint ("model dir: ..."), or ``out/experiment.json``
            is not an experiment's report (the message names the file and the reason).
    """
    from rich.console import Console

    from modelstore.store import ModelStore, StoreMissingError
    from schemas import settings

    console = console or Console()
    if not versions:
        raise ValueError("versions: give at least one version of the store, e.g. 'v000000,v000002'")
    root = _store_root(cfg)
    try:
        have = ModelStore(root, create=False).versions()
    except StoreMissingError:
        raise ValueError(f"versions: no model store at {root} (run `flywheel experiment --out {cfg.out}` "
                         "first)") from None
    missing = [v for v in versions if v not in have]
    if missing:
        raise ValueError(f"versions: {missing} not in the store at {root} (it holds {have})")
    model_dir = settings.base_model_dir()
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model dir: {model_dir} holds no checkpoint; run 'flywheel model init' first "
                         "(or set FLYWHEEL_MODEL_DIR)")
    exp = None
    ep = cfg.out / "experiment.json"
    if ep.exists():
        try:
            exp = json.loads(ep.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{ep}: not JSON: {exc}") from exc
        if not isinstance(exp, dict) or not isinstance(exp.get("versions"), list):
            raise ValueError(f"{ep}: versions: missing (not an experiment's report)")
    store, model_dir = _setup(cfg)
    prior = {}
    if exp is not None:
        ec = exp.get("config", {})
        served = ec.get("problem_ids") or list(range(ec.get("problems", 0)))
        mine = cfg.problem_ids if cfg.problem_ids is not None else list(range(cfg.problems))
        if sorted(served) == sorted(mine):
            prior = {v["version"]: v for v in exp["versions"]}
        else:  # votes on other problems are another workload: never pooled
            console.print(f"eval: not pooled with experiment.json (it served problems {served}, this run {mine})")
    wl = _Workload(cfg, model_dir)
    rows = []
    try:
        for i, v in enumerate(versions):
            got = wl.serve_and_vote(cfg, wl.load(store, v), f"eval {i}", cfg.seed * 1_000_003 + 7_919 * (i + 1),
                                    console)
            new = {k: got[k] for k in _PUBLIC}
            pooled = dict(new)
            if v in prior:
                p = prior[v]
                bp = {int(k): list(x) for k, x in p["by_problem"].items()}
                for k, x in new["by_problem"].items():
                    bp.setdefault(int(k), []).extend(x)
                up, n = p["thumbs_up"] + new["thumbs_up"], p["n"] + new["n"]
                pooled = {**new, "thumbs_up": up, "n": n, "rate": up / n, "ci95": list(wilson(up, n)),
                          "by_problem": bp}
            rows.append({"version": v, "new": new, "pooled": pooled})
    finally:
        wl.engine.close()
    report = {"seed": cfg.seed, "versions": rows,
              "comparison_new": compare(rows[0]["new"], rows[-1]["new"], cfg.seed),
              "comparison_pooled": compare(rows[0]["pooled"], rows[-1]["pooled"], cfg.seed)}
    (cfg.out / f"eval-seed{cfg.seed}.json").write_text(json.dumps(report, indent=2, default=str))
    write_plot({"versions": [r["pooled"] for r in rows], "comparison": report["comparison_pooled"]},
               cfg.out / "learning_curve_pooled.png")
    return report


def _learn(cfg: ExperimentConfig, r: int, logs: Path, store, console) -> str:
    before = set(store.versions())
    args = [sys.executable, "-m", "flywheel.cli", "learn", "--once", "--parent", "latest", *learn_flags(cfg.learner),
            "--seed", str(cfg.seed + r)]
    get = cfg.learner_setting
    console.print(f"round {r}: learner cycle ({get('objective')}, {get('steps')} steps x {get('batch_size')}, "
                  f"lr {get('lr')}, last {get('train_layers')} layers) ...")
    t0 = time.time()
    log = logs / f"learner-{r}.log"
    with open(log, "ab") as f:
        p = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    new = sorted(set(store.versions()) - before)
    if p.returncode != 0 or not new:
        raise RuntimeError(f"learner cycle {r} failed (exit {p.returncode}, published {new}); see {log}")
    console.print(f"round {r}: published {new[-1]} in {time.time() - t0:.0f} s")
    return new[-1]


def write_plot(report: dict, path: Path) -> None:
    """Thumbs-up rate by version with 95 % Wilson intervals (line + error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vs = report["versions"]
    xs = list(range(len(vs)))
    rates = [v["rate"] for v in vs]
    fig, ax = plt.subplots(figsize=(max(4.5, 1.3 * len(vs) + 2), 3.6))
    ax.errorbar(xs, rates, yerr=[[v["rate"] - v["ci95"][0] for v in vs], [v["ci95"][1] - v["rate"] for v in vs]],
                fmt="o-", capsize=5)
    ax.set_xticks(xs, [f"{v['version']}\n{v['thumbs_up']}/{v['n']}" for v in vs], fontsize=8)
    ax.set_ylabel("thumbs-up rate (95% Wilson CI)")
    c = report["comparison"]
    ax.set_title(f"learning on the demo workload: {c['last']} - {c['first']} = {c['diff']:+.3f} "
                 f"[{c['newcombe_ci95'][0]:+.3f}, {c['newcombe_ci95'][1]:+.3f}]", fontsize=9)
    ax.set_ylim(0, max(0.5, max(v["ci95"][1] for v in vs) + 0.05))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
