"""Arrow schema of the RewardedSample Parquet shards written by ``ingest`` and read by
``learner`` (through the DuckDB catalog).

Layout on disk: ``<samples_dir>/model_version=<v>/date=<YYYY-MM-DD>/part-<uuid>.parquet``
(hive partitioning), each file written to a temp name and renamed (atomic).
"""

from __future__ import annotations

import json

import pyarrow as pa

from schemas.events import RewardedSample

SAMPLE_SCHEMA = pa.schema([
    ("completion_id", pa.string()),
    ("created_at", pa.int64()),  # ms
    ("user_hash", pa.string()),
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("completion_token_ids", pa.list_(pa.int32())),
    ("behavior_logprobs", pa.list_(pa.float32())),
    ("sampling", pa.string()),  # SamplingParams JSON
    ("expert_routes", pa.string()),  # ExpertRoutes JSON or null
    ("finish_reason", pa.string()),
    ("reward", pa.float32()),
    ("label", pa.bool_()),
    ("n_votes", pa.int32()),
    ("votes_up", pa.int32()),
    ("votes_down", pa.int32()),
    ("event_ids", pa.list_(pa.string())),
    ("sealed_at", pa.int64()),  # ms
])
# partition columns (directory names): model_version, date


def samples_to_table(samples: list[RewardedSample]) -> pa.Table:
    """RewardedSamples -> Arrow table with :data:`SAMPLE_SCHEMA` (partition columns excluded)."""
    cols: dict[str, list] = {f.name: [] for f in SAMPLE_SCHEMA}
    for s in samples:
        cols["completion_id"].append(str(s.completion_id))
        cols["created_at"].append(s.created_at)
        cols["user_hash"].append(s.user_hash)
        cols["prompt_token_ids"].append(s.prompt_token_ids)
        cols["completion_token_ids"].append(s.completion_token_ids)
        cols["behavior_logprobs"].append(s.behavior_logprobs)
        cols["sampling"].append(s.sampling.model_dump_json())
        cols["expert_routes"].append(s.expert_routes.model_dump_json() if s.expert_routes else None)
        cols["finish_reason"].append(s.finish_reason)
        cols["reward"].append(s.reward)
        cols["label"].append(s.label)
        cols["n_votes"].append(s.n_votes)
        cols["votes_up"].append(s.votes_up)
        cols["votes_down"].append(s.votes_down)
        cols["event_ids"].append(s.event_ids)
        cols["sealed_at"].append(s.sealed_at)
    return pa.table(cols, schema=SAMPLE_SCHEMA)


def row_to_sample(row: dict) -> RewardedSample:
    """One row (as from ``Table.to_pylist()`` or DuckDB ``fetchall`` dicts) -> RewardedSample."""
    from schemas.events import ExpertRoutes, SamplingParams

    return RewardedSample(
        completion_id=row["completion_id"], model_version=row["model_version"],
        created_at=row["created_at"], user_hash=row["user_hash"],
        prompt_token_ids=list(row["prompt_token_ids"]),
        completion_token_ids=list(row["completion_token_ids"]),
        behavior_logprobs=list(row["behavior_logprobs"]),
        sampling=SamplingParams.model_validate(json.loads(row["sampling"])),
        expert_routes=ExpertRoutes.model_validate_json(row["expert_routes"]) if row["expert_routes"] else None,
        finish_reason=row["finish_reason"], reward=row["reward"], label=row["label"],
        n_votes=row["n_votes"], votes_up=row["votes_up"], votes_down=row["votes_down"],
        event_ids=list(row["event_ids"]), sealed_at=row["sealed_at"])
