"""Feedback that serving derives from chat traffic alone: ``regenerate`` and ``followup``.

A product that never posts feedback still tells serving two things through its chat requests:

* **Regenerate.** The same user (same ``user_hash``: the fleet's salt gives every pod the same
  hash) sends the same messages again within ``window_s``: the completions of the latest
  earlier request with those messages get a ``regenerate`` event (value 1). "The same
  messages" is the digest of the request's messages (role, text, and ``name`` /
  ``tool_call_id`` / ``tool_calls``; ``developer`` counted as ``system``), compared exactly.
  Completions of the same request (its ``n`` choices, or a retry that carries the same
  ``x-request-id``) never regenerate each other.
* **Follow-up.** A chat request whose last assistant message is, up to white space, a reply
  this pod served to this user within ``window_s``, and is followed by a user message: that
  reply's completion gets a ``followup`` event whose value the judge decides from (the
  reply's text, the user's next message, the user message the reply answered): +1
  satisfied, -1 dissatisfied, None no event. Only the last assistant message of a request is
  judged (an earlier one was judged when the conversation was at that turn).

Both are ordinary :class:`schemas.events.FeedbackEvent` s of the user who sent the later
request, at the later request's time, with ``metadata={"source": "serving"}`` and the
deterministic ``event_id`` of :func:`schemas.events.signal_event_id`::

    uuid5(SIGNAL_NAMESPACE, f"{kind}:{earlier_completion_id}:{later_turn_id}")

where ``later_turn_id`` is the later request's turn id: the digest of its messages (128 bits
of sha256, :meth:`SignalDetector.turn`) written as a UUID. It stands where the contract says
"later completion id" and names the later request by what it says, not by a completion id,
which is new on every try: a retried request, on this pod or on another pod that served the
earlier completion, gives the same ``event_id``, and the join counts it once.

The default judge (:func:`rule_judge`), on the next message lower-cased, with ``’`` read as
``'`` and white space collapsed, first rule that matches:

1. it repeats the question (the user message before the reply): equal once punctuation is
   dropped, or both have at least 3 words and their word sets overlap by Jaccard >= 0.8: -1;
2. it says the reply failed (:data:`DISSATISFIED`): "wrong", "incorrect", "not right/correct/
   true/accurate/helpful/useful/good/great/perfect", "doesn't/didn't/isn't/not/can't ...
   work/compile/run/help", "doesn't make sense", "makes no sense", "error(s)", "exception",
   "traceback", "fails/failed/failing", "broken", "bug(s)/buggy", "crash(es/ed)", "not what I
   asked/wanted/meant/need(ed)", "try again", "misunderstood", "useless", "nonsense" (after
   "no/without/zero error(s)/bug(s)/exception(s)/failure(s)" are removed): -1;
3. it says the reply helped (:data:`SATISFIED`): "thanks", "thank you", "thx", "cheers",
   "works/worked/working", "great", "perfect", "awesome", "excellent", "brilliant", "exactly",
   "helpful", "nice", "that helps": +1;
4. otherwise None (no event).

What the detector remembers is bounded: at most ``max_remembered`` completions by messages and
as many by reply text (least recently used out first; about 0.7 KB per completion, measured
with tracemalloc over 20,000), an entry older than ``window_s`` is never matched and is dropped
as newer ones arrive; and the ids of the events it emitted, also at most ``max_remembered``,
so the ``n`` choices of one request or a retry on the same pod emit an event once. It knows
nothing about HTTP, the engine or Kafka:
:class:`serving.http.serving_openai.OpenAIServing` feeds it and writes what it returns to the
pod's event log.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import re
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from schemas.events import SIGNAL_NAMESPACE, FeedbackEvent, signal_event_id

__all__ = ["SIGNAL_NAMESPACE", "ChatTurn", "FollowupJudge", "SignalDetector", "rule_judge", "repeats",
           "reply_key", "message_text"]

log = logging.getLogger("flywheel.serving.signals")

SOURCE = {"source": "serving"}  # every derived event's metadata
MAX_PER_PROMPT = 32  # completions remembered per (user, messages): the last two requests at n = 16
KEY_CHARS = 32  # hex characters of a messages or reply digest (128 bits)


class FollowupJudge(Protocol):
    """Decides a follow-up: ``judge(reply, next_message, question)``.

    Args:
        reply: the earlier assistant reply's text, as the client sent it back.
        next_message: the text of the user message right after it.
        question: the text of the user message the reply answered (the last one before it),
            or None when there is none.

    Returns:
        +1 (satisfied), -1 (dissatisfied), or None (no judgement: no event).
    """

    def __call__(self, reply: str, next_message: str, question: str | None) -> int | None: ...


def _norm(text: str) -> str:
    """Lower case, ``’`` as ``'``, white space collapsed."""
    return " ".join(text.replace("\u2019", "'").lower().split())


def _words(text: str) -> list[str]:
    return re.findall(r"[^\W_]+", text)


_NT = r"(?:(?:does|did|do|is|was|wo|ca)n'?t|(?:does|did|do|is|was|will|can) ?not|still not|not)"
#: Rule 2 of :func:`rule_judge`: the next message says the reply failed.
DISSATISFIED = tuple(re.compile(p) for p in (
    r"\b(?:wrong|incorrect|inaccurate|useless|nonsense)\b",
    r"\bnot (?:quite |really |very )?(?:right|correct|true|accurate|helpful|useful|good|great|perfect)\b",
    _NT + r" (?:work|working|compile|compiling|run|running|help|helping)\b",
    r"\b(?:(?:does|did)n'?t|(?:does|did) not) make (?:any )?sense\b",
    r"\bmakes no sense\b",
    r"\b(?:errors?|exceptions?|traceback|fails|failed|failing|broken|bugs?|buggy|crash(?:es|ed)?)\b",
    r"\bnot what i (?:asked|wanted|meant|need|needed|was looking for)\b",
    r"\btry again\b",
    r"\bmisunderstood\b",
))
#: Rule 3 of :func:`rule_judge`: the next message says the reply helped.
SATISFIED = tuple(re.compile(p) for p in (
    r"\b(?:thanks|thank you|thx|cheers)\b",
    r"\b(?:works|worked|working)\b",
    r"\b(?:great|perfect|awesome|excellent|brilliant|exactly|helpful|nice)\b",
    r"\bthat helps\b",
))
_NO_PROBLEM = re.compile(r"\b(?:no|without|zero) (?:errors?|bugs?|exceptions?|failures?)\b")
REPEAT_JACCARD = 0.8  # word-set overlap at which a next message repeats the question
REPEAT_MIN_WORDS = 3  # below it only an exact repeat counts


def repeats(question: str | None, next_message: str) -> bool:
    """Whether ``next_message`` repeats ``question`` (rule 1 of :func:`rule_judge`)."""
    if not question:
        return False
    a, b = _words(_norm(question)), _words(_norm(next_message))
    if not a or not b:
        return False
    if a == b:
        return True
    sa, sb = set(a), set(b)
    if len(a) < REPEAT_MIN_WORDS or len(b) < REPEAT_MIN_WORDS:
        return False
    return len(sa & sb) / len(sa | sb) >= REPEAT_JACCARD


def rule_judge(reply: str, next_message: str, question: str | None) -> int | None:
    """The default :class:`FollowupJudge`: the rules in the module docstring, in order.

    ``reply`` is not read by these rules (a judge of its own may compare it with the next
    message). Returns +1, -1 or None.
    """
    if repeats(question, next_message):
        return -1
    text = _norm(next_message)
    cleared = _NO_PROBLEM.sub(" ", text)
    if any(p.search(cleared) for p in DISSATISFIED):
        return -1
    if any(p.search(text) for p in SATISFIED):
        return 1
    return None


def _get(m: Any, name: str) -> Any:
    if isinstance(m, dict):
        return m.get(name)
    v = getattr(m, name, None)
    if v is None:
        v = (getattr(m, "model_extra", None) or {}).get(name)
    return v


def message_text(content: Any) -> str:
    """A message's ``content`` as text: a string as is, a list of parts as its ``text``
    parts joined (others skipped), None as ``""``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str))


def reply_key(text: str) -> str | None:
    """Digest of a reply's text up to white space (leading, trailing, runs); None when it is
    empty (a reply with tool calls only cannot be matched)."""
    t = " ".join(text.split())
    return hashlib.sha256(t.encode()).hexdigest()[:KEY_CHARS] if t else None


@dataclass(frozen=True)
class ChatTurn:
    """What a chat request's messages say for the signals (:meth:`SignalDetector.turn`).

    Attributes:
        prompt_key: digest of the messages (32 hex characters: 128 bits of sha256 of their
            canonical JSON ``[[role, text, {name, tool_call_id, tool_calls}], ...]``).
        reply_key: :func:`reply_key` of the last assistant message when a user message
            follows it, else None (no follow-up to judge).
        reply: that assistant message's text ("" when none).
        next_message: the text of the first user message after it ("" when none).
        question: the text of the last user message before it, or None.
    """

    prompt_key: str
    reply_key: str | None = None
    reply: str = ""
    next_message: str = ""
    question: str | None = None

    @property
    def turn_id(self) -> uuid.UUID:
        """``prompt_key`` as a UUID: the later request's part of a derived event's id."""
        return uuid.UUID(hex=self.prompt_key)


@dataclass(frozen=True)
class _Served:
    completion_id: uuid.UUID
    request_id: str
    created_ms: int


class SignalDetector:
    """Remembers what this pod served to whom and derives ``regenerate`` and ``followup``
    events from later chat requests (module docstring: rules, event ids, bounds).

    Thread-safe (one lock); pure otherwise: time is the ``created_at`` it is given.

    Args:
        regenerate: derive ``regenerate`` events.
        followup: derive ``followup`` events.
        window_s: how long a served completion can be the target of a signal (s, > 0,
            finite), from its request's ``created_at`` to the later request's.
        max_remembered: completions remembered at most (>= 1); also the bound on remembered
            event ids.
        judge: decides follow-ups (default :func:`rule_judge`).

    Raises:
        ValueError: ``window_s`` not a finite number > 0, or ``max_remembered`` < 1 (naming it).
    """

    def __init__(self, *, regenerate: bool, followup: bool, window_s: float, max_remembered: int,
                 judge: FollowupJudge | None = None):
        if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not math.isfinite(window_s) \
                or window_s <= 0:
            raise ValueError(f"window_s: must be a finite number of seconds > 0, got {window_s!r}")
        if isinstance(max_remembered, bool) or not isinstance(max_remembered, int) or max_remembered < 1:
            raise ValueError(f"max_remembered: must be an integer >= 1, got {max_remembered!r}")
        self.regenerate = bool(regenerate)
        self.followup = bool(followup)
        self.window_ms = int(window_s * 1000)
        self.max_remembered = max_remembered
        self.judge: FollowupJudge = judge or rule_judge
        self._lock = threading.Lock()
        # (user_hash, prompt_key) -> completions served for those messages, oldest first
        self._by_prompt: collections.OrderedDict[tuple[str, str], list[_Served]] = collections.OrderedDict()
        self._n_prompt = 0  # completions in _by_prompt
        # (user_hash, reply_key) -> the latest completion whose reply has that text
        self._by_reply: collections.OrderedDict[tuple[str, str], _Served] = collections.OrderedDict()
        self._emitted: collections.OrderedDict[uuid.UUID, None] = collections.OrderedDict()
        self.judge_errors = 0  # follow-ups not judged: the judge raised or answered something else

    @classmethod
    def from_config(cls, cfg, judge: FollowupJudge | None = None) -> "SignalDetector":
        """The detector :class:`serving.config.ServeConfig` ``cfg`` asks for
        (``derive_regenerate``, ``derive_followup``, ``signal_window_s``, ``signal_memory``)."""
        return cls(regenerate=cfg.derive_regenerate, followup=cfg.derive_followup, window_s=cfg.signal_window_s,
                   max_remembered=cfg.signal_memory, judge=judge)

    @property
    def enabled(self) -> bool:
        """Whether any signal is derived (else the pod need not call :meth:`observe`)."""
        return self.regenerate or self.followup

    # ------------------------------------------------------------------ messages
    @staticmethod
    def turn(messages: Iterable[Any]) -> ChatTurn:
        """The :class:`ChatTurn` of a request's ``messages`` (OpenAI chat messages: dicts or
        :class:`serving.protocol.ChatMessage`; ``content`` a string, a list of text parts or
        None).

        Raises:
            ValueError: a message without a ``role``, naming its index.
        """
        msgs = list(messages)
        canon, roles, texts = [], [], []
        for i, m in enumerate(msgs):
            role = _get(m, "role")
            if not isinstance(role, str):
                raise ValueError(f"messages.{i}.role: a chat message needs a role, got {role!r}")
            role = "system" if role == "developer" else role
            text = message_text(_get(m, "content"))
            extra = {k: _get(m, k) for k in ("name", "tool_call_id", "tool_calls") if _get(m, k) is not None}
            canon.append([role, text, extra])
            roles.append(role)
            texts.append(text)
        blob = json.dumps(canon, ensure_ascii=False, sort_keys=True, separators=(",", ":"), default=str)
        key = hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()[:KEY_CHARS]
        last_a = max((i for i, r in enumerate(roles) if r == "assistant"), default=None)
        if last_a is None or last_a + 1 >= len(roles) or roles[last_a + 1] != "user":
            return ChatTurn(prompt_key=key)
        rk = reply_key(texts[last_a])
        if rk is None:
            return ChatTurn(prompt_key=key)
        question = next((texts[i] for i in range(last_a - 1, -1, -1) if roles[i] == "user"), None)
        return ChatTurn(prompt_key=key, reply_key=rk, reply=texts[last_a], next_message=texts[last_a + 1],
                        question=question)

    # ------------------------------------------------------------------ observing
    def observe(self, user_hash: str, messages: Iterable[Any], completion_id: uuid.UUID, reply_text: str,
                created_at: int, request_id: str | None = None) -> list[FeedbackEvent]:
        """:meth:`observe_turn` on ``turn(messages)``."""
        return self.observe_turn(user_hash, self.turn(messages), completion_id, reply_text, created_at, request_id)

    def observe_turn(self, user_hash: str, turn: ChatTurn, completion_id: uuid.UUID, reply_text: str,
                     created_at: int, request_id: str | None = None) -> list[FeedbackEvent]:
        """Remember one served completion and return the events its request implies.

        Args:
            user_hash: the requesting user's salted hash (call only for requests that carry a
                user: an anonymous request says nothing about a person).
            turn: :meth:`turn` of the request's messages.
            completion_id: this completion's id.
            reply_text: the text the client receives for it.
            created_at: the request's arrival (ms since the epoch).
            request_id: the request's id (its ``n`` choices share it; a retry with the same
                ``x-request-id`` too); None: the completion is its own request.

        Returns:
            New ``regenerate`` / ``followup`` events (none already returned for the same
            ``event_id`` while it is remembered), each to be published like posted feedback.

        A judge that raises or returns something other than +1, -1 or None costs only its
        follow-up (logged, counted in :attr:`judge_errors`): the regenerate events of the same
        request are still returned.

        Raises:
            pydantic.ValidationError: an event the contract refuses (``created_at`` out of range).
        """
        if not self.enabled:
            return []
        rid = str(completion_id) if request_id is None else request_id
        me = _Served(completion_id, rid, int(created_at))
        horizon = me.created_ms - self.window_ms
        out: list[tuple[str, uuid.UUID, float]] = []
        target = None
        with self._lock:
            self._expire(horizon)
            if self.regenerate:
                out += [("regenerate", s.completion_id, 1.0) for s in self._regenerated(user_hash, turn, me, horizon)]
            if self.followup and turn.reply_key is not None:
                s = self._by_reply.get((user_hash, turn.reply_key))
                if s is not None and horizon <= s.created_ms <= me.created_ms and s.request_id != rid:
                    target = s
            self._remember(user_hash, turn, me, reply_text)
        if target is not None:
            verdict = self._judge(turn)
            if verdict is not None:
                out.append(("followup", target.completion_id, float(verdict)))
        events = [FeedbackEvent(event_id=signal_event_id(kind, cid, turn.turn_id), completion_id=cid,
                                user_hash=user_hash, kind=kind, value=value, created_at=me.created_ms,
                                metadata=dict(SOURCE)) for kind, cid, value in out]
        with self._lock:  # ids marked emitted only once every event was built
            events = [ev for ev in events if ev.event_id not in self._emitted]
            for ev in events:
                self._emitted[ev.event_id] = None
            while len(self._emitted) > self.max_remembered:
                self._emitted.popitem(last=False)
        return events

    def _judge(self, turn: ChatTurn) -> int | None:
        """The judge's verdict on ``turn``'s follow-up: +1, -1, or None when it has none, raised,
        or answered something else (logged and counted in :attr:`judge_errors`: the request's
        other events are still returned, and the follow-up is not judged again)."""
        try:
            verdict = self.judge(turn.reply, turn.next_message, turn.question)
            if verdict is not None and (isinstance(verdict, bool) or verdict not in (1, -1)):
                raise ValueError(f"judge: must return +1, -1 or None, got {verdict!r}")
        except Exception as exc:  # noqa: BLE001 - a judge's failure costs its follow-up, not the other signals
            with self._lock:
                self.judge_errors += 1
            log.warning("signals: the follow-up judge failed (%s: %s): no followup event for this turn",
                        type(exc).__name__, str(exc)[:200])
            return None
        return verdict

    def remembered(self) -> int:
        """Completions remembered now (<= ``max_remembered``)."""
        with self._lock:
            return self._n_prompt

    # ------------------------------------------------------------------ memory (lock held)
    def _regenerated(self, user_hash: str, turn: ChatTurn, me: _Served, horizon: int) -> list[_Served]:
        """The completions of the latest earlier request with the same messages, in the window."""
        served = self._by_prompt.get((user_hash, turn.prompt_key)) or []
        earlier = [s for s in served if s.request_id != me.request_id and horizon <= s.created_ms <= me.created_ms]
        if not earlier:
            return []
        last = max(earlier, key=lambda s: s.created_ms).request_id
        return [s for s in earlier if s.request_id == last]

    def _remember(self, user_hash: str, turn: ChatTurn, me: _Served, reply_text: str) -> None:
        key = (user_hash, turn.prompt_key)
        served = self._by_prompt.pop(key, [])
        self._n_prompt -= len(served)
        served = (served + [me])[-MAX_PER_PROMPT:]
        self._by_prompt[key] = served
        self._n_prompt += len(served)
        while self._n_prompt > self.max_remembered:
            k, old = next(iter(self._by_prompt.items()))
            if len(old) > 1 and k == key:  # this entry alone exceeds the bound
                self._n_prompt -= 1
                old.pop(0)
                continue
            self._by_prompt.popitem(last=False)
            self._n_prompt -= len(old)
        rk = reply_key(reply_text)
        if rk is not None:
            self._by_reply.pop((user_hash, rk), None)
            self._by_reply[(user_hash, rk)] = me
            while len(self._by_reply) > self.max_remembered:
                self._by_reply.popitem(last=False)

    def _expire(self, horizon: int) -> None:
        """Drop the oldest entries whose latest completion is older than ``horizon`` (ms).
        Entries are kept in the order they were last touched, which is the order of their
        requests' arrival up to the requests' durations, so this stops at the first live one;
        lookups check the window themselves."""
        while self._by_prompt:
            served = next(iter(self._by_prompt.values()))
            if served[-1].created_ms >= horizon:
                break
            self._by_prompt.popitem(last=False)
            self._n_prompt -= len(served)
        while self._by_reply:
            s = next(iter(self._by_reply.values()))
            if s.created_ms >= horizon:
                break
            self._by_reply.popitem(last=False)

