"""Layers point down (issue 21 item 3): the product packages never import the CLI and demo
package ``flywheel``, ``schemas`` (the contracts) imports no other Flywheel package, the
shared packages ``modelstore`` and ``samplestore`` import only ``schemas``, and a role reaches
another role only through the public modules listed in ``SIDEWAYS`` (none today); a new edge
fails here until it is added on purpose.

Walks every import statement of every module with ``ast``, function-level imports included,
so a lazy ``from flywheel.users import ...`` inside a command counts as much as a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("schemas", "modelstore", "samplestore", "serving", "ingest", "learner", "deploy")
# what each package may import of Flywheel's own top-level packages
ALLOWED = {
    "schemas": {"schemas"},
    "modelstore": {"schemas", "modelstore"},  # shared under the roles: versions, codec, the fleet record
    "samplestore": {"schemas", "samplestore"},  # shared under the roles: the sample shards and their queries
    "serving": {"schemas", "modelstore", "serving"},
    "ingest": {"schemas", "samplestore", "ingest"},
    "learner": {"schemas", "modelstore", "samplestore", "learner"},
    "deploy": {"schemas", "modelstore", "samplestore", "deploy"},
}
OURS = {*PRODUCT, "flywheel"}
SIDEWAYS = {
}


def imported_modules(path: Path) -> set[tuple[str, int]]:
    """(module, line) of every absolute import in ``path``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {(a.name, node.lineno) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add((node.module, node.lineno))
    return out


def test_the_walker_sees_lazy_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\ndef f():\n    from flywheel.users import x\n    import modelstore.store as s\n")
    assert imported_modules(f) == {("os", 1), ("flywheel.users", 3), ("modelstore.store", 4)}


def test_packages_import_only_downwards():
    wrong = []
    for pkg in PRODUCT:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for module, line in imported_modules(path):
                top = module.split(".")[0]
                if top in OURS and top not in ALLOWED[pkg] and (pkg, module) not in SIDEWAYS:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_learner_gets_its_gate_verifier_by_name():
    """The held-out gate's verifier comes from the workload by ``MODULE:FUNCTION``
    (``flywheel learn --gate-verifier``), and a bad name is refused naming what is wrong."""
    import pytest

    from learner.gate import load_gate_verifier

    fn = load_gate_verifier("flywheel.users:gate_verifier")
    with pytest.raises(ValueError, match="'120-999'"):
        fn("120-999", tokenizer=None)  # HumanEval has problems 0..163: refused before any tokenizer use
    for bad, why in (("flywheel.users", "MODULE:FUNCTION"), ("no_such_mod:f", "does not import"),
                     ("flywheel.users:nope", "no callable 'nope'")):
        with pytest.raises(ValueError, match=why):
            load_gate_verifier(bad)
