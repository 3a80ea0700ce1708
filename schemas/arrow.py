"""Arrow schema of the RewardedSample Parquet shards written by ``ingest`` and read by
``learner`` (through ``samplestore.catalog``) and by analysts with plain DuckDB or pyarrow.

Layout on disk (``samplestore.shards``)::

    <samples_dir>/date=<YYYY-MM-DD>/hour=<HH>/part-<sealed_ms, 13 digits>-<uuid>.parquet

``date``/``hour`` are the UTC day and hour of the shard's first ``sealed_at`` and
``sealed_ms`` is that ``sealed_at`` in ms: every row of the shard has ``sealed_at >=
sealed_ms`` (a file-level watermark that the learner reads from the name alone). Every
field of a sample is a column of the file, so one file read alone loses nothing.

Columns (:data:`SAMPLE_SCHEMA`, format :data:`FORMAT_VERSION`, in the file's key-value
metadata under ``flywheel.samples.format``):

==========================  =============================  ==================================
column                      Arrow type                     meaning
==========================  =============================  ==================================
completion_id               string                         UUID of the completion
model_version               string (dictionary)            version that produced it (behavior)
split                       string (dictionary)            ``train`` or ``eval`` (never trained)
created_at                  timestamp[ms, tz=UTC]          completion served
sealed_at                   timestamp[ms, tz=UTC]          label sealed
user_hash                   string                         salted user hash
prompt_token_ids            list<int32>                    P tokens
completion_token_ids        list<int32>                    C tokens
behavior_logprobs           list<float32>                  C raw logprobs (temperature 1)
sampling                    struct<temperature: double,    the request's sampling params
                            top_p: double, top_k: int32,   (``schemas.events.SamplingParams``)
                            max_tokens: int32, seed:
                            int64, logprobs_kind: string>
expert_routes               binary (null for dense)        the routes: one zstd frame (codec
                                                           ``zstd``) or raw bytes (codec null)
expert_routes_shape         list<int32> (3 values)         (P + C - 1, num_hidden_layers, top_k)
expert_routes_dtype         string                         ``uint8`` or ``uint16``
finish_reason               string (dictionary)            stop | length | abort
reward                      float32                        the reward policy's reward
label                       bool                           reward > 0 (desirable, KTO)
n_votes                     int32                          each user's last signal of each
                                                           kind (a score: of each name)
votes_up, votes_down        int32                          each user's last thumb counted
event_ids                   list<string>                   every feedback event folded in
expert_routes_codec         string (dictionary)            ``zstd`` or null (format 3)
reward_policy               string (dictionary)            the policy's digest (format 4)
thumb                       double                         mean of users' last thumbs, [-1, 1]
copied, regenerated         int32                          users who copied / asked again
kept_share                  double                         mean kept share of edits, [0, 1]
followup                    double                         mean followup judgement, [-1, 1]
scores                      list<struct<name: string,      per declared score name: the mean
                            value: double>>                of users' last values, by name
==========================  =============================  ==================================

Components (format 4, ``schemas.reward``; ``docs/data.md`` re-scores them under another
policy): a null ``thumb`` / ``kept_share`` / ``followup`` means no user sent that kind; a
format-3 shard lacks these columns and reads as nulls, ``copied`` / ``regenerated`` 0 and
``scores`` empty (:func:`conform`, :func:`row_to_sample`), ``reward_policy`` null (sealed
before policies had a digest: the mean of thumbs).

Routes (format 3, D65): with ``expert_routes_codec = 'zstd'`` the cell is the zstd frame
serving wrote (``ExpertRoutes.data``, base64-decoded, byte for byte); it decompresses to the
C-order bytes of the array in ``expert_routes_dtype``. The worker decompresses every frame
once at sealing to check that it holds exactly ``shape`` values (a frame that does not is
quarantined, field ``expert_routes``) and does not compress it again: the column is written
without Parquet compression. With the codec null (every format-2 shard, which lacks the
column, and a format-1 shard upgraded by ``flywheel data migrate``) the cell is the raw
little-endian C-order bytes. In numpy::

    raw = row["expert_routes"]
    if row.get("expert_routes_codec") == "zstd":
        raw = zstandard.ZstdDecompressor().decompress(raw)
    np.frombuffer(raw, row["expert_routes_dtype"]).reshape(row["expert_routes_shape"])

:func:`table_to_samples` reads formats 2 and 3 (a table without the codec column is format 2).
Format 1 (the earlier layout: JSON strings for sampling and routes, integer-ms times,
``model_version`` only in the directory name) is converted by :func:`upgrade_v1_table`
(``flywheel data migrate``).
"""

from __future__ import annotations

import binascii
import datetime as dt
import itertools
import json
import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.events import ExpertRoutes, RewardedSample, SamplingParams

FORMAT_VERSION = 4
FORMAT_KEY = b"flywheel.samples.format"
TIMESTAMP = pa.timestamp("ms", tz="UTC")
SAMPLING_TYPE = pa.struct([
    ("temperature", pa.float64()), ("top_p", pa.float64()), ("top_k", pa.int32()),
    ("max_tokens", pa.int32()), ("seed", pa.int64()), ("logprobs_kind", pa.string())])
SCORES_TYPE = pa.list_(pa.struct([("name", pa.string()), ("value", pa.float64())]))

SAMPLE_SCHEMA = pa.schema([
    ("completion_id", pa.string()),
    ("model_version", pa.string()),
    ("split", pa.string()),
    ("created_at", TIMESTAMP),
    ("sealed_at", TIMESTAMP),
    ("user_hash", pa.string()),
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("completion_token_ids", pa.list_(pa.int32())),
    ("behavior_logprobs", pa.list_(pa.float32())),
    ("sampling", SAMPLING_TYPE),
    ("expert_routes", pa.binary()),
    ("expert_routes_shape", pa.list_(pa.int32())),
    ("expert_routes_dtype", pa.string()),
    ("finish_reason", pa.string()),
    ("reward", pa.float32()),
    ("label", pa.bool_()),
    ("n_votes", pa.int32()),
    ("votes_up", pa.int32()),
    ("votes_down", pa.int32()),
    ("event_ids", pa.list_(pa.string())),
    ("expert_routes_codec", pa.string()),  # format 3: "zstd" (the served frame) or null (raw bytes)
    ("reward_policy", pa.string()),  # format 4: the reward policy's digest and the components
    ("thumb", pa.float64()),
    ("copied", pa.int32()),
    ("regenerated", pa.int32()),
    ("kept_share", pa.float64()),
    ("followup", pa.float64()),
    ("scores", SCORES_TYPE),
], metadata={FORMAT_KEY: str(FORMAT_VERSION).encode()})

_SAMPLING_FIELDS = [f.name for f in SAMPLING_TYPE]
#: Columns added after format 2: absent from format-2 files, read as nulls (:func:`conform`).
ADDED_IN_3 = ("expert_routes_codec",)
#: Columns added in format 4 (the reward policy's digest and components): absent from earlier
#: files, read as nulls (:func:`conform`; :func:`row_to_sample` reads null counts as 0 and
#: null scores as none).
ADDED_IN_4 = ("reward_policy", "thumb", "copied", "regenerated", "kept_share", "followup", "scores")
#: Every column an earlier format-2 or later file may lack.
ADDED_AFTER_2 = ADDED_IN_3 + ADDED_IN_4
ROUTES_CODEC = "zstd"


_ZSTD = threading.local()  # one zstd decompression context per thread (a context is not thread-safe)


def _checked_frame(r: ExpertRoutes) -> tuple[bytes, bytes, list[int]]:
    """``(zstd frame as served, its decompressed C-order bytes, shape)`` of routes, the frame
    checked to decode to exactly ``shape`` values in ``r.dtype``.

    Raises:
        ValueError: ``expert_routes``: the payload does not decode to exactly ``shape`` in ``dtype``
            (the same check as :meth:`schemas.events.ExpertRoutes.to_array`)."""
    import pybase64  # SIMD base64: ~5 us instead of binascii's ~45 us for a 10 KB payload (D67)
    import zstandard

    shape = [int(x) for x in r.shape]
    size = np.dtype(r.dtype).itemsize
    want = shape[0] * shape[1] * shape[2] * size
    dctx = getattr(_ZSTD, "d", None)
    if dctx is None:
        dctx = _ZSTD.d = zstandard.ZstdDecompressor()
    try:
        frame = pybase64.b64decode(r.data)  # = binascii.a2b_base64 on every contract-valid payload
        raw = dctx.decompress(frame, max_output_size=want + 1)
    except (zstandard.ZstdError, binascii.Error) as exc:
        raise ValueError(f"expert_routes: payload does not decode: {exc}") from exc
    if len(raw) != want:
        raise ValueError(f"expert_routes: payload has {len(raw) // size} values, shape {tuple(shape)} "
                         f"needs {want // size}")
    return frame, raw, shape


def _routes_raw(r: ExpertRoutes | None) -> tuple[bytes | None, list[int] | None, str | None]:
    """``(little-endian C-order bytes, shape, dtype)`` of routes, or Nones for a dense model.

    Raises:
        ValueError: ``expert_routes``: as :func:`_checked_frame`."""
    if r is None:
        return None, None, None
    _, raw, shape = _checked_frame(r)
    dt_ = np.dtype(r.dtype)
    if dt_.itemsize > 1 and not np.little_endian:  # the column is little endian
        raw = np.frombuffer(raw, dt_).astype(dt_.newbyteorder("<")).tobytes()
    return raw, shape, r.dtype


def _routes_frame(r: ExpertRoutes | None) -> tuple[bytes | None, list[int] | None, str | None, str | None]:
    """``(zstd frame as served, shape, dtype, codec)`` of routes for a format-3 row, or Nones
    for a dense model. The frame is ``r.data`` base64-decoded, kept byte for byte; it is
    decompressed once, only to check it (the output is dropped), so a frame that does not
    decode to exactly ``shape`` in ``dtype`` is refused at sealing, as in format 2.

    Raises:
        ValueError: ``expert_routes``: as :func:`_checked_frame`."""
    if r is None:
        return None, None, None, None
    frame, _, shape = _checked_frame(r)
    return frame, shape, r.dtype, ROUTES_CODEC


def samples_to_table(samples: list[RewardedSample]) -> pa.Table:
    """RewardedSamples -> Arrow table with :data:`SAMPLE_SCHEMA` (times as UTC timestamps,
    routes as the served zstd frame with their shape, dtype and codec, format 3). Built
    column by column (one Arrow conversion per column).

    Raises:
        ValueError: a sample's routes do not decode to their shape (``expert_routes``).
        pyarrow.ArrowInvalid / OverflowError / TypeError: a value its column cannot hold
            (:func:`unwritable_column` names it)."""
    routes = [_routes_frame(s.expert_routes) for s in samples]
    sp = [s.sampling for s in samples]
    sampling = pa.StructArray.from_arrays(
        [pa.array([getattr(x, k) for x in sp], f.type) for k, f in zip(_SAMPLING_FIELDS, SAMPLING_TYPE)],
        fields=list(SAMPLING_TYPE))

    def col(name: str):
        return [getattr(s, name) for s in samples]

    def lists(name: str, dtype) -> pa.Array:
        """A list column through numpy: one flat array and the offsets (half the cost of
        ``pa.array`` on the nested lists; a value beyond ``dtype`` raises OverflowError)."""
        vals = col(name)
        off = np.zeros(len(vals) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, vals), np.int64, len(vals)), out=off[1:])
        if off[-1] > np.iinfo(np.int32).max:  # beyond list<> offsets: Arrow's own conversion decides
            return pa.array(vals, pa.list_(pa.from_numpy_dtype(dtype)))
        flat = np.fromiter(itertools.chain.from_iterable(vals), dtype, int(off[-1]))
        return pa.ListArray.from_arrays(pa.array(off.astype(np.int32)), pa.array(flat))

    cols = {
        "completion_id": [str(s.completion_id) for s in samples],
        "model_version": col("model_version"), "split": col("split"),
        "created_at": col("created_at"), "sealed_at": col("sealed_at"), "user_hash": col("user_hash"),
        "prompt_token_ids": lists("prompt_token_ids", np.int32),
        "completion_token_ids": lists("completion_token_ids", np.int32),
        "behavior_logprobs": lists("behavior_logprobs", np.float32), "sampling": sampling,
        "expert_routes": [r[0] for r in routes], "expert_routes_shape": [r[1] for r in routes],
        "expert_routes_dtype": [r[2] for r in routes], "finish_reason": col("finish_reason"),
        "reward": col("reward"), "label": col("label"), "n_votes": col("n_votes"), "votes_up": col("votes_up"),
        "votes_down": col("votes_down"), "event_ids": col("event_ids"),
        "expert_routes_codec": [r[3] for r in routes], **_component_cols(samples)}
    return pa.Table.from_arrays([c if isinstance(c, pa.Array) else pa.array(c, f.type)
                                 for f, c in zip(SAMPLE_SCHEMA, (cols[f.name] for f in SAMPLE_SCHEMA))],
                                schema=SAMPLE_SCHEMA)


def _scores_cell(scores: dict[str, float]) -> list[dict]:
    return [{"name": k, "value": v} for k, v in sorted(scores.items())]


def _component_cols(samples: list[RewardedSample]) -> dict[str, list]:
    """The format-4 columns of ``samples``: the policy digest and each component."""
    return {"reward_policy": [s.reward_policy for s in samples], "thumb": [s.thumb for s in samples],
            "copied": [s.copied for s in samples], "regenerated": [s.regenerated for s in samples],
            "kept_share": [s.kept_share for s in samples], "followup": [s.followup for s in samples],
            "scores": [_scores_cell(s.scores) for s in samples]}


def unwritable_column(s: RewardedSample) -> tuple[str, str] | None:
    """The first column of :data:`SAMPLE_SCHEMA` whose value in ``s`` Arrow refuses, as
    ``(column, reason)`` (e.g. a token id beyond int32, a string that is not UTF-8), or None
    when every column converts. Used to name the field of a sample that cannot be written."""
    try:
        raw, shape, dtype, codec = _routes_frame(s.expert_routes)
    except Exception as exc:  # noqa: BLE001 - any refusal names the column
        return "expert_routes", f"{type(exc).__name__}: {str(exc)[:200]}"
    row = {"completion_id": str(s.completion_id), "model_version": s.model_version, "split": s.split,
           "created_at": s.created_at, "sealed_at": s.sealed_at, "user_hash": s.user_hash,
           "prompt_token_ids": s.prompt_token_ids, "completion_token_ids": s.completion_token_ids,
           "behavior_logprobs": s.behavior_logprobs, "sampling": {k: getattr(s.sampling, k) for k in _SAMPLING_FIELDS},
           "expert_routes": raw, "expert_routes_shape": shape, "expert_routes_dtype": dtype,
           "finish_reason": s.finish_reason, "reward": s.reward, "label": s.label, "n_votes": s.n_votes,
           "votes_up": s.votes_up, "votes_down": s.votes_down, "event_ids": s.event_ids,
           "expert_routes_codec": codec, **{k: v[0] for k, v in _component_cols([s]).items()}}
    for f in SAMPLE_SCHEMA:
        try:
            pa.array([row[f.name]], f.type)
        except Exception as exc:  # noqa: BLE001 - any refusal names the column
            return f.name, f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def _ms(v) -> int:
    if isinstance(v, dt.datetime):
        return int(v.timestamp() * 1000) if v.tzinfo else int(v.replace(tzinfo=dt.timezone.utc).timestamp() * 1000)
    return int(v)


def routes_from_raw(raw: bytes | None, shape, dtype: str | None, codec: str | None = None) -> ExpertRoutes | None:
    """The :class:`ExpertRoutes` of a row's ``expert_routes`` cell (None when null): with
    ``codec`` ``"zstd"`` (format 3) the cell is the served frame, handed back as the event's
    ``data`` without decoding it (bit-exact; :meth:`ExpertRoutes.to_array` decodes it where
    the routes are used); with ``codec`` None (format 2) the raw bytes, encoded anew.

    Raises:
        ValueError: ``expert_routes``: the bytes do not fill ``shape`` in ``dtype``;
            ``expert_routes_codec``: a codec other than ``zstd``.
    """
    if raw is None:
        return None
    shape = tuple(int(x) for x in shape)
    dtype = dtype or "uint8"
    if codec is not None:
        if codec != ROUTES_CODEC:
            raise ValueError(f"expert_routes_codec: {codec!r} is not {ROUTES_CODEC!r} (or null for raw bytes)")
        return ExpertRoutes(shape=shape, dtype=dtype, codec=codec, data=binascii.b2a_base64(raw, newline=False).decode())
    arr = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
    if len(shape) != 3 or arr.size != int(np.prod(shape)):
        raise ValueError(f"expert_routes: {arr.size} values of {dtype}, shape {shape} needs "
                         f"{int(np.prod(shape)) if len(shape) == 3 else '3 dims'}")
    return ExpertRoutes.from_array(arr.reshape(shape).astype(dtype))


def _scores_of(cell) -> dict[str, float]:
    """A ``scores`` cell (list of ``{name, value}``, or a DuckDB/Arrow map as pairs or a dict;
    null) -> ``{name: value}``."""
    if not cell:
        return {}
    if isinstance(cell, dict):
        return dict(cell)
    return {(x["name"] if isinstance(x, dict) else x[0]): (x["value"] if isinstance(x, dict) else x[1]) for x in cell}


def row_to_sample(row: dict) -> RewardedSample:
    """One row of a format-2, 3 or 4 table (``Table.to_pylist()`` or DuckDB dicts: times may be
    datetimes or integer ms) -> RewardedSample (the format-4 columns absent or null: no
    policy digest, no components).

    Raises:
        pydantic.ValidationError / ValueError: the row is not a valid sample (names the field).
    """
    return RewardedSample(
        completion_id=row["completion_id"], model_version=row["model_version"],
        split=row.get("split") or "train",
        created_at=_ms(row["created_at"]), user_hash=row["user_hash"],
        prompt_token_ids=list(row["prompt_token_ids"]),
        completion_token_ids=list(row["completion_token_ids"]),
        behavior_logprobs=list(row["behavior_logprobs"]),
        sampling=SamplingParams.model_validate(row["sampling"]),
        expert_routes=routes_from_raw(row["expert_routes"], row["expert_routes_shape"], row["expert_routes_dtype"],
                                      row.get("expert_routes_codec")),
        finish_reason=row["finish_reason"], reward=row["reward"], label=row["label"],
        n_votes=row["n_votes"], votes_up=row["votes_up"], votes_down=row["votes_down"],
        event_ids=list(row["event_ids"]), sealed_at=_ms(row["sealed_at"]),
        reward_policy=row.get("reward_policy"), thumb=row.get("thumb"), copied=row.get("copied") or 0,
        regenerated=row.get("regenerated") or 0, kept_share=row.get("kept_share"), followup=row.get("followup"),
        scores=_scores_of(row.get("scores")))


def table_to_samples(table: pa.Table) -> list[RewardedSample]:
    """A format-2, 3 or 4 table (extra columns such as hive ``date``/``hour`` ignored; no
    ``expert_routes_codec`` column: format 2, raw routes; no component columns: before format
    4) -> RewardedSamples, in row order."""
    for name in ("created_at", "sealed_at"):
        if pa.types.is_timestamp(table.schema.field(name).type):
            i = table.schema.get_field_index(name)
            ms = pc.cast(table.column(name), pa.timestamp("ms", tz="UTC"))  # DuckDB hands back us
            table = table.set_column(i, name, pc.cast(ms, pa.int64()))
    return [row_to_sample(r) for r in table.to_pylist()]


def format_version(schema: pa.Schema) -> int:
    """The shard format of ``schema``: the number under :data:`FORMAT_KEY`; without it, 1 when
    ``sampling`` is a JSON string (the earlier layout), 4 with ``reward_policy``, 3 with
    ``expert_routes_codec``, else 2."""
    meta = schema.metadata or {}
    if FORMAT_KEY in meta:
        return int(meta[FORMAT_KEY])
    if schema.field("sampling").type == pa.string():
        return 1
    if "reward_policy" in schema.names:
        return 4
    return 3 if "expert_routes_codec" in schema.names else 2


def conform(table: pa.Table) -> pa.Table:
    """A format-2, 3 or 4 table (columns of :data:`SAMPLE_SCHEMA`, any subset is fine)
    with the columns added in formats 3 and 4 (:data:`ADDED_AFTER_2`) appended as nulls where
    absent, so it casts to :data:`SAMPLE_SCHEMA`."""
    for name in ADDED_AFTER_2:
        if name not in table.column_names:
            table = table.append_column(SAMPLE_SCHEMA.field(name), pa.nulls(table.num_rows, SAMPLE_SCHEMA.field(name).type))
    return table


def upgrade_v1_table(table: pa.Table, model_version: str) -> pa.Table:
    """A format-1 shard's table (JSON ``sampling``/``expert_routes`` strings, integer-ms
    times, ``model_version`` only in the directory name) -> :data:`SAMPLE_SCHEMA`; the split
    of format-1 samples is ``train`` (the split did not exist).

    Raises:
        ValueError: a row's JSON does not decode (names the column and completion_id).
    """
    n = table.num_rows
    ids = table.column("completion_id").to_pylist()
    sampling, raw, shapes, dtypes = [], [], [], []
    for cid, s, r in zip(ids, table.column("sampling").to_pylist(), table.column("expert_routes").to_pylist()):
        try:
            sp = SamplingParams.model_validate(json.loads(s))
            er = ExpertRoutes.model_validate_json(r) if r else None
        except ValueError as exc:
            raise ValueError(f"sampling/expert_routes: row {cid} does not decode: {exc}") from exc
        sampling.append({k: getattr(sp, k) for k in _SAMPLING_FIELDS})
        b, sh, d = _routes_raw(er)
        raw.append(b)
        shapes.append(sh)
        dtypes.append(d)
    cols = {
        "completion_id": table.column("completion_id"),
        "model_version": pa.array([model_version] * n, pa.string()),
        "split": pa.array(["train"] * n, pa.string()),
        "created_at": pc.cast(table.column("created_at"), pa.int64()).cast(TIMESTAMP),
        "sealed_at": pc.cast(table.column("sealed_at"), pa.int64()).cast(TIMESTAMP),
        "sampling": pa.array(sampling, SAMPLING_TYPE),
        "expert_routes": pa.array(raw, pa.binary()),
        "expert_routes_shape": pa.array(shapes, pa.list_(pa.int32())),
        "expert_routes_dtype": pa.array(dtypes, pa.string()),
        "expert_routes_codec": pa.nulls(n, pa.string()),  # raw bytes (a migrated shard keeps them raw)
        **{c: pa.nulls(n, SAMPLE_SCHEMA.field(c).type) for c in ADDED_IN_4},  # no policy, no components
    }
    return pa.table({f.name: cols[f.name] if f.name in cols else table.column(f.name).cast(f.type)
                     for f in SAMPLE_SCHEMA}, schema=SAMPLE_SCHEMA)
