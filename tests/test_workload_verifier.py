"""The HumanEval verifier cannot be passed without passing the tests (docs/demo.md, "What the
verifiers cannot check"). Each reply below defines the entry point, answers wrongly (or not at
all) and tries one way to end the sandbox with a success before, instead of, or around the
problem's ``check``; every one must read as failed. The right answer passes through the same
sandbox (the canonical solution), so a failure is the reply's, not the harness's.

Real subprocesses throughout (the judge and its unprivileged worker, flywheel.users.run_tests)."""

from __future__ import annotations

import os
import socket
import textwrap

import pytest

from flywheel.users import decode_value, encode_value, load_problems, run_tests


@pytest.fixture(scope="module")
def problems():
    return load_problems()


WRONG = "    return False\n"  # has_close_elements: wrong on the tests that expect True


def _reply(problem: dict, prelude: str = "", body: str = WRONG, after: str = "") -> str:
    return textwrap.dedent(prelude) + problem["prompt"] + body + textwrap.dedent(after)


ATTACKS = {
    "sys.exit(0) at import": dict(prelude="import sys\n", after="sys.exit(0)\n"),
    "os._exit(0) at import": dict(prelude="import os\n", after="os._exit(0)\n"),
    "SystemExit raised by a function called at import": dict(
        after="def _leave():\n    raise SystemExit(0)\n_leave()\n"),
    "exit() builtin at import": dict(after="exit(0)\n"),
    "atexit handler that exits 0": dict(prelude="import atexit, os\natexit.register(lambda: os._exit(0))\n",
                                        after="raise RuntimeError('die, then exit 0 from atexit')\n"),
    "sys.exit(0) inside the function": dict(prelude="import sys\n", body="    sys.exit(0)\n"),
    "os._exit(0) inside the function": dict(prelude="import os\n", body="    os._exit(0)\n"),
    "SystemExit raised inside the function": dict(body="    raise SystemExit(0)\n"),
    "KeyboardInterrupt inside the function": dict(body="    raise KeyboardInterrupt\n"),
    "redefine check": dict(after="def check(candidate):\n    return None\n"),
    "redefine check through builtins and __main__": dict(
        prelude="import builtins, sys\n",
        after="builtins.check = lambda c: None\nsys.modules['__main__'].check = lambda c: None\n"),
    "AssertionError made harmless through builtins": dict(
        prelude="import builtins\nbuiltins.AssertionError = type('Nothing', (Exception,), {})\n"),
    "print the success markers": dict(after="print('passed'); print('PASS'); print('PASS ' + '0' * 32)\n"
                                            "import sys; sys.stdout.flush(); sys.exit(0)\n"),
    "write a marker on every inherited descriptor": dict(
        prelude="import os\n",
        after="for fd in range(0, 64):\n    try:\n        os.write(fd, b'PASS ' + b'0' * 32 + b'\\n')\n"
              "    except OSError:\n        pass\nos._exit(0)\n"),
    "write a marker into the judge's descriptors through /proc": dict(
        prelude="import os\n",
        after="p = os.getppid()\nfor fd in range(0, 64):\n    try:\n"
              "        with open(f'/proc/{p}/fd/{fd}', 'w') as f:\n            f.write('PASS ' + '0' * 32 + '\\n')\n"
              "    except OSError:\n        pass\n"),
    "kill the parent (the judge)": dict(prelude="import os, signal\n",
                                        after="os.kill(os.getppid(), signal.SIGKILL)\n"),
    "kill itself with SIGKILL": dict(prelude="import os, signal\n", after="os.kill(os.getpid(), signal.SIGKILL)\n"),
    "SIGTERM handler that exits 0, then SIGTERM itself": dict(
        prelude="import os, signal\nsignal.signal(signal.SIGTERM, lambda *a: os._exit(0))\n",
        after="os.kill(os.getpid(), signal.SIGTERM)\n"),
    "alarm that exits 0 while the tests run": dict(
        prelude="import os, signal, time\nsignal.signal(signal.SIGALRM, lambda *a: os._exit(0))\n",
        body="    signal.setitimer(signal.ITIMER_REAL, 0.001)\n    time.sleep(1)\n    return False\n"),
    "return an object whose == is always True": dict(
        prelude="class _Any:\n    def __eq__(self, o):\n        return True\n    __hash__ = None\n"
                "    def __bool__(self):\n        return True\n",
        body="    return _Any()\n"),
    "return a bool subclass whose == is always True": dict(
        prelude="class _B(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\n",
        body="    return _B(1)\n"),
    "monkeypatch the sandbox's own encoder": dict(
        prelude="import sys\n",
        after="m = sys.modules.get('flywheel.users') or sys.modules.get('__main__')\n"
              "m.encode_value = lambda x, depth=0: ['b', True]\n"),
    "fork a child that outlives the reply and exits 0": dict(
        prelude="import os\n", after="if os.fork() == 0:\n    os._exit(0)\nos._exit(0)\n"),
    "infinite loop (timeout)": dict(body="    while True:\n        pass\n"),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_reply_that_does_not_pass_the_tests_never_passes(problems, name):
    p = problems[0]
    assert p["entry_point"] == "has_close_elements"
    passed, reason = run_tests(p, _reply(p, **ATTACKS[name]), timeout_s=3.0)
    assert not passed, f"{name}: passed without passing the tests"
    assert reason in ("failed", "timeout"), reason


@pytest.mark.parametrize("i", [0, 32, 33, 38, 53])  # helpers from the prompt, a test naming the function, random
def test_the_right_answer_passes_through_the_same_sandbox(problems, i):
    p = problems[i]
    assert run_tests(p, p["prompt"] + p["canonical_solution"]) == (True, "passed")


def test_a_wrong_answer_and_a_missing_function_fail(problems):
    p = problems[2]  # truncate_number
    assert run_tests(p, p["prompt"] + "    return 0.0\n") == (False, "failed")
    assert run_tests(p, "def something_else(x):\n    return x\n") == (False, "no entry point")


PROBE = {"entry_point": "probe", "prompt": 'def probe(port):\n    """What the reply could reach."""\n',
         "test": "def check(candidate):\n    assert candidate(PORT) == []\n"}

PROBE_REPLY = '''
import os
def probe(port):
    got = []
    if os.geteuid() == 0:
        got.append("root")
    for what in ("mem", "environ", "fd/1", "fd/0"):
        try:
            with open(f"/proc/{os.getppid()}/{what}", "rb"):
                got.append("judge " + what)
        except OSError:
            pass
    import ctypes, struct  # loaded before the reply runs; the socket module may not import as nobody
    libc = ctypes.CDLL(None)
    s = libc.socket(2, 1, 0)  # AF_INET, SOCK_STREAM
    addr = struct.pack("<H", 2) + struct.pack(">H", port) + bytes([127, 0, 0, 1]) + bytes(8)
    if s >= 0 and libc.connect(s, addr, len(addr)) == 0:
        got.append("network")
    return got
'''


def _can_isolate_network() -> bool:
    import subprocess

    cmd = ["unshare", "-n", "true"] if os.geteuid() == 0 else ["unshare", "-rn", "true"]
    try:
        return subprocess.run(cmd, capture_output=True).returncode == 0
    except OSError:
        return False


def test_the_reply_runs_unprivileged_without_the_judge_or_the_network():
    """The worker cannot read the judge's memory or descriptors (the judge is non-dumpable; as
    root the reply runs as nobody) and, where the kernel allows a network namespace, cannot
    reach a port on this host (it could post feedback to the serving pod)."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        port = srv.getsockname()[1]
        problem = {**PROBE, "test": PROBE["test"].replace("PORT", str(port))}
        if not _can_isolate_network():  # the probe still must not reach the judge
            problem["test"] = problem["test"].replace("== []", "in ([], ['network'])")
        passed, reason = run_tests(problem, PROBE_REPLY, timeout_s=5.0)
        srv.setblocking(False)
        try:
            conn, _ = srv.accept()
            conn.close()
            connected = True
        except BlockingIOError:
            connected = False
    assert (passed, reason) == (True, "passed")
    if _can_isolate_network():
        assert not connected


def test_values_cross_as_plain_data_only():
    for v in [None, True, 0, -3, 2**80, 1.5, float("inf"), 1 + 2j, "é", b"\x00", [1, (2, "x")], {1: [2.0]},
              {3, 4}, frozenset({"a"}), ()]:
        assert decode_value(encode_value(v)) == v and type(decode_value(encode_value(v))) is type(v)

    class Sub(int):
        pass

    for bad in [Sub(1), object(), (x for x in ()), [[[]]] * 0 + [Sub(2)]]:
        with pytest.raises(TypeError):
            encode_value(bad)
    for bad in [["Z"], ["i", 3], ["l", [["S", [["l", []]]]]], "x", ["d", [[["N"]]]]]:
        with pytest.raises((ValueError, TypeError)):
            decode_value(bad)
