"""``flywheel learn``: run learner cycles (once, or as a daemon on a schedule)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import typer


def _learn(once: bool = typer.Option(False, "--once", help="Run one cycle and exit."),
           store: Optional[str] = typer.Option(None, help="Model store dir or fsspec URL (default $FLYWHEEL_STORE, "
                                               "else $FLYWHEEL_HOME/store)."),
           samples: Optional[Path] = typer.Option(None, help="RewardedSample Parquet root (default "
                                                  "$FLYWHEEL_HOME/data/samples)."),
           state: Optional[Path] = typer.Option(None, help="Learner state dir: watermark, consumed shards, resume "
                                                "checkpoint; on storage that outlives the pod (default "
                                                "$FLYWHEEL_LEARNER_STATE, else $FLYWHEEL_HOME/learner)."),
           min_samples: int = typer.Option(1, help="Skip the cycle below this many trainable samples."),
           steps: int = typer.Option(4, help="Optimizer steps per cycle."),
           batch_size: int = typer.Option(8, help="Samples per step."),
           lr: float = typer.Option(1e-5, help="AdamW learning rate."),
           beta: float = typer.Option(0.1, help="KTO beta."),
           desirable_weight: float = typer.Option(1.0, help="KTO lambda_D (weight of desirable samples)."),
           undesirable_weight: float = typer.Option(1.0, help="KTO lambda_U (weight of undesirable samples)."),
           balance_classes: bool = typer.Option(False, "--balance-classes",
                                                help="Per cycle, raise the minority class's KTO weight so "
                                                     "lambda_D*n_D = lambda_U*n_U."),
           objective: str = typer.Option("kto", help="kto | reinforce."),
           baseline: str = typer.Option("batch", help="REINFORCE baseline: 'batch' (LOO over the step's batch) "
                                        "or 'prompt' (LOO over the other completions of the same prompt)."),
           is_cap: float = typer.Option(2.0, help="Truncation of the importance ratio."),
           max_staleness: int = typer.Option(4, help="Drop samples more than this many versions old."),
           seed: int = typer.Option(0, help="RNG seed."),
           checkpoint_every: int = typer.Option(0, help="Resumable DeepSpeed checkpoint every N steps (0 = off)."),
           zero_stage: int = typer.Option(2, help="DeepSpeed ZeRO stage (1 or 2)."),
           holdout_frac: float = typer.Option(0.0, help="Eval gate: fraction of new samples held out (0 = off)."),
           max_regression: float = typer.Option(0.0, help="Eval gate: allowed score drop vs the parent."),
           gate_problems: Optional[str] = typer.Option(
               None, help="Eval gate on held-out prompts the --gate-verifier selects and scores as the "
                          "workload's users do (HumanEval: code run against the tests in the sandbox), "
                          "e.g. '120-163'; score = pass rate."),
           gate_verifier: str = typer.Option(
               "flywheel.users:gate_verifier", help="Eval gate: the workload's verifier, MODULE:FUNCTION "
                                                    "(learner.gate.GateVerifier); the default is HumanEval's."),
           gate_samples: int = typer.Option(2, min=1, help="Eval gate: completions per held-out prompt."),
           gate_max_tokens: int = typer.Option(128, min=1, help="Eval gate: new tokens per completion."),
           train_layers: int = typer.Option(0, help="Train only the last N decoder layers (0 = all)."),
           measure_free_max: int = typer.Option(0, help="Samples that also get a replay-off forward "
                                                "for route-flip figures (0 = all)."),
           measure_chunk: int = typer.Option(1, min=1, help="Samples per forward in the start-of-cycle reference "
                                             "pass (1 = each alone, unpadded: the layout of --aligned-logprobs, so "
                                             "the mismatch can be exactly 0; more is faster, ~1e-6 apart)."),
           no_replay: bool = typer.Option(False, "--no-replay", help="Free routing (no router replay)."),
           allow_free_routing: bool = typer.Option(False, help="Train samples without routes on free routing."),
           parent: str = typer.Option("stable", help="Train from the 'stable' (promoted) or 'latest' version."),
           every_h: float = typer.Option(1.0, help="Daemon: run a cycle at least every this many hours."),
           every_n: int = typer.Option(64, help="Daemon: run a cycle once this many new samples are sealed."),
           poll_s: float = typer.Option(10.0, help="Daemon: seconds between checks for new samples."),
           micro_batch_size: int = typer.Option(0, min=0, help="Samples per forward/backward; a step's batch is "
                                                "accumulated over micro-batches (0 = one micro-batch)."),
           precision: str = typer.Option("auto", help="auto | fp32 | bf16. auto: the parent version's dtype. "
                                         "bf16: bf16 weights and activations, fp32 master weights and AdamW "
                                         "state under ZeRO. The new version keeps the parent's dtype."),
           activation_checkpointing: bool = typer.Option(False, "--activation-checkpointing",
                                                         help="Recompute layer activations in backward."),
           lateness_s: float = typer.Option(600.0, help="How late (s) a shard may appear after a newer one was "
                                            "consumed and still be found (the watermark's allowed lateness)."),
           metrics_port: int = typer.Option(0, min=0, max=65535, help="Serve Prometheus /metrics on this port "
                                            "(0 = off; rank 0 only)."),
           ) -> None:
    """Train on new sealed samples (KTO + router replay, DeepSpeed) and publish a version."""
    from schemas import settings
    from learner.cycle import count_new, load_state, run_cycle
    from learner.trainer import LearnerConfig, ensure_dist_env

    try:
        cfg = LearnerConfig(steps=steps, batch_size=batch_size, lr=lr, beta=beta, objective=objective,
                            baseline=baseline,
                            desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                            balance_classes=balance_classes,
                            is_cap=is_cap, max_staleness=max_staleness, seed=seed, router_replay=not no_replay,
                            checkpoint_every=checkpoint_every, zero_stage=zero_stage,
                            holdout_frac=holdout_frac, max_regression=max_regression,
                            allow_free_routing=allow_free_routing, min_samples=min_samples,
                            train_layers=train_layers, measure_free_max=measure_free_max, measure_chunk=measure_chunk,
                            micro_batch_size=micro_batch_size, precision=precision,
                            activation_checkpointing=activation_checkpointing, lateness_s=lateness_s)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if parent not in ("stable", "latest"):
        raise typer.BadParameter(f"must be 'stable' or 'latest', got {parent!r}", param_hint="--parent")
    from learner.cycle import open_store

    store = store or settings.store_dir()  # a directory or an fsspec URL
    st = open_store(store)
    if not st.versions():
        typer.echo(f"learn: the model store {store} has no version yet. Publish the base first: "
                   "`flywheel serve` does it on first start (or deploy.store.ModelStore(...).init_base).",
                   err=True)
        raise typer.Exit(1)
    evaluate = None
    if gate_problems:
        from learner.gate import generation_evaluator, load_gate_verifier
        from schemas.modelspec import load_tokenizer

        try:
            verifier = load_gate_verifier(gate_verifier)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--gate-verifier") from exc
        tok = load_tokenizer(st.base_dir)
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        eos = tok.eos_token_id if eos is None or eos == tok.unk_token_id else eos
        try:
            prompts, score = verifier(gate_problems, tok)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--gate-problems") from exc
        try:
            evaluate = generation_evaluator(prompts, score, int(eos), max_tokens=gate_max_tokens,
                                            samples_per_prompt=gate_samples, seed=seed)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
    samples = samples or settings.samples_dir()
    state = state or settings.learner_state_dir()
    ensure_dist_env()  # sets MASTER_PORT etc. when unset; subprocess-friendly
    from learner.metrics import LearnerMetrics, cycle_outcome

    lm = LearnerMetrics()
    if metrics_port and int(os.environ.get("RANK", "0")) == 0:
        lm.serve(metrics_port)

    def cycle() -> None:
        started_ms = int(time.time() * 1000)
        rank0 = int(os.environ.get("RANK", "0")) == 0
        t0 = time.monotonic()
        try:
            m = run_cycle(store, samples, state, cfg, parent=parent, show_progress=rank0, evaluate=evaluate)
        except Exception:
            lm.cycle_done("failed", {}, time.monotonic() - t0)
            raise
        if not rank0:
            return
        # Waiting samples are recounted before the cycle is reported, so a scrape that sees the
        # cycle also sees what it left behind (not the count that started it).
        lm.samples_waiting.set(count_new(samples, state, int(cfg.lateness_s * 1000)))
        lm.cycle_done(*cycle_outcome(m, load_state(state), started_ms), time.monotonic() - t0)
        if m is None:
            cycles = load_state(state)["cycles"]
            if cycles and cycles[-1].get("rejected") and cycles[-1]["at"] >= started_ms:
                typer.echo(f"learn: candidate rejected by the eval gate: {cycles[-1]['rejected']}")
            else:
                typer.echo(f"learn: fewer than {min_samples} new trainable samples; nothing published")
            return
        keys = ("data/n_samples", "kto/loss_first", "kto/loss", "mismatch/max", "is/ratio_mean",
                "perf/tokens_per_s")
        summary = {k: m.metrics[k] for k in keys if k in m.metrics}
        typer.echo(f"learn: published {m.version} (parent {m.parent}, {m.kind}) {json.dumps(summary)}")

    if once:
        cycle()
        return
    last = time.monotonic()
    from deploy.desired import FleetRecord

    fleet = FleetRecord(st)  # `flywheel pause` writes the fleet's desired state on the store
    was_paused = False
    while True:  # daemon: every_h hours or every_n new samples, whichever first
        # Operator pause (`flywheel pause` / `flywheel resume`): read from the fleet's desired
        # state before each cycle, wherever this learner runs; a cycle already running finishes.
        try:
            paused = fleet.read().paused
        except ValueError as exc:  # unreadable record: do not train on a pause we cannot see
            paused = {"actor": "unknown", "reason": f"desired-state record unreadable: {exc}"}
        lm.paused.set(bool(paused))
        if paused:
            if not was_paused:
                typer.echo(f"learn: paused by operator ({json.dumps(paused)}); waiting")
            was_paused = True
            time.sleep(poll_s)
            continue
        if was_paused:
            typer.echo("learn: resumed")
            was_paused = False
        n_new = count_new(samples, state, int(cfg.lateness_s * 1000))  # new shards only, from the watermark
        lm.samples_waiting.set(n_new)
        if n_new >= max(every_n, min_samples) or (time.monotonic() - last >= every_h * 3600 and n_new >= min_samples):
            cycle()
            last = time.monotonic()
        time.sleep(poll_s)


def register(app: typer.Typer) -> None:
    """Add ``flywheel learn`` to the CLI."""
    app.command("learn")(_learn)
