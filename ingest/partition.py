"""Which partition a completion's label lives in: Kafka's murmur2 of its ``completion_id``.

The join state is scoped to partitions (``ingest.state_pg``): the label of a completion is
owned by the worker holding its *home partition*, ``home_partition(completion_id, n)``,
the partition that kafka-python's and aiokafka's default partitioner (and the Java
client's) gives the key ``str(completion_id).encode()`` among ``n`` partitions. Serving and
the feedback SDK produce with that key, so their records are already there. A producer with
another partitioner (librdkafka's default is ``consistent_random``, CRC32) puts a vote
elsewhere; the worker then forwards it to its home partition of the internal topic
:func:`rekeyed_topic` before the join (``ingest.worker``), so no vote depends on the producer's
partitioner to meet its completion (``docs/kafka.md``; ``docs/decisions.md`` D16).

Cost: kafka-python's pure-Python ``murmur2`` takes ~15 us per key on this machine, a third
of the join's per-record budget; :func:`home_partitions` hashes a whole consumer batch of
36-byte UUID keys at once with numpy (~0.3 us per key) and gives the same numbers
(``tests/test_ingest_multihost.py`` checks it against kafka-python's on random keys).
"""

from __future__ import annotations

import numpy as np

REKEYED_BASE = "flywheel.ingest.rekeyed"  # internal topic: records forwarded to their home partition
SOURCE_HEADER = "flywheel-source-topic"  # header of a forwarded record: the topic it came from

_M = np.uint32(0x5BD1E995)
_SEED = 0x9747B28C


def rekeyed_topic() -> str:
    """The internal topic's name under the settings' topic prefix (``FLYWHEEL_KAFKA_TOPIC_PREFIX``)."""
    from schemas.settings import kafka_settings

    return kafka_settings().topic_prefix + REKEYED_BASE


def _murmur2_kafka(key: bytes) -> int:
    from kafka.partitioner.default import murmur2

    return murmur2(key)


def home_partitions(keys: list[str], n: int) -> list[int]:
    """Kafka's default-partitioner partition of each key (str, encoded as UTF-8) among ``n``.

    ``(murmur2(key) & 0x7fffffff) % n``, as kafka-python's ``DefaultPartitioner``. Keys of
    36 bytes (a UUID's text) are hashed vectorised; others one by one with kafka-python's.

    Raises:
        ValueError: ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"n: partition count must be >= 1, got {n}")
    enc = [k.encode() for k in keys]
    out = np.empty(len(enc), dtype=np.int64)
    idx = [i for i, b in enumerate(enc) if len(b) == 36]
    if idx:
        words = np.frombuffer(b"".join(enc[i] for i in idx), dtype="<u4").reshape(len(idx), 9)
        with np.errstate(over="ignore"):
            h = np.full(len(idx), _SEED ^ 36, dtype=np.uint32)
            for j in range(9):
                k = words[:, j] * _M
                k ^= k >> np.uint32(24)
                k *= _M
                h *= _M
                h ^= k
            h ^= h >> np.uint32(13)
            h *= _M
            h ^= h >> np.uint32(15)
        out[idx] = (h & np.uint32(0x7FFFFFFF)).astype(np.int64) % n
    for i, b in enumerate(enc):
        if len(b) != 36:
            out[i] = (_murmur2_kafka(b) & 0x7FFFFFFF) % n
    return out.tolist()


def home_partition(key: str, n: int) -> int:
    """:func:`home_partitions` of one key."""
    return home_partitions([key], n)[0]
