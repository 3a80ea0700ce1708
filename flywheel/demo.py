"""``flywheel demo``: the whole loop on one machine, on real input, with every real part.

Starts the embedded broker (unless ``FLYWHEEL_KAFKA_BOOTSTRAP`` is set), builds the
default model if missing, starts serving, the ingest worker and the rollout controller as
real subprocesses, replays HumanEval prompts as product traffic from simulated users who
vote by running the returned code (``flywheel.users``), runs learner cycles
(``flywheel learn --once`` subprocesses) whose versions the controller canaries, and ends
with a report (``flywheel.report``).

The demo only drives and observes; every decision (join, training, canary verdict) is
made by the component that owns it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console

from flywheel import report as rep
from flywheel.demo_config import DemoConfig, role_models
from flywheel.supervise import StopSignals, die_with_parent, run_measuring_peak
from flywheel.workload import Task, Workload, fixed_eval_set, fixed_kind
from learner.config import learn_flags
from samplestore import votes as sample_queries
from schemas.options import flags_for

# The canary's step deadline is never shorter than DEADLINE_REQUESTS times the median request
# time the first traffic phase measured (step_deadline_s); the controller's deadline_s setting
# is the floor. A vote counts only once sealed into a sample: it arrives up to 1.5 s after its
# reply (a flip 0.05-0.8 s later), the label seals seal_after_s (3 s) after it, ingest ticks
# every 0.5 s and the controller looks every 5 s: ~11 s from reply to count. The rule lengthens
# the 45 s quick deadline only when a request takes over 45 / 4 = 11.25 s, longer than that
# lag, so the replies done by 3 request times are counted by 4: at the quick demo's 8 requests
# in flight, 50 % to the candidate and a thumb on 80 % of replies, 3 x 8 x 0.5 x 0.8 = 9.6
# votes per arm expected, against the 2 per arm the analysis needs (min_votes)
DEADLINE_REQUESTS = 4

# the fixed eval's changes of the fleet's desired-state record: who makes them (the record's
# actor and the ledger rows'), and how long a version may take to load on the pod (s)
EVAL_ACTOR = "flywheel demo"
EVAL_LOAD_TIMEOUT_S = 900.0


def step_deadline_s(floor_s: float, request_s: list[float], k: float = DEADLINE_REQUESTS) -> float:
    """The canary's step deadline (s): ``max(floor_s, k x median(request_s))``, so a step
    lasts at least ``k`` request times on a slow box; ``floor_s`` when no request was measured.

    Args:
        floor_s: the configured step deadline (the controller's ``deadline_s``), s, finite, > 0.
        request_s: wall seconds of each request measured (finite, >= 0), in any order.
        k: request times per step deadline (:data:`DEADLINE_REQUESTS`), finite, > 0.

    Raises:
        ValueError: a value out of bounds; the message names it (``floor_s``, ``k``,
            ``request_s[2]``) and gives the value.
    """
    def check(name: str, v, positive: bool, what: str = "number of seconds") -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not (v > 0 if positive else v >= 0):
            raise ValueError(f"{name}: must be a finite {what} {'> 0' if positive else '>= 0'}, got {v!r}")

    check("floor_s", floor_s, True)
    check("k", k, True, "number")
    for i, t in enumerate(request_s):
        check(f"request_s[{i}]", t, False)
    if not request_s:
        return float(floor_s)
    return float(max(floor_s, k * statistics.median(request_s)))


def feedback_by_version(results: list[dict], with_feedback: set[str]) -> dict[str, int]:
    """How many of ``results`` (a traffic phase's replies: dicts with ``version`` and
    ``completion_id``) got feedback the API accepted (``completion_id`` in ``with_feedback``),
    by version, sorted by version; versions with none are left out."""
    out: dict[str, int] = {}
    for r in results:
        if r["completion_id"] in with_feedback:
            out[r["version"]] = out.get(r["version"], 0) + 1
    return dict(sorted(out.items()))


def canary_counts_line(decision: dict, fed: dict[str, int], seal_after_s: float | None) -> str:
    """The line printed after a canary's decision that sets the controller's counts beside the
    demo's, each labelled: what the decision counted (votes, and rewarded samples when the
    reward test ran, per arm: replies sealed into samples since the canary started, from the
    ledger row's ``numbers``) and the canary phase's replies with feedback the API accepted,
    per arm (``fed``: :func:`feedback_by_version` of the phase). The second is at least the
    first while ingest has not sealed every reply or the controller has not looked since; a
    count the row does not hold is ``?``.

    Args:
        decision: the ledger row as a dict (``version``: the candidate, ``stable``, ``numbers``).
        fed: replies with accepted feedback by version.
        seal_after_s: ingest's ``seal_after_s`` (s), or None when not known.
    """
    cand, stable = decision.get("version"), decision.get("stable")
    nums = decision.get("numbers") or {}
    t, r = nums.get("thumbs_up") or {}, nums.get("reward") or {}
    counted = f"votes candidate {t.get('candidate_votes', '?')}, stable {t.get('stable_votes', '?')}"
    if "candidate_samples" in r:
        counted += f"; rewarded samples candidate {r['candidate_samples']}, stable {r.get('stable_samples', '?')}"
    seal = f"{seal_after_s:g} s" if seal_after_s is not None else "seal_after_s"
    return (f"the decision counted replies sealed into samples since the canary started ({counted}); the users' "
            f"feedback was accepted on {fed.get(cand, 0)} candidate and {fed.get(stable, 0)} stable replies of the "
            f"canary's traffic: a reply counts once ingest seals it ({seal} after its last feedback) and the "
            f"controller looks again, so the decision can count fewer")


def _canary_interval(decision: dict | None) -> dict | None:
    """The sequential test's always-valid interval of the relative difference
    rate(candidate) / rate(stable) - 1 at the final decision (from the ledger row's numbers),
    or None."""
    t = ((decision or {}).get("numbers") or {}).get("thumbs_up") or {}
    if "ci_lo" not in t:
        return None
    return {"diff": t["diff"], "lo": t["ci_lo"], "hi": t["ci_hi"], "alpha": t.get("alpha"), "delta": t.get("delta"),
            "scale": t.get("scale", "absolute"), "abs_diff": t.get("abs_diff", t["diff"]),
            "candidate": [t["candidate_up"], t["candidate_votes"]], "stable": [t["stable_up"], t["stable_votes"]]}


class Proc:
    """A child process with its output in a log file; stopped with SIGTERM then SIGKILL, and
    SIGKILLed by the kernel if the demo dies first (:func:`flywheel.supervise.die_with_parent`).
    Its own session: a terminal's Ctrl-C or hang-up reaches the demo, which stops it."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        try:
            self.p = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                      stdin=subprocess.DEVNULL, start_new_session=True,
                                      preexec_fn=die_with_parent())
        except BaseException:
            self._log.close()
            raise

    def alive(self) -> bool:
        return self.p.poll() is None

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    stop_timeout_s = 10.0  # stop()'s default wait after each of SIGTERM and SIGKILL (s)

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM to its process group, then SIGKILL after ``timeout_s`` (default
        :attr:`stop_timeout_s`); returns within ``2 x timeout_s`` whatever happens: a stop
        signal's handler may run it while the code it interrupted holds this Popen's wait lock
        (inside :meth:`alive`), which no wait here can take, so none is unbounded.

        Raises:
            RuntimeError: it was sent SIGKILL but not seen to exit within ``timeout_s`` more.
        """
        timeout_s = self.stop_timeout_s if timeout_s is None else timeout_s
        try:
            if self.p.poll() is None:
                for sig in (signal.SIGTERM, signal.SIGKILL):  # each followed by one bounded wait
                    try:
                        os.killpg(self.p.pid, sig)
                    except ProcessLookupError:
                        pass
                    try:
                        self.p.wait(timeout_s)
                        break
                    except subprocess.TimeoutExpired:
                        pass
                else:
                    raise RuntimeError(f"{self.name} (pid {self.p.pid}) was sent SIGKILL but not seen to exit "
                                       f"within {timeout_s:g} s")
        finally:
            self._log.close()


DEMO_MARKER = ".flywheel-demo"  # in <out>/home: made by a demo, so a later demo may replace it
# the traffic threads' joins share one deadline (s): a request's own timeout is 600 s; after a
# stop signal serving is already stopped, so the requests in flight fail at once
TRAFFIC_JOIN_S = 660.0
STOPPING_JOIN_S = 10.0
VOTES_JOIN_S = 60.0  # the vote threads' joins share one deadline (s)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "flywheel.cli", *args]


class Demo:
    """One run of the main job. Use :meth:`run`; returns the report dict."""

    def __init__(self, cfg: DemoConfig, console: Console | None = None):
        self.cfg = cfg
        self.console = console or Console()
        self.rng = random.Random(cfg.seed)
        self.procs: list[Proc] = []
        self.accepted: set[str] = set()  # feedback event_ids the API accepted (HTTP 200)
        self.with_feedback: set[str] = set()  # completion_ids with at least one accepted feedback event
        self.controller: Proc | None = None  # started after the first traffic phase (start_controller)
        # SIGINT, SIGTERM and SIGHUP stop every child (active during run()); _start and the
        # waiting loops refuse to go on once one was received
        self.stop_signals = StopSignals(self.stop_children)
        self.deadline_s: float | None = None  # the canary step deadline the controller runs with (s)
        self.feedback_rejected = 0
        self.requests_ok = 0
        self.requests_failed = 0
        self.lock = threading.Lock()
        self.phase_log: list[dict] = []
        self.vote_threads: list[threading.Thread] = []
        self.completions: dict[str, dict] = {}  # completion_id -> what was asked and how it was judged
        self.signals_sent: dict[str, int] = {}  # accepted feedback events by kind
        self.learner_peak_gb: dict[int, float] = {}  # cycle -> the learner process's peak RSS (GB)
        self.published_in: dict[str, int] = {}  # version -> the cycle whose learner published it
        # the fixed eval set: the same prompts and sampling seeds for every version, never asked
        # by the users (reserved), scored at the end (fixed_eval)
        self.fixed = fixed_eval_set(cfg.families, cfg.fixed_per_family,
                                    cfg.fixed_humaneval if "humaneval" in cfg.families else 0, cfg.seed)
        for t in self.fixed:
            t.kind = fixed_kind(t.family, cfg.held_out)
        self.workload = Workload(families=cfg.families, held_out=cfg.held_out, eval_share=cfg.eval_share,
                                 humaneval_problems=tuple(range(cfg.problems)), seed=cfg.seed,
                                 weights=cfg.weights(), reserved=frozenset(t.key for t in self.fixed))

    # ----------------------------------------------------------------- setup
    def _env(self) -> dict:
        env = dict(os.environ)
        env["FLYWHEEL_HOME"] = str(self.home)
        env["FLYWHEEL_KAFKA_BOOTSTRAP"] = self.bootstrap
        env["FLYWHEEL_SERVING_URL"] = self.url
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def log(self, msg: str) -> None:
        self.console.log(msg)

    def setup(self) -> None:
        from flywheel.broker import free_port, spawn
        from flywheel.modelinit import init_model
        from schemas import settings

        cfg = self.cfg
        cfg.out.mkdir(parents=True, exist_ok=True)
        self.home = (cfg.out / "home").absolute()
        if self.home.exists():
            if not (self.home / DEMO_MARKER).exists():  # never delete what a demo did not make
                raise ValueError(f"out: {self.home} exists and was not made by flywheel demo; "
                                 "choose another --out or remove it yourself")
            import shutil
            self.log(f"replacing {self.home}: the home (store, samples, ledger) an earlier flywheel demo "
                     "left in this --out")
            shutil.rmtree(self.home)
        self.home.mkdir(parents=True)
        (self.home / DEMO_MARKER).write_text("made by flywheel demo; the next run with this --out replaces it\n")
        os.environ["FLYWHEEL_HOME"] = str(self.home)
        self.logs = cfg.out / "logs"
        self.logs.mkdir(exist_ok=True)
        self.broker = None
        self.stop_signals.check()
        if os.environ.get("FLYWHEEL_KAFKA_BOOTSTRAP"):
            self.bootstrap = os.environ["FLYWHEEL_KAFKA_BOOTSTRAP"]
            from schemas.topic_admin import ensure_topics
            ensure_topics(self.bootstrap)
            self.log(f"using external Kafka at {self.bootstrap}")
        else:
            with self.stop_signals.deferred():  # a stop signal meanwhile finds it in self.broker
                self.broker = spawn(log_path=self.logs / "broker.log", die_with_parent=True)
            self.bootstrap = self.broker.bootstrap
            self.log(f"embedded Tansu broker on {self.bootstrap}, topics created (6 partitions)")
        os.environ["FLYWHEEL_KAFKA_BOOTSTRAP"] = self.bootstrap
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model_dir = settings.base_model_dir()
        if (model_dir / "config.json").exists() and not (model_dir / "flywheel_model.json").exists():
            self.log(f"using the checkpoint at {model_dir} as given (FLYWHEEL_MODEL_DIR)")
        else:
            model_dir = init_model(model_dir, log=self.log)
        from modelstore.store import ModelStore
        self.store = ModelStore(settings.store_dir())
        self.store.init_base(model_dir)
        self.samples_dir = settings.samples_dir()
        env = self._env()
        serve = flags_for(role_models("serve"), {"max_batch": cfg.concurrency, **cfg.serve})
        self.serving = self._start("serving", _cli("serve", "--port", str(self.port), "--pod", "pod-0", *serve), env)
        self.ingest = self._start("ingest", _cli("ingest", *flags_for(role_models("ingest"), cfg.ingest)), env)
        self._wait_http(self.url + "/healthz", 180, self.serving)
        self.log(f"serving ready at {self.url}")

    def start_controller(self, first: list[dict]) -> None:
        """Start the rollout controller with the step deadline :func:`step_deadline_s` gives
        from the first traffic phase's request times (``first``: :meth:`traffic`'s replies,
        each with ``latency_s``), and log the deadline chosen. No canary runs before the first
        learner cycle, so the controller is not needed earlier.

        Raises:
            SystemExit: ``128 + signum``: a stop signal was received (before: no controller is
                started; during its start: it is stopped).
        """
        self.stop_signals.check()
        from deploy.controller import ControllerConfig

        floor = float(self.cfg.controller.get("deadline_s", ControllerConfig.deadline_s))
        times = [r["latency_s"] for r in first]
        self.deadline_s = step_deadline_s(floor, times)
        if times:
            self.log(f"canary step deadline {self.deadline_s:.0f} s: the larger of the configured {floor:g} s and "
                     f"{DEADLINE_REQUESTS} x the median request time of the first phase "
                     f"({statistics.median(times):.1f} s over {len(times)} requests)")
        else:
            self.log(f"canary step deadline {self.deadline_s:.0f} s (configured; no request of the first phase "
                     "was answered to measure)")
        flags = flags_for(role_models("controller"), {**self.cfg.controller, "deadline_s": self.deadline_s})
        self.controller = self._start("controller", _cli("controller", "--serving", self.url, *flags), self._env())

    def _start(self, name: str, args: list[str], env: dict) -> Proc:
        """Start child ``name`` (:class:`Proc`, log in :attr:`logs`) and track it in
        :attr:`procs`, which :meth:`stop_children` stops. Refused once a stop signal was
        received; a stop signal during the start is acted on once the child is tracked
        (:meth:`StopSignals.deferred`: the fork runs Python's at-fork hooks, where an exception
        raised by a handler is dropped).

        Raises:
            SystemExit: ``128 + signum``: a stop signal was received before the child was
                started (none is), or while it was (it is stopped first).
            OSError: the child could not be started.
        """
        self.stop_signals.check()
        with self.stop_signals.deferred():
            p = Proc(name, args, self.logs, env)
            self.procs.append(p)
        return p

    def _wait_http(self, url: str, timeout_s: float, proc: Proc) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.stop_signals.check()
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{url} not ready after {timeout_s}s:\n{proc.tail()}")

    # --------------------------------------------------------------- traffic
    def _one_request(self, client: httpx.Client, task: Task, user: str) -> dict | None:
        max_tokens = self.cfg.max_tokens if task.family == "humaneval" else self.cfg.max_tokens_short
        body = {"model": "flywheel", "messages": task.messages, "max_tokens": max_tokens,
                "temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "user": user,
                "seed": self.rng.randrange(1 << 30), "metadata": {"flywheel_split": task.split}}
        t0 = time.monotonic()
        try:
            r = client.post(self.url + "/v1/chat/completions", json=body, timeout=600)
        except httpx.HTTPError:
            with self.lock:
                self.requests_failed += 1
            return None
        latency_s = time.monotonic() - t0
        if r.status_code != 200:
            with self.lock:
                self.requests_failed += 1
            return None
        data = r.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] or ""
        passed = task.verifier.score(text)
        version = r.headers.get("x-flywheel-model-version", "?")
        rec = {"version": version, "family": task.family, "split": task.split, "kind": task.kind, "key": task.key,
               "passed": passed,
               "has_answer": task.verifier.has_answer(text), "finish_reason": choice.get("finish_reason"),
               "tokens": (data.get("usage") or {}).get("completion_tokens", 0)}
        with self.lock:
            self.requests_ok += 1
            self.completions[data["id"]] = rec
        plan = self.cfg.behaviour.plan(passed, self.rng, signals=self.cfg.signals, code=task.family == "humaneval")
        rec["thumb"], rec["action"], rec["noisy"] = plan.final, plan.action, plan.noisy
        t = threading.Thread(target=self._send_votes, args=(data["id"], user, plan), daemon=True)
        t.start()
        self.vote_threads.append(t)
        return {**rec, "voted": plan.final, "completion_id": data["id"], "latency_s": latency_s}

    def _send_votes(self, completion_id: str, user: str, plan) -> None:
        start = time.monotonic()
        with httpx.Client(timeout=30) as c:
            for delay, event_id, kind, value in plan.events:
                time.sleep(max(0.0, delay - (time.monotonic() - start)))
                for attempt in range(5):
                    try:  # the feedback API's wire, as the SDK's HTTP mode sends it
                        r = c.post(self.url + "/v1/feedback", json={
                            "completion_id": completion_id, "event_id": event_id, "kind": kind,
                            "value": value, "user": user})
                    except httpx.HTTPError:
                        time.sleep(0.2 * (attempt + 1))
                        continue
                    with self.lock:
                        if r.status_code == 200:
                            if event_id not in self.accepted:
                                self.signals_sent[kind] = self.signals_sent.get(kind, 0) + 1
                            self.accepted.add(event_id)
                            self.with_feedback.add(completion_id)
                        else:
                            self.feedback_rejected += 1
                    break

    def traffic(self, phase: str, n: int) -> list[dict]:
        """Send ``n`` chat requests with ``concurrency`` in flight; users vote in background.
        Returns the replies as :meth:`traffic_until` does."""
        return self.traffic_until(phase, lambda: False, n)

    def traffic_until(self, phase: str, done, limit: int) -> list[dict]:
        """Send requests with ``concurrency`` in flight, as a steady stream, until ``done()``
        (checked every second) is true or ``limit`` requests were sent; users vote in
        background. Shows a live bar on a terminal, a status line every 30 s otherwise: the
        phase's replies right and by version, and how many of them got feedback the API
        accepted, by version. On any exit (SIGTERM included) no new request starts; those in
        flight finish.

        Returns one dict per answered request: the demo's record of the reply (``version``,
        ``family``, ``split``, ``kind``, ``key``, ``passed``, ``has_answer``,
        ``finish_reason``, ``tokens``, ``thumb``, ``action``, ``noisy``) with ``voted``,
        ``completion_id`` and ``latency_s`` (the request's wall seconds).

        Raises:
            RuntimeError: serving, ingest or the controller died.
        """
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        results: list[dict] = []
        sent = 0
        lock = threading.Lock()
        stop = threading.Event()

        def worker() -> None:
            nonlocal sent
            with httpx.Client() as client:
                while not stop.is_set():
                    with lock:
                        if sent >= limit:
                            return
                        sent += 1
                        task = self.workload.next_task(self.rng)  # the generators are not thread-safe
                        user = f"user-{self.rng.randrange(self.cfg.users)}"
                    r = self._one_request(client, task, user)
                    if r:
                        with lock:
                            results.append(r)

        def status() -> str:
            with lock:
                by_v = {v: sum(1 for x in results if x["version"] == v) for v in sorted({x["version"] for x in results})}
                right = sum(1 for x in results if x["passed"])
                rows = list(results)
            with self.lock:
                fed = feedback_by_version(rows, self.with_feedback)
            return f"right {right}/{len(rows)} by version {by_v}, replies with feedback accepted {fed}"

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(self.cfg.concurrency)]
        bounded = limit < 1_000_000
        with Progress(TextColumn(f"[bold]{phase}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                      TimeElapsedColumn(), console=self.console, transient=False) as prog:
            bar = prog.add_task(phase, total=limit if bounded else None, status="")
            for t in threads:
                t.start()
            t0 = last = time.monotonic()
            try:
                while any(t.is_alive() for t in threads) and not done():
                    self._check_alive()
                    time.sleep(1.0)
                    prog.update(bar, completed=len(results), status=status())
                    if not self.console.is_terminal and time.monotonic() - last >= 30:
                        last = time.monotonic()
                        self.console.print(f"{phase}: {len(results)}{f'/{limit}' if bounded else ''} served in "
                                           f"{last - t0:.0f} s, {status()}")
            finally:
                stop.set()
                deadline = time.monotonic() + (STOPPING_JOIN_S if self.stop_signals.received else TRAFFIC_JOIN_S)
                for t in threads:  # daemon threads: one still running at the deadline ends with the demo
                    t.join(timeout=max(0.0, deadline - time.monotonic()))
            prog.update(bar, completed=len(results), status=status())
        self.phase_log.append({"phase": phase, "requests": sent, "ok": len(results),
                               "passed": sum(1 for x in results if x["passed"]),
                               "by_version": {v: sum(1 for x in results if x["version"] == v)
                                              for v in {x["version"] for x in results}}})
        return results

    def wait_votes_sealed(self, timeout_s: float) -> None:
        """Wait until every accepted vote is in a sample or dead-lettered."""
        self.stop_signals.check()
        joined = time.monotonic() + VOTES_JOIN_S
        for t in self.vote_threads:
            t.join(timeout=max(0.0, joined - time.monotonic()))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            in_samples = set(sample_queries.event_ids_in_samples(self.samples_dir))
            missing = self.accepted - in_samples - self.dead_lettered_ids()
            if not missing:
                return
            self._check_alive()
            time.sleep(1.0)
        self.log(f"[yellow]{len(missing)} accepted votes not sealed after {timeout_s}s")

    def dead_lettered_ids(self) -> set[str]:
        """event_ids of feedback events on the dead-letter topic (read from the start)."""
        from kafka import KafkaConsumer, TopicPartition

        from schemas.events import DeadLetter
        from schemas.settings import kafka_client_config, topic_names

        deadletter = topic_names().deadletter
        ids: set[str] = set()
        c = KafkaConsumer(**kafka_client_config(self.bootstrap), enable_auto_commit=False,
                          consumer_timeout_ms=1500, group_id=None)
        try:
            parts = c.partitions_for_topic(deadletter) or set()
            tps = [TopicPartition(deadletter, p) for p in parts]
            c.assign(tps)
            c.seek_to_beginning(*tps)
            for msg in c:
                try:
                    dl = DeadLetter.from_bytes(msg.value)
                    ids.add(str(json.loads(dl.payload).get("event_id")))
                except Exception:  # a dead letter we cannot attribute stays counted as lost
                    continue
        finally:
            c.close()
        return ids

    def _check_alive(self) -> None:
        """Raise if a stop signal was received (SystemExit) or a child died (RuntimeError)."""
        self.stop_signals.check()
        for p in (self.serving, self.ingest, self.controller):
            if p is not None and not p.alive():
                raise RuntimeError(f"{p.name} died:\n{p.tail(40)}")

    # ---------------------------------------------------------------- cycles
    def learn(self, cycle: int) -> str | None:
        self.stop_signals.check()
        before = set(self.store.versions())
        objective = self.cfg.learner_setting("objective")
        self.log(f"cycle {cycle}: learner (DeepSpeed ZeRO-2, {objective}, router replay) ...")
        args = _cli("learn", "--once", *learn_flags(self.cfg.learner), "--seed", str(self.cfg.seed + cycle))
        with open(self.logs / f"learner-{cycle}.log", "ab") as logf:  # a stop signal kills the learner
            code, peak = run_measuring_peak(args, stop=self.stop_signals, env=self._env(), stdout=logf,
                                            stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
        self.learner_peak_gb[cycle] = round(peak / 1e9, 2)
        if code != 0:
            raise RuntimeError(f"learner failed (exit {code}); see {self.logs}/learner-{cycle}.log")
        new = sorted(set(self.store.versions()) - before)
        if not new:
            self.log(f"[yellow]learner published no version (gate or too few samples); "
                     f"peak RSS {peak / 1e9:.2f} GB")
            return None
        self.published_in[new[-1]] = cycle
        self.log(f"learner published {new[-1]}; peak RSS {peak / 1e9:.2f} GB")
        return new[-1]

    def publish_degraded(self, noise: float = 0.5, layers: int = 4) -> str:
        """Publish a deliberately degraded candidate: the stable's weights with Gaussian noise
        of ``noise`` x each tensor's std added to the MLP/expert weights of the last ``layers``
        decoder layers (seeded). Its canary must end in a rollback on evidence."""
        import torch

        parent = self.store.stable() or self.store.versions()[-1]
        state = self.store.load(parent)
        n_layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
        g = torch.Generator().manual_seed(self.cfg.seed + 7)
        touched = 0
        for k, t in state.items():
            parts = k.split(".")
            if (k.startswith("model.layers.") and int(parts[2]) >= n_layers - layers and t.is_floating_point()
                    and t.dim() >= 2 and ("mlp" in k or "experts" in k) and "gate.weight" not in k):
                t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype) * (noise * t.float().std().item()))
                touched += 1
        m = self.store.publish(state, parent, metrics={"degraded": f"noise {noise} x std on {touched} MLP tensors "
                                                                    f"of the last {layers} layers (demo --bad-candidate)"})
        self.log(f"published [red]degraded[/red] candidate {m.version} (parent {parent}, {touched} tensors noised)")
        return m.version

    def canary(self, version: str) -> dict:
        """Serve traffic until the controller decides about ``version``."""
        from deploy.ledger import Ledger
        from schemas import settings

        ledger = Ledger(settings.ledger_path())
        deadline = time.monotonic() + max(600.0, 6 * self.deadline_s)
        # canary traffic only makes sense once the controller has loaded the candidate
        while time.monotonic() < deadline and ledger.final_decision(version) is None:
            slots = httpx.get(self.url + "/admin/slots", timeout=10).json()
            if (slots.get("candidate") or {}).get("version") == version or slots["stable"]["version"] == version:
                self.log(f"controller loaded {version} into the candidate slot "
                         f"({slots.get('candidate_weight', 0):.0%} of traffic)")
                break
            self._check_alive()
            time.sleep(0.5)
        served = self.traffic_until(f"canary {version}",
                                    lambda: ledger.final_decision(version) is not None or time.monotonic() > deadline,
                                    limit=1_000_000)
        decision = ledger.final_decision(version)
        if decision is not None:
            by = (decision.get("numbers") or {}).get("decided_by")
            if by == "deadline":
                self.log(f"[yellow]canary of {version} was INCONCLUSIVE: the sequential test did not decide "
                         f"before the step deadline ({self.deadline_s:.0f} s), so it was {decision['decision']} by "
                         f"the deadline policy, not promoted[/yellow]")
            self.log(f"controller decided [bold]{decision['decision']}[/bold] for {version} "
                     f"(decided by {by}): {decision['reason']}")
            with self.lock:
                fed = feedback_by_version(served, self.with_feedback)
            self.log(canary_counts_line(decision, fed, self.cfg.ingest.get("seal_after_s")))
            return decision
        raise RuntimeError(f"no canary decision for {version} in time:\n{self.controller.tail(40)}")

    # ------------------------------------------------------------ fixed eval
    def _eval_candidate(self, version: str | None, expected: str | None = None):
        """Put ``version`` in the fleet's candidate slot at weight 0 (None: empty the slot,
        whose candidate must still be ``expected``) the way the operator commands change the
        fleet (:func:`deploy.operator.run_action`): one change of the desired-state record, then
        a watch of the pods until each serves it (they load it by their own watch of the
        record), at most :data:`EVAL_LOAD_TIMEOUT_S`. The record's ``action`` says ``fixed
        eval`` and its actor :data:`EVAL_ACTOR`, which ``flywheel status`` shows; the watch's
        end is a ``FLEET_CONVERGED`` / ``FLEET_NOT_CONVERGED`` ledger row (rows that no
        rollout's status or final decision reads).

        Returns:
            ``(changed, converged, text)``: whether the record was changed, whether every pod
            serves it, and a line on how it ended (each pod not serving it, or why the record
            was not changed).
        """
        from deploy import ledger
        from deploy.operator import PodChoice, run_action
        from deploy.wiring import admin, bootstrap
        from modelstore.desired import FleetRecord, LockTimeout, dropping
        from schemas import settings
        from schemas.ledger import LedgerEntry

        fleet = FleetRecord(self.store)
        if version is None:
            change, what = dropping(expected), "fixed eval done"
            why = f"fixed eval done: candidate slot emptied ({expected} was asked by id at 0 %)"
        else:
            def change(x):
                if x.stable == version:
                    raise ValueError(f"candidate: {version} is the fleet's stable version")
                x.candidate, x.weight = version, 0.0
                return x
            what = "fixed eval"
            why = (f"fixed eval: {version} in the candidate slot at 0 % of users, asked the fixed prompts by id "
                   "(no user is sent to it)")

        written: list = []  # the record as the change wrote it

        def record(suffix: str, numbers: dict) -> None:
            if suffix not in ("converged", "not_converged"):  # the record itself holds the change
                return
            p = numbers.get("pods") or {}
            try:
                ledger.record(settings.ledger_path(), LedgerEntry(
                    version=version or expected or "-", stable=written[0].stable if written else None, step=-1,
                    weight=0.0, decision="FLEET_CONVERGED" if suffix == "converged" else "FLEET_NOT_CONVERGED",
                    reason=f"{why} ({p.get('converged', 0)} of {p.get('pods', 0)} pods converged)",
                    numbers=numbers, actor=EVAL_ACTOR), bootstrap())
            except Exception as exc:  # noqa: BLE001 - the eval goes on; the record holds the change
                self.log(f"[yellow]fixed eval: could not write the ledger row ({exc})")

        choice = PodChoice(given=None, default=self.url, make_admin=lambda u: admin(u, 2.0))
        try:
            res = run_action(fleet, choice, change, what=what, who=EVAL_ACTOR, why=why,
                             on_changed=lambda before, after: written.append(after),
                             record=record, timeout_s=EVAL_LOAD_TIMEOUT_S)
        except (ValueError, LockTimeout, OSError) as exc:
            return False, False, f"the fleet's desired state was not changed: {exc}"
        if res.converged:
            return True, True, f"every pod serves {res.desired.summary()} ({res.elapsed_s:.1f} s)"
        bad = "; ".join(o.line() for o in res.not_converged()) or res.discovery_error or "no pod found"
        return True, False, f"not every pod serves {res.desired.summary()} after {res.elapsed_s:.0f} s: {bad}"

    def fixed_eval(self, on_version=None) -> list[dict]:
        """Score every version in the store on the fixed eval set (:attr:`fixed`): the same
        prompts, each with the same sampling seed under every version (common random numbers:
        the per-prompt outcomes are pairs), asked by no user and sent no feedback, so never
        trained on. Runs after the last canary: the controller is stopped first (it would take
        a candidate in the record for a canary to run). Each version other than the stable is
        put in the candidate slot at weight 0 through the fleet's desired-state record
        (:meth:`_eval_candidate`), so every pod serves what the record says and ``flywheel
        status`` shows no drift; its prompts are asked by version id once the pods serve it,
        and the slot is emptied in the record at the end. Each version's requests come from a
        user of their own (``fixed-eval-<version>``): the same messages from one user would be
        read by serving as a regenerate of the earlier reply.

        Args:
            on_version: called as ``on_version(version)`` once the pods serve ``version`` and
                before its prompts are asked (a check of the fleet's state), or None.

        Returns one row per (version, prompt): ``{"version", "key", "family", "kind",
        "passed", "has_answer", "finish_reason", "tokens"}``; a version the pods do not load is
        logged, taken out of the record again and left out.
        """
        from concurrent.futures import ThreadPoolExecutor

        from modelstore.desired import FleetRecord

        self.stop_signals.check()
        if not self.fixed:
            return []
        if self.controller is not None:
            self.controller.stop()
        try:
            stable = FleetRecord(self.store).read().stable
        except (OSError, ValueError) as exc:
            self.log(f"[yellow]fixed eval not run: the fleet's desired-state record is unreadable ({exc})")
            return []
        rows: list[dict] = []
        placed: str | None = None  # the candidate the eval put in the record
        seeds = [int.from_bytes(hashlib.sha256(f"fixed-seed:{self.cfg.seed}:{i}".encode()).digest()[:4], "big")
                 >> 2 for i in range(len(self.fixed))]
        for v in self.store.versions():
            if v != stable:
                changed, ok, how = self._eval_candidate(v)
                placed = v if changed else placed
                if not ok:
                    self.log(f"[yellow]fixed eval: {v} did not load: {how}")
                    if changed:  # the record must not keep a candidate the pods cannot serve
                        changed, ok, how = self._eval_candidate(None, expected=v)
                        placed = None if changed else v
                        if not ok:
                            self.log(f"[yellow]fixed eval: {v} not taken out of the candidate slot: {how}")
                    continue
                self.log(f"fixed eval: {v} in the candidate slot at 0 %: {how}")
            if on_version is not None:
                on_version(v)
            t0 = time.monotonic()
            self.log(f"fixed eval: asking {v} the {len(self.fixed)} fixed prompts")
            done, lock, every = [0], threading.Lock(), max(1, len(self.fixed) // 4)

            def ask(i: int, v: str = v) -> dict | None:
                row = _ask(i, v)
                with lock:  # progress, a line per quarter of the set
                    done[0] += 1
                    if done[0] % every == 0 and done[0] < len(self.fixed):
                        self.log(f"fixed eval: {v} {done[0]}/{len(self.fixed)} prompts answered")
                return row

            def _ask(i: int, v: str) -> dict | None:
                task = self.fixed[i]
                body = {"model": v, "messages": task.messages, "temperature": self.cfg.temperature,
                        "top_p": self.cfg.top_p, "user": f"fixed-eval-{v}", "seed": seeds[i],
                        "max_tokens": self.cfg.max_tokens if task.family == "humaneval" else self.cfg.max_tokens_short,
                        "metadata": {"flywheel_split": "eval"}}
                try:
                    r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=600)
                except httpx.HTTPError:
                    return None
                if r.status_code != 200 or r.headers.get("x-flywheel-model-version", v) != v:
                    return None
                data = r.json()
                text = data["choices"][0]["message"]["content"] or ""
                return {"version": v, "key": task.key, "family": task.family, "kind": task.kind,
                        "passed": bool(task.verifier.score(text)), "has_answer": task.verifier.has_answer(text),
                        "finish_reason": data["choices"][0].get("finish_reason"),
                        "tokens": (data.get("usage") or {}).get("completion_tokens", 0)}

            with ThreadPoolExecutor(self.cfg.concurrency) as ex:
                got = [x for x in ex.map(ask, range(len(self.fixed))) if x is not None]
            rows += got
            lost = len(self.fixed) - len(got)
            self.log(f"fixed eval: {v} right on {sum(x['passed'] for x in got)} of {len(self.fixed)} prompts"
                     + (f" ({lost} not answered)" if lost else "") + f", in {time.monotonic() - t0:.0f} s")
        if placed is not None:
            _, ok, how = self._eval_candidate(None, expected=placed)
            self.log(f"fixed eval: candidate slot emptied: {how}" if ok else
                     f"[yellow]fixed eval: the candidate slot was not emptied: {how}")
        return rows

    # ---------------------------------------------------------------- report
    def build_report(self, t0: float, fixed_rows: list[dict] | None = None) -> dict:
        from deploy.ledger import Ledger
        from schemas import settings

        by_v = sample_queries.samples_by_version(self.samples_dir)
        ledger = Ledger(settings.ledger_path())
        versions = []
        for v in self.store.versions():
            m = self.store.manifest(v)
            s = by_v.get(v, {"samples": 0, "votes_up": 0, "votes_down": 0, "mean_reward": None})
            n = s["votes_up"] + s["votes_down"]
            d = ledger.final_decision(v) if v != "v000000" else None
            metrics = m.metrics or {}
            versions.append({
                "version": v, "parent": m.parent, "samples": s["samples"], "votes_up": s["votes_up"],
                "votes_down": s["votes_down"], "thumbs_up_rate": (s["votes_up"] / n) if n else None,
                "mean_reward": s["mean_reward"],
                "ci95": list(rep.wilson_interval(s["votes_up"], n)),
                "decision": d["decision"] if d else ("base" if m.parent is None else None),
                "reason": d["reason"] if d else ("initial version" if m.parent is None else None),
                "mismatch_mean": metrics.get("mismatch/mean"), "mismatch_max": metrics.get("mismatch/max"),
                "delta_ratio": (m.snapshot_bytes / m.size_bytes) if m.kind == "delta" and m.size_bytes else None,
                "swap_pause_ms": (d or {}).get("numbers", {}).get("swap_pause_ms") if d else None,
                "decided_by": (d.get("numbers") or {}).get("decided_by") if d else None,
                "canary_interval": _canary_interval(d),
                "train_samples": metrics.get("samples"),
                "learner_peak_rss_gb": self.learner_peak_gb.get(self.published_in.get(v, -1)),
            })
        family_of = {cid: r["family"] for cid, r in self.completions.items()}
        rows = sample_queries.votes_by_completion(self.samples_dir)
        figures = rep.split_figures(rows, family_of)
        kinds = rep.kind_figures(rows, {cid: r.get("kind") for cid, r in self.completions.items()})
        for row in versions:
            v = row["version"]
            row["splits"] = figures.get(v, {})
            mine = [r for r in self.completions.values() if r["version"] == v]
            he = [r for r in mine if r["family"] == "humaneval" and r["split"] == "eval"]
            row["humaneval_eval"] = {"passed": sum(r["passed"] for r in he), "n": len(he)}
            row["guards"] = {"n": len(mine),
                             "mean_tokens": (sum(r["tokens"] or 0 for r in mine) / len(mine)) if mine else 0.0,
                             "no_answer_share": (sum(not r["has_answer"] for r in mine) / len(mine)) if mine else 0.0,
                             "truncated_share": (sum(r["finish_reason"] == "length" for r in mine) / len(mine))
                             if mine else 0.0}
            row["kinds"] = kinds.get(v, {})
            row["replies"] = rep.reply_figures(mine)  # every served reply, with 95 % intervals
            row["degraded"] = bool((self.store.manifest(v).metrics or {}).get("degraded"))
        promoted = [r["version"] for r in versions if r["decision"] == "PROMOTE"]
        gain = rep.eval_gain(figures, versions[0]["version"], promoted[-1]) if promoted else None
        if gain is not None:
            gain["by_kind"] = self._gain_by_kind(rows, versions[0]["version"], promoted[-1])
            boot = rep.cluster_bootstrap_gain([r for r in rows if (r["split"] or "train") == "eval"],
                                              {cid: r.get("key") or cid for cid, r in self.completions.items()},
                                              versions[0]["version"], promoted[-1], seed=self.cfg.seed)
            gain["cluster_ci95"] = boot["ci95"] if boot else None
        fixed_rows = fixed_rows or []
        first = versions[0]["version"]
        fixed = {"prompts": len(self.fixed), "families": sorted({t.family for t in self.fixed}),
                 "by_version": rep.fixed_figures(fixed_rows),
                 "comparison": rep.paired_comparison(fixed_rows, first, promoted[-1], seed=self.cfg.seed)
                 if promoted else None,
                 "vs_first": {r["version"]: rep.paired_comparison(fixed_rows, first, r["version"], seed=self.cfg.seed)
                              for r in versions[1:]}}
        signals = rep.signal_figures(self.completions, sample_queries.signals_by_completion(self.samples_dir))
        ids = sample_queries.event_ids_in_samples(self.samples_dir)
        uniq = set(ids)
        dead = self.dead_lettered_ids()
        lost = self.accepted - uniq - dead
        return {
            "versions": versions,
            "eval_gain": gain,
            "fixed_eval": fixed,
            "signals": signals,
            "signals_setting": self.cfg.signals,
            "learner_peak_rss_gb": {str(c): gb for c, gb in sorted(self.learner_peak_gb.items())},
            "signals_accepted": dict(sorted(self.signals_sent.items())),
            "workload": {"families": list(self.cfg.families), "held_out": list(self.cfg.held_out),
                         "eval_share": self.cfg.eval_share},
            "events_accepted": len(self.accepted),
            "events_in_samples": len(uniq & self.accepted),
            "events_dead_lettered": len(dead & self.accepted),
            "events_lost": len(lost),
            "events_double_counted": len(ids) - len(uniq),
            "feedback_rejected": self.feedback_rejected,
            "requests_ok": self.requests_ok, "requests_failed": self.requests_failed,
            "phases": self.phase_log,
            "quick": self.cfg.quick,
            "canary_step_deadline_s": self.deadline_s,  # the controller's, from start_controller
            "wall_s": time.time() - t0,
        }

    def _gain_by_kind(self, rows: list[dict], first: str, last: str) -> dict:
        """``eval_gain`` per kind of never-trained prompt (``fresh``, ``harder``, ``unseen``):
        Newcombe's interval (votes independent) and the cluster bootstrap over prompts."""
        kind_of = {cid: r.get("kind") for cid, r in self.completions.items()}
        key_of = {cid: r.get("key") or cid for cid, r in self.completions.items()}
        figs = rep.kind_figures(rows, kind_of)
        out = {}
        for kind in ("fresh", "harder", "unseen"):
            a, b = (figs.get(first) or {}).get(kind), (figs.get(last) or {}).get(kind)
            if not a or not b or not a["votes"] or not b["votes"]:
                continue
            d, lo, hi = rep.newcombe_interval(a["votes_up"], a["votes"], b["votes_up"], b["votes"])
            boot = rep.cluster_bootstrap_gain([r for r in rows if kind_of.get(str(r["completion_id"])) == kind],
                                              key_of, first, last, seed=self.cfg.seed)
            out[kind] = {"up_from": a["votes_up"], "n_from": a["votes"], "up_to": b["votes_up"], "n_to": b["votes"],
                         "diff": d, "ci95": [lo, hi], "cluster_ci95": boot["ci95"] if boot else None,
                         "prompts": boot["prompts"] if boot else None}
        return out

    def stop_children(self) -> None:
        """Stop every process this demo started (controller, ingest, serving, then the
        broker); idempotent, never raises."""
        stops = [(p.name, p.stop) for p in reversed(self.procs)]
        if getattr(self, "broker", None) is not None:  # setup may have failed before the broker
            stops.append(("broker", self.broker.stop))
        for name, stop in stops:
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - the next child must still be stopped
                try:
                    self.console.log(f"[red]could not stop {name}: {exc}")
                except Exception:  # noqa: BLE001 - a hung-up terminal; a handler inside a write to it
                    pass

    def run(self) -> dict:
        t0 = time.time()
        # every child is stopped, however the run ends: on SIGINT, SIGTERM or SIGHUP first
        # (then SystemExit(128 + signum); stopping them first also ends the traffic threads'
        # requests at once), else when the run returns or raises
        with self.stop_signals:
            report = self._run(t0)
            self.stop_signals.check()  # a stop whose SystemExit was dropped still ends the run so
            return report

    def _run(self, t0: float) -> dict:
        self.setup()
        self.start_controller(self.traffic("v000000 traffic", self.cfg.prompts_per_phase))
        for cycle in range(1, self.cfg.cycles + 1):
            if cycle > 1 and self.cfg.between_prompts:
                # the stable version's own traffic: a canary alone leaves the next cycle
                # too few samples, half of them from the version before (stale)
                self.traffic(f"{self.store.stable() or 'stable'} traffic", self.cfg.between_prompts)
            self.wait_votes_sealed(120)
            v = self.learn(cycle)
            if v is not None:
                self.canary(v)
        if self.cfg.final_prompts:
            self.traffic("after the last canary", self.cfg.final_prompts)
        if self.cfg.bad_candidate:
            self.canary(self.publish_degraded())
        self.wait_votes_sealed(120)
        fixed_rows = self.fixed_eval()  # stops the controller: after the last canary
        report = self.build_report(t0, fixed_rows)
        rep.write_report(report, self.cfg.out)
        rep.write_fixed(fixed_rows, self.cfg.out / "fixed_eval.jsonl")
        rep.write_votes(sample_queries.votes_by_completion(self.samples_dir), self.completions, self.cfg.out / "votes.jsonl")
        rep.print_report(report, self.console)
        self.console.print(f"report: {self.cfg.out / 'report.json'}, plot: "
                           f"{self.cfg.out / 'thumbs_up_by_version.png'}")
        return report
