"""The learner role, assembled: :func:`build_learner` and :class:`Learner` (``flywheel learn``).

:class:`DaemonConfig` holds the settings that are not per cycle (where the store, samples
and state are, which version to train from, the schedule, the held-out generation gate, the
metrics port); :class:`learner.config.LearnerConfig` holds the cycle's. ``build_learner``
opens the model store, builds the gate's evaluator and the Prometheus metrics; a
:class:`Learner` runs one cycle (:meth:`Learner.cycle`) or the daemon loop
(:meth:`Learner.serve`), which reads the fleet's desired-state record before each cycle and
waits while an operator has paused learning. Tests and other programs call these directly;
``learner.commands`` only parses the options into the two configs and calls them.

:class:`DaemonConfig` is declared in :mod:`learner.daemon_config` (so that
:mod:`learner.cycle` reads its defaults without importing the role) and importable from here.
This module imports no torch at import time (the CLI imports it to build its options).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from learner.config import LearnerConfig
from learner.daemon_config import DaemonConfig
from schemas.events import now_ms


class SettingError(ValueError):
    """A setting the role cannot use (a usage error); ``flag`` names the option, ``reason`` says why."""

    def __init__(self, flag: str | None, reason: str):
        super().__init__(f"{flag}: {reason}" if flag else reason)
        self.flag, self.reason = flag, reason


class StartError(RuntimeError):
    """The learner cannot start on this store (a state error, not a usage error)."""


def _rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def build_gate(daemon: DaemonConfig, base_dir, seed: int):
    """The held-out generation gate's evaluator (``learner.gate.generation_evaluator``), or
    None without ``daemon.gate_problems``.

    Args:
        daemon: names the verifier, the problems, samples and tokens per completion.
        base_dir: the store's base checkpoint (its tokenizer encodes the prompts).
        seed: the sampling seed (the cycle's ``LearnerConfig.seed``).

    Raises:
        SettingError: the verifier does not load (``--gate-verifier``), refuses the problems
            (``--gate-problems``), or a sampling value is out of range.
    """
    if not daemon.gate_problems:
        return None
    from learner.gate import generation_evaluator, load_gate_verifier
    from schemas.modelspec import load_tokenizer

    try:
        verifier = load_gate_verifier(daemon.gate_verifier)
    except ValueError as exc:
        raise SettingError("--gate-verifier", str(exc)) from exc
    tok = load_tokenizer(base_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    eos = tok.eos_token_id if eos is None or eos == tok.unk_token_id else eos
    try:
        prompts, score = verifier(daemon.gate_problems, tok)
    except ValueError as exc:
        raise SettingError("--gate-problems", str(exc)) from exc
    try:
        return generation_evaluator(prompts, score, int(eos), max_tokens=daemon.gate_max_tokens,
                                    samples_per_prompt=daemon.gate_samples, seed=seed)
    except ValueError as exc:
        raise SettingError(None, str(exc)) from exc


class Learner:
    """One assembled learner: its store, sample and state locations, configs, gate and metrics.

    Built by :func:`build_learner`: ``store`` is the store's directory or URL (what the cycle
    opens), ``model_store`` the opened ``modelstore.store.ModelStore``; ``say`` receives each line
    the role reports (stdout in the CLI).
    """

    def __init__(self, cfg: LearnerConfig, daemon: DaemonConfig, store: str, model_store, samples: Path,
                 state: Path, evaluate, metrics, say: Callable[[str], None] = print):
        self.cfg, self.daemon, self.store, self.model_store = cfg, daemon, store, model_store
        self.samples, self.state, self.evaluate, self.metrics, self.say = samples, state, evaluate, metrics, say

    def cycle(self) -> None:
        """Run one cycle (train, gate, publish) and report its outcome on rank 0.

        Raises:
            Exception: whatever the cycle raised (counted as a failed cycle first).
        """
        from learner.cycle import count_new, load_state, run_cycle
        from learner.metrics import cycle_outcome

        lm, started_ms, rank0, t0 = self.metrics, now_ms(), _rank0(), time.monotonic()
        try:
            m = run_cycle(self.store, self.samples, self.state, self.cfg, parent=self.daemon.parent,
                          show_progress=rank0, evaluate=self.evaluate)
        except Exception:
            lm.cycle_done("failed", {}, time.monotonic() - t0)
            raise
        if not rank0:
            return
        # Waiting samples are recounted before the cycle is reported, so a scrape that sees the
        # cycle also sees what it left behind (not the count that started it).
        lm.samples_waiting.set(count_new(self.samples, self.state, int(self.cfg.lateness_s * 1000)))
        lm.cycle_done(*cycle_outcome(m, load_state(self.state), started_ms), time.monotonic() - t0)
        if m is None:
            cycles = load_state(self.state)["cycles"]
            if cycles and cycles[-1].get("rejected") and cycles[-1]["at"] >= started_ms:
                self.say(f"learn: candidate rejected by the eval gate: {cycles[-1]['rejected']}")
            else:
                self.say(f"learn: fewer than {self.cfg.min_samples} new trainable samples; nothing published")
            return
        keys = ("data/n_samples", "kto/loss_first", "kto/loss", "mismatch/max", "is/ratio_mean",
                "perf/tokens_per_s")
        summary = {k: m.metrics[k] for k in keys if k in m.metrics}
        self.say(f"learn: published {m.version} (parent {m.parent}, {m.kind}) {json.dumps(summary)}")

    def _paused(self, fleet) -> dict | None:
        """The operator's pause from the fleet's desired-state record (None: not paused)."""
        try:
            return fleet.read().paused
        except ValueError as exc:  # unreadable record: do not train on a pause we cannot see
            return {"actor": "unknown", "reason": f"desired-state record unreadable: {exc}"}

    def serve(self) -> None:
        """The daemon: a cycle every ``every_h`` hours or ``every_n`` new samples, whichever
        comes first, checked every ``poll_s`` seconds; never returns.

        Operator pause (``flywheel pause`` / ``flywheel resume``): read from the fleet's
        desired state on the store before each cycle, wherever this learner runs; a cycle
        already running finishes.
        """
        from modelstore.desired import FleetRecord
        from learner.cycle import count_new

        d, lm = self.daemon, self.metrics
        fleet = FleetRecord(self.model_store)  # `flywheel pause` writes the fleet's desired state on the store
        last, was_paused = time.monotonic(), False
        while True:
            paused = self._paused(fleet)
            lm.paused.set(bool(paused))
            if paused:
                if not was_paused:
                    self.say(f"learn: paused by operator ({json.dumps(paused)}); waiting")
                was_paused = True
                time.sleep(d.poll_s)
                continue
            if was_paused:
                self.say("learn: resumed")
                was_paused = False
            n_new = count_new(self.samples, self.state, int(self.cfg.lateness_s * 1000))  # from the watermark
            lm.samples_waiting.set(n_new)
            min_n = self.cfg.min_samples
            if n_new >= max(d.every_n, min_n) or (time.monotonic() - last >= d.every_h * 3600 and n_new >= min_n):
                self.cycle()
                last = time.monotonic()
            time.sleep(d.poll_s)


def build_learner(cfg: LearnerConfig, daemon: DaemonConfig, say: Callable[[str], None] = print) -> Learner:
    """Assemble the learner role: open the model store, build the eval gate, resolve the
    sample and state locations (``schemas.settings`` defaults), set the distributed
    environment, and start the metrics server on rank 0 when ``daemon.metrics_port`` is set.

    Raises:
        StartError: the model store has no version yet (publish the base first).
        SettingError: the gate's settings are unusable (see :func:`build_gate`).
    """
    from learner.cycle import open_store
    from learner.metrics import LearnerMetrics
    from learner.trainer import ensure_dist_env
    from schemas import settings

    store = daemon.store or settings.store_dir()  # a directory or an fsspec URL
    st = open_store(store)
    if not st.versions():
        raise StartError(f"learn: the model store {store} has no version yet. Publish the base first: "
                         "`flywheel serve` does it on first start (or modelstore.store.ModelStore(...).init_base).")
    evaluate = build_gate(daemon, st.base_dir, cfg.seed)
    samples = daemon.samples or settings.samples_dir()
    state = daemon.state or settings.learner_state_dir()
    ensure_dist_env()  # sets MASTER_PORT etc. when unset; subprocess-friendly
    lm = LearnerMetrics()
    if daemon.metrics_port and _rank0():
        lm.serve(daemon.metrics_port)
    return Learner(cfg, daemon, store, st, samples, state, evaluate, lm, say)
