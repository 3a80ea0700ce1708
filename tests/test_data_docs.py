"""docs/data.md: every SQL example runs with plain DuckDB (no Flywheel import) against the
catalog of a real home, from the catalog's folder, after the home was moved; the pyarrow
example runs with pyarrow and numpy alone."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np

from samplestore import catalog, shards as writer
from schemas.events import DeadLetter, ExpertRoutes, RewardedSample, SamplingParams, now_ms

DOC = Path(__file__).resolve().parents[1] / "docs" / "data.md"


def _home(root: Path) -> Path:
    home = root / ".flywheel"
    sd = home / "data" / "samples"
    t = now_ms() - 3_600_000
    rng = np.random.default_rng(0)
    for k, (version, split) in enumerate([("v000000", "train"), ("v000000", "eval"), ("v000001", "train"),
                                          ("v000001", "eval")]):
        rows = []
        for i in range(3):
            up = (i + k) % 2
            rows.append(RewardedSample(
                completion_id=uuid.uuid4(), model_version=version, created_at=t - 5000, user_hash="u",
                prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5], behavior_logprobs=[-0.5, -1.0],
                sampling=SamplingParams(temperature=0.7, top_p=0.9),
                expert_routes=ExpertRoutes.from_array(rng.integers(0, 4, (4, 2, 2))), finish_reason="stop",
                reward=1.0 if up else -1.0, label=bool(up), n_votes=1, votes_up=up, votes_down=1 - up,
                event_ids=[str(uuid.uuid4())], sealed_at=t + k, split=split))
        writer.write_shard(rows, writer.shard_path(sd, t + k))
    writer.write_deadletters([DeadLetter(source_topic="flywheel.feedback", key="k", field="completion_id",
                                         reason="late: sealed", payload="{}", at=t)], catalog.deadletters_dir(sd))
    catalog.refresh_catalog(sd, home / "catalog.duckdb")
    return home


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


def test_every_sql_example_runs_with_plain_duckdb_from_a_moved_home(tmp_path):
    home = _home(tmp_path / "a")
    moved = tmp_path / "b" / ".flywheel"
    shutil.copytree(home, moved)
    shutil.rmtree(home)  # the catalog must not point at the old place
    sqls = blocks("sql")
    assert len(sqls) >= 8
    code = ("import duckdb, json, sys\n"
            "con = duckdb.connect('catalog.duckdb', read_only=True)\n"
            "out = [len(con.execute(q).fetchall()) for q in json.loads(sys.argv[1])]\n"
            "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-I", "-c", code, json.dumps(sqls)], cwd=moved, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    counts = json.loads(r.stdout)
    assert all(n >= 1 for n in counts), list(zip(counts, sqls))


def test_every_catalog_view_is_documented(tmp_path):
    import duckdb

    home = _home(tmp_path)
    con = duckdb.connect(str(home / "catalog.duckdb"), read_only=True)
    views = [r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()]
    con.close()
    doc = DOC.read_text()
    assert len(views) >= 7
    missing = [v for v in views if f"`{v}`" not in doc or not re.search(rf"FROM {v}\b", doc)]
    assert not missing, f"docs/data.md lacks a section or an example query for {missing}"


def test_pyarrow_example_runs_alone(tmp_path):
    home = _home(tmp_path)
    (py,) = blocks("python")
    r = subprocess.run([sys.executable, "-I", "-c", py], cwd=home, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].split()[:2] == ["v000001", "eval"] and lines[1] == "(4, 2, 2)" and lines[2] == "12"
