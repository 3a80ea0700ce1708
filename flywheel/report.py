"""The demo's report: per-version thumbs-up rate with a 95 % interval, canary decisions,
mismatch and delta figures, and the event accounting (accepted = in samples + dead-lettered
+ lost; lost must be 0). Written as ``report.json`` and ``thumbs_up_by_version.png``.

Per version it also reports the votes by kind of prompt (``flywheel.workload.KINDS``:
``train``; and never trained on: ``fresh``, ``harder``, ``unseen``), and over every served
reply the mean length and the shares with no answer and cut at ``max_tokens``, each with a
95 % interval. ``eval_gain`` compares the first version with the last promoted one on each
kind, with Newcombe's interval (votes independent) and a cluster bootstrap over prompts
(votes on the same prompt are correlated: :func:`cluster_bootstrap_gain`).

``signals`` gives every signal's rate (thumb, copy, edit and its kept share, regenerate,
follow-up) per served reply by version and kind (:func:`signal_figures`). ``fixed_eval``
scores every version on one fixed held-out prompt set and compares the last promoted version
with the first paired by prompt: exact McNemar and a paired bootstrap
(:func:`paired_comparison`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from deploy.stats import newcombe_interval, wilson_interval  # the one implementation (wilson re-exported)


def _rate(up: int, n: int) -> dict:
    lo, hi = wilson_interval(up, n)
    return {"votes_up": up, "votes": n, "rate": (up / n) if n else None, "ci95": [lo, hi]}


def split_figures(rows: list[dict], family_of: dict[str, str]) -> dict[str, dict]:
    """Per version: thumbs-up by split (``train``/``eval``) and, within each split, by task
    family, each with a 95 % Wilson interval. ``family_of`` maps completion_id -> family
    (the demo's own record of what it asked); unknown ids count as ``other``.

    Returns ``{version: {split: {"all": rate, "by_family": {family: rate}}}}`` where a rate is
    ``{"votes_up", "votes", "rate", "ci95"}`` (votes = each user's last vote)."""
    acc: dict = {}
    for r in rows:
        v, sp = r["model_version"], r["split"] or "train"
        fam = family_of.get(str(r["completion_id"]), "other")
        up, n = int(r["votes_up"] or 0), int(r["votes_up"] or 0) + int(r["votes_down"] or 0)
        for key in ("all", fam):
            a = acc.setdefault(v, {}).setdefault(sp, {}).setdefault(key, [0, 0])
            a[0] += up
            a[1] += n
    out: dict = {}
    for v, by_split in acc.items():
        for sp, fams in by_split.items():
            out.setdefault(v, {})[sp] = {"all": _rate(*fams["all"]),
                                         "by_family": {f: _rate(*x) for f, x in sorted(fams.items()) if f != "all"}}
    return out


def kind_figures(rows: list[dict], kind_of: dict[str, str]) -> dict[str, dict]:
    """Per version: thumbs-up by kind of prompt, each with a 95 % Wilson interval.
    ``kind_of`` maps completion_id -> kind (``train``/``fresh``/``harder``/``unseen``);
    unknown ids count by their split (``train``, else ``fresh``).

    Returns ``{version: {kind: {"votes_up", "votes", "rate", "ci95"}}}``."""
    acc: dict = {}
    for r in rows:
        cid = str(r["completion_id"])
        kind = kind_of.get(cid) or ("train" if (r["split"] or "train") == "train" else "fresh")
        a = acc.setdefault(r["model_version"], {}).setdefault(kind, [0, 0])
        up = int(r["votes_up"] or 0)
        a[0] += up
        a[1] += up + int(r["votes_down"] or 0)
    return {v: {k: _rate(*x) for k, x in sorted(ks.items())} for v, ks in acc.items()}


def reply_figures(replies: list[dict]) -> dict:
    """Figures over served replies (every one, voted or not): ``{"n", "mean_tokens",
    "mean_tokens_ci95", "no_answer", "truncated"}``; the mean's interval is the normal one,
    ``mean +/- 1.96 s / sqrt(n)``; the shares are :func:`_rate` dicts (Wilson), counted
    as ``votes_up`` = replies with no answer / cut at ``max_tokens`` of ``votes`` = n.
    Each reply is ``{"tokens", "has_answer", "finish_reason"}``."""
    n = len(replies)
    toks = [float(r.get("tokens") or 0) for r in replies]
    mean = sum(toks) / n if n else 0.0
    sd = math.sqrt(sum((t - mean) ** 2 for t in toks) / (n - 1)) if n > 1 else 0.0
    h = 1.959963984540054 * sd / math.sqrt(n) if n else 0.0
    return {"n": n, "mean_tokens": mean, "mean_tokens_ci95": [mean - h, mean + h],
            "no_answer": _rate(sum(not r.get("has_answer") for r in replies), n),
            "truncated": _rate(sum(r.get("finish_reason") == "length" for r in replies), n)}


def cluster_bootstrap_gain(rows: list[dict], key_of: dict[str, str], first: str, last: str,
                           n_boot: int = 2000, seed: int = 0) -> dict | None:
    """Thumbs-up rate of ``last`` minus ``first`` with a 95 % percentile interval from a
    cluster bootstrap over prompts (Field and Welsh 2007; Cameron and Miller 2015, s. VI):
    prompts, not votes, are resampled with replacement, each carrying every vote both
    versions got on it, so repeated and correlated votes on one prompt widen the interval
    as they should (Newcombe's interval treats them as independent). ``key_of`` maps
    completion_id -> prompt key; ``rows`` as :func:`votes_by_completion` gives (filter them to
    one kind first). Deterministic for a ``seed``. Resamples where a version has no vote are
    dropped (counted in ``dropped``).

    Returns ``{"from", "to", "diff", "ci95", "prompts", "n_boot", "dropped", "method"}``, or
    None when either version has no vote.
    """
    import numpy as np

    per: dict[str, list[int]] = {}
    for r in rows:
        v = r["model_version"]
        if v not in (first, last):
            continue
        k = key_of.get(str(r["completion_id"]), str(r["completion_id"]))
        a = per.setdefault(k, [0, 0, 0, 0])
        up, n = int(r["votes_up"] or 0), int(r["votes_up"] or 0) + int(r["votes_down"] or 0)
        i = 0 if v == first else 2
        a[i] += up
        a[i + 1] += n
    boot = stratified_cluster_bootstrap([np.array(list(per.values()), dtype=float).reshape(-1, 4)], n_boot, seed)
    if boot is None:
        return None
    return {"from": first, "to": last, **boot, "method": "cluster bootstrap over prompts, 95 % percentile"}


def stratified_cluster_bootstrap(strata: list, n_boot: int = 4000, seed: int = 0) -> dict | None:
    """Difference of pooled thumbs-up rates (last minus first) with a 95 % percentile interval
    from a bootstrap that resamples prompts with replacement within each stratum (run).

    Args:
        strata: per run, an array ``(prompts, 4)`` of ``[up_first, n_first, up_last, n_last]``.
        n_boot: resamples; seed: the generator's seed (deterministic).

    Returns ``{"diff", "ci95", "prompts", "n_boot", "dropped", "method"}`` or None when either
    version has no vote in the pool. Resamples where a version got no vote are dropped (counted).
    One stratum is the plain cluster bootstrap (:func:`cluster_bootstrap_gain`).
    """
    import numpy as np

    strata = [s for s in strata if len(s)]
    if not strata:
        return None
    tot = sum(s.sum(axis=0) for s in strata)
    if tot[1] == 0 or tot[3] == 0:
        return None
    rng = np.random.default_rng(seed)
    acc = np.zeros((n_boot, 4))
    for s in strata:
        acc += s[rng.integers(0, len(s), (n_boot, len(s)))].sum(axis=1)
    ok = (acc[:, 1] > 0) & (acc[:, 3] > 0)
    d = acc[ok, 2] / acc[ok, 3] - acc[ok, 0] / acc[ok, 1]
    lo, hi = np.percentile(d, [2.5, 97.5])
    return {"diff": float(tot[2] / tot[3] - tot[0] / tot[1]), "ci95": [float(lo), float(hi)],
            "prompts": int(sum(len(s) for s in strata)), "n_boot": n_boot, "dropped": int((~ok).sum()),
            "method": "cluster bootstrap over prompts, stratified by run, 95 % percentile"}


def mcnemar_exact(only_first: int, only_last: int) -> float:
    """Two-sided exact McNemar p-value (McNemar 1947; the exact binomial form, Fagerland,
    Lydersen and Laake 2013): under "no difference" each discordant pair is equally likely
    to favour either version, so ``min(b, c) ~ Binomial(b + c, 1/2)``;
    ``p = min(1, 2 * P[X <= min(b, c)])``. 1.0 when there is no discordant pair.

    Args:
        only_first: prompts right under the first version only (b, count >= 0).
        only_last: prompts right under the last version only (c, count >= 0).

    Raises:
        ValueError: a negative count.
    """
    b, c = int(only_first), int(only_last)
    if b < 0 or c < 0:
        raise ValueError(f"only_first/only_last: counts >= 0, got {b}, {c}")
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_bootstrap(strata: list, n_boot: int = 4000, seed: int = 0) -> list[float] | None:
    """95 % percentile interval of the mean paired difference (last minus first, per prompt)
    from a bootstrap that resamples prompts with replacement within each stratum (run) and
    pools the strata (each prompt weighs the same). Deterministic for a ``seed``.

    Args:
        strata: per run, a sequence of per-prompt differences in {-1, 0, 1} (or any floats).

    Returns ``[lo, hi]``, or None when there is no prompt.
    """
    import numpy as np

    strata = [np.asarray(s, dtype=float) for s in strata if len(s)]
    if not strata:
        return None
    rng = np.random.default_rng(seed)
    total = np.zeros(n_boot)
    n = 0
    for s in strata:
        total += s[rng.integers(0, len(s), (n_boot, len(s)))].sum(axis=1)
        n += len(s)
    lo, hi = np.percentile(total / n, [2.5, 97.5])
    return [float(lo), float(hi)]


def paired_comparison(rows: list[dict], first: str, last: str, seed: int = 0, n_boot: int = 4000,
                      strata_key: str | None = None) -> dict | None:
    """``last`` against ``first`` on the fixed eval set, paired by prompt: each prompt was asked
    of both versions with the same sampling seed, so the per-prompt outcomes are pairs.

    Args:
        rows: ``{"version", "key", "kind", "passed"}`` per (version, prompt) (``fixed_eval``
            rows), and ``strata_key``'s field when given (the run, to pool several runs).
        first, last: the versions compared. seed, n_boot: the bootstrap's.

    Returns ``{"from", "to", "prompts", "rate_from", "rate_to", "diff", "both", "only_from",
    "only_to", "neither", "mcnemar_p", "ci95", "by_kind": {kind: same fields}, "method"}``
    (``diff`` = rate_to - rate_from; ``ci95`` the paired bootstrap's, stratified by
    ``strata_key``), or None when no prompt was scored under both versions.
    """
    pairs: dict[tuple, list] = {}
    for r in rows:
        if r["version"] not in (first, last):
            continue
        k = (r.get(strata_key) if strata_key else None, r["key"])
        p = pairs.setdefault(k, [None, None, r.get("kind") or "fresh"])
        p[0 if r["version"] == first else 1] = bool(r["passed"])
    both_scored = {k: v for k, v in pairs.items() if v[0] is not None and v[1] is not None}
    if not both_scored:
        return None

    def figures(items: dict) -> dict:
        a = [v[0] for v in items.values()]
        b = [v[1] for v in items.values()]
        n = len(a)
        cells = {"both": sum(x and y for x, y in zip(a, b)), "only_from": sum(x and not y for x, y in zip(a, b)),
                 "only_to": sum(y and not x for x, y in zip(a, b)), "neither": sum(not x and not y for x, y in zip(a, b))}
        strata: dict = {}
        for (st, _), v in items.items():
            strata.setdefault(st, []).append(int(v[1]) - int(v[0]))
        return {"prompts": n, "rate_from": sum(a) / n, "rate_to": sum(b) / n, "diff": (sum(b) - sum(a)) / n,
                **cells, "mcnemar_p": mcnemar_exact(cells["only_from"], cells["only_to"]),
                "ci95": paired_bootstrap(list(strata.values()), n_boot, seed)}

    out = {"from": first, "to": last, **figures(both_scored), "by_kind": {}}
    for kind in sorted({v[2] for v in both_scored.values()}):
        out["by_kind"][kind] = figures({k: v for k, v in both_scored.items() if v[2] == kind})
    out["method"] = ("paired by prompt (same prompts and sampling seeds): exact McNemar, two-sided; "
                     "paired bootstrap over prompts" + (", stratified by run" if strata_key else "") + ", 95 % percentile")
    return out


def fixed_figures(rows: list[dict]) -> dict[str, dict]:
    """Per version, the fixed eval set's pass rate overall and by kind and family, each a
    :func:`_rate` dict (``votes_up`` = right replies of ``votes`` = prompts scored)."""
    acc: dict = {}
    for r in rows:
        v = acc.setdefault(r["version"], {"all": [0, 0], "by_kind": {}, "by_family": {}})
        for a in (v["all"], v["by_kind"].setdefault(r.get("kind") or "fresh", [0, 0]),
                  v["by_family"].setdefault(r.get("family") or "other", [0, 0])):
            a[0] += bool(r["passed"])
            a[1] += 1
    return {v: {"all": _rate(*x["all"]), "by_kind": {k: _rate(*y) for k, y in sorted(x["by_kind"].items())},
                "by_family": {k: _rate(*y) for k, y in sorted(x["by_family"].items())}} for v, x in acc.items()}




def signal_figures(completions: dict[str, dict], joined: dict[str, dict] | None = None) -> dict[str, dict]:
    """Every signal's rate by version and kind of prompt, over served replies.

    ``sent`` (the users' own record, ``completions[cid]["thumb"]`` and ``["action"]``): the
    share of replies with a thumb and its up rate, and the share copied, edited (with the mean
    kept share), regenerated, followed up dissatisfied / satisfied. ``joined`` (the samples'
    columns, ``{cid: {"copied", "regenerated", "kept_share", "followup", ...}}``; None when the
    shards carry none): the same shares as the join folded them. Each share is a :func:`_rate`
    dict over the replies served.

    Returns ``{version: {kind: {"replies", "sent": {...}, "joined": {...} | None}}}``.
    """
    acc: dict = {}
    for cid, c in completions.items():
        a = acc.setdefault(c.get("version"), {}).setdefault(c.get("kind") or "train", {"n": 0, "sent": {}, "joined": {}})
        a["n"] += 1
        s = a["sent"]
        thumb, action = c.get("thumb"), c.get("action")
        kind, value = action if action else (None, None)
        for name, hit in (("thumb", thumb is not None), ("thumb_up", thumb == 1), ("copy", kind == "copy"),
                          ("edit", kind == "edit"), ("regenerate", kind == "regenerate"),
                          ("followup_dissatisfied", kind == "followup" and value < 0),
                          ("followup_satisfied", kind == "followup" and value > 0)):
            s[name] = s.get(name, 0) + bool(hit)
        if kind == "edit":
            s["kept_sum"] = s.get("kept_sum", 0.0) + float(value)
        j = (joined or {}).get(cid)
        if j is not None:
            d = a["joined"]
            for name, hit in (("copy", (j.get("copied") or 0) > 0), ("edit", j.get("kept_share") is not None),
                              ("regenerate", (j.get("regenerated") or 0) > 0),
                              ("followup_dissatisfied", (j.get("followup") or 0) < 0),
                              ("followup_satisfied", (j.get("followup") or 0) > 0)):
                d[name] = d.get(name, 0) + bool(hit)
            if j.get("kept_share") is not None:
                d["kept_sum"] = d.get("kept_sum", 0.0) + float(j["kept_share"])

    def shares(counts: dict, n: int) -> dict:
        out = {k: _rate(counts.get(k, 0), n) for k in ("copy", "edit", "regenerate", "followup_dissatisfied",
                                                        "followup_satisfied")}
        out["mean_kept_share"] = counts["kept_sum"] / counts["edit"] if counts.get("edit") else None
        return out

    res: dict = {}
    for v, kinds in acc.items():
        for kind, a in sorted(kinds.items()):
            sent = shares(a["sent"], a["n"])
            sent["thumb"] = _rate(a["sent"].get("thumb", 0), a["n"])
            sent["thumb_up"] = _rate(a["sent"].get("thumb_up", 0), a["sent"].get("thumb", 0))
            res.setdefault(v, {})[kind] = {"replies": a["n"], "sent": sent,
                                           "joined": shares(a["joined"], a["n"]) if joined is not None else None}
    return res


def eval_gain(figures: dict[str, dict], first: str, last: str) -> dict | None:
    """Thumbs-up on eval prompts, ``last`` minus ``first``, with Newcombe's 95 % interval
    (method 10) over independent votes: ``{"from", "to", "diff", "ci95", "n_from", "n_to",
    "up_from", "up_to"}``; None when either version has no eval votes."""
    a = ((figures.get(first) or {}).get("eval") or {}).get("all")
    b = ((figures.get(last) or {}).get("eval") or {}).get("all")
    if not a or not b or not a["votes"] or not b["votes"]:
        return None
    d, lo, hi = newcombe_interval(a["votes_up"], a["votes"], b["votes_up"], b["votes"])
    return {"from": first, "to": last, "diff": d, "ci95": [lo, hi], "n_from": a["votes"], "n_to": b["votes"],
            "up_from": a["votes_up"], "up_to": b["votes_up"], "method": "Newcombe 1998 method 10, 95 %"}


def write_plot(report: dict, path: Path) -> None:
    """Bar chart of thumbs-up rate by version with 95 % Wilson intervals; the mean reward by
    version instead when no version has a thumb (``flywheel demo --signals implicit``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vs = report["versions"]
    fig, ax = plt.subplots(figsize=(max(4, 1.4 * len(vs) + 2), 3.6))
    xs = range(len(vs))
    colors = {"promote": "tab:green", "rollback": "tab:red", "base": "tab:blue"}
    if not any(v["votes_up"] + v["votes_down"] for v in vs):
        ax.bar(xs, [v.get("mean_reward") or 0.0 for v in vs],
               color=[colors.get((v.get("decision") or "").lower(), "tab:gray") for v in vs])
        ax.set_xticks(list(xs), [f"{v['version']}\n{(v.get('decision') or '-').lower()}\nn={v['samples']}"
                                 for v in vs], fontsize=8)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_ylabel("mean reward (reward policy)")
        ax.set_ylim(-1, 1)
        ax.set_title("Flywheel demo: mean reward by model version (no thumbs sent)")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return
    rates = [v["thumbs_up_rate"] or 0.0 for v in vs]  # None: a version without votes
    lo = [max(0.0, r - v["ci95"][0]) for r, v in zip(rates, vs)]  # >= 0: Wilson's bound may round past the rate
    hi = [max(0.0, v["ci95"][1] - r) for r, v in zip(rates, vs)]
    ax.bar(xs, rates, yerr=[lo, hi], capsize=5,
           color=[colors.get((v.get("decision") or "").lower(), "tab:gray") for v in vs])
    ax.set_xticks(list(xs), [f"{v['version']}\n{(v.get('decision') or '-').lower()}\n"
                             f"n={v['votes_up'] + v['votes_down']}" for v in vs], fontsize=8)
    ev = [((v.get("splits") or {}).get("eval") or {}).get("all") for v in vs]
    if any(x and x.get("votes") for x in ev):
        ex = [i + 0.3 for i in xs]
        er = [x["rate"] if x and x.get("votes") else 0.0 for x in ev]
        elo = [max(0.0, x["rate"] - x["ci95"][0]) if x and x.get("votes") else 0.0 for x in ev]
        ehi = [max(0.0, x["ci95"][1] - x["rate"]) if x and x.get("votes") else 0.0 for x in ev]
        ax.errorbar(ex, er, yerr=[elo, ehi], fmt="D", color="black", capsize=4, label="eval split (never trained on)")
        ax.legend(fontsize=7, loc="upper left")
    ax.set_ylabel("thumbs-up rate (95% Wilson CI)")
    ax.set_ylim(0, 1)
    ax.set_title("Flywheel demo: thumbs-up rate by model version")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    write_plot(report, out / "thumbs_up_by_version.png")


def write_votes(rows: list[dict], completions: dict[str, dict], path: Path) -> int:
    """Write one JSON line per voted completion: ``completion_id``, ``version``, ``family``,
    ``split``, ``kind``, ``key`` (the prompt's stable id), ``votes_up``, ``votes_down``, and the
    served reply's ``has_answer``, ``finish_reason`` and ``tokens``. ``rows`` as
    :func:`votes_by_completion` gives; ``completions`` maps completion_id -> the demo's record of
    the reply. What ``flywheel demo-pool`` reads to pool several runs by prompt. Returns the
    number of lines written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w") as f:
        for r in rows:
            c = completions.get(str(r["completion_id"])) or {}
            f.write(json.dumps({"completion_id": str(r["completion_id"]), "version": r["model_version"],
                                "family": c.get("family"), "split": r["split"] or c.get("split"),
                                "kind": c.get("kind"), "key": c.get("key"),
                                "votes_up": int(r["votes_up"] or 0), "votes_down": int(r["votes_down"] or 0),
                                "has_answer": c.get("has_answer"), "finish_reason": c.get("finish_reason"),
                                "tokens": c.get("tokens")}) + "\n")
            n += 1
    return n


def write_fixed(rows: list[dict], path: Path) -> int:
    """Write the fixed eval set's rows (one JSON line per version and prompt: ``version``,
    ``key``, ``family``, ``kind``, ``passed``, ``has_answer``, ``finish_reason``, ``tokens``),
    what ``flywheel demo-pool`` pools by run. Returns the number of lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return len(rows)


def _clip(text: str, n: int) -> str:
    """``text`` cut to ``n`` characters with a trailing ellipsis when cut (report.json keeps it whole)."""
    return text if len(text) <= n else text[: n - 1] + "…"


def _fmt_rate(x: dict | None) -> str:
    if not x or not x.get("votes"):
        return "-"
    return f"{x['rate']:.3f} ({x['votes_up']}/{x['votes']}) [{x['ci95'][0]:.2f},{x['ci95'][1]:.2f}]"


def _fmt_mean(r: dict | None) -> str:
    if not r or not r.get("n"):
        return "-"
    lo, hi = r["mean_tokens_ci95"]
    return f"{r['mean_tokens']:.1f} [{lo:.1f},{hi:.1f}]"


def _print_kinds(report: dict, console) -> None:
    """Per version: votes by kind of prompt and the served replies' figures, with intervals;
    then ``eval_gain`` per kind with Newcombe's and the cluster bootstrap's intervals."""
    from rich.table import Table

    if not any(v.get("kinds") or v.get("replies") for v in report["versions"]):
        return
    t = Table(title="Thumbs-up by kind of prompt (train; never trained on: fresh, harder, unseen) and every "
                    "served reply")
    for col in ("version", "all votes", "train", "fresh", "harder", "unseen", "reply tokens", "no answer",
                "cut at max_tokens"):
        t.add_column(col, overflow="fold")
    for v in report["versions"]:
        k, r = v.get("kinds") or {}, v.get("replies") or {}
        n = v["votes_up"] + v["votes_down"]
        allv = {"votes_up": v["votes_up"], "votes": n, "rate": v["thumbs_up_rate"], "ci95": v["ci95"]}
        t.add_row(v["version"], _fmt_rate(allv), *(_fmt_rate(k.get(x)) for x in ("train", "fresh", "harder", "unseen")),
                  _fmt_mean(r), _fmt_rate(r.get("no_answer")), _fmt_rate(r.get("truncated")))
    console.print(t)
    g = report.get("eval_gain") or {}
    for kind, x in (g.get("by_kind") or {}).items():
        cl = x.get("cluster_ci95")
        console.print(f"eval gain on {kind} prompts {g['from']} -> {g['to']}: {x['up_from']}/{x['n_from']} -> "
                      f"{x['up_to']}/{x['n_to']}, diff {x['diff']:+.3f}, Newcombe [{x['ci95'][0]:+.3f}, "
                      f"{x['ci95'][1]:+.3f}]" + (f", cluster bootstrap over {x['prompts']} prompts "
                                                  f"[{cl[0]:+.3f}, {cl[1]:+.3f}]" if cl else ""))


def _fmt_paired(x: dict | None) -> str:
    if not x:
        return "-"
    ci = x.get("ci95")
    return (f"{x['diff']:+.3f} ({x['only_to']} vs {x['only_from']} discordant of {x['prompts']}) "
            + (f"[{ci[0]:+.3f},{ci[1]:+.3f}]" if ci else "") + f" McNemar p={x['mcnemar_p']:.3g}")


def _print_fixed(report: dict, console) -> None:
    """The fixed eval set: per version its pass rate by kind beside the live thumbs-up rate,
    then the paired comparison (last promoted against the first)."""
    from rich.table import Table

    fx = report.get("fixed_eval") or {}
    by_v = fx.get("by_version") or {}
    if not by_v:
        return
    kinds = sorted({k for x in by_v.values() for k in (x.get("by_kind") or {})})
    t = Table(title=f"Fixed eval set ({fx.get('prompts', 0)} prompts, the same prompts and sampling seeds for every "
                    "version, never trained on or asked by the users) beside the live votes")
    for col in ("version", "fixed: all", *(f"fixed: {k}" for k in kinds), "live thumbs-up", "live fresh"):
        t.add_column(col, overflow="fold")
    for v in report["versions"]:
        f = by_v.get(v["version"])
        if not f:
            continue
        n = v["votes_up"] + v["votes_down"]
        live = {"votes_up": v["votes_up"], "votes": n, "rate": v["thumbs_up_rate"], "ci95": v["ci95"]}
        t.add_row(v["version"], _fmt_rate(f["all"]), *(_fmt_rate((f.get("by_kind") or {}).get(k)) for k in kinds),
                  _fmt_rate(live), _fmt_rate((v.get("kinds") or {}).get("fresh")))
    console.print(t)
    c = fx.get("comparison")
    if c:
        console.print(f"fixed eval {c['from']} -> {c['to']} (paired): {c['rate_from']:.3f} -> {c['rate_to']:.3f}, "
                      f"diff {_fmt_paired(c)}")
        for kind, x in (c.get("by_kind") or {}).items():
            console.print(f"  {kind}: {x['rate_from']:.3f} -> {x['rate_to']:.3f}, diff {_fmt_paired(x)}")
    else:
        console.print("fixed eval comparison: no version after the first was promoted (usual for --quick)")


def _print_signals(report: dict, console) -> None:
    """Every signal's rate by version and kind of prompt (as the join folded it when the samples
    carry the signal columns, else as the users sent it)."""
    from rich.table import Table

    sig = report.get("signals") or {}
    if not sig:
        return
    joined = any(k.get("joined") for kinds in sig.values() for k in kinds.values())
    t = Table(title="Signals per served reply by version and kind of prompt "
                    + ("(as joined into samples; thumbs as sent)" if joined else "(as the users sent them)"))
    for col in ("version", "kind", "replies", "thumb / up", "copy", "edit (kept)", "regenerate", "followup -/+"):
        t.add_column(col, overflow="fold")

    def pct(x: dict | None) -> str:
        return "-" if not x or not x.get("votes") else f"{x['rate']:.2f}"

    for v in sorted(sig):
        for kind, x in sig[v].items():
            s = x["sent"]
            d = x["joined"] if joined and x.get("joined") else s
            kept = d.get("mean_kept_share")
            t.add_row(v, kind, str(x["replies"]), f"{pct(s['thumb'])} / {pct(s['thumb_up'])}", pct(d["copy"]),
                      pct(d["edit"]) + (f" ({kept:.2f})" if kept is not None else ""), pct(d["regenerate"]),
                      f"{pct(d['followup_dissatisfied'])} / {pct(d['followup_satisfied'])}")
    console.print(t)


def print_report(report: dict, console=None) -> None:
    """Rich table of the report."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if not console.is_terminal:  # a log file or CI: do not squeeze the table into 80 columns
        console = Console(width=200)
    t = Table(title="Flywheel demo report")
    for col in ("version", "parent", "samples", "mean reward", "up/down", "thumbs-up (95% CI)", "decision",
                "reason", "mismatch mean/max", "delta ratio", "swap pause ms"):
        t.add_column(col, overflow="fold")
    for v in report["versions"]:
        mm = ("-" if v.get("mismatch_mean") is None
              else f"{v['mismatch_mean']:.2e}/{v['mismatch_max']:.2e}")
        t.add_row(v["version"], v.get("parent") or "-", str(v["samples"]),
                  "-" if v.get("mean_reward") is None else f"{v['mean_reward']:+.3f}",
                  f"{v['votes_up']}/{v['votes_down']}",
                  "-" if v["thumbs_up_rate"] is None
                  else f"{v['thumbs_up_rate']:.3f} [{v['ci95'][0]:.2f},{v['ci95'][1]:.2f}]",
                  v.get("decision") or "-", _clip(v.get("reason") or "", 160), mm,
                  "-" if v.get("delta_ratio") is None else f"{v['delta_ratio']:.1f}x",
                  "-" if v.get("swap_pause_ms") is None else f"{v['swap_pause_ms']:.2f}")
    console.print(t)
    if any(v.get("splits") for v in report["versions"]):
        e = Table(title="Prompts no version trained on (eval split) and the canary")
        for col in ("version", "eval thumbs-up (95% CI)", "by family", "train thumbs-up", "HumanEval eval pass",
                    "canary interval", "decided by", "guards: len / no answer / cut"):
            e.add_column(col, overflow="fold")
        for v in report["versions"]:
            sp = v.get("splits") or {}
            ev, tr = (sp.get("eval") or {}).get("all"), (sp.get("train") or {}).get("all")
            fams = ", ".join(f"{f} {x['votes_up']}/{x['votes']}" for f, x in ((sp.get("eval") or {}).get("by_family")
                                                                             or {}).items())
            ci = v.get("canary_interval")
            g = v.get("guards") or {}
            he = v.get("humaneval_eval") or {}
            e.add_row(v["version"], _fmt_rate(ev), fams or "-", _fmt_rate(tr),
                      f"{he['passed']}/{he['n']}" if he.get("n") else "-",
                      f"{ci['diff']:+.3f} [{ci['lo']:+.3f},{ci['hi']:+.3f}]" if ci else "-",
                      v.get("decided_by") or "-",
                      (f"{g['mean_tokens']:.0f} / {g['no_answer_share']:.2f} / {g['truncated_share']:.2f}"
                       if g.get("n") else "-"))
        console.print(e)
        _print_kinds(report, console)
        g = report.get("eval_gain")
        if g:
            verdict = "better at 95 %" if g["ci95"][0] > 0 else "not shown better at 95 %"
            cl = g.get("cluster_ci95")
            console.print(f"eval gain {g['from']} -> {g['to']}: {g['up_from']}/{g['n_from']} -> {g['up_to']}/{g['n_to']}, "
                          f"diff {g['diff']:+.3f}, 95 % Newcombe [{g['ci95'][0]:+.3f}, {g['ci95'][1]:+.3f}]"
                          + (f", cluster bootstrap over prompts [{cl[0]:+.3f}, {cl[1]:+.3f}]" if cl else "")
                          + f": [bold]{verdict}[/bold]")
        else:
            console.print("eval gain: not measured: no version after the first was promoted with eval votes "
                          "to compare (usual for --quick: one short cycle; the full run measures it)")
    _print_signals(report, console)
    _print_fixed(report, console)
    console.print(f"feedback events accepted {report['events_accepted']}, in samples "
                  f"{report['events_in_samples']}, dead-lettered {report['events_dead_lettered']}, "
                  f"[bold]lost {report['events_lost']}[/bold]; double-counted "
                  f"{report.get('events_double_counted', 0)}; wall {report['wall_s']:.0f}s")
