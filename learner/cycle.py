"""One learner cycle: new sealed samples -> DeepSpeed update -> a new version in the store.

**Finding new samples costs the same whatever the history** (``samplestore.catalog``): shard names
carry the time of their first seal inside ``date=/hour=`` partitions, and the learner keeps a
watermark ``W`` (the newest first-seal time it consumed) and the names of the shards it
consumed whose time is within ``lateness`` of it. A poll lists only the partitions from
``W - lateness`` on and reads only the footers (or the ``split`` column) of shards it has
not consumed; no older file is opened and no old row is materialised. A shard that appears
more than ``lateness`` (default 10 min) after a newer shard was consumed is never seen:
ingest names a shard when it seals it and renames it into place seconds later, so
``lateness`` only needs to cover that delay and clock skew between ingest hosts.

State (``<state_dir>/learner_state.json``, bounded: no per-sample ids)::

    {"format": 2, "watermark_ms": W, "consumed": {"date=../hour=../part-...": first_seal_ms},
     "cycles": [the last MAX_CYCLES cycle records: published, rejected or skipped (run_cycle)]}

A format-1 state (every trained completion id) is upgraded once, by one scan of the shards
(:func:`upgrade_state`). ``<state_dir>/ckpt`` holds the resumable DeepSpeed checkpoint of an
unfinished cycle and ``<state_dir>/cycle`` the cycle's samples spilled to a local Arrow file
(:class:`learner.data.SpilledSamples`), read a micro-batch at a time. The parent is the
store's stable (or latest) version; the store (``modelstore.store.ModelStore`` API: ``base_dir``,
``latest()``, ``load(v)``, ``publish(state, parent, metrics, eval)``) writes the bit-exact
delta and the manifest with per-tensor sha256. All training metrics go into the manifest.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from modelstore.store import NonFiniteWeightsError
from samplestore.catalog import Shard, count_rows, find_shards, read_shards
from schemas.arrow import table_to_samples
from schemas.events import RewardedSample, now_ms
from schemas.manifest import VersionManifest
from learner.daemon_config import DaemonConfig
from learner.data import SpilledSamples
from learner.gate import Evaluator, gate_decision, in_holdout, preference_margin_evaluator
from learner.rank import is_rank0
from learner.trainer import LearnerConfig, train

STATE_FILE = "learner_state.json"
STATE_FORMAT = 2
MAX_CYCLES = 100  # cycle records kept in the state (every version's metrics are in its manifest)


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (``serving.engine.trim_heap``)."""
    from schemas.modelspec import trim_heap as trim

    trim()


def open_store(store_root):
    """``store_root`` if it already is a store object, else ``modelstore.store.ModelStore(store_root)``."""
    if hasattr(store_root, "publish") and hasattr(store_root, "load"):
        return store_root
    from modelstore.store import ModelStore

    return ModelStore(store_root)  # a directory, or a URL (s3://, memory://, ...) opened through fsspec


def new_state() -> dict:
    """An empty format-2 learner state."""
    return {"format": STATE_FORMAT, "watermark_ms": 0, "consumed": {}, "cycles": []}


def load_state(state_dir: str | Path) -> dict:
    """The learner state (module docstring; a new one if none). A format-1 state (with
    ``trained`` ids) is returned as stored: :func:`upgrade_state` converts it."""
    f = Path(state_dir) / STATE_FILE
    if not f.exists():
        return new_state()
    return json.loads(f.read_text())


def save_state(state_dir: str | Path, state: dict) -> None:
    """Write the learner state atomically (temp file + rename)."""
    d = Path(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{STATE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(d / STATE_FILE)


def upgrade_state(state: dict, samples_dir: str | Path, lateness_ms: int) -> dict:
    """A format-1 state (``{"trained": [ids], "cycles"}``) -> format 2, by one scan of the
    shards' ids: a shard is consumed when all its ids were trained on (the format-1 learner
    consumed whole shards); the watermark is the oldest unconsumed shard's time (or the
    newest consumed one's), so nothing untrained falls behind it. Format 2 is returned as is."""
    if "trained" not in state:
        return state
    trained = set(state["trained"])
    consumed, pending = {}, []
    for sh in find_shards(samples_dir, 0):
        ids = read_shards([sh], ["completion_id"]).column(0).to_pylist()
        if ids and all(i in trained for i in ids):
            consumed[sh.name] = sh.sealed_ms
        else:
            pending.append(sh.sealed_ms)
    w = min(pending) if pending else max(consumed.values(), default=0)
    return {"format": STATE_FORMAT, "watermark_ms": w,
            "consumed": {n: t for n, t in consumed.items() if t >= w - lateness_ms},
            "cycles": list(state.get("cycles", []))[-MAX_CYCLES:]}


def new_shards(samples_dir: str | Path, state: dict, lateness_ms: int) -> list[Shard]:
    """Shards not consumed yet, found from the watermark (partitions before
    ``watermark_ms - lateness_ms`` are not listed)."""
    since = max(int(state["watermark_ms"]) - lateness_ms, 0)
    return [s for s in find_shards(samples_dir, since) if s.name not in state["consumed"]]


def consume(state: dict, shards: list[Shard], lateness_ms: int) -> dict:
    """Record ``shards`` as consumed: the watermark moves to the newest first-seal time and
    names older than ``watermark - lateness`` are forgotten (they are never listed again)."""
    consumed = dict(state["consumed"])
    for s in shards:
        consumed[s.name] = s.sealed_ms
    w = max([int(state["watermark_ms"])] + [s.sealed_ms for s in shards])
    return {**state, "watermark_ms": w, "consumed": {n: t for n, t in consumed.items() if t >= w - lateness_ms}}


def count_new(samples_dir: str | Path, state_dir: str | Path, lateness_ms: int) -> int:
    """Trainable (``train`` split) samples in the shards not consumed yet (the daemon's poll:
    lists the partitions from the watermark on and reads the ``split`` column of new shards)."""
    state = _loaded(state_dir, samples_dir, lateness_ms)
    return count_rows(new_shards(samples_dir, state, lateness_ms), "train")


def _loaded(state_dir: str | Path, samples_dir: str | Path, lateness_ms: int) -> dict:
    """The state, upgraded to format 2 and saved when it was format 1 (one scan, once)."""
    state = load_state(state_dir)
    if "trained" in state:
        state = upgrade_state(state, samples_dir, lateness_ms)
        save_state(state_dir, state)
    return state


def read_samples(samples_dir: str | Path, exclude: set[str] | None = None) -> list[RewardedSample]:
    """Every RewardedSample in the shards (a full scan, for tests and tools; cycles use
    :func:`new_shards`), one per completion_id, oldest seal first; ids in ``exclude`` skipped.

    Raises:
        pydantic.ValidationError: a row does not make a valid RewardedSample (names the field).
        samplestore.catalog.OldShardsError: format-1 shards are present (``flywheel data migrate``).
    """
    out, seen = [], set(exclude or ())
    for s in table_to_samples(read_shards(find_shards(samples_dir, 0))):
        if str(s.completion_id) not in seen:
            seen.add(str(s.completion_id))
            out.append(s)
    return sorted(out, key=lambda s: (s.sealed_at, str(s.completion_id)))


#: what each of the trainer's ``data/dropped_<reason>`` counts means, in a skipped cycle's reason
_DROPPED = {
    "stale": "stale (made more than max_staleness {max_staleness} versions before the parent {parent})",
    "bad_version": "with an unreadable model_version",
    "eval_split": "in the eval split (never trained on)",
    "empty_completion": "with an empty prompt or completion",
    "logprobs_misaligned": "whose behavior_logprobs do not match their completion",
    "routes_missing": "without expert routes (router replay needs them; see --allow-free-routing)",
    "routes_misaligned": "whose expert routes do not fit the model's layers and top_k",
    "routes_out_of_range": "whose expert routes name an expert the model lacks",
    "not_positive": "with reward <= 0 (objective psr trains on rewards > 0 only)",
}


def skip_reason(metrics: dict, config: LearnerConfig, parent: str, n_held: int = 0) -> str:
    """Why a cycle trained nothing, from the trainer's ``data/*`` metrics (:func:`learner.trainer.train`
    returned no state): ``"4 new samples, none trainable: 4 with reward <= 0 (objective psr
    trains on rewards > 0 only)"``; ``n_held`` samples held out for the gate are counted too.
    Drop reasons without wording here are named as the trainer counts them."""
    n = int(metrics.get("data/n_candidates", 0)) + n_held
    kept = int(metrics.get("data/n_samples", 0))
    parts = [f"{int(c)} " + _DROPPED.get(k.removeprefix("data/dropped_"), k.removeprefix("data/dropped_")).format(
                 max_staleness=config.max_staleness, parent=parent)
             for k, c in metrics.items() if k.startswith("data/dropped_") and c]
    if n_held:
        parts.append(f"{n_held} held out for the eval gate")
    head = f"{n} new samples, " + ("none trainable" if kept == 0 else
                                   f"{kept} trainable, fewer than min_samples {config.min_samples}")
    return head + (": " + ", ".join(parts) if parts else "")


def parent_version(store, which: str = "stable") -> str | None:
    """The version a cycle trains from.

    ``"stable"``: the store's stable record (``ModelStore.stable()``: what every pod serves,
    moved by promote, rollback and rollback --to, so an operator's rollback is honoured),
    falling back to the latest when there is none; ``"latest"``: the newest version. None on
    an empty store.
    """
    if which not in ("stable", "latest"):
        raise ValueError(f"parent: must be 'stable' or 'latest', got {which!r}")
    vs = list(store.versions())
    if not vs:
        return None
    if which == "stable":
        stable = store.stable() if hasattr(store, "stable") else None
        if stable is not None:
            return stable
    return vs[-1]


def run_cycle(store_root, samples_dir: str | Path, state_dir: str | Path, config: LearnerConfig,
              show_progress: bool = True, parent: str = DaemonConfig.parent, evaluate: Evaluator | None = None,
              skipped: dict | None = None) -> VersionManifest | None:
    """Train on the sealed samples of the shards not yet consumed and publish one new version.

    Args:
        store_root: model store directory (or a store object with the ModelStore API).
        samples_dir: root of the RewardedSample Parquet shards.
        state_dir: where the learner keeps ``learner_state.json`` (watermark, consumed shards).
        config: :class:`learner.trainer.LearnerConfig`.
        show_progress: draw a rich progress bar on stderr.
        parent: which version to train from, ``"stable"`` or ``"latest"`` (:func:`parent_version`;
            default: ``DaemonConfig``'s).
        evaluate: evaluation gate ``evaluate(model) -> {"score": float, ...}`` run on the
            parent and on the candidate; default: with ``config.holdout_frac > 0``, the
            preference margin on held-out new ``train`` samples (:mod:`learner.gate`), else no gate.
        skipped: when given, filled (on every rank) with the skip record of a cycle whose
            samples the trainer's filters left fewer than ``config.min_samples`` (below).

    Returns:
        The published :class:`VersionManifest`, or None when:

        - fewer than ``config.min_samples`` new ``train`` samples exist: nothing is read,
          consumed or recorded;
        - the trainer's filters (staleness, sample checks, psr's reward > 0) left fewer than
          ``config.min_samples``: nothing is consumed; the state's ``cycles`` gets a record
          ``{"parent", "at", "version": None, "skipped": reason (:func:`skip_reason`),
          "n_new": new train samples judged, "n_samples", "metrics": the trainer's data/*}``;
        - the gate rejected the candidate or its weights hold NaN or infinite values (shards
          consumed; the reason is the last entry of ``learner_state.json`` ``cycles``).

    Raises:
        RuntimeError: the store has no version to train from.
        samplestore.catalog.OldShardsError: format-1 shards are present (``flywheel data migrate``).
        learner.rank.RankError: (a ValueError) ``$RANK`` is set but names no rank
            (:func:`learner.rank.is_rank0`); raised before anything is read.
    """
    rank0 = is_rank0()  # under torchrun only rank 0 writes the state and publishes
    store = open_store(store_root)
    parent = parent_version(store, parent)
    if parent is None:
        raise RuntimeError(f"model store {store_root}: no version yet; publish a base version first")
    lateness_ms = int(config.lateness_s * 1000)
    state = _loaded(state_dir, samples_dir, lateness_ms)
    shards = new_shards(samples_dir, state, lateness_ms)
    n_new = count_rows(shards, "train")
    if n_new < config.min_samples:
        return None
    t0 = time.perf_counter()
    work = Path(state_dir) / "cycle"
    hold: list[RewardedSample] = []
    keep = None
    if evaluate is None and config.holdout_frac > 0:
        keep = lambda s: s.split != "train" or not in_holdout(s.completion_id, config.holdout_frac)  # noqa: E731
    src = SpilledSamples.from_shards([s.path for s in shards], work / "samples.arrow", keep=keep, aside=hold)
    record = {"parent": parent, "n_candidates": len(src) + len(hold), "n_shards": len(shards),
              "at": now_ms()}
    manifest = _train_and_publish(store, parent, src, hold, state_dir, config, show_progress, evaluate, record, t0)
    trim_heap()  # the cycle's model, engine and decode buffers are freed: give their pages back (daemon)
    if manifest is False:  # training did not run (or another rank publishes): nothing consumed
        shutil.rmtree(work, ignore_errors=True)
        if "skipped" in record:  # fewer than min_samples survived the trainer's filters
            record["n_new"] = n_new
            if skipped is not None:
                skipped.update(record)
            if rank0:  # the record only: watermark and consumed as they were
                state["cycles"] = (state["cycles"] + [record])[-MAX_CYCLES:]
                save_state(state_dir, state)
        return None
    state = consume(state, shards, lateness_ms)
    state["cycles"] = (state["cycles"] + [record])[-MAX_CYCLES:]
    save_state(state_dir, state)
    shutil.rmtree(Path(state_dir) / "ckpt", ignore_errors=True)  # the cycle is done
    shutil.rmtree(work, ignore_errors=True)
    return manifest


def _load_parent(store, parent: str):
    """The base model holding the parent's weights, and the parent's dtypes by tensor name.

    Memory: one model's worth. The store reconstructs the parent without caching it
    (``load(..., cache=False)``: a delta's ancestors are freed as soon as it is decoded, and
    no copy is made for the caller) and the model is built around those tensors
    (``serving.engine.build_model``: parameters on the meta device, then assigned), so
    neither the base checkpoint's weights nor a second copy of the parent are ever
    resident. The C heap's freed decode buffers are handed back to the OS afterwards
    (``trim_heap``), so they do not stay in the process's RSS through training. Tensors
    of another dtype than the base checkpoint's are converted to it (the training
    precision follows the model: ``learner.trainer.resolve_precision``).

    Raises:
        RuntimeError: the parent's tensors do not fit the base model (names listed).
    """
    from schemas.modelspec import checkpoint_dtype
    from schemas.modelspec import WeightsMismatchError, build_model
    from transformers import AutoConfig

    parent_state = store.load(parent, cache=False)
    dtypes = {k: v.dtype for k, v in parent_state.items()}
    try:
        model = build_model(store.base_dir, parent_state,
                            dtype=checkpoint_dtype(AutoConfig.from_pretrained(str(store.base_dir))))
    except WeightsMismatchError as exc:
        raise RuntimeError(f"parent {parent}: state does not fit the base model ({exc})") from None
    del parent_state
    trim_heap()
    return model, dtypes


def _progress_bar(config: LearnerConfig, parent: str):
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

    return bar, progress


def _train_and_publish(store, parent: str, src, hold: list[RewardedSample], state_dir, config: LearnerConfig,
                       show_progress: bool, evaluate: Evaluator | None, record: dict, t0: float):
    """Load the parent, train, gate (``evaluate``, else the preference margin on ``hold``
    when it has both labels), publish. Returns the manifest, None when the gate rejected the
    candidate or the store refused its weights as NaN or infinite (``record`` says why), or
    False when training did not run (``record["skipped"]`` says why when the trainer's filters
    left too few samples) or another rank publishes."""
    model, parent_dtypes = _load_parent(store, parent)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    if evaluate is None and any(s.label for s in hold) and not all(s.label for s in hold):
        evaluate = preference_margin_evaluator(hold, pad_id)
    load_s = time.perf_counter() - t0
    bar, progress = _progress_bar(config, parent) if show_progress else (None, None)
    eval_parent = evaluate(model) if evaluate else None
    try:
        new_state, metrics = train(model, src, parent, config, pad_id, progress,
                                   ckpt_dir=Path(state_dir) / "ckpt", work_dir=Path(state_dir) / "cycle")
    finally:
        if bar is not None:
            bar.stop()
    trim_heap()  # the step's activations and the optimizer's state are freed: publish starts from the model
    if new_state is None:
        record.update({"version": None, "n_samples": metrics.get("data/n_samples"),
                       "skipped": skip_reason(metrics, config, parent, len(hold)), "metrics": metrics})
        return False
    if not is_rank0():  # multi-process (torchrun): rank 0 publishes
        return False
    metrics["perf/load_s"] = load_s
    metrics["perf/cycle_s"] = time.perf_counter() - t0
    record["n_samples"] = metrics.get("data/n_samples")
    eval_result: dict = {}
    if evaluate is not None:
        eval_cand = evaluate(model)  # train() updated ``model`` in place: it is the candidate
        ok, reason = gate_decision(eval_parent, eval_cand, config.max_regression)
        eval_result = {"parent": eval_parent, "candidate": eval_cand, "passed": ok, "reason": reason}
        if not ok:
            record.update({"version": None, "rejected": reason, "eval": eval_result, "metrics": metrics})
            return None
    keys = list(parent_dtypes) if parent_dtypes else list(new_state)
    publish_state = {k: new_state[k].detach().to(parent_dtypes[k]).contiguous() if k in parent_dtypes
                     else new_state[k] for k in keys}
    del new_state
    try:
        manifest = store.publish(publish_state, parent=parent, metrics=metrics, eval=eval_result)
    except NonFiniteWeightsError as exc:  # a diverged step (NaN loss, an overflow in the parent's dtype)
        record.update({"version": None, "rejected": f"candidate weights: {exc.reason}", "metrics": metrics})
        return None
    record["version"] = manifest.version
    return manifest
