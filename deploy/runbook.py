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
     "the reason names the pod and the tensor (ledger numbers.failure = refused): corrupt/truncated delta or "
     "wrong parent in the model store; failure = timeout / unreachable / server is a sick pod instead (next rows)",
     "nothing to undo (slots unchanged); republish from the learner; `flywheel versions` shows it as failed"),
    ("A command or the controller fails with 'no answer within N s' (wedged pod)",
     "the error and the ledger row name the pod and the timeout (`flywheel status --json`: decisions[].numbers "
     "failure=timeout, pod, timeout_s); `flywheel status` exits 1 with serving_error; the version is NOT marked "
     "failed and no second call went to that pod",
     "restart or replace the pod (it starts on the store's stable record), then redo the action; the controller "
     "retries the load by itself; big models may need `flywheel controller --serving-timeout-s 300` "
     "(or FLYWHEEL_SERVING_TIMEOUT_S)"),
    ("A command or the controller fails with 'HTTP 500' from a pod",
     "the pod's logs (the message names the error type: out of memory, disk); the ledger row has "
     "failure=server and http_status; a transport failure, so the version is not marked failed",
     "fix or restart the pod, then redo the command (`flywheel promote --yes`, `flywheel rollback --yes`); "
     "the controller retries by itself"),
    ("A pod serves another version after a restart than before (a rollback looks undone)",
     "`flywheel status`: the 'desired state' line (what every pod, restarted or not, is brought to) and a "
     "warning per pod whose stable differs from it",
     "`flywheel rollback --to vNNNNNN --yes --reason '...'` moves the desired state and every pod together; "
     "never promote by hand on /admin (the pod's own watch and the controller undo it: drift)"),
    ("An operator command prints 'not converged: ... k of n pods serve it' and exits 1",
     "the lines above it name each pod and why (still at generation N, timeout, unreachable, HTTP 5xx, "
     "refused); the ledger row FLEET_NOT_CONVERGED carries numbers.pods.by_pod; `flywheel status` shows each "
     "pod and its drift",
     "nothing to redo: the desired state is set; each pod converges to it by itself (it reads the record every "
     "--desired-poll s) and the controller retries it at each poll, with or without a controller running; a "
     "stopped or hung pod converges once it runs again; one that stays unreachable or hung: restart or replace "
     "it (it reads the desired state before it is ready)"),
    ("An operator command watches the wrong pods, or says `--serving ... was not recorded as the fleet's pods`",
     "`flywheel status -o json`: `pods` lists the pods of the desired state's list; the command's note says why "
     "a --serving list was not recorded (a spec that found no pod, a pod that did not answer) or that it is not "
     "the recorded list",
     "fix the pod or the spec and name the pods again with --serving; to replace a recorded list, add "
     "`--record-pods` and the --serving list to the next action, or now: `flywheel rollback --to <the current "
     "stable> --record-pods --serving URL --serving URL --yes` (it also reloads the stable, verified)"),
    ("A pod does not converge (drift in `flywheel status` that stays)",
     "`flywheel status -o wide` (the pod's slots and drift) and the controller's log/ledger RECONCILE rows: "
     "'refused' means the pod cannot load the version (corrupt files on its copy of the store), "
     "'load_balancer' means a Service URL was given as a pod",
     "fix the store files or `flywheel rollback --to <a good version> --yes`; give the controller each pod "
     "(`--serving URL` per pod, or `dns+http://` on a headless Service), never the load balancer's URL"),
    ("Two operators acted at once / a command printed 'superseded'",
     "`flywheel status`: the desired state's generation, action and actor; the last MANUAL_* ledger rows "
     "(one per generation, in order)",
     "the later action wins on every pod, the store's stable record and the ledger; re-run yours if it "
     "should win"),
    ("`flywheel versions` lists a version as corrupt, or the controller recorded FAILED naming manifest.json",
     "the error names the version and the file (versions/vNNNNNN/manifest.json) and the first bad field; the "
     "controller skips that version and canaries the next good one",
     "republish the weights from the learner under a new id; restore or delete the bad version directory"),
    ("`flywheel rollback --to <the current stable>` exits 1 with 'refused ... checksum'",
     "the reload reads the version from the store and verifies every tensor: its files are corrupt; pods "
     "keep serving the weights they verified at load",
     "restore the version's files (the controller then reloads it) or `flywheel rollback --to` another good "
     "version"),
    ("`flywheel controller --once` (a CronJob) exits 1",
     "its output: 'phase=failed' (a candidate could not be loaded; the reason names the pod) or 'pod not "
     "converged' lines",
     "as for the FAILED and 'not converged' rows above; the exit status is for scripts and CronJobs"),
    ("`flywheel status` shows 'digest = manifest: NO' or warns 'files changed under the same id'",
     "someone rewrote a published version's files (versions are immutable: republish under a new id); "
     "`flywheel versions` digest vs the served weights digest",
     "stable: `flywheel rollback --to vNNNNNN --yes` reloads it from the store (verified); candidate: "
     "`flywheel rollback --yes`, then `flywheel canary start vNNNNNN --yes`"),
    ("Controller process died mid-canary",
     "`flywheel status`: the last ledger decisions (step, weight); serving keeps the current weights meanwhile",
     "restart `flywheel controller`: it resumes from the ledger at the same step (the status file is only a cache)"),
    ("A canary stays at its first step; `flywheel status` or `canary start` warns 'no controller has been seen'",
     "the warning names the controller's heartbeat (fleet/controller.json beside the record, rewritten at every "
     "poll) and its age; a controller counts as running within $FLYWHEEL_CONTROLLER_SEEN_S (default 60 s) plus "
     "its --poll-s",
     "start `flywheel controller` (or step it with `flywheel controller --once`), or end the canary by hand: "
     "`flywheel promote --yes` / `flywheel canary abort --yes`"),
    ("Serving slow or erroring after a promotion",
     "serving `/metrics` (latency, errors, swap pause) and `flywheel status` (which version is stable)",
     "`flywheel rollback --yes`"),
    ("Learner publishes bad versions back to back, or must stop for maintenance",
     "`flywheel versions` (status rejected/rolled_back piling up); `flywheel status --json` learner.paused",
     "`flywheel pause --reason '...' --yes`; later `flywheel resume --yes` (written into the fleet's desired "
     "state on the store; the learner daemon reads it before each cycle, wherever it runs)"),
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
