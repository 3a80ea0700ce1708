"""The torch engine's scheduler: the waiting queue, admission, and the worker loop.

One worker thread keeps one :class:`serving.torch_engine.batch.RunningBatch` per LoadedModel
being served. Every iteration it admits waiting requests (FIFO, up to ``max_batch`` running
in all; :meth:`Scheduler._admit`) into the batch of their weights, then runs one step of every
running batch and resolves the requests that finished. Policies (``EngineConfig.scheduler``):

- ``continuous``: requests join and leave the running batch at every step boundary, so a new
  request waits at most one step to join, never for the longest request in the batch. With
  ``waiting_served_ratio > 0`` waiting requests are held back until enough of them can join
  together (text-generation-inference's router rule, :meth:`Scheduler._hold_joins`).
- ``static``: a batch is formed from the waiting requests when none runs on their weights and
  takes nobody new until its last row ends.

Threads: :meth:`Scheduler.add`, :meth:`Scheduler.abort`, :meth:`Scheduler.pause` and the
other public methods are called from any thread and hold ``cv``; the batches are touched by
the worker thread only.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from serving.config import EngineConfig
from serving.params import GenRequest, GenResult, ServingValidationError
from serving.torch_engine.batch import RunningBatch

log = logging.getLogger("flywheel.serving.engine")


@dataclass
class WaitingRequest:
    """A queued request: the request, its future and when it was submitted (perf_counter s)."""

    req: GenRequest
    fut: concurrent.futures.Future
    t_submit: float


class Scheduler:
    """The waiting queue and running batches of one torch engine, and the worker thread that
    steps them (see the module docstring).

    Args:
        engine: the owning :class:`serving.engine.TorchEngine`; each running batch reads its
            device, token ids and limits (:class:`serving.torch_engine.batch.RunningBatch`).
        config: the engine's settings: ``max_batch``, ``max_queue``, ``scheduler``,
            ``waiting_served_ratio``, ``max_waiting_tokens``.

    Attributes:
        pending: the waiting requests in arrival order (``WaitingRequest``).
        running: ``{id(LoadedModel): RunningBatch}``.
        batches_run: prefill groups admitted; fused_joins: those that rode in a decode forward;
        steps_run: decode steps (one per running batch per iteration); last_batch_size: rows
            running after the last iteration.
    """

    def __init__(self, engine: Any, config: EngineConfig):
        self.engine = engine
        self.policy = config.scheduler
        self.max_batch = config.max_batch
        self.max_queue = config.max_queue
        self.waiting_served_ratio = config.waiting_served_ratio
        self.max_waiting_tokens = config.max_waiting_tokens
        self.pending: collections.deque[WaitingRequest] = collections.deque()
        self.live: dict[str, GenRequest] = {}  # request_id -> request, queued or running
        self.running: dict[int, RunningBatch] = {}
        self.cv = threading.Condition()
        self.paused = False
        self.closed = False
        self.batches_run = 0
        self.fused_joins = 0
        self.steps_run = 0
        self.last_batch_size = 0
        self._steps_since_join = 0  # decode iterations since waiting requests last joined
        self.thread = threading.Thread(target=self._run, name="flywheel-engine", daemon=True)

    def start(self) -> None:
        """Start the worker thread."""
        self.thread.start()

    # ------------------------------------------------------------------ any thread
    def add(self, req: GenRequest) -> concurrent.futures.Future:
        """Queue ``req``; the future resolves to its :class:`GenResult`.

        Raises:
            ServingValidationError: 429 ``queue_full`` when ``max_queue`` requests wait; 400
                when a request with the same ``request_id`` is queued or running.
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.cv:
            if len(self.pending) >= self.max_queue:
                raise ServingValidationError("request", "queue", f"server queue is full ({self.max_queue})",
                                             status=429, code="queue_full")
            if req.request_id in self.live:
                raise ServingValidationError("request_id", req.request_id, "is already running on this engine")
            self.live[req.request_id] = req
            self.pending.append(WaitingRequest(req, fut, time.perf_counter()))
            self.cv.notify()
        fut.add_done_callback(lambda _f, rid=req.request_id: self.live.pop(rid, None))
        return fut

    def abort(self, request: "str | GenRequest") -> None:
        """End a request (by id or the request) at its next step; unknown ids are ignored."""
        req = request if isinstance(request, GenRequest) else self.live.get(request)
        if req is not None:
            req.cancelled.set()
            with self.cv:
                self.cv.notify()

    def queue_depth(self) -> int:
        """Requests waiting to join a running batch."""
        return len(self.pending)

    def num_running(self) -> int:
        """Requests in a running batch (or prefilled at its next step)."""
        return sum(len(r.seqs) + len(r.joining) for r in list(self.running.values()))

    def pause(self) -> None:
        """Admit no new request; running ones go on."""
        with self.cv:
            self.paused = True

    def resume(self) -> None:
        """Admit again."""
        with self.cv:
            self.paused = False
            self.cv.notify_all()

    def close(self) -> None:
        """Stop the worker (up to 30 s for its current step); every request it did not finish
        fails with RuntimeError ``engine closed``."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        self.thread.join(timeout=30)
        while self.pending:
            it = self.pending.popleft()
            if not it.fut.done():
                it.fut.set_exception(RuntimeError("engine closed"))

    # ------------------------------------------------------------------ worker thread
    def _admit(self) -> list[WaitingRequest] | None:
        """Wait for work; take the waiting requests that may join now (None: closed).

        Continuous: any waiting request while fewer than ``max_batch`` run. Static: only
        requests whose weights have no running batch (they form a new one together).
        Aborted waiting requests are always taken (they resolve at once).
        """
        with self.cv:
            while not self.closed and not self.running and (self.paused or not self.pending):
                self.cv.wait(0.5)
            if self.closed:
                return None
            if self.paused or not self.pending:
                return []
            running = self.num_running()
            room = self.max_batch - running
            if self._hold_joins(running, room):
                return []
            out: list[WaitingRequest] = []
            rest: collections.deque[WaitingRequest] = collections.deque()
            while self.pending:
                it = self.pending.popleft()
                if it.req.cancelled.is_set() or (
                        room > 0 and (self.policy == "continuous" or id(it.req.model) not in self.running)):
                    out.append(it)
                    room -= 0 if it.req.cancelled.is_set() else 1
                else:
                    rest.append(it)
            self.pending = rest
            return out

    def _hold_joins(self, running: int, room: int) -> bool:
        """Continuous with ``waiting_served_ratio`` r > 0: True while the waiting requests
        should keep waiting for company: fewer than ``floor(r x running)`` (or the room left)
        wait, and fewer than ``max_waiting_tokens`` steps passed since the last join. Called
        under ``cv``."""
        if self.policy != "continuous" or self.waiting_served_ratio <= 0 or not running:
            return False
        if self._steps_since_join >= self.max_waiting_tokens:
            return False
        if any(it.req.cancelled.is_set() for it in self.pending):  # resolve aborts at once
            return False
        waiting = len(self.pending)  # none is cancelled here
        want = min(room, math.floor(self.waiting_served_ratio * running))
        return waiting < max(want, 1)

    def _run(self) -> None:
        """The worker loop: admit, step every running batch, until closed; then fail what runs."""
        import torch

        with torch.inference_mode():
            while True:
                items = self._admit()
                if items is None:
                    break
                if items:
                    self._start(items)
                    self._steps_since_join = 0
                for key, run in list(self.running.items()):
                    self._step(key, run)
                self._steps_since_join += 1
                self.last_batch_size = self.num_running()
        for run in self.running.values():
            for s in run.seqs + run.joining:
                if not s.item.fut.done():
                    s.item.fut.set_exception(RuntimeError("engine closed"))
        self.running.clear()

    def _start(self, items: list[WaitingRequest]) -> None:
        """Admitted requests into the running batch of their weights: prefilled now into a
        new batch, or queued to join a batch with running rows at the end of its next step.
        Requests aborted while waiting resolve now (finish reason ``abort``, no token)."""
        groups: dict[int, list[WaitingRequest]] = {}
        for it in items:
            if not it.fut.set_running_or_notify_cancel():
                continue
            if it.req.cancelled.is_set():  # aborted while waiting: no token made
                it.fut.set_result(GenResult(
                    completion_token_ids=[], behavior_logprobs=[], top_logprobs=[], expert_routes=None,
                    finish_reason="abort", ttft_ms=0.0, latency_ms=(time.perf_counter() - it.t_submit) * 1000,
                    version=it.req.model.version, batch_size=0))
                continue
            groups.setdefault(id(it.req.model), []).append(it)
        now = time.perf_counter()
        for key, group in groups.items():
            run = self.running.get(key) or RunningBatch(group[0].req.model, self.engine)
            if run.seqs:  # a running batch takes them at the end of its next step
                run.queue_join(group, now)
                self.batches_run += 1
                continue
            try:
                run.join(group, now)
            except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
                log.exception("prefill of %d requests failed", len(group))
                for it in group:
                    it.fut.set_exception(exc)
                continue
            self.running[key] = run
            self.batches_run += 1

    def _step(self, key: int, run: RunningBatch) -> None:
        """One step of ``run``; resolve the rows that finished; drop the batch when empty."""
        fused = run.fused_joins
        try:
            done = run.step()
            self.steps_run += 1
        except Exception as exc:  # noqa: BLE001 - fail this batch's requests, keep serving
            log.exception("step of a batch of %d failed", len(run.seqs) + len(run.joining))
            for s in run.seqs + run.joining:
                if not s.item.fut.done():
                    s.item.fut.set_exception(exc)
            run.seqs, run.joining = [], []
            done = []
        self.fused_joins += run.fused_joins - fused
        for s in done:
            try:
                s.item.fut.set_result(run.result(s))
            except Exception as exc:  # noqa: BLE001 - e.g. the aligned scoring pass failed
                log.exception("finishing request %s failed", s.req.request_id)
                s.item.fut.set_exception(exc)
        if not run.seqs and not run.joining:
            self.running.pop(key, None)
