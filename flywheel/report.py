"""The demo's report: per-version thumbs-up rate with a 95 % interval, canary decisions,
mismatch and delta figures, and the event accounting (accepted = in samples + dead-lettered
+ lost; lost must be 0). Written as ``report.json`` and ``thumbs_up_by_version.png``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


from deploy.stats import wilson_interval  # noqa: E402,F401 (the one implementation; re-exported)

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


def write_plot(report: dict, path: Path) -> None:
    """Bar chart of thumbs-up rate by version with 95 % Wilson intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vs = report["versions"]
    fig, ax = plt.subplots(figsize=(max(4, 1.4 * len(vs) + 2), 3.6))
    xs = range(len(vs))
    rates = [v["thumbs_up_rate"] for v in vs]
    lo = [v["thumbs_up_rate"] - v["ci95"][0] for v in vs]
    hi = [v["ci95"][1] - v["thumbs_up_rate"] for v in vs]
    colors = {"promote": "tab:green", "rollback": "tab:red", "base": "tab:blue"}
    ax.bar(xs, rates, yerr=[lo, hi], capsize=5,
           color=[colors.get((v.get("decision") or "").lower(), "tab:gray") for v in vs])
    ax.set_xticks(list(xs), [f"{v['version']}\n{(v.get('decision') or '-').lower()}\n"
                             f"n={v['votes_up'] + v['votes_down']}" for v in vs], fontsize=8)
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


def _clip(text: str, n: int) -> str:
    """``text`` cut to ``n`` characters with a trailing ellipsis when cut (report.json keeps it whole)."""
    return text if len(text) <= n else text[: n - 1] + "…"


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
    console.print(f"feedback events accepted {report['events_accepted']}, in samples "
                  f"{report['events_in_samples']}, dead-lettered {report['events_dead_lettered']}, "
                  f"[bold]lost {report['events_lost']}[/bold]; double-counted "
                  f"{report.get('events_double_counted', 0)}; wall {report['wall_s']:.0f}s")
