"""Offset commits fenced by the group generation a batch was fetched under.

A worker commits a batch's offsets only as the group member that was assigned the batch's
partitions when the batch was fetched. Kafka fences such a commit by its generation and
member id (KIP-62's rebalance protocol; Java's ``KafkaConsumer.commitSync`` refuses to
commit while the member is not stable): a broker that no longer knows the member answers
``UNKNOWN_MEMBER_ID``, a later generation ``ILLEGAL_GENERATION``.

aiokafka 0.14's ``AIOKafkaConsumer.commit`` sends the generation the consumer holds at send
time instead. After a heartbeat finds that the broker forgot the member (the memory-only
embedded broker restarted), that is generation -1 and no member id until the rejoin
completes, while the fetcher keeps fetching the old assignment from its old positions. A
broker whose group is still empty takes a generation -1 commit as a standalone commit. On a
restarted broker those old positions can lie inside records it never delivered (the pods'
re-sent events), so such a commit moved the group past them, and the assignment that
followed started there: accepted votes were never consumed (``test_chaos``, ~1 run in 4;
``tests/test_ingest_scale.py::test_records_fetched_while_the_group_rejoins_are_never_committed_past``).

Here the request carries the membership captured when the batch was fetched
(:func:`membership`), and nothing is committed while the worker is not a member. A batch
that is not committed is consumed again under the next assignment and deduped by the join
state (``ingest.worker`` crash-safety rule 1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Membership:
    """A consumer's place in its group: the generation and the member id the coordinator gave."""

    generation: int
    member_id: str


def membership(consumer) -> Membership | None:
    """The group membership ``consumer`` (an ``AIOKafkaConsumer`` with a ``group_id``) holds
    now; None while it is not a member of any generation (before its first join, and from a
    failed heartbeat's reset until the rejoin completes)."""
    coord = getattr(consumer, "_coordinator", None)
    generation = getattr(coord, "generation", -1)
    member_id = getattr(coord, "member_id", "")
    if generation is None or generation < 0 or not member_id:
        return None
    return Membership(generation, member_id)


class CommitRefused(Exception):
    """The coordinator did not take the commit.

    Attributes:
        retriable: True when the same commit may succeed if sent again as the same member
            (coordinator moving or loading); False when the membership is gone (unknown
            member, older generation, rebalance in progress) or the request was refused
            for good.
    """

    def __init__(self, message: str, retriable: bool):
        super().__init__(message)
        self.retriable = retriable


async def commit(consumer, offsets: dict, member: Membership | None) -> None:
    """Commit ``offsets`` (``{TopicPartition: next offset to read}``) for ``consumer``'s group
    as ``member``.

    Raises:
        CommitRefused: ``member`` is None (not a member: nothing is sent), the coordinator
            is unknown or unreachable, or it answered an error for any partition.
    """
    from aiokafka import errors as Errors
    from aiokafka.client import ConnectionGroup
    from aiokafka.protocol.commit import OffsetCommitRequest

    if member is None:
        raise CommitRefused("not a member of the group (rejoining)", retriable=False)
    if not offsets:
        return
    coord = consumer._coordinator
    node_id = coord.coordinator_id
    if node_id is None:
        raise CommitRefused("group coordinator unknown", retriable=True)
    by_topic: dict[str, list] = {}
    for tp, off in sorted(offsets.items()):
        by_topic.setdefault(tp.topic, []).append((tp.partition, int(off), ""))
    request = OffsetCommitRequest(coord.group_id, member.generation, member.member_id,
                                  OffsetCommitRequest.DEFAULT_RETENTION_TIME, list(by_topic.items()))
    try:
        response = await consumer._client.send(node_id, request, group=ConnectionGroup.COORDINATION)
    except Errors.KafkaError as exc:
        raise CommitRefused(f"{type(exc).__name__}: {exc}", retriable=True) from exc
    failed = [(topic, partition, Errors.for_code(code)) for topic, parts in response.topics
              for partition, code in parts if code != 0]
    if failed:
        names = sorted({err.__name__ for _, _, err in failed})
        fenced = (Errors.UnknownMemberIdError, Errors.IllegalGenerationError, Errors.RebalanceInProgressError)
        retriable = all(err.retriable and not issubclass(err, fenced) for _, _, err in failed)
        raise CommitRefused(f"{len(failed)} partitions refused: {', '.join(names)}", retriable=retriable)
