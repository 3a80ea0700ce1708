"""What a newcomer reads: test files are named after what they test; product code says what is
true now, not which issue or trial it came from (history lives in docs/decisions.md and git);
no new import cycle between files and no new role package importing another role's package
(the ones left are listed and may only go). Reads the checkout's files with ``ast``; imports
none of the product packages."""

from __future__ import annotations

import ast

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("schemas", "modelstore", "samplestore", "serving", "ingest", "learner", "deploy", "flywheel", "sdk")


def test_no_test_file_is_named_after_how_its_bug_was_found():
    named = sorted(p.name for p in (ROOT / "tests").glob("test_*.py")
                   if re.match(r"test_(trial|issue|stop|run)_?[a-z0-9]*_", p.name))
    assert not named, f"name these after what they test: {named}"


def test_no_issue_or_review_round_names_in_product_code():
    pattern = re.compile(r"\b([Ii]ssue \d+|[Hh]ardening [IVX]+|[Tt]rial [A-Z]\b|[Ss]top \d+)")
    hits = [f"{p.relative_to(ROOT)}:{i}" for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not hits, f"product code tells its history (move it to docs/decisions.md): {hits}"


ROLES = ("serving", "ingest", "learner", "deploy")
# The layout's debts: none left, and a new one fails (an entry needs a decision in docs/decisions.md)
KNOWN_CYCLES: set = set()
KNOWN_CROSS_ROLE: set = set()


def _module_graph() -> dict[str, set[str]]:
    """Product module -> the product modules it imports anywhere in the file (lazy and
    TYPE_CHECKING imports included), resolved to the longest existing module name."""
    import ast

    files = {}
    for pkg in ("schemas", "modelstore", "samplestore", *ROLES, "flywheel"):
        for p in (ROOT / pkg).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, p in files.items():
        deps = set()
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                names = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
            else:
                continue
            deps |= {r for r in map(resolve, names) if r and r != mod}
        graph[mod] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_new_import_cycle_between_files():
    new = _cycles(_module_graph()) - KNOWN_CYCLES
    assert not new, f"files importing each other (lazy imports count): {[sorted(c) for c in new]}"


def test_no_new_role_importing_another_role():
    graph = _module_graph()
    cross = {(m, d.split(".")[0]) for m, deps in graph.items() for d in deps
             if m.split(".")[0] in ROLES and d.split(".")[0] in ROLES and d.split(".")[0] != m.split(".")[0]}
    assert cross <= KNOWN_CROSS_ROLE, f"a role imports another role's package: {sorted(cross - KNOWN_CROSS_ROLE)}"


def test_no_module_reads_names_through_a_module_getattr():
    """Names a module gives are resolved once and passed in (topic names: ``TopicNames``), not
    recomputed from the environment by a module ``__getattr__`` at every read."""
    hits = [str(p.relative_to(ROOT)) for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))
            if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
                   for n in ast.parse(p.read_text(encoding="utf-8")).body)]
    assert not hits, f"module __getattr__ in {hits}"
