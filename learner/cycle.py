"""One learner cycle: new sealed samples -> DeepSpeed update -> a new version in the store.

Reads the RewardedSample Parquet shards written by ``ingest`` with DuckDB (hive
partitioning, partition column ``model_version``), skips completions already trained on
(``<state_dir>/learner_state.json`` keeps their ids; ``<state_dir>/ckpt`` holds the
resumable DeepSpeed checkpoint of an unfinished cycle), loads the parent = the store's
latest version, trains (``learner.trainer.train``) and publishes through the model store
(``deploy.store.ModelStore`` API: ``base_dir``, ``latest()``, ``load(v)``,
``publish(state, parent, metrics, eval)``), which writes the bit-exact delta and the
manifest with per-tensor sha256. All training metrics go into the manifest.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from schemas.arrow import row_to_sample
from schemas.events import RewardedSample
from schemas.manifest import VersionManifest
from learner.gate import Evaluator, gate_decision, preference_margin_evaluator, split_holdout
from learner.trainer import LearnerConfig, train

STATE_FILE = "learner_state.json"


def open_store(store_root):
    """``store_root`` if it already is a store object, else ``deploy.store.ModelStore(store_root)``."""
    if hasattr(store_root, "publish") and hasattr(store_root, "load"):
        return store_root
    from deploy.store import ModelStore

    return ModelStore(store_root)  # a directory, or a URL (s3://, memory://, ...) opened through fsspec


def load_state(state_dir: str | Path) -> dict:
    """The learner state: ``{"trained": [completion_id, ...], "cycles": [...]}`` (empty if new)."""
    f = Path(state_dir) / STATE_FILE
    if not f.exists():
        return {"trained": [], "cycles": []}
    return json.loads(f.read_text())


def save_state(state_dir: str | Path, state: dict) -> None:
    """Write the learner state atomically (temp file + rename)."""
    d = Path(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{STATE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(d / STATE_FILE)


def read_samples(samples_dir: str | Path, exclude: set[str] | None = None) -> list[RewardedSample]:
    """Sealed RewardedSamples from ``<samples_dir>/**/*.parquet`` via DuckDB, oldest seal first.

    One row per completion_id (the latest ``sealed_at`` wins); ids in ``exclude`` skipped.
    Returns [] when there are no shards.

    Raises:
        pydantic.ValidationError: a row does not make a valid RewardedSample (names the field).
    """
    import duckdb

    root = Path(samples_dir)
    if not root.exists() or not any(root.rglob("*.parquet")):
        return []
    glob = str(root / "**" / "*.parquet").replace("'", "''")
    con = duckdb.connect()
    try:
        tbl = con.sql(
            f"SELECT * FROM read_parquet('{glob}', hive_partitioning=true, union_by_name=true) "
            "QUALIFY row_number() OVER (PARTITION BY completion_id ORDER BY sealed_at DESC) = 1 "
            "ORDER BY sealed_at, completion_id").to_arrow_table()
    finally:
        con.close()
    exclude = exclude or set()
    out = []
    for row in tbl.to_pylist():
        if row["completion_id"] in exclude:
            continue
        row["model_version"] = str(row["model_version"])
        out.append(row_to_sample(row))
    return out


def parent_version(store, which: str = "stable") -> str | None:
    """The version a cycle trains from.

    ``"stable"``: the newest version whose last status is ``promoted`` (what serving runs
    and what produced the newest samples), falling back to the latest when none is;
    ``"latest"``: the newest version. None on an empty store.
    """
    if which not in ("stable", "latest"):
        raise ValueError(f"parent: must be 'stable' or 'latest', got {which!r}")
    vs = list(store.versions())
    if not vs:
        return None
    if which == "stable":
        for v in reversed(vs):
            hist = store.manifest(v).status_history
            if hist and hist[-1].status == "promoted":
                return v
    return vs[-1]


def run_cycle(store_root, samples_dir: str | Path, state_dir: str | Path, config: LearnerConfig,
              show_progress: bool = True, parent: str = "stable", evaluate: Evaluator | None = None
              ) -> VersionManifest | None:
    """Train on the sealed samples not yet trained on and publish one new version.

    Args:
        store_root: model store directory (or a store object with the ModelStore API).
        samples_dir: root of the RewardedSample Parquet shards.
        state_dir: where the learner keeps ``learner_state.json`` (trained completion ids).
        config: :class:`learner.trainer.LearnerConfig`.
        show_progress: draw a rich progress bar on stderr.
        parent: which version to train from, ``"stable"`` or ``"latest"`` (:func:`parent_version`).
        evaluate: evaluation gate ``evaluate(model) -> {"score": float, ...}`` run on the
            parent and on the candidate; default: with ``config.holdout_frac > 0``, the
            preference margin on held-out new samples (:mod:`learner.gate`), else no gate.

    Returns:
        The published :class:`VersionManifest`, or None when fewer than
        ``config.min_samples`` trainable samples are available (nothing is consumed then) or
        the gate rejected the candidate (samples consumed; the reason is the last entry of
        ``learner_state.json`` ``cycles``).

    Raises:
        RuntimeError: the store has no version to train from.
    """
    from schemas.modelspec import load_model

    store = open_store(store_root)
    parent = parent_version(store, parent)
    if parent is None:
        raise RuntimeError(f"model store {store_root}: no version yet; publish a base version first")
    state = load_state(state_dir)
    done = set(state["trained"])
    samples = read_samples(samples_dir, exclude=done)
    if len(samples) < config.min_samples:
        return None

    t0 = time.perf_counter()
    model = load_model(store.base_dir)
    parent_state = store.load(parent)
    missing, unexpected = model.load_state_dict(parent_state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"parent {parent}: state does not fit the base model (missing "
                           f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})")
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    # Memory: keep only the parent's key order and dtypes; the model holds the weights now
    # (the full SmolLM2 MoE is 1.5 GB fp32 per copy; DeepSpeed adds ~4 copies).
    parent_dtypes = {k: v.dtype for k, v in parent_state.items()}
    del parent_state
    if hasattr(store, "clear_cache"):
        store.clear_cache()
    load_s = time.perf_counter() - t0

    progress = None
    bar = None
    if show_progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("learn {task.fields[parent]}→"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), TextColumn("{task.fields[status]}"),
                       console=Console(stderr=True), transient=False)
        task = bar.add_task("learn", total=config.steps, parent=parent, status="measuring")
        bar.start()

        def progress(step: int, met: dict) -> None:
            loss = met.get("kto/loss", met.get("pg/loss", float("nan")))
            bar.update(task, completed=step, status=f"loss {loss:.4f}  is {met.get('is/ratio_mean', 1):.3f}")

    train_samples = samples
    if evaluate is None and config.holdout_frac > 0:
        train_samples, hold = split_holdout(samples, config.holdout_frac)
        if any(s.label for s in hold) and not all(s.label for s in hold):
            evaluate = preference_margin_evaluator(hold, pad_id)
    eval_parent = evaluate(model) if evaluate else None
    try:
        new_state, metrics = train(model, train_samples, parent, config, pad_id, progress,
                                   ckpt_dir=Path(state_dir) / "ckpt")
    finally:
        if bar is not None:
            bar.stop()
    if new_state is None:
        return None
    if int(os.environ.get("RANK", "0")) != 0:  # multi-process (torchrun): rank 0 publishes
        return None
    metrics["perf/load_s"] = load_s
    metrics["perf/cycle_s"] = time.perf_counter() - t0
    record = {"parent": parent, "n_candidates": len(samples), "n_samples": metrics.get("data/n_samples"),
              "at": int(time.time() * 1000)}
    eval_result: dict = {}
    if evaluate is not None:
        eval_cand = evaluate(model)  # train() updated ``model`` in place: it is the candidate
        ok, reason = gate_decision(eval_parent, eval_cand, config.max_regression)
        eval_result = {"parent": eval_parent, "candidate": eval_cand, "passed": ok, "reason": reason}
        if not ok:
            state["trained"] = sorted(done | {str(s.completion_id) for s in samples})
            state["cycles"].append({**record, "version": None, "rejected": reason, "eval": eval_result,
                                    "metrics": metrics})
            save_state(state_dir, state)
            shutil.rmtree(Path(state_dir) / "ckpt", ignore_errors=True)
            return None
    keys = list(parent_dtypes) if parent_dtypes else list(new_state)
    publish_state = {k: new_state[k].detach().to(parent_dtypes[k]).contiguous() if k in parent_dtypes
                     else new_state[k] for k in keys}
    del new_state
    manifest = store.publish(publish_state, parent=parent, metrics=metrics, eval=eval_result)
    state["trained"] = sorted(done | {str(s.completion_id) for s in samples})
    state["cycles"].append({**record, "version": manifest.version})
    save_state(state_dir, state)
    shutil.rmtree(Path(state_dir) / "ckpt", ignore_errors=True)  # the cycle is done
    return manifest
