"""Pooling several full demo runs into one claim (``flywheel demo-pool``; docs/experiments.md).

Each run directory holds the demo's ``report.json`` and ``votes.jsonl`` (one line per voted
completion: version, kind, prompt key, votes). For each kind of prompt (``train``, ``fresh``,
``harder``, ``unseen``) and for all votes, the pool compares each run's last promoted version
with its first version:

* per run: the difference of thumbs-up rates with Newcombe's interval (votes independent) and a
  cluster bootstrap over that run's prompts;
* pooled: the difference of the pooled rates (every run's votes summed) with Newcombe's
  interval and a *stratified* cluster bootstrap: each resample draws, within each run, that
  run's prompts with replacement (a prompt carries every vote both versions got on it), so
  repeated votes on one prompt and the run-to-run split of votes both count (Field and Welsh
  2007, s. 3; Cameron and Miller 2015, s. VI.A).

It also checks every promotion: the candidate's own votes (all of them, every kind) against the
version it replaced, and its no-answer and truncated shares over every served reply, each with
Newcombe's interval; a promotion whose candidate is *shown worse* on any of them (the interval
excludes 0 on the worse side) is listed in ``worse_promotions``.

When a run has ``fixed_eval.jsonl`` (the fixed eval set's outcomes), its last promoted version
is compared with its first paired by prompt (``fixed_eval`` per run), and
``fixed_eval_pooled`` pools every run's pairs (a run with no promotion as its first version
against itself: no change): the mean paired difference, exact McNemar on
the pooled discordant pairs, and a paired bootstrap over prompts stratified by run
(:func:`flywheel.report.paired_comparison`).

Two verdicts each way, on ``fresh`` prompts: from the users' live thumbs
(``every_run_positive_on_fresh``, ``pooled_fresh_cluster_excludes_0``; None when no promoted
run has thumbs on fresh prompts, as with ``--signals implicit``) and from the fixed eval set
(``fixed_every_run_positive_on_fresh``: each run's paired difference > 0, a run with no
promotion counting 0; ``fixed_pooled_fresh_excludes_0``: the pooled paired interval's lower
bound > 0; None without fixed eval outcomes).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from deploy.stats import newcombe_interval
from flywheel.report import paired_comparison, stratified_cluster_bootstrap  # the one bootstrap (re-exported)
from flywheel.workload import KINDS as PROMPT_KINDS  # a prompt's kind, as the demo writes it

KINDS = (*PROMPT_KINDS, "all")


def _read_text(p: Path) -> str:
    """``p``'s text as UTF-8. Raises ValueError naming ``p`` when it is not UTF-8."""
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{p}: not UTF-8 text: {exc}") from exc


def _json_lines(p: Path) -> list:
    """Each non-blank line of ``p`` parsed as JSON. Raises ValueError naming ``p``, the line
    and the reason when ``p`` is not UTF-8 or a line is not JSON."""
    out = []
    for i, line in enumerate(_read_text(p).splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}: line {i}: not JSON: {exc}") from exc
    return out


# counts far above any demo run's (a full run serves about 10^4 replies), so a typo or a
# corrupted figure (1e23) is refused rather than pooled
MAX_COUNT = 10**9


def _count(v) -> str | None:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
        return f"must be an integer in [0, {MAX_COUNT}]"
    return None


def _version(v) -> str | None:
    return None if isinstance(v, str) else "must be a string (a version name such as 'v000001')"


def _string(v) -> str | None:
    return None if isinstance(v, str) else "must be a string"


def _boolean(v) -> str | None:
    return None if isinstance(v, bool) else "must be true or false (a JSON boolean)"


def _kind(v) -> str | None:
    return None if isinstance(v, str) and v in PROMPT_KINDS else f"must be one of {', '.join(PROMPT_KINDS)}"


def _seconds(v) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    return None if ok else "must be a finite number of seconds >= 0"


def _or_null(check):
    return lambda v: None if v is None else check(v)


# one schema per record: field -> (check returning the reason it fails or None, required)
VOTE = {"version": (_version, True), "kind": (_or_null(_kind), True), "key": (_or_null(_string), True),
        "votes_up": (_count, True), "votes_down": (_count, True)}
FIXED = {"version": (_version, True), "key": (_string, True), "passed": (_boolean, True),
         "kind": (_or_null(_kind), False)}
REPORT = {"events_accepted": (_count, True), "events_lost": (_count, True), "wall_s": (_or_null(_seconds), False),
          "quick": (_or_null(_boolean), False)}
VERSION = {"version": (_version, True), "decision": (_or_null(_string), False)}
SHARE = {"votes_up": (_count, True), "votes": (_count, True)}  # a reply figure: votes_up of votes


def _check_record(p: Path, where: str, rec, schema: dict) -> None:
    """Raise ValueError naming ``p``, ``where`` (e.g. ``"line 3: "``), the field and the reason
    unless ``rec`` is an object with every required field of ``schema`` and each field present
    passes its check."""
    if not isinstance(rec, dict):
        raise ValueError(f"{p}: {where}not a JSON object")
    missing = {f for f, (_, required) in schema.items() if required} - set(rec)
    if missing:
        raise ValueError(f"{p}: {where}missing {sorted(missing)}")
    for f, (check, _) in schema.items():
        if f in rec:
            reason = check(rec[f])
            if reason:
                raise ValueError(f"{p}: {where}{f}: {reason}, got {rec[f]!r}")


def _check_report(rp: Path, report) -> None:
    """Raise ValueError naming ``rp``, the field and the reason unless ``report`` is what the
    demo writes: its event counts, and each version's name, decision and reply figures."""
    if not isinstance(report, dict) or "versions" not in report:
        raise ValueError(f"{rp}: no 'versions' (not a demo report)")
    vs = report["versions"]
    if not isinstance(vs, list) or not vs or not all(isinstance(r, dict) and "version" in r for r in vs):
        raise ValueError(f"{rp}: versions: must be a non-empty list of versions (the run ended before its report?)")
    for i, r in enumerate(vs):
        _check_record(rp, f"versions[{i}].", r, VERSION)
        replies = r.get("replies")
        if replies is not None and not isinstance(replies, dict):
            raise ValueError(f"{rp}: versions[{i}].replies: must be an object, got {replies!r}")
        for k in ("no_answer", "truncated"):
            share = (replies or {}).get(k)
            if share is not None:
                _check_record(rp, f"versions[{i}].replies.{k}.", share, SHARE)
                if share["votes_up"] > share["votes"]:
                    raise ValueError(f"{rp}: versions[{i}].replies.{k}.votes_up: must be <= votes "
                                     f"({share['votes']}), got {share['votes_up']}")
    if vs[0].get("decision") == "PROMOTE":
        raise ValueError(f"{rp}: versions[0].decision: the first version is what every promotion is measured "
                         f"from, so it cannot be 'PROMOTE' (not a demo report)")
    _check_record(rp, "", report, REPORT)


def _regular_file(p: Path) -> bool:
    """Whether ``p`` exists; raises ValueError naming ``p`` when it is there but not a regular
    file (a directory, a device such as a link to /dev/zero)."""
    if not p.exists():
        return False
    if not p.is_file():
        raise ValueError(f"{p}: not a regular file")
    return True


def load_run(path: Path) -> dict:
    """Read one run directory: ``{"dir", "report", "votes", "fixed"}``.

    Raises:
        ValueError: ``report.json``, ``votes.jsonl`` or ``fixed_eval.jsonl`` is missing (the
            first two), not a regular file, not UTF-8, not JSON or not what the demo writes (a
            field missing or of the wrong type: a ``version`` or ``key`` that is not a string,
            a count that is not an integer in [0, :data:`MAX_COUNT`], a ``passed`` that is not a
            boolean, a ``kind`` not in :data:`PROMPT_KINDS`, a first version already promoted);
            the message names the file, the line or field, and the reason.
    """
    path = Path(path)
    rp, vp = path / "report.json", path / "votes.jsonl"
    for p in (rp, vp):
        if not _regular_file(p):
            raise ValueError(f"{p}: missing (a full `flywheel demo` run writes it)")
    try:
        report = json.loads(_read_text(rp))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{rp}: not JSON (truncated?): {exc}") from exc
    _check_report(rp, report)
    votes = _json_lines(vp)
    for i, v in enumerate(votes, 1):
        _check_record(vp, f"line {i}: ", v, VOTE)
    fixed = []
    fp = path / "fixed_eval.jsonl"
    if _regular_file(fp):  # runs before the fixed eval set have none
        fixed = _json_lines(fp)
        for i, r in enumerate(fixed, 1):
            _check_record(fp, f"line {i}: ", r, FIXED)
    return {"dir": str(path), "report": report, "votes": votes, "fixed": fixed}


def _kind_of(v: dict) -> str:
    return v.get("kind") or ("train" if (v.get("split") or "train") == "train" else "fresh")


def _clusters(votes: list[dict], kind: str, first: str, last: str) -> np.ndarray:
    """Per prompt key: ``[up_first, n_first, up_last, n_last]``, shape ``(prompts, 4)``, float64."""
    per: dict[str, list[int]] = {}
    for v in votes:
        if v["version"] not in (first, last) or (kind != "all" and _kind_of(v) != kind):
            continue
        a = per.setdefault(str(v["key"] or v.get("completion_id")), [0, 0, 0, 0])
        i = 0 if v["version"] == first else 2
        a[i] += int(v["votes_up"])
        a[i + 1] += int(v["votes_up"]) + int(v["votes_down"])
    return np.array(list(per.values()), dtype=float).reshape(-1, 4)


def _compare(strata: list[np.ndarray], seed: int) -> dict | None:
    tot = sum((s.sum(axis=0) for s in strata if len(s)), np.zeros(4))
    if tot[1] == 0 or tot[3] == 0:
        return None
    d, lo, hi = newcombe_interval(int(tot[0]), int(tot[1]), int(tot[2]), int(tot[3]))  # last - first
    boot = stratified_cluster_bootstrap(strata, seed=seed)
    return {"up_from": int(tot[0]), "n_from": int(tot[1]), "up_to": int(tot[2]), "n_to": int(tot[3]),
            "diff": d, "ci95": [lo, hi], "cluster_ci95": boot["ci95"] if boot else None,
            "prompts": boot["prompts"] if boot else None}


def promotion_checks(run: dict) -> list[dict]:
    """Every promotion of a run: the candidate's own votes against the version it replaced
    (the stable before it), all kinds, with Newcombe's 95 % interval (candidate minus
    replaced); ``shown_worse`` when the interval's upper bound is below 0; and the no-answer
    and truncated shares of every served reply (:func:`_reply_shares`)."""
    out, stable = [], None
    up_n: dict[str, list[int]] = {}
    for v in run["votes"]:
        a = up_n.setdefault(v["version"], [0, 0])
        a[0] += int(v["votes_up"])
        a[1] += int(v["votes_up"]) + int(v["votes_down"])
    rows = {row["version"]: row for row in run["report"]["versions"]}
    for row in run["report"]["versions"]:
        if row.get("decision") == "base":
            stable = row["version"]
        elif row.get("decision") == "PROMOTE" and stable is not None:
            a, b = up_n.get(stable, [0, 0]), up_n.get(row["version"], [0, 0])
            d, lo, hi = newcombe_interval(a[0], a[1], b[0], b[1]) if a[1] and b[1] else (None, None, None)
            shares = _reply_shares(rows[stable], row)
            out.append({"candidate": row["version"], "replaced": stable, "up_candidate": b[0], "n_candidate": b[1],
                        "up_replaced": a[0], "n_replaced": a[1], "diff": d, "ci95": [lo, hi],
                        "shown_worse": hi is not None and hi < 0, "replies": shares,
                        "guards_shown_worse": [k for k, c in shares.items() if c["ci95"][0] > 0],
                        "decided_by": row.get("decided_by"), "reason": row.get("reason")})
            stable = row["version"]
    return out


def _reply_shares(replaced: dict, candidate: dict) -> dict:
    """No-answer and truncated shares over every served reply (the report's ``replies``),
    candidate minus replaced with Newcombe's 95 % interval; a lower bound above 0 shows the
    candidate worse on that guard. Versions without reply figures are skipped."""
    out = {}
    for k in ("no_answer", "truncated"):
        a, b = (replaced.get("replies") or {}).get(k), (candidate.get("replies") or {}).get(k)
        if a and b and a.get("votes") and b.get("votes"):
            d, lo, hi = newcombe_interval(a["votes_up"], a["votes"], b["votes_up"], b["votes"])
            out[k] = {"replaced": [a["votes_up"], a["votes"]], "candidate": [b["votes_up"], b["votes"]],
                      "diff": d, "ci95": [lo, hi]}
    return out


def pool_runs(runs: list[dict], seed: int = 0) -> dict:
    """Pool runs as :func:`load_run` gives them: per run and pooled, last promoted minus first
    version by kind (module docstring). A run with no promotion is reported and left out of
    the pool (its gain is undefined). Returns a JSON-ready dict."""
    per_run, strata = [], {k: [] for k in KINDS}
    fixed_rows: list[dict] = []
    for i, run in enumerate(runs):
        rep = run["report"]
        first = rep["versions"][0]["version"]
        promoted = [r["version"] for r in rep["versions"] if r.get("decision") == "PROMOTE"]
        entry = {"dir": run["dir"], "first": first, "last": promoted[-1] if promoted else None,
                 "wall_s": rep.get("wall_s"), "events_accepted": rep.get("events_accepted"),
                 "events_lost": rep.get("events_lost"), "promotions": promotion_checks(run), "by_kind": {}}
        # the fixed eval set, paired within the run: the last promoted version against the first; a
        # run that promoted nothing counts as no change (its first against itself: every pair equal),
        # so a loop that fails to promote counts against a claim (docs/experiments.md, experiment 4)
        last = promoted[-1] if promoted else first
        mine = [r for r in run.get("fixed") or [] if r["version"] == first]
        mine += [dict(r, version="last") for r in run.get("fixed") or [] if r["version"] == last]
        fixed_rows += [dict(r, run=i, version="first" if r["version"] == first else "last") for r in mine]
        if promoted:
            entry["fixed_eval"] = paired_comparison(run.get("fixed") or [], first, last, seed=seed)
            for k in KINDS:
                s = _clusters(run["votes"], k, first, promoted[-1])
                strata[k].append(s)
                entry["by_kind"][k] = _compare([s], seed)
        per_run.append(entry)
    pooled = {k: _compare(strata[k], seed) for k in KINDS}
    worse = [dict(p, dir=r["dir"]) for r in per_run for p in r["promotions"]
             if p["shown_worse"] or p["guards_shown_worse"]]
    fresh = [r["by_kind"].get("fresh") for r in per_run]
    live = any(f is not None for f in fresh)  # no promoted run with thumbs on fresh prompts: no live verdict
    fixed_pooled = paired_comparison(fixed_rows, "first", "last", seed=seed, strata_key="run")
    fixed_fresh = [_of_kind(r.get("fixed_eval"), "fresh") for r in per_run]
    has_fixed = all(run.get("fixed") for run in runs) and bool(runs)
    pooled_fixed_fresh = _of_kind(fixed_pooled, "fresh")
    return {"runs": per_run, "pooled": pooled, "worse_promotions": worse,
            "fixed_eval_pooled": fixed_pooled,
            "every_run_positive_on_fresh": (all(f is not None and f["diff"] > 0 for f in fresh) and bool(fresh)
                                            if live else None),
            "pooled_fresh_cluster_excludes_0": (bool(pooled["fresh"] and pooled["fresh"]["cluster_ci95"]
                                                     and pooled["fresh"]["cluster_ci95"][0] > 0) if live else None),
            "fixed_every_run_positive_on_fresh": (all(f is not None and f["diff"] > 0 for f in fixed_fresh)
                                                  if has_fixed else None),
            "fixed_pooled_fresh_excludes_0": (bool(pooled_fixed_fresh and pooled_fixed_fresh["ci95"][0] > 0)
                                              if has_fixed else None)}


def _of_kind(comparison: dict | None, kind: str) -> dict | None:
    """A paired comparison's figures for ``kind`` (its ``by_kind`` entry; ``all``: the whole)."""
    if kind == "all":
        return comparison
    return ((comparison or {}).get("by_kind") or {}).get(kind)


def _forest_rows(pool: dict) -> tuple[list, list]:
    """The forest plot's rows: ``(name, diff, (lo, hi))`` for the fixed eval set (paired
    bootstrap) and for the users' live thumbs (cluster bootstrap), on fresh prompts and on all."""
    fixed, live = [], []

    def add(name: str, fixed_cmp: dict | None, live_cmp: dict | None, k: str) -> None:
        f = _of_kind(fixed_cmp, k)
        if f:
            fixed.append((f"{name} ({k})", f["diff"], tuple(f["ci95"])))
        if live_cmp and live_cmp.get("cluster_ci95"):
            live.append((f"{name} ({k})", live_cmp["diff"], tuple(live_cmp["cluster_ci95"])))

    for k in ("fresh", "all"):
        for r in pool["runs"]:
            add(Path(r["dir"]).name, r.get("fixed_eval"), r["by_kind"].get(k), k)
        add("pooled", pool.get("fixed_eval_pooled"), pool["pooled"].get(k), k)
    return fixed, live


def write_forest_plot(pool: dict, path: Path) -> None:
    """Forest plot: each run's and the pooled gain on ``fresh`` prompts and on all, with 95 %
    intervals: the fixed eval set's paired difference (paired bootstrap) and, where users sent
    thumbs, the live thumbs-up rate's (cluster bootstrap), one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(rows, label) for rows, label in zip(_forest_rows(pool), (
        "fixed eval set: pass rate, last promoted minus first (paired, 95% bootstrap)",
        "users' thumbs-up rate, last promoted minus first (95% cluster bootstrap)")) if rows]
    if not panels:
        panels = [([], "no run has fixed eval outcomes or thumbs on these prompts")]
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(7, sum(0.45 * len(r) + 1.2 for r, _ in panels)))
    for ax, (rows, label) in zip(axes[:, 0], panels):
        for i, (name, diff, (lo, hi)) in enumerate(rows):
            y = len(rows) - i
            ax.plot([lo, hi], [y, y], color="black" if name.startswith("pooled") else "tab:blue")
            ax.plot([diff], [y], "D" if name.startswith("pooled") else "o", color="black")
        ax.axvline(0, color="grey", linestyle="--")
        ax.set_yticks(range(len(rows), 0, -1), [n for n, _, _ in rows])
        ax.set_xlabel(label)
    axes[0, 0].set_title("Flywheel demo runs pooled")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
