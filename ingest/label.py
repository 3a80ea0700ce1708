"""The open join state of one completion (:class:`LabelState`) and its JSON form.

A :class:`LabelState` is what :class:`ingest.join.Joiner` keeps per ``completion_id`` while the
label is open, and what an :class:`ingest.store.JoinStore` stores (:meth:`LabelState.to_json`,
:meth:`LabelState.from_json`). When it is due is the join's decision
(:meth:`ingest.join.Joiner.due_at`, from its ``JoinConfig``), not this module's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pydantic_core

from schemas.events import FeedbackEvent


@dataclass(slots=True)
class Vote:
    """One user's current signal of one kind: ``value`` (±1 for a thumb, the event's value
    for other kinds; None for an edit carrying ``text``, its final text), ``created_at`` ms
    (client time), ``seq`` arrival order."""

    event_id: str
    value: float | None
    created_at: int
    seq: int
    text: str | None = None


def signal_key(ev: FeedbackEvent) -> str:
    """The key under which a user's last signal of ``ev``'s kind is kept in
    :attr:`LabelState.signals`: the kind, ``score:<name>`` for a score (thumbs are in
    :attr:`LabelState.votes`)."""
    return f"score:{ev.name}" if ev.kind == "score" else ev.kind


@dataclass(slots=True)
class LabelState:
    """Open join state of one completion.

    ``completion``: the CompletionEvent JSON (bytes as consumed, or str), ``""`` when it is
    stored but was not read (:meth:`ingest.state.StateStore.get_many`), or None while only
    feedback has arrived. ``claim``: the store's claim on it (``"shard:<path>"`` while being
    sealed, ``"dead:"`` while its orphan votes are dead-lettered), not serialised.
    ``votes``: user_hash -> that user's last thumb (:class:`Vote`). ``signals``: every other
    kind's last signals, :func:`signal_key` -> user_hash -> :class:`Vote`. ``event_ids``: every folded
    feedback event (in arrival order). Times are ms: ``first_seen_at`` (processing time of
    the first event of either kind), ``last_vote_at`` (processing time of the last folded
    vote), ``created_at`` (the completion's).
    """

    completion_id: str
    completion: bytes | str | None = None
    created_at: int | None = None
    votes: dict[str, Vote] = field(default_factory=dict)
    event_ids: list[str] = field(default_factory=list)
    signals: dict[str, dict[str, Vote]] = field(default_factory=dict)
    first_seen_at: int = 0
    first_vote_at: int | None = None
    last_vote_at: int | None = None
    seq: int = 0
    pending_raw: dict[str, str] = field(default_factory=dict)  # event_id -> raw, while orphan
    claim: str | None = None

    def to_json(self) -> str:
        """This state as JSON (str), without ``completion`` and ``claim`` (stored apart); read
        back by :meth:`from_json`. ``signals`` is present only when non-empty."""
        if not (self.votes or self.event_ids or self.pending_raw or self.signals) and self.first_vote_at is None \
                and self.last_vote_at is None and type(self.created_at) is int:
            # a new completion's state (one per completion): the same JSON, ~10x cheaper
            return (f'{{"completion_id":{pydantic_core.to_json(self.completion_id).decode()},'
                    f'"created_at":{self.created_at},"event_ids":[],"votes":{{}},'
                    f'"first_seen_at":{int(self.first_seen_at)},"first_vote_at":null,"last_vote_at":null,'
                    f'"seq":{int(self.seq)},"pending_raw":{{}}}}')
        # pydantic-core's JSON codec: ~3.5x faster than the json module on these small dicts,
        # and a state is read and written once per folded vote
        d = {  # the completion is stored apart (ingest.state)
            "completion_id": self.completion_id,
            "created_at": self.created_at, "event_ids": self.event_ids,
            "votes": {u: [v.event_id, v.value, v.created_at, v.seq] for u, v in self.votes.items()},
            "first_seen_at": self.first_seen_at, "first_vote_at": self.first_vote_at,
            "last_vote_at": self.last_vote_at, "seq": self.seq, "pending_raw": self.pending_raw}
        if self.signals:  # (absent when empty: a thumbs-only state's JSON is what it always was)
            d["signals"] = {k: {u: [v.event_id, v.value, v.created_at, v.seq] + ([v.text] if v.text is not None else [])
                                for u, v in us.items()} for k, us in self.signals.items()}
        return pydantic_core.to_json(d).decode()

    @classmethod
    def from_json(cls, raw: str, completion: bytes | str | None = None, claim: str | None = None) -> "LabelState":
        """The state that :meth:`to_json` wrote as ``raw``, with ``completion`` and ``claim`` as
        given (the store keeps them apart)."""
        d = pydantic_core.from_json(raw)
        d["completion"] = completion
        d["claim"] = claim
        d["votes"] = {u: Vote(*v) for u, v in d["votes"].items()}
        if "signals" in d:
            d["signals"] = {k: {u: Vote(*v) for u, v in us.items()} for k, us in d["signals"].items()}
        return cls(**d)
