"""On-call runbook rows: (symptom, what to check, which command).

Printed by ``flywheel runbook``; ``docs/runbook.md`` embeds :func:`runbook_markdown` verbatim
(a test keeps the two identical).
"""

from __future__ import annotations

RUNBOOK: list[tuple[str, str, str]] = [
    ("Users complain right after a new version went out",
     "`flywheel status`: is a canary running, at what weight; last decisions and their thumbs-up numbers",
     "`flywheel canary abort --yes` (during a canary) or `flywheel rollback --yes` (after promotion)"),
    ("A bad version is stable (promoted) and must go",
     "`flywheel versions`: which earlier version was promoted; `flywheel status` for the stable digest",
     "`flywheel rollback --yes` (previous promoted) or `flywheel rollback --to vNNNNNN --yes`"),
    ("Canary stuck in HOLD (inconclusive)",
     "`flywheel status --json`: rollout.last_reason says how many votes each arm has and how many are needed; "
     "is ingest writing samples (`flywheel data` / sample shards) and are users voting?",
     "wait, or `flywheel promote --yes` / `flywheel canary abort --yes`; the step deadline rolls back by itself"),
    ("Canary HOLD (error): metrics unavailable",
     "the reason names the source: sample shards unreadable (disk, permissions) or serving `/metrics` unreachable",
     "fix the source; the controller resumes on its own (`flywheel controller --once` to step by hand)"),
    ("Canary decision shows error_rate / p99_latency / tokens_per_s SKIPPED",
     "the ledger numbers say why: serving does not export that metric per version, or too few requests",
     "nothing to do; thumbs-up still decides. Judge latency by hand on serving `/metrics` if in doubt"),
    ("Canary rolled back on error rate, p99 latency or tokens/s",
     "`flywheel status --json`: decisions[-1].numbers has both arms' values and the limit ratio",
     "look at serving logs for the candidate; republish from the learner when fixed"),
    ("Controller reports FAILED: serving could not load the candidate",
     "the reason names the pod and the tensor: corrupt/truncated delta or wrong parent in the model store",
     "nothing to undo (slots unchanged); republish from the learner; `flywheel versions` shows it as failed"),
    ("Controller process died mid-canary",
     "`flywheel status`: the last ledger decisions (step, weight); serving keeps the current weights meanwhile",
     "restart `flywheel controller`: it resumes from the ledger at the same step (the status file is only a cache)"),
    ("Serving slow or erroring after a promotion",
     "serving `/metrics` (latency, errors, swap pause) and `flywheel status` (which version is stable)",
     "`flywheel rollback --yes`"),
    ("Learner publishes bad versions back to back, or must stop for maintenance",
     "`flywheel versions` (status rejected/rolled_back piling up); `flywheel status --json` learner.paused",
     "`flywheel pause --reason '...' --yes`; later `flywheel resume --yes` (the daemon checks before each cycle)"),
    ("Need to test a specific version (also one rolled back earlier)",
     "`flywheel versions`: the version exists and its status",
     "`flywheel canary start vNNNNNN --yes`"),
]


def runbook_markdown() -> str:
    """The runbook as a Markdown table (``|`` inside cells escaped)."""
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = ["| Symptom | What to check | Command |", "|---|---|---|"]
    lines += [f"| {esc(a)} | {esc(b)} | {esc(c)} |" for a, b, c in RUNBOOK]
    return "\n".join(lines) + "\n"
