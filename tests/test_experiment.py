"""``flywheel experiment``: the statistics against published / hand-computed values, and one
real round (engine -> sandbox votes -> Parquet -> `flywheel learn` subprocess -> store ->
hash-verified reload) on the tiny MoE."""

from __future__ import annotations

import json
import math

import duckdb
import pytest

from flywheel.experiment import (ExperimentConfig, cluster_bootstrap_diff, evaluate, newcombe_diff, one_sided_z,
                                 run)


def test_newcombe_matches_the_paper():
    # Newcombe (1998), Stat. Med. 17:873, Table II example (a): 56/70 vs 48/80,
    # method 10 (hybrid score, no continuity correction): 0.0524 to 0.3339
    d, lo, hi = newcombe_diff(48, 80, 56, 70)
    assert d == pytest.approx(0.2)
    assert (round(lo, 4), round(hi, 4)) == (0.0524, 0.3339)
    with pytest.raises(ValueError, match="both arms need n > 0"):
        newcombe_diff(0, 0, 1, 2)


def test_one_sided_z_by_hand():
    # 10/100 vs 20/100: pooled p = 0.15, se = sqrt(0.15 * 0.85 * 0.02) = 0.0504975
    z, p = one_sided_z(10, 100, 20, 100)
    assert z == pytest.approx(0.1 / math.sqrt(0.15 * 0.85 * 0.02))
    assert z == pytest.approx(1.9803, abs=1e-4)
    assert p == pytest.approx(0.02383, abs=1e-4)  # 1 - Phi(1.9803)
    assert one_sided_z(0, 10, 0, 10) == (0.0, 0.5)  # no variance: no evidence


def test_cluster_bootstrap_by_construction():
    first = {i: [False] * 4 for i in range(10)}
    assert cluster_bootstrap_diff(first, {i: [True] * 4 for i in range(10)}) == (1.0, 1.0)
    same = {i: [i % 2 == 0] * 4 for i in range(10)}
    lo, hi = cluster_bootstrap_diff(same, same)
    assert lo == hi == 0.0  # the same problems are resampled for both versions
    with pytest.raises(ValueError, match="no problem in common"):
        cluster_bootstrap_diff({1: [True]}, {2: [True]})


def test_config_rejects_bad_values(tmp_path):
    for kw, name in (({"rounds": 0}, "rounds"), ({"temperature": 0.0}, "temperature"),
                     ({"problem_ids": [200]}, "problem_ids"),
                     ({"learner": {"objective": "dpo"}}, "objective"),
                     ({"learner": {"baseline": "prompt"}}, "baseline"),  # the prompt baseline is REINFORCE's
                     ({"learner": {"stepz": 3}}, "stepz"), ({"learner": {"steps": 4}}, "restates")):
        with pytest.raises(ValueError, match=name):
            ExperimentConfig(out=tmp_path, **kw)


def test_no_model_built_says_to_run_model_init(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from flywheel.cli import app

    monkeypatch.setenv("FLYWHEEL_MODEL_DIR", str(tmp_path / "no-model"))
    r = CliRunner().invoke(app, ["experiment", "--out", str(tmp_path / "exp"), "--rounds", "1"])
    assert r.exit_code == 2 and "flywheel model init" in r.output and "Traceback" not in r.output, r.output


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else None


def test_eval_only_refusals_leave_the_out_dir_as_it_was(tmp_path, monkeypatch):
    """`--eval-only` with no store, an unknown version, no versions or a broken experiment.json
    is refused before anything is created: no home/, no logs/, the out dir's files unchanged."""
    from typer.testing import CliRunner

    from flywheel.cli import app

    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path / "elsewhere"))  # restored after (the command sets it)
    monkeypatch.delenv("FLYWHEEL_STORE", raising=False)
    monkeypatch.setenv("FLYWHEEL_MODEL_DIR", str(tmp_path / "no-model"))

    def refuse(out, versions, says):
        before = _tree(out)
        r = CliRunner().invoke(app, ["experiment", "--out", str(out), "--eval-only", versions], env={"COLUMNS": "400"})
        flat = " ".join(r.output.replace("│", " ").split())
        assert r.exit_code == 2 and says in flat and "Traceback" not in r.output, r.output
        assert _tree(out) == before, r.output

    refuse(tmp_path / "new", "v9", "no model store at")
    assert not (tmp_path / "new").exists()
    out = tmp_path / "exp"  # a store holding v000000 only (a complete version: its manifest)
    (out / "home/store/versions/v000000").mkdir(parents=True)
    (out / "home/store/versions/v000000/manifest.json").write_text("{}")
    refuse(out, "v000000,v9", "['v9'] not in the store")
    refuse(out, " , ", "give at least one version")
    refuse(out, "", "no version named")  # given but empty: refused, never the full experiment
    refuse(out, " ", "no version named")
    refuse(out, "v000000", "holds no checkpoint")  # the known version, but no base model to serve it with
    monkeypatch.setenv("FLYWHEEL_MODEL_DIR", str(tmp_path / "model"))
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text("{}")
    (out / "experiment.json").write_text('{"versions": [')  # cut short
    refuse(out, "v000000", "experiment.json: not JSON")
    assert _tree(out) == ["experiment.json", "home", "home/store", "home/store/versions",
                          "home/store/versions/v000000", "home/store/versions/v000000/manifest.json"]


def test_one_round_on_the_tiny_moe(tiny_moe_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_MODEL_DIR", str(tiny_moe_dir))
    monkeypatch.delenv("FLYWHEEL_STORE", raising=False)
    monkeypatch.delenv("FLYWHEEL_SAMPLES", raising=False)
    cfg = ExperimentConfig(out=tmp_path / "exp", rounds=1, problem_ids=[0, 23], samples_per_problem=3,
                           max_tokens=6, learner={"steps": 1, "batch_size": 4, "lr": 1e-3, "balance_classes": True},
                           max_batch=8)
    rep = run(cfg)
    v0, v1 = rep["versions"]
    assert (v0["version"], v1["version"]) == ("v000000", "v000001")
    assert v0["n"] == v1["n"] == 6 and set(v0["by_problem"]) == {0, 23}
    # what the learner trained on is exactly round 0's completions with their votes
    con = duckdb.connect()
    rows = con.execute("SELECT label, model_version, len(completion_token_ids) FROM read_parquet(?, "
                       "hive_partitioning=true)", [str(tmp_path / "exp/home/data/samples/**/*.parquet")]).fetchall()
    assert len(rows) == 6 and {r[1] for r in rows} == {"v000000"}
    assert sum(r[0] for r in rows) == v0["thumbs_up"]
    assert all(1 <= r[2] <= 6 for r in rows)
    state = json.loads((tmp_path / "exp/home/learner/learner_state.json").read_text())
    assert len(state["consumed"]) == 1 and state["cycles"][0]["version"] == "v000001"  # round 0's one shard
    assert v0["learner"]["data/n_samples"] == 6
    c = rep["comparison"]
    assert (c["first"], c["last"]) == ("v000000", "v000001")
    assert c["diff"] == pytest.approx(v1["rate"] - v0["rate"])
    assert (tmp_path / "exp/learning_curve.png").stat().st_size > 1000
    assert json.loads((tmp_path / "exp/experiment.json").read_text())["comparison"]["first"] == "v000000"

    # more votes for the same versions, new seeds, pooled with the experiment's
    ev = evaluate(ExperimentConfig(**{**cfg.__dict__, "seed": 1}), ["v000000", "v000001"])
    for row, old in zip(ev["versions"], (v0, v1)):
        assert row["new"]["n"] == 6 and row["pooled"]["n"] == 12
        assert row["pooled"]["thumbs_up"] == old["thumbs_up"] + row["new"]["thumbs_up"]
        assert sum(len(x) for x in row["pooled"]["by_problem"].values()) == 12
    assert (tmp_path / "exp/eval-seed1.json").exists() and (tmp_path / "exp/learning_curve_pooled.png").exists()
    # other problems (a held-out check) are another workload: never pooled with the experiment's
    held = evaluate(ExperimentConfig(**{**cfg.__dict__, "seed": 2, "problem_ids": [5]}), ["v000000", "v000001"])
    for row in held["versions"]:
        assert row["new"]["n"] == row["pooled"]["n"] == 3 and set(row["pooled"]["by_problem"]) == {5}
    with pytest.raises(ValueError, match="not in the store"):
        evaluate(cfg, ["v000009"])


def test_kto_settings_follow_the_objective():
    """The experiment balances KTO's classes by default; with reinforce or psr that setting is
    left at the learner's default (the learner refuses it), and asking for it is refused."""
    from flywheel.experiment import ExperimentLearnerOptions as Options, learner_changes

    assert learner_changes(Options())["balance_classes"] is True  # objective kto (the learner's default)
    assert ExperimentConfig().learner["balance_classes"] is True
    for objective in ("reinforce", "psr"):
        changes = learner_changes(Options(objective=objective))
        assert "balance_classes" not in changes and changes["objective"] == objective
        ExperimentConfig(learner=changes)  # accepted
        assert "balance_classes" not in learner_changes(Options(objective=objective, balance_classes=False))
        with pytest.raises(ValueError, match="balance_classes: is read by objective 'kto' only"):
            ExperimentConfig(learner=learner_changes(Options(objective=objective, balance_classes=True)))
    assert "balance_classes" not in learner_changes(Options(balance_classes=False))  # kto, turned off
