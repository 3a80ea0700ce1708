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
import time
from pathlib import Path
from typing import Callable

from learner.config import LearnerConfig
from learner.daemon_config import DaemonConfig
from learner.rank import RANK_ENV, RankError, is_rank0
from schemas.events import now_ms


class SettingError(ValueError):
    """A setting the role cannot use (a usage error); ``flag`` names the option, ``reason`` says why."""

    def __init__(self, flag: str | None, reason: str):
        super().__init__(f"{flag}: {reason}" if flag else reason)
        self.flag, self.reason = flag, reason


class StartError(RuntimeError):
    """The learner cannot start on this store (a state error, not a usage error)."""


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

    The daemon's memory between polls (:meth:`poll`): ``skipped`` is the skip record of the
    last cycle when the trainer's filters left it too few samples (``learner.cycle.run_cycle``),
    else None; ``judged`` is ``(new train samples that cycle judged, its parent)`` while the
    daemon waits for samples beyond those, else None.
    """

    def __init__(self, cfg: LearnerConfig, daemon: DaemonConfig, store: str, model_store, samples: Path,
                 state: Path, evaluate, metrics, say: Callable[[str], None] = print):
        self.cfg, self.daemon, self.store, self.model_store = cfg, daemon, store, model_store
        self.samples, self.state, self.evaluate, self.metrics, self.say = samples, state, evaluate, metrics, say
        self.skipped: dict | None = None
        self.judged: tuple[int, str] | None = None
        self._fleet = None
        self._was_paused = False
        self._last = time.monotonic()

    def cycle(self) -> None:
        """Run one cycle (train, gate, publish) and report its outcome on rank 0; sets
        :attr:`skipped` on every rank.

        Raises:
            Exception: whatever the cycle raised (counted as a failed cycle first).
        """
        from learner.cycle import count_new, load_state, run_cycle
        from learner.metrics import cycle_outcome

        lm, started_ms, rank0, t0 = self.metrics, now_ms(), is_rank0(), time.monotonic()
        skipped: dict = {}
        self.skipped = None
        try:
            m = run_cycle(self.store, self.samples, self.state, self.cfg, parent=self.daemon.parent,
                          show_progress=rank0, evaluate=self.evaluate, skipped=skipped)
        except Exception:
            lm.cycle_done("failed", {}, time.monotonic() - t0)
            raise
        self.skipped = skipped or None
        if not rank0:
            return
        # Waiting samples are recounted before the cycle is reported, so a scrape that sees the
        # cycle also sees what it left behind (not the count that started it).
        n_left = count_new(self.samples, self.state, int(self.cfg.lateness_s * 1000))
        lm.samples_waiting.set(n_left)
        state = load_state(self.state)
        lm.cycle_done(*cycle_outcome(m, state, started_ms), time.monotonic() - t0)
        if m is None:
            last = state["cycles"][-1] if state["cycles"] else {}
            if last.get("rejected") and last["at"] >= started_ms:
                self.say(f"learn: candidate rejected by the eval gate: {last['rejected']}")
            elif self.skipped is not None:
                self.say(f"learn: {self.skipped['skipped']}; nothing published")
            elif n_left < self.cfg.min_samples:
                self.say(f"learn: {n_left} new samples, fewer than min_samples {self.cfg.min_samples}; "
                         "nothing published")
            else:  # samples arrived while the cycle ran: it saw fewer
                self.say(f"learn: fewer than min_samples {self.cfg.min_samples} new samples; nothing published")
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

    def poll(self) -> bool:
        """One check of the daemon loop (:meth:`serve`); returns whether it ran a cycle.

        A cycle runs when at least ``min_samples`` new train samples are waiting and either
        ``max(every_n, 1)`` of them are unjudged or ``every_h`` hours passed since the last
        cycle with at least one unjudged. Unjudged: all of them, except after a cycle that the
        trainer's filters left too few samples (psr with no reward > 0, all stale, ...): that
        cycle consumed nothing, so its samples are still waiting and would start the same
        empty cycle at every poll; they count as judged until a cycle consumes them, fewer are
        waiting than were judged, or the parent changes (staleness is measured from it). The
        wait is said once.

        Operator pause (``flywheel pause`` / ``flywheel resume``): read from the fleet's
        desired state on the store at each poll, wherever this learner runs; a cycle
        already running finishes.
        """
        from learner.cycle import count_new, parent_version
        from modelstore.desired import FleetRecord

        d, lm = self.daemon, self.metrics
        if self._fleet is None:
            self._fleet = FleetRecord(self.model_store)  # `flywheel pause` writes the fleet's desired state there
        paused = self._paused(self._fleet)
        lm.paused.set(bool(paused))
        if paused:
            if not self._was_paused:
                self.say(f"learn: paused by operator ({json.dumps(paused)}); waiting")
            self._was_paused = True
            return False
        if self._was_paused:
            self.say("learn: resumed")
            self._was_paused = False
        n_new = count_new(self.samples, self.state, int(self.cfg.lateness_s * 1000))  # from the watermark
        lm.samples_waiting.set(n_new)
        if self.judged is not None and (n_new < self.judged[0]
                                        or parent_version(self.model_store, d.parent) != self.judged[1]):
            self.judged = None
        unjudged = n_new - (self.judged[0] if self.judged else 0)
        due = time.monotonic() - self._last >= d.every_h * 3600
        if n_new < self.cfg.min_samples or not (unjudged >= max(d.every_n, 1) or (due and unjudged >= 1)):
            return False
        self.cycle()
        self._last = time.monotonic()
        self.judged = None
        if self.skipped is not None:
            self.judged = (int(self.skipped["n_new"]), str(self.skipped["parent"]))
            if is_rank0():
                self.say(f"learn: waiting for {max(d.every_n, 1)} new samples beyond the {self.judged[0]} judged "
                         f"(or one after every_h {d.every_h:g} h) before the next cycle")
        return True

    def serve(self) -> None:
        """The daemon: :meth:`poll` every ``poll_s`` seconds; never returns."""
        while True:
            self.poll()
            time.sleep(self.daemon.poll_s)


def build_learner(cfg: LearnerConfig, daemon: DaemonConfig, say: Callable[[str], None] = print) -> Learner:
    """Assemble the learner role: open the model store, build the eval gate, resolve the
    sample and state locations (``schemas.settings`` defaults), set the distributed
    environment, and start the metrics server on rank 0 when ``daemon.metrics_port`` is set.

    Raises:
        StartError: the model store has no version yet (publish the base first).
        SettingError: the gate's settings are unusable (see :func:`build_gate`), or ``$RANK`` is
            set but names no rank (flag ``$RANK``: :func:`learner.rank.is_rank0`), checked first.
    """
    try:
        rank0 = is_rank0()  # before ensure_dist_env, which hands RANK to torch
    except RankError as exc:
        raise SettingError(f"${RANK_ENV}", exc.reason) from None
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
    if daemon.metrics_port and rank0:
        lm.serve(daemon.metrics_port)
    return Learner(cfg, daemon, store, st, samples, state, evaluate, lm, say)
