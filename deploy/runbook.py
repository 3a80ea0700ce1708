"""On-call runbook rows: (symptom, what to check, which command). Printed by ``flywheel runbook``."""

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
     "the reason names the source: sample shards unreadable (disk, permissions) or serving unreachable",
     "fix the source; the controller resumes on its own (`flywheel controller --once` to step by hand)"),
    ("Controller reports FAILED: serving could not load the candidate",
     "the reason names the pod and the tensor: corrupt/truncated delta or wrong parent in the model store",
     "nothing to undo (slots unchanged); republish from the learner; `flywheel versions` shows it as failed"),
    ("Controller process died mid-canary",
     "`flywheel status`: the persisted phase/step; serving keeps the current weights meanwhile",
     "restart `flywheel controller`: it resumes from the stored phase"),
    ("Serving slow or erroring after a promotion",
     "serving `/metrics` (latency, errors, swap pause) and `flywheel status` (which version is stable)",
     "`flywheel rollback --yes`"),
    ("Need to test a specific version (also one rolled back earlier)",
     "`flywheel versions`: the version exists and its status",
     "`flywheel canary start vNNNNNN --yes`"),
]
