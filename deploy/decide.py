"""One canary step's decision: a pure function of the persisted rollout state and the evidence.

:func:`decide_step` is the reconcile rule of Flagger's scheduler: it reads the stored phase
(step, step start, failed-check counts), the evidence (each arm's votes, operational figures
and guard figures) and the clock, and returns what to do. It performs nothing: the
controller (:mod:`deploy.controller`) applies the effects (serving weights, loads, ledger
rows) and persists the new state. It knows nothing of pods, files or Kafka.

Actions: HOLD (keep collecting), ADVANCE (next traffic step), PROMOTE (the candidate
becomes stable), ROLLBACK (drop the candidate). ``decided_by`` says what decided a
terminal action: ``sequential_test`` (the thumbs-up test of :mod:`deploy.analysis`),
``operational`` (error rate, p99 latency, tokens/s), ``guard`` (reward-hacking guards),
``deadline`` (the step deadline's configured outcome), ``error`` (the data could not be
judged until the deadline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from deploy.analysis import AnalysisConfig, ArmStats, Outcome, analyze, judges_reward

DEADLINE_OUTCOMES = ("rollback", "promote")


class StepAction(str, Enum):
    """What one reconcile step does to a running canary."""

    HOLD = "HOLD"  # keep the weight, collect more evidence
    ADVANCE = "ADVANCE"  # move to the next traffic step
    PROMOTE = "PROMOTE"  # the candidate becomes stable (terminal)
    ROLLBACK = "ROLLBACK"  # drop the candidate (terminal)


@dataclass
class Evidence:
    """What the controller observed for one step, since the canary started.

    Fields:
        candidate, stable: each arm's :class:`deploy.analysis.ArmStats`.
        step_votes: candidate votes since the current step started (count).
        source_error: why the evidence could not be read (None: it could).
        skipped: ``{metric: reason}`` for metrics the sources do not provide.
        by_split: per-split figures for the ledger and the report, e.g.
            ``{"eval": {"candidate": [up, n], "stable": [up, n]}, "train": {...}}``.
        first: the first version's guard figures (None: not known, or it is the stable).
        stable_all: the stable's guard figures over all its completions (None: not known):
            the first version is then compared through the stable's window.
    """

    candidate: ArmStats
    stable: ArmStats
    step_votes: int = 0
    source_error: str | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    by_split: dict = field(default_factory=dict)
    first: ArmStats | None = None
    stable_all: ArmStats | None = None


@dataclass
class StepPolicy:
    """The parts of the rollout policy one step needs (see ``ControllerConfig``).

    Fields:
        steps: candidate traffic shares, increasing; the last is 1.0.
        step_deadline_s: a step still undecided after this long takes ``deadline_outcome`` (s).
        deadline_outcome: ``rollback`` (production default) or ``promote``.
        min_votes_per_step: new candidate votes a step needs before it may advance (count).
        analysis: thresholds of :func:`deploy.analysis.analyze`.
    """

    steps: tuple[float, ...]
    step_deadline_s: float
    deadline_outcome: str
    min_votes_per_step: int
    analysis: AnalysisConfig


@dataclass
class StepDecision:
    """The decision of :func:`decide_step`.

    Fields:
        action: :class:`StepAction`.
        reason: one human line, with the numbers that decided.
        numbers: JSON-ready figures for the ledger (per metric, the interval, the step).
        failed_checks: updated failed-checks-in-a-row per operational metric and guard.
        decided_by: what decided (module docstring); None for a HOLD.
        weight: the candidate's traffic share after the action (0 when terminal).
    """

    action: StepAction
    reason: str
    numbers: dict
    failed_checks: dict[str, int]
    decided_by: str | None
    weight: float


def next_share(steps: tuple[float, ...], step: int) -> float | None:
    """The traffic share a passing step ``step`` advances to, or None when passing it
    promotes: at the last step, or when the next step is the final 1.0. At 100 % the stable
    version serves nothing, so its evidence would stop growing and an analysis there could
    only repeat the last one's stable figures; the final 1.0 is therefore the promotion
    itself (Flagger promotes after its last analysed weight the same way)."""
    if step + 1 >= len(steps) or (steps[step + 1] >= 1.0 and step + 1 == len(steps) - 1):
        return None
    return steps[step + 1]


def decide_step(step: int, step_started_ms: int, failed_checks: dict[str, int], ev: Evidence,
                policy: StepPolicy, now_ms: int) -> StepDecision:
    """Decide one reconcile step of a canary at traffic step ``step`` (index into
    ``policy.steps``) that started at ``step_started_ms`` (ms).

    Rules: the analysis (:func:`deploy.analysis.analyze`) decides ROLLBACK at once; its
    PROMOTE advances only once the step has ``min_votes_per_step`` new candidate votes, and
    at the last analysed step (:func:`next_share`) promotes; an undecided step past ``step_deadline_s`` takes
    ``deadline_outcome`` (a step whose data could not be judged, or with fewer than
    ``min_votes`` votes on an arm, rolls back: never promoted on empty data).

    Returns:
        :class:`StepDecision`. Pure: same inputs, same decision.
    """
    d = analyze(ev.candidate, ev.stable, policy.analysis, source_error=ev.source_error, skipped=ev.skipped,
                failed_checks=failed_checks, first=ev.first, stable_all=ev.stable_all)
    waited_s = (now_ms - step_started_ms) / 1000.0
    weight = policy.steps[step]
    numbers = {**d.numbers(), "waited_s": waited_s, "step": step, "weight": weight,
               "step_candidate_votes": ev.step_votes, "min_votes_per_step": policy.min_votes_per_step,
               "failed_checks": d.failed_checks, "by_split": ev.by_split}

    def out(action: StepAction, reason: str, by: str | None, w: float) -> StepDecision:
        numbers["decided_by"] = by
        return StepDecision(action, reason, numbers, d.failed_checks, by, w)

    if d.outcome == Outcome.ROLLBACK:
        return out(StepAction.ROLLBACK, d.reason, d.decided_by, 0.0)
    nxt = next_share(policy.steps, step)
    if d.outcome == Outcome.PROMOTE and ev.step_votes >= policy.min_votes_per_step:
        if nxt is not None:
            return out(StepAction.ADVANCE, f"to {nxt:.0%}: {d.reason}", d.decided_by, nxt)
        return out(StepAction.PROMOTE, d.reason, d.decided_by, 0.0)
    reason = d.reason
    if d.outcome == Outcome.PROMOTE:
        reason = (f"HOLD (inconclusive): {ev.step_votes} new candidate votes at step {step} ({weight:.0%}), "
                  f"need {policy.min_votes_per_step}; analysis so far: {d.reason}")
    if waited_s < policy.step_deadline_s:
        return out(StepAction.HOLD, reason, None, weight)
    why = f"step deadline {policy.step_deadline_s:.0f}s reached after {waited_s:.0f}s undecided"
    if d.error:
        return out(StepAction.ROLLBACK, f"{why}, data not judgeable: rolled back; {reason}", "error", 0.0)
    # the evidence the test judges: rewarded samples under the reward test, thumbs votes otherwise
    if judges_reward(ev.candidate, ev.stable, policy.analysis):
        unit, n_c, n_s = "rewarded samples", ev.candidate.rewarded, ev.stable.rewarded
    else:
        unit, n_c, n_s = "votes", ev.candidate.votes, ev.stable.votes
    if policy.deadline_outcome == "promote" and min(n_c, n_s) < policy.analysis.min_votes:
        return out(StepAction.ROLLBACK, f"{why}, deadline outcome promote but too few {unit} to promote "
                   f"(candidate {n_c}, stable {n_s}, need {policy.analysis.min_votes} "
                   f"per arm): rolled back; {reason}", "deadline", 0.0)
    if policy.deadline_outcome == "promote":
        if nxt is not None:
            return out(StepAction.ADVANCE, f"{why}, deadline outcome promote: to {nxt:.0%}; {reason}", "deadline", nxt)
        return out(StepAction.PROMOTE, f"{why}, deadline outcome promote; {reason}", "deadline", 0.0)
    return out(StepAction.ROLLBACK, f"{why}, deadline outcome rollback; {reason}", "deadline", 0.0)
