"""A cycle's samples as a source read in micro-batches, so a cycle of any size runs in
bounded memory.

:class:`SampleSource` is what :func:`learner.trainer.train` reads: ``len``, ``take(idx)`` ->
RewardedSamples, and per-sample metadata (:class:`SampleMeta`, ~100 bytes a sample: ids,
labels, rewards, versions, splits, lengths, a prompt key). Two sources:

* :class:`InMemorySamples`: a list already in memory (tests, the gate, small tools).
* :class:`SpilledSamples`: the cycle's rows streamed from its Parquet shards into a local
  Arrow IPC file with one record batch per sample; ``take`` reads only the batches asked for
  (no memory map), so resident memory holds one micro-batch of samples, not the cycle.

:class:`RefLogprobs` keeps the reference policy's per-token logprobs of every completion in
a local float32 file (offsets in memory), read back per micro-batch.

This module knows nothing about models or losses.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.arrow import SAMPLE_SCHEMA, conform, table_to_samples
from schemas.events import RewardedSample

READ_ROWS = 64  # rows per Parquet read while spilling


def prompt_key(prompt_token_ids) -> int:
    """A stable 64-bit key of a prompt's token ids (groups completions of one prompt)."""
    a = np.asarray(prompt_token_ids, dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(a, digest_size=8).digest(), "little")


@dataclass
class SampleMeta:
    """Per-sample metadata of a source, index-aligned (all lists have ``len(source)``)."""

    completion_ids: list[str] = field(default_factory=list)
    labels: list[bool] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    splits: list[str] = field(default_factory=list)
    prompt_keys: list[int] = field(default_factory=list)
    completion_lens: list[int] = field(default_factory=list)
    input_lens: list[int] = field(default_factory=list)  # P + C - 1 forward rows

    def add(self, s: RewardedSample) -> None:
        self.completion_ids.append(str(s.completion_id))
        self.labels.append(bool(s.label))
        self.rewards.append(float(s.reward))
        self.versions.append(s.model_version)
        self.splits.append(s.split)
        self.prompt_keys.append(prompt_key(s.prompt_token_ids))
        self.completion_lens.append(len(s.completion_token_ids))
        self.input_lens.append(len(s.prompt_token_ids) + len(s.completion_token_ids) - 1)


class SampleSource(Protocol):
    """What the trainer reads: ``len(src)``, ``src.take([i, ...]) -> [RewardedSample]`` in
    the order asked, and ``src.meta`` (:class:`SampleMeta`)."""

    meta: SampleMeta

    def __len__(self) -> int: ...

    def take(self, idx: list[int]) -> list[RewardedSample]: ...


class InMemorySamples:
    """A :class:`SampleSource` over a list held in memory."""

    def __init__(self, samples: Iterable[RewardedSample]):
        self.samples = list(samples)
        self.meta = SampleMeta()
        for s in self.samples:
            self.meta.add(s)

    def __len__(self) -> int:
        return len(self.samples)

    def take(self, idx: list[int]) -> list[RewardedSample]:
        return [self.samples[i] for i in idx]


class SpilledSamples:
    """A :class:`SampleSource` backed by a local Arrow IPC file, one record batch per sample.

    Build with :meth:`from_shards`. ``take`` opens the file, reads the asked batches only
    and closes it; memory between calls is the metadata.
    """

    def __init__(self, path: Path, meta: SampleMeta):
        self.path = Path(path)
        self.meta = meta

    def __len__(self) -> int:
        return len(self.meta.completion_ids)

    @classmethod
    def from_shards(cls, shard_paths: list[Path], path: Path, keep: Callable[[RewardedSample], bool] | None = None,
                    aside: list | None = None) -> "SpilledSamples":
        """Stream ``shard_paths`` (:data:`schemas.arrow.SAMPLE_SCHEMA` Parquet) into ``path``,
        one completion_id once (the latest ``sealed_at`` of duplicates is not chosen: the
        first seen wins, and ingest seals a completion once). Samples for which ``keep``
        returns False go to the list ``aside`` instead (e.g. a gate's holdout).

        Raises:
            samplestore.shards.BadShardError: (a ``ValueError``) a row is not a valid
                RewardedSample (e.g. a NaN reward, or one beyond ``schemas.reward.REWARD_LIMIT``);
                the message names the shard file, the row, its completion_id, the field and the
                reason. Nothing is left at ``path`` (or its temp file) then.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        meta, seen = SampleMeta(), set()
        cols = [f.name for f in SAMPLE_SCHEMA]
        try:
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, SAMPLE_SCHEMA) as w:
                for sp in shard_paths:
                    pf = pq.ParquetFile(sp)
                    have = set(pf.schema_arrow.names)  # a format-2 shard lacks the format-3 columns
                    first = 0  # the batch's first row in the shard
                    for rb in pf.iter_batches(batch_size=READ_ROWS, columns=[c for c in cols if c in have]):
                        t = conform(pa.Table.from_batches([rb])).select(cols).cast(SAMPLE_SCHEMA)
                        for i, s in enumerate(_samples_of(t, sp, first)):
                            cid = str(s.completion_id)
                            if cid in seen:
                                continue
                            seen.add(cid)
                            if keep is not None and not keep(s):
                                if aside is not None:
                                    aside.append(s)
                                continue
                            w.write_batch(t.slice(i, 1).combine_chunks().to_batches()[0])
                            meta.add(s)
                        first += t.num_rows
        except BaseException:
            tmp.unlink(missing_ok=True)  # no partial spill file stays behind
            raise
        tmp.replace(path)
        return cls(path, meta)

    def take(self, idx: list[int]) -> list[RewardedSample]:
        if not idx:
            return []
        with pa.OSFile(str(self.path), "rb") as f:
            r = pa.ipc.open_file(f)
            t = pa.Table.from_batches([r.get_batch(int(i)) for i in idx], schema=r.schema)
        return table_to_samples(t)


def _samples_of(t: pa.Table, shard: Path, first: int) -> list[RewardedSample]:
    """The samples of ``t``, rows ``first``.. of ``shard``: the whole batch at once, and row by
    row only when that fails, to name the first bad row.

    Raises:
        samplestore.shards.BadShardError: a row is not a valid RewardedSample."""
    from pydantic import ValidationError

    from samplestore.shards import BadShardError

    try:
        return table_to_samples(t)
    except (ValidationError, ValueError):
        pass
    out = []
    for j in range(t.num_rows):
        try:
            out.append(table_to_samples(t.slice(j, 1))[0])
        except (ValidationError, ValueError) as exc:
            cid = t.column("completion_id")[j].as_py()
            raise BadShardError.of(shard, first + j, None if cid is None else str(cid), exc) from None
    return out


class RefLogprobs:
    """Per-completion-token reference logprobs of every sample, in a float32 file.

    ``put(i, values)`` appends sample ``i``'s C values; ``get(i)`` reads them back. Offsets
    live in memory (16 bytes a sample); the values stay on disk.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w+b")
        self._at: dict[int, tuple[int, int]] = {}
        self._end = 0

    def put(self, i: int, values: np.ndarray) -> None:
        v = np.ascontiguousarray(values, dtype="<f4")
        self._f.seek(self._end)
        self._f.write(v.tobytes())
        self._at[i] = (self._end, v.size)
        self._end += v.nbytes

    def get(self, i: int) -> np.ndarray:
        off, n = self._at[i]
        self._f.seek(off)
        return np.frombuffer(self._f.read(4 * n), dtype="<f4")

    def close(self) -> None:
        self._f.close()
        self.path.unlink(missing_ok=True)
