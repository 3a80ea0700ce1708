"""Pooling full demo runs (flywheel/pool.py, `flywheel demo-pool`): counts, Newcombe's interval
and the stratified cluster bootstrap checked against formulas written out here, promotion
checks, and the command on real files in a subprocess."""
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flywheel import report as rep
from flywheel.pool import load_run, pool_runs, stratified_cluster_bootstrap

Z = 1.959963984540054


def wilson(x: int, n: int) -> tuple[float, float]:
    p = x / n
    c = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    h = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / (1 + Z * Z / n)
    return c - h, c + h


def newcombe(x1, n1, x2, n2):
    """p2 - p1, Newcombe 1998 method 10, written out from the paper."""
    p1, p2 = x1 / n1, x2 / n2
    l1, u1 = wilson(x1, n1)
    l2, u2 = wilson(x2, n2)
    d = p2 - p1
    return d, d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2), d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)


def make_run(path: Path, rng: random.Random, p_first: float, p_last: float, prompts: int = 60,
             votes_per_prompt: int = 2, versions=("v000000", "v000001"), decisions=("base", "PROMOTE"),
             kind: str = "fresh") -> list[dict]:
    path.mkdir(parents=True)
    votes = []
    for v, p in zip(versions, (p_first, p_last)):
        for k in range(prompts):
            for j in range(votes_per_prompt):
                up = rng.random() < p
                votes.append({"completion_id": f"{v}-{k}-{j}", "version": v, "family": "chain_sum", "split": "eval",
                              "kind": kind, "key": f"q{k}", "votes_up": int(up), "votes_down": int(not up),
                              "has_answer": True, "finish_reason": "stop", "tokens": 10})
    report = {"versions": [{"version": v, "decision": d, "decided_by": "sequential_test" if d == "PROMOTE" else None,
                            "reason": "test"} for v, d in zip(versions, decisions)],
              "wall_s": 60.0, "events_accepted": len(votes), "events_lost": 0}
    (path / "report.json").write_text(json.dumps(report))
    (path / "votes.jsonl").write_text("".join(json.dumps(v) + "\n" for v in votes))
    return votes


def linearised_se(runs_votes: list[list[dict]], first: str, last: str) -> float:
    """Cluster-robust standard error of the pooled difference by linearisation (Taylor),
    prompts as clusters within runs as strata, without the small-sample factor (as the
    bootstrap): Var = sum_h m_h * var0(z_i), z_i = (u_l - R_l n_l)/N_l - (u_f - R_f n_f)/N_f."""
    cl = []
    for h, votes in enumerate(runs_votes):
        per = {}
        for v in votes:
            a = per.setdefault(v["key"], [0, 0, 0, 0])
            i = 0 if v["version"] == first else 2
            a[i] += v["votes_up"]
            a[i + 1] += v["votes_up"] + v["votes_down"]
        cl.append(np.array(list(per.values()), float))
    tot = sum(c.sum(axis=0) for c in cl)
    rf, rl = tot[0] / tot[1], tot[2] / tot[3]
    var = 0.0
    for c in cl:
        z = (c[:, 2] - rl * c[:, 3]) / tot[3] - (c[:, 0] - rf * c[:, 1]) / tot[1]
        var += len(c) * z.var()
    return math.sqrt(var)


def test_pooled_counts_and_newcombe_match_the_formula(tmp_path):
    rng = random.Random(1)
    a = make_run(tmp_path / "a", rng, 0.2, 0.3)
    b = make_run(tmp_path / "b", rng, 0.25, 0.35, prompts=40)
    pool = pool_runs([load_run(tmp_path / "a"), load_run(tmp_path / "b")])
    c = pool["pooled"]["fresh"]
    uf = sum(v["votes_up"] for v in a + b if v["version"] == "v000000")
    ul = sum(v["votes_up"] for v in a + b if v["version"] == "v000001")
    assert (c["up_from"], c["n_from"], c["up_to"], c["n_to"]) == (uf, 200, ul, 200)
    d, lo, hi = newcombe(uf, 200, ul, 200)
    assert c["diff"] == pytest.approx(d) and c["ci95"] == pytest.approx([lo, hi])
    assert c["prompts"] == 100  # 60 + 40 prompt keys, each run's keys its own clusters
    # per run, the same figures over that run's votes alone
    ra = pool["runs"][0]["by_kind"]["fresh"]
    assert ra["n_from"] == 120 and ra["diff"] == pytest.approx(
        newcombe(sum(v["votes_up"] for v in a if v["version"] == "v000000"), 120,
                 sum(v["votes_up"] for v in a if v["version"] == "v000001"), 120)[0])
    assert pool["pooled"]["train"] is None  # no train votes in these runs


def test_stratified_bootstrap_matches_the_linearised_cluster_se(tmp_path):
    rng = random.Random(7)
    runs = [make_run(tmp_path / f"r{i}", rng, 0.2, 0.3, prompts=80, votes_per_prompt=4) for i in range(3)]
    pool = pool_runs([load_run(tmp_path / f"r{i}") for i in range(3)], seed=3)
    lo, hi = pool["pooled"]["fresh"]["cluster_ci95"]
    se = linearised_se(runs, "v000000", "v000001")
    assert (hi - lo) / 2 == pytest.approx(Z * se, rel=0.12)


def test_repeated_votes_on_one_prompt_widen_the_cluster_interval_not_newcombe():
    """The same 240 votes per version, once spread over 240 prompts and once over 30 prompts
    carrying 8 identical votes each: Newcombe's interval is the same, the cluster one is about
    sqrt(8) times wider."""
    rng = np.random.default_rng(0)
    f, l = rng.random(30) < 0.2, rng.random(30) < 0.35
    clustered = np.stack([8 * f, np.full(30, 8), 8 * l, np.full(30, 8)], axis=1).astype(float)
    spread = np.repeat(np.stack([f, np.ones(30), l, np.ones(30)], axis=1).astype(float), 8, axis=0)
    wc = np.diff(stratified_cluster_bootstrap([clustered], seed=1)["ci95"])[0]
    ws = np.diff(stratified_cluster_bootstrap([spread], seed=1)["ci95"])[0]
    assert wc / ws == pytest.approx(math.sqrt(8), rel=0.2)


def test_a_promotion_whose_candidate_is_shown_worse_is_listed(tmp_path):
    rng = random.Random(3)
    make_run(tmp_path / "bad", rng, 0.6, 0.1, prompts=50, kind="train")
    make_run(tmp_path / "ok", rng, 0.2, 0.25, prompts=50)
    pool = pool_runs([load_run(tmp_path / "bad"), load_run(tmp_path / "ok")])
    assert [p["candidate"] for p in pool["worse_promotions"]] == ["v000001"]
    assert pool["worse_promotions"][0]["dir"].endswith("bad")
    p = pool["runs"][0]["promotions"][0]
    assert p["replaced"] == "v000000" and p["ci95"][1] < 0 and p["n_candidate"] == 100
    assert pool["runs"][1]["promotions"][0]["shown_worse"] is False


def test_write_votes_round_trips_through_load_run(tmp_path):
    rows = [{"completion_id": "c1", "model_version": "v000000", "split": "eval", "votes_up": 1, "votes_down": 0},
            {"completion_id": "c2", "model_version": "v000001", "split": "train", "votes_up": 0, "votes_down": 2}]
    comps = {"c1": {"family": "chain_sum", "kind": "fresh", "key": "k1", "has_answer": True,
                    "finish_reason": "stop", "tokens": 7}}
    (tmp_path / "report.json").write_text(json.dumps({"versions": [{"version": "v000000", "decision": "base"}],
                                                      "events_accepted": 3, "events_lost": 0}))
    assert rep.write_votes(rows, comps, tmp_path / "votes.jsonl") == 2
    got = load_run(tmp_path)["votes"]
    assert got[0] == {"completion_id": "c1", "version": "v000000", "family": "chain_sum", "split": "eval",
                      "kind": "fresh", "key": "k1", "votes_up": 1, "votes_down": 0, "has_answer": True,
                      "finish_reason": "stop", "tokens": 7}
    assert got[1]["kind"] is None and got[1]["votes_down"] == 2


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "flywheel.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "COLUMNS": "200"}, timeout=120)


def test_demo_pool_command_writes_pool_and_plot_and_refuses_a_run_without_votes(tmp_path):
    rng = random.Random(5)
    for s in ("s0", "s1"):
        make_run(tmp_path / s, rng, 0.2, 0.4, prompts=60)
    r = _cli("demo-pool", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out", str(tmp_path / "pool"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    pool = json.loads((tmp_path / "pool" / "pool.json").read_text())
    assert (tmp_path / "pool" / "pool.png").stat().st_size > 1000
    assert "pooled fresh" in r.stdout and pool["pooled"]["fresh"]["n_from"] == 240
    (tmp_path / "alias").symlink_to(tmp_path / "s0")
    for twice in (["s0", "s0"], ["s0", "alias"], ["s0", "./s1/../s0"]):  # one run twice would count twice
        r = _cli("demo-pool", *twice, cwd=tmp_path)
        flat = " ".join(r.stderr.replace("│", " ").split())
        assert r.returncode == 2 and f"{Path(twice[1])}: the same run as s0; give each run once" in flat, r.stderr
    (tmp_path / "s1" / "votes.jsonl").unlink()
    r = _cli("demo-pool", str(tmp_path / "s0"), str(tmp_path / "s1"), cwd=tmp_path)
    assert r.returncode == 2 and "votes.jsonl: missing" in r.stderr
    for bad in ("-1", str(2**63)):  # numpy's generator refuses a negative seed; bounded as every seed is (D99)
        r = _cli("demo-pool", str(tmp_path / "s0"), "--bootstrap-seed", bad, cwd=tmp_path)
        flat = " ".join(r.stderr.replace("│", " ").split())
        assert r.returncode == 2 and "Invalid value for '--bootstrap-seed'" in flat, r.stderr
        assert "Traceback" not in r.stderr, r.stderr


def test_a_promotion_with_more_unanswered_replies_is_listed(tmp_path):
    """Votes equal, but the candidate left 30 of 100 served replies without an answer against
    the replaced version's 5 of 100: Newcombe's interval for the difference is above 0."""
    make_run(tmp_path / "r", random.Random(2), 0.3, 0.3, prompts=50)
    rp = tmp_path / "r" / "report.json"
    report = json.loads(rp.read_text())
    share = (lambda up, n: {"votes_up": up, "votes": n})
    report["versions"][0]["replies"] = {"no_answer": share(5, 100), "truncated": share(2, 100)}
    report["versions"][1]["replies"] = {"no_answer": share(30, 100), "truncated": share(3, 100)}
    rp.write_text(json.dumps(report))
    pool = pool_runs([load_run(tmp_path / "r")])
    p = pool["runs"][0]["promotions"][0]
    assert p["guards_shown_worse"] == ["no_answer"]
    d, lo, hi = newcombe(5, 100, 30, 100)
    assert p["replies"]["no_answer"]["ci95"] == pytest.approx([lo, hi]) and lo > 0
    assert [w["candidate"] for w in pool["worse_promotions"]] == ["v000001"]


@pytest.mark.parametrize("report,votes,msg", [
    ({"versions": []}, "", "versions: must be a non-empty list"),
    ([1, 2], "", "no 'versions'"),
    ({"versions": [{"version": "v000000"}]}, '{"version": "v1"}\n', "line 1: missing"),
    ({"versions": [{"version": "v000000"}]}, '[1]\n', "line 1: not a JSON object"),
    ({"versions": [{"version": "v000000"}]},
     '{"version": "v1", "kind": "fresh", "key": "k", "votes_up": -1, "votes_down": 0}\n', "votes_up: must be"),
    ({"versions": [{"version": "v000000"}]}, '{"version": \n', "not JSON"),
])
def test_load_run_names_the_file_and_the_field(tmp_path, report, votes, msg):
    if isinstance(report, dict):
        report.update(events_accepted=1, events_lost=0)
    (tmp_path / "report.json").write_text(json.dumps(report))
    (tmp_path / "votes.jsonl").write_text(votes)
    with pytest.raises(ValueError, match=msg):
        load_run(tmp_path)


@pytest.mark.parametrize("name,content,reason", [
    ("report.json", b'{"versions": [{"version": "v0\xff"}]}', "not UTF-8 text"),
    ("report.json", b'{"versions": [{"version": "v000000"}, {"vers', "not JSON (truncated?)"),
    ("report.json", b'{"versions": [{"version": 1}]}', "versions[0].version: must be a string"),
    ("report.json", b'{"versions": [{"version": "v000000"}, {"version": null}]}',
     "versions[1].version: must be a string"),
    ("votes.jsonl", b'{"version": "v000000", "kind": "fresh", "key": "k", "votes_up": 1, "votes_down": 0}\n\xfe\n',
     "not UTF-8 text"),
    ("votes.jsonl", b'{"version": "v000000", "kind": "fresh", "key": "k", "votes_up": 1, "votes_down": 0}\n'
                    b'{"version": 7, "kind": "fresh", "key": "k", "votes_up": 1, "votes_down": 0}\n',
     "line 2: version: must be a string"),
    ("fixed_eval.jsonl", b'{"version": null, "key": "k", "passed": true}\n', "line 1: version: must be a string"),
    ("fixed_eval.jsonl", b'{"version": "v000000", "key": "k", "pas', "line 1: not JSON"),
])
def test_demo_pool_names_the_bad_file_and_the_reason(tmp_path, name, content, reason):
    """A report or votes file that is not UTF-8, is cut short, or has a version that is not a
    string: a clear refusal naming the file (not the run directory) and the reason, no traceback."""
    make_run(tmp_path / "s0", random.Random(3), 0.2, 0.4, prompts=5)
    (tmp_path / "s0" / name).write_bytes(content)
    r = _cli("demo-pool", "s0", "--out", str(tmp_path / "pool"), cwd=tmp_path)
    flat = " ".join(r.stderr.replace("│", " ").split())
    assert r.returncode == 2 and f"{Path('s0') / name}: {reason}" in flat, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "pool").exists(), r.stderr


def test_fixed_eval_pools_pairs_by_run_and_counts_a_run_without_promotion_as_no_change():
    """Run a: v2 promoted, pairs (0,1), (0,1), (1,1); run b: nothing promoted, so its 2 prompts
    count as first against first (no discordant pair). Pooled: 5 prompts, 2 discordant for the
    last, diff 2/5; by hand McNemar p = 2 * P[Bin(2, 1/2) <= 0] = 0.5."""
    from flywheel.pool import pool_runs

    def rows(v0, v1, pairs):
        out = []
        for i, (a, b) in enumerate(pairs):
            out += [{"version": v0, "key": f"k{i}", "kind": "fresh", "passed": bool(a)},
                    {"version": v1, "key": f"k{i}", "kind": "fresh", "passed": bool(b)}]
        return out

    runs = [{"dir": "a", "report": {"versions": [{"version": "v0"}, {"version": "v2", "decision": "PROMOTE"}]},
             "votes": [], "fixed": rows("v0", "v2", [(0, 1), (0, 1), (1, 1)])},
            {"dir": "b", "report": {"versions": [{"version": "v0"}, {"version": "v1", "decision": "ROLLBACK"}]},
             "votes": [], "fixed": rows("v0", "v1", [(0, 1), (1, 0)])}]
    p = pool_runs(runs)
    f = p["fixed_eval_pooled"]
    assert (f["prompts"], f["only_to"], f["only_from"]) == (5, 2, 0)
    assert abs(f["diff"] - 0.4) < 1e-12 and f["mcnemar_p"] == 0.5
    assert abs(p["runs"][0]["fixed_eval"]["diff"] - 2 / 3) < 1e-12 and "fixed_eval" not in p["runs"][1]
    # no thumbs (implicit signals): no live verdict; the fixed set's: run b promoted nothing, so
    # not every run is positive; the pooled interval (5 prompts, 2 gained) is the bootstrap's
    assert p["every_run_positive_on_fresh"] is None and p["pooled_fresh_cluster_excludes_0"] is None
    assert p["fixed_every_run_positive_on_fresh"] is False
    assert p["fixed_pooled_fresh_excludes_0"] is (f["by_kind"]["fresh"]["ci95"][0] > 0)
    runs[1]["report"]["versions"][1]["decision"] = "PROMOTE"  # b: (0,1) gained, (1,0) lost: diff 0
    assert pool_runs(runs)["fixed_every_run_positive_on_fresh"] is False
    runs[1]["fixed"] = rows("v0", "v1", [(0, 1), (0, 0)])  # b: +1/2
    p = pool_runs(runs)
    assert p["fixed_every_run_positive_on_fresh"] is True
    # 5 pairs: a (0,1) (0,1) (1,1), b (0,1) (0,0); every resample's mean is >= 0, and is 0 only
    # when both strata draw only their non-gaining pairs: P = (1/3)^3 * (1/2)^2 = 1/108 < 2.5 %
    assert p["fixed_eval_pooled"]["by_kind"]["fresh"]["ci95"][0] > 0 and p["fixed_pooled_fresh_excludes_0"] is True
    for run in runs:
        run["fixed"] = []
    assert pool_runs(runs)["fixed_every_run_positive_on_fresh"] is None


def _edit_report(change):
    def edit(run: Path) -> None:
        report = json.loads((run / "report.json").read_text())
        for v in report["versions"]:
            v["replies"] = {"no_answer": {"votes_up": 1, "votes": 10}, "truncated": {"votes_up": 0, "votes": 10}}
        change(report)
        (run / "report.json").write_text(json.dumps(report))
    return edit


def _edit_line(name: str, line: int, **fields):
    """Set ``fields`` on line ``line`` (1-based) of the run's ``name`` (a valid fixed_eval.jsonl
    of two prompts under v000000 and v000001 is written first when ``name`` is that file)."""
    def edit(run: Path) -> None:
        if name == "fixed_eval.jsonl":
            (run / name).write_text("".join(json.dumps({"version": v, "key": f"q{k}", "kind": "fresh", "passed": True})
                                            + "\n" for v in ("v000000", "v000001") for k in range(2)))
        rows = [json.loads(x) for x in (run / name).read_text().splitlines()]
        rows[line - 1].update(fields)
        (run / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return edit


def _drop_counts(report: dict) -> None:
    del report["events_accepted"], report["events_lost"]


def _zero_link(run: Path) -> None:
    (run / "report.json").unlink()
    (run / "report.json").symlink_to("/dev/zero")


M = "must be an integer in [0, 1000000000]"


@pytest.mark.parametrize("edit,reason", [
    (_edit_report(lambda r: r["versions"][0]["replies"]["no_answer"].update(votes_up="x")),
     f"report.json: versions[0].replies.no_answer.votes_up: {M}, got 'x'"),
    (_edit_report(lambda r: r["versions"][1]["replies"]["truncated"].update(votes_up=1e23)),
     f"report.json: versions[1].replies.truncated.votes_up: {M}, got 1e+23"),
    (_edit_report(lambda r: r["versions"][1]["replies"]["truncated"].update(votes_up=11)),
     "report.json: versions[1].replies.truncated.votes_up: must be <= votes (10), got 11"),
    (_edit_report(lambda r: r["versions"][0].update(decision="PROMOTE")),
     "report.json: versions[0].decision: the first version is what every promotion is measured from"),
    (_edit_report(_drop_counts), "report.json: missing ['events_accepted', 'events_lost']"),
    (_zero_link, "report.json: not a regular file"),
    (_edit_line("votes.jsonl", 2, key={"a": 1}), "votes.jsonl: line 2: key: must be a string, got {'a': 1}"),
    (_edit_line("votes.jsonl", 3, kind="bogus"),
     "votes.jsonl: line 3: kind: must be one of train, fresh, harder, unseen, got 'bogus'"),
    (_edit_line("fixed_eval.jsonl", 2, key=["q", 1]), "fixed_eval.jsonl: line 2: key: must be a string, got ['q', 1]"),
    (_edit_line("fixed_eval.jsonl", 4, passed="yes"),
     "fixed_eval.jsonl: line 4: passed: must be true or false (a JSON boolean), got 'yes'"),
])
def test_demo_pool_refuses_a_field_the_demo_does_not_write(tmp_path, edit, reason):
    """A hostile run directory: a count that is not an integer or is absurd, a key that is not a
    string, an unknown kind, a ``passed`` that is not a boolean, a first version already
    promoted, the event counts missing, a report that is a link to a device: exit 2 naming the
    file, the line (jsonl) or field, and the reason; no traceback, nothing written."""
    make_run(tmp_path / "s0", random.Random(3), 0.2, 0.4, prompts=5)
    edit(tmp_path / "s0")
    r = _cli("demo-pool", "s0", "--out", str(tmp_path / "pool"), cwd=tmp_path)
    flat = " ".join(r.stderr.replace("│", " ").split())
    assert r.returncode == 2 and " ".join(f"{Path('s0')}/{reason}".split()) in flat, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "pool").exists(), r.stderr


def test_the_valid_run_the_hostile_cases_start_from_pools(tmp_path):
    """The run the refusals above edit, with reply figures and a fixed eval file, loads and pools."""
    make_run(tmp_path / "s0", random.Random(3), 0.2, 0.4, prompts=5)
    _edit_report(lambda r: None)(tmp_path / "s0")
    _edit_line("fixed_eval.jsonl", 1)(tmp_path / "s0")
    pool = pool_runs([load_run(tmp_path / "s0")])
    assert pool["runs"][0]["first"] == "v000000" and pool["runs"][0]["last"] == "v000001"
    assert pool["runs"][0]["events_lost"] == 0 and pool["fixed_eval_pooled"]["prompts"] == 2
