"""The reward-hacking guards' figures over EVERY served completion, not only the voted ones.

The sample shards hold the completions users voted on; a candidate whose unvoted replies
drift (shorter, no answer, cut at ``max_tokens``, repeating themselves) would hide there.
Every completion a pod serves is on the completions topic (``schemas.settings.topic_names().completions``,
the same record the stream processor joins), so :class:`ServedCompletions` reads that topic
from its start in a background thread and keeps, per model version and second of
``created_at``, the guard counts of :class:`deploy.analysis.ArmStats`: ``completions``,
``completion_tokens``, ``no_answer``, ``truncated``, ``repetitive``, ``truncated_tokens``.

``no_answer`` is the workload's notion (does the reply contain an answer its verifier could
judge?): this package cannot know it, so it comes through the :class:`ReplyJudge` interface,
named on the command line as ``module:attribute`` (:func:`load_judge`), e.g. the demo's
``flywheel.workload:reply_judge``. Without a judge ``no_answer`` counts empty replies (no
completion token). ``repetitive`` is a token-level property (:func:`is_repetitive`).
"""

from __future__ import annotations

import importlib
import json
import logging
import threading
import time
from collections import defaultdict
from typing import Protocol

log = logging.getLogger(__name__)

GUARD_FIELDS = ("completions", "completion_tokens", "no_answer", "truncated", "repetitive", "truncated_tokens")
REP_N = 4  # n-gram order of the repetition measure
REP_MAX = 0.5  # a reply whose seq-rep-4 exceeds this is repetitive
REP_MIN_TOKENS = 8  # shorter replies are never called repetitive


def seq_rep_n(tokens: list[int], n: int = REP_N) -> float:
    """Share of repeated n-grams in one sequence, ``1 - |unique n-grams| / |n-grams|``
    (seq-rep-n of Welleck et al. 2020, "Neural text generation with unlikelihood training",
    section 5); 0.0 when the sequence has no n-gram."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def is_repetitive(tokens: list[int]) -> bool:
    """True when a reply of at least ``REP_MIN_TOKENS`` tokens has seq-rep-4 > ``REP_MAX``
    (more than half its 4-grams are repeats: a loop, not prose)."""
    return len(tokens) >= REP_MIN_TOKENS and seq_rep_n(tokens) > REP_MAX


class ReplyJudge(Protocol):
    """The workload's view of a reply, for the guards."""

    def has_answer(self, prompt_token_ids: list[int], completion_token_ids: list[int]) -> bool:
        """True when the reply contains an answer the workload's verifier could judge."""


def load_judge(spec: str) -> ReplyJudge:
    """The object named by ``module:attribute`` (called with no argument when it is a class or
    a factory function without ``has_answer``).

    Raises:
        ValueError: ``spec`` is not ``module:attribute``, or names nothing with ``has_answer``.
    """
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"reply judge: expected module:attribute, got {spec!r}")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reply judge: cannot load {spec!r}: {exc}") from exc
    if not hasattr(obj, "has_answer") and callable(obj):
        try:
            obj = obj()
        except Exception as exc:  # noqa: BLE001 - e.g. the factory's tokenizer is missing
            raise ValueError(f"reply judge: {spec!r} failed to build: {type(exc).__name__}: {exc}") from exc
    if not callable(getattr(obj, "has_answer", None)):
        raise ValueError(f"reply judge: {spec!r} has no has_answer(prompt_token_ids, completion_token_ids)")
    return obj


def reply_flags(event: dict, judge: ReplyJudge | None) -> tuple[int, int, int, int]:
    """``(tokens, no_answer, truncated, repetitive)`` of one completion record (the
    CompletionEvent's JSON fields)."""
    toks = event.get("completion_token_ids") or []
    if judge is None:
        no_answer = not toks
    else:
        no_answer = not judge.has_answer(event.get("prompt_token_ids") or [], toks)
    return len(toks), int(no_answer), int(event.get("finish_reason") == "length"), int(is_repetitive(toks))


class ServedCompletions:
    """Guard counts of every served completion, per version, from the completions topic.

    Args:
        bootstrap: Kafka bootstrap servers.
        topic: the completions topic (default ``schemas.settings.topic_names().completions``).
        judge: the workload's :class:`ReplyJudge`, or None (``no_answer`` = empty reply).
        poll_s: consumer poll timeout (s).

    Counts are kept per ``(version, created_at // 1000)`` so :meth:`counts` can answer "since
    the canary started" to the second (a completion in the start's own second counts only
    if the second starts at or after it). A record that does not parse is skipped and counted
    in ``skipped``. The thread reads from the topic's start, so a restarted controller
    rebuilds the same counts.
    """

    def __init__(self, bootstrap: str, topic: str | None = None, judge: ReplyJudge | None = None,
                 poll_s: float = 0.3):
        if topic is None:
            from schemas.settings import topic_names

            topic = topic_names().completions
        self.bootstrap, self.topic, self.judge, self.poll_s = bootstrap, topic, judge, poll_s
        self._buckets: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0] * len(GUARD_FIELDS))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.records = 0
        self.skipped = 0
        self.error: str | None = None

    def start(self) -> "ServedCompletions":
        self._thread = threading.Thread(target=self._run, name="served-completions", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def add(self, event: dict) -> None:
        """Count one completion record (the topic reader's step; public for tests and replays)."""
        tokens, no_ans, trunc, rep = reply_flags(event, self.judge)
        key = (str(event["model_version"]), int(event["created_at"]) // 1000)
        with self._lock:
            b = self._buckets[key]
            for i, v in enumerate((1, tokens, no_ans, trunc, rep, tokens if trunc else 0)):
                b[i] += v
            self.records += 1

    def counts(self, since_ms: int = 0, versions=None) -> dict[str, dict]:
        """``{version: {completions, completion_tokens, no_answer, truncated, repetitive,
        truncated_tokens}}`` of
        completions created at or after ``since_ms`` (to the second), for ``versions`` (all
        when None)."""
        first_s = -(-int(since_ms) // 1000)  # ceil: whole seconds at or after since_ms
        out: dict[str, list[int]] = {}
        with self._lock:
            for (v, sec), b in self._buckets.items():
                if sec >= first_s and (versions is None or v in versions):
                    acc = out.setdefault(v, [0] * len(GUARD_FIELDS))
                    for i, x in enumerate(b):
                        acc[i] += x
        return {v: dict(zip(GUARD_FIELDS, acc)) for v, acc in out.items()}

    def _run(self) -> None:
        from kafka import KafkaConsumer, TopicPartition

        from schemas.settings import kafka_client_config

        consumer = None
        while not self._stop.is_set():
            try:
                if consumer is None:
                    with self._lock:  # (re)reading from the topic's start: count every record once
                        self._buckets.clear()
                        self.records = self.skipped = 0
                    consumer = KafkaConsumer(**kafka_client_config(self.bootstrap), group_id=None,
                                             enable_auto_commit=False, auto_offset_reset="earliest")
                    parts = [TopicPartition(self.topic, p) for p in (consumer.partitions_for_topic(self.topic) or [])]
                    if not parts:
                        consumer.close()
                        consumer = None
                        time.sleep(1.0)
                        continue
                    consumer.assign(parts)
                    consumer.seek_to_beginning(*parts)
                for recs in consumer.poll(timeout_ms=int(self.poll_s * 1000)).values():
                    for r in recs:
                        try:
                            self.add(json.loads(r.value))
                        except (ValueError, KeyError, TypeError) as exc:
                            self.skipped += 1
                            log.debug("completion record at %s skipped: %s", r.offset, exc)
                self.error = None
            except Exception as exc:  # noqa: BLE001 - broker away: report and retry
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("completions topic unreadable (%s); retrying", self.error)
                if consumer is not None:
                    try:
                        consumer.close()
                    except Exception:  # noqa: BLE001
                        pass
                consumer = None
                self._stop.wait(2.0)
        if consumer is not None:
            consumer.close()
