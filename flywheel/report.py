"""The demo's report: per-version thumbs-up rate with a 95 % interval, canary decisions,
mismatch and delta figures, and the event accounting (accepted = in samples + dead-lettered
+ lost; lost must be 0). Written as ``report.json`` and ``thumbs_up_by_version.png``.

Per version it also reports the votes by kind of prompt (``flywheel.workload.KINDS``:
``train``; and never trained on: ``fresh``, ``harder``, ``unseen``), and over every served
reply the mean length and the shares with no answer and cut at ``max_tokens``, each with a
95 % interval. ``eval_gain`` compares the first version with the last promoted one on each
kind, with Newcombe's interval (votes independent) and a cluster bootstrap over prompts
(votes on the same prompt are correlated: :func:`cluster_bootstrap_gain`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from deploy.stats import newcombe_interval, wilson_interval  # the one implementation (wilson re-exported)


def samples_by_version(samples_dir: Path) -> dict[str, dict]:
    """Per producing version: samples, votes up/down (ingest's ``votes_by_version`` view)."""
    from ingest.catalog import query

    rows = query("SELECT model_version, samples, votes_up, votes_down FROM votes_by_version", samples_dir)
    return {r["model_version"]: {"samples": int(r["samples"]), "votes_up": int(r["votes_up"] or 0),
                                 "votes_down": int(r["votes_down"] or 0)} for r in rows}


def event_ids_in_samples(samples_dir: Path) -> list[str]:
    """Every feedback event_id folded into a sample (with repeats, to detect double counting)."""
    import duckdb

    if not list(Path(samples_dir).rglob("*.parquet")):
        return []
    con = duckdb.connect()
    try:
        rows = con.execute("SELECT unnest(event_ids) FROM read_parquet(?, hive_partitioning=true)",
                           [str(Path(samples_dir) / "**" / "*.parquet")]).fetchall()
    finally:
        con.close()
    return [r[0] for r in rows]


def votes_by_completion(samples_dir: Path) -> list[dict]:
    """One row per sample: ``completion_id`` (str), ``model_version``, ``split``, ``votes_up``,
    ``votes_down`` (ingest's ``samples`` view: the votes the loop itself collected)."""
    from ingest.catalog import query

    if not list(Path(samples_dir).rglob("*.parquet")):
        return []
    return query("SELECT CAST(completion_id AS VARCHAR) AS completion_id, model_version, split, votes_up, votes_down "
                 "FROM samples", samples_dir)


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
    """Bar chart of thumbs-up rate by version with 95 % Wilson intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vs = report["versions"]
    fig, ax = plt.subplots(figsize=(max(4, 1.4 * len(vs) + 2), 3.6))
    xs = range(len(vs))
    rates = [v["thumbs_up_rate"] for v in vs]
    lo = [max(0.0, v["thumbs_up_rate"] - v["ci95"][0]) for v in vs]  # >= 0: Wilson's bound may round past the rate
    hi = [max(0.0, v["ci95"][1] - v["thumbs_up_rate"]) for v in vs]
    colors = {"promote": "tab:green", "rollback": "tab:red", "base": "tab:blue"}
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


def print_report(report: dict, console=None) -> None:
    """Rich table of the report."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if not console.is_terminal:  # a log file or CI: do not squeeze the table into 80 columns
        console = Console(width=200)
    t = Table(title="Flywheel demo report")
    for col in ("version", "parent", "samples", "up/down", "thumbs-up (95% CI)", "decision", "reason",
                "mismatch mean/max", "delta ratio", "swap pause ms"):
        t.add_column(col, overflow="fold")
    for v in report["versions"]:
        mm = ("-" if v.get("mismatch_mean") is None
              else f"{v['mismatch_mean']:.2e}/{v['mismatch_max']:.2e}")
        t.add_row(v["version"], v.get("parent") or "-", str(v["samples"]),
                  f"{v['votes_up']}/{v['votes_down']}",
                  f"{v['thumbs_up_rate']:.3f} [{v['ci95'][0]:.2f},{v['ci95'][1]:.2f}]",
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
    console.print(f"feedback events accepted {report['events_accepted']}, in samples "
                  f"{report['events_in_samples']}, dead-lettered {report['events_dead_lettered']}, "
                  f"[bold]lost {report['events_lost']}[/bold]; double-counted "
                  f"{report.get('events_double_counted', 0)}; wall {report['wall_s']:.0f}s")
