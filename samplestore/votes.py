"""The queries over the sample shards that the canary and the report read: per version and
arm, votes, rewards under each reward policy, each signal's counts, the guards' reply counts;
per completion, votes and signals. DuckDB over the hive-partitioned Parquet shards
(:func:`samplestore.source.samples_source`), in memory, no file lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from samplestore.source import samples_source

SIGNAL_COLUMNS = ("thumb", "copied", "regenerated", "kept_share", "followup", "reward")  # the join's, when present


def _query_samples(samples_dir: Path, select, group_by: str, since_ms: int) -> list[tuple]:
    """Rows of ``SELECT <select(columns)> FROM <shards> WHERE created_at >= since_ms GROUP BY
    <group_by>`` over the sample shards ([] when there are none yet), with ``t`` = created_at
    in ms, for :func:`canary_counts`. ``select`` gets the set of the shards' column names (a
    column no shard has cannot be named, one some shards lack reads as null)."""
    samples_dir = Path(samples_dir)
    if not samples_dir.exists() or not any(samples_dir.rglob("*.parquet")):
        return []
    con = duckdb.connect()
    try:
        src, created, cols = samples_source(con, samples_dir)
        src = f"(SELECT *, {created} AS t FROM {src})"  # t: created_at in ms
        return con.execute(f"SELECT {select(cols)} FROM {src} WHERE t >= ? GROUP BY {group_by}",
                           [int(since_ms)]).fetchall()
    finally:
        con.close()


EMPTY_REPLY_TOKENS = 2  # a reply of at most this many tokens counts as "no answer" for the guard


@dataclass
class CanaryCounts:
    """What one poll of a canary reads from the sample shards, from one DuckDB query.

    Fields (counts; versions are ``model_version`` strings):
        votes: ``{version: (votes_up, votes_down, samples)}`` since the canary started.
        step_votes: ``{version: (votes_up, votes_down)}`` since the current step started.
        guards: ``{version: {completions, completion_tokens, no_answer, truncated,
            truncated_tokens}}`` since the canary started: ``no_answer`` = replies of at most
            ``EMPTY_REPLY_TOKENS`` tokens, ``truncated`` = ``finish_reason == 'length'`` (cut at
            max_tokens), ``truncated_tokens`` = the tokens of those cut replies.
        by_split: ``{split: {version: (votes_up, votes)}}`` since the canary started.
        rewards: ``{version: {reward_policy digest: {rewarded, reward_sum, reward_sq_sum,
            reward_min, reward_max, regenerated, dissatisfied, copied, edited, kept_sum,
            kept_sq_sum}}}`` since the canary
            started, over the samples that carry a reward policy (``deploy.analysis.ArmStats``'
            fields of the same names: ``regenerated`` = samples with ``regenerated > 0``,
            ``dissatisfied`` with ``followup < 0``, ``copied`` with ``copied > 0``, ``edited``
            with a ``kept_share``, whose sum and sum of squares follow); empty
            on shards written before the reward policy.
        step_rewarded: ``{version: {digest: samples}}``, those samples since the step started.
    """

    votes: dict = field(default_factory=dict)
    step_votes: dict = field(default_factory=dict)
    guards: dict = field(default_factory=dict)
    by_split: dict = field(default_factory=dict)
    rewards: dict = field(default_factory=dict)
    step_rewarded: dict = field(default_factory=dict)


def canary_counts(samples_dir: Path, canary_since_ms: int, step_since_ms: int) -> CanaryCounts:
    """Everything a canary's poll reads from the sample shards, in one scan (shards written
    before samples had a ``split`` column count as ``train``).
    Samples created at or after ``canary_since_ms`` count for the canary, at or after
    ``step_since_ms`` for the step (ms). Raises what DuckDB raises on unreadable shards."""
    since = min(int(canary_since_ms), int(step_since_ms))
    c_at, s_at = int(canary_since_ms), int(step_since_ms)

    def select(cols: set[str]) -> str:
        split = "coalesce(CAST(split AS VARCHAR), 'train')" if "split" in cols else "'train'"
        if "reward_policy" in cols:  # the reward policy's columns; null in shards written before it
            pol, r = "CAST(reward_policy AS VARCHAR)", "CAST(reward AS DOUBLE)"
            rewarded = f"t >= {c_at} AND reward_policy IS NOT NULL"

            def share(col: str, cond: str) -> str:
                if col not in cols:
                    return "0"
                return f"sum(CAST({col} {cond} AS INTEGER)) FILTER (WHERE {rewarded})"

            rew = (f"count(*) FILTER (WHERE {rewarded}), sum({r}) FILTER (WHERE {rewarded}), "
                   f"sum({r} * {r}) FILTER (WHERE {rewarded}), min({r}) FILTER (WHERE {rewarded}), "
                   f"max({r}) FILTER (WHERE {rewarded}), {share('regenerated', '> 0')}, "
                   f"{share('followup', '< 0')}, {share('copied', '> 0')}, "
                   f"count(*) FILTER (WHERE t >= {s_at} AND reward_policy IS NOT NULL), ")
            if "kept_share" in cols:  # the edits' kept shares, [0, 1]
                k = "CAST(kept_share AS DOUBLE)"
                rew += (f"count({k}) FILTER (WHERE {rewarded}), sum({k}) FILTER (WHERE {rewarded}), "
                        f"sum({k} * {k}) FILTER (WHERE {rewarded})")
            else:
                rew += "0, 0, 0"
        else:
            pol, rew = "NULL", "0, 0, 0, NULL, NULL, 0, 0, 0, 0, 0, 0, 0"
        return (f"CAST(model_version AS VARCHAR), {split}, {pol}, {rew}, "
                f"sum(votes_up) FILTER (WHERE t >= {c_at}), sum(votes_down) FILTER (WHERE t >= {c_at}), "
                f"count(*) FILTER (WHERE t >= {c_at}), "
                f"sum(votes_up) FILTER (WHERE t >= {s_at}), sum(votes_down) FILTER (WHERE t >= {s_at}), "
                f"sum(len(completion_token_ids)) FILTER (WHERE t >= {c_at}), "
                f"sum(CAST(len(completion_token_ids) <= {EMPTY_REPLY_TOKENS} AS INTEGER)) FILTER (WHERE t >= {c_at}), "
                f"sum(CAST(finish_reason = 'length' AS INTEGER)) FILTER (WHERE t >= {c_at}), "
                f"sum(len(completion_token_ids)) FILTER (WHERE t >= {c_at} AND finish_reason = 'length')")

    out = CanaryCounts()
    for (v, sp, pol, rn, rsum, rsq, rmin, rmax, regen, dissat, copied, rstep, edited, ksum, ksq, up, down, n, sup,
         sdown, toks, empty,
         trunc, trunc_toks) in _query_samples(samples_dir, select, "1, 2, 3", since):
        up, down, n, sup, sdown, rn, rstep = (int(x or 0) for x in (up, down, n, sup, sdown, rn, rstep))
        if pol is not None and rn:
            r = out.rewards.setdefault(v, {}).setdefault(pol, {
                "rewarded": 0, "reward_sum": 0.0, "reward_sq_sum": 0.0, "reward_min": None, "reward_max": None,
                "regenerated": 0, "dissatisfied": 0, "copied": 0, "edited": 0, "kept_sum": 0.0, "kept_sq_sum": 0.0})
            r["rewarded"] += rn
            r["reward_sum"] += float(rsum or 0.0)
            r["reward_sq_sum"] += float(rsq or 0.0)
            r["reward_min"] = float(rmin) if r["reward_min"] is None else min(r["reward_min"], float(rmin))
            r["reward_max"] = float(rmax) if r["reward_max"] is None else max(r["reward_max"], float(rmax))
            for key, x in (("regenerated", regen), ("dissatisfied", dissat), ("copied", copied), ("edited", edited)):
                r[key] += int(x or 0)
            r["kept_sum"] += float(ksum or 0.0)
            r["kept_sq_sum"] += float(ksq or 0.0)
        if pol is not None and rstep:
            d = out.step_rewarded.setdefault(v, {})
            d[pol] = d.get(pol, 0) + rstep
        a = out.votes.get(v, (0, 0, 0))
        if n:
            out.votes[v] = (a[0] + up, a[1] + down, a[2] + n)
            b = out.by_split.setdefault(sp, {}).get(v, (0, 0))
            out.by_split[sp][v] = (b[0] + up, b[1] + up + down)
            g = out.guards.setdefault(v, {"completions": 0, "completion_tokens": 0, "no_answer": 0, "truncated": 0,
                                          "truncated_tokens": 0})
            g["completions"] += n
            g["completion_tokens"] += int(toks or 0)
            g["no_answer"] += int(empty or 0)
            g["truncated"] += int(trunc or 0)
            g["truncated_tokens"] += int(trunc_toks or 0)
        if sup or sdown:
            b = out.step_votes.get(v, (0, 0))
            out.step_votes[v] = (b[0] + sup, b[1] + sdown)
    return out


def samples_by_version(samples_dir: Path) -> dict[str, dict]:
    """Per producing version: samples, votes up/down (ingest's ``votes_by_version`` view) and
    ``mean_reward``, the mean of the samples' ``reward`` under the policy that labelled them
    (None for a version without samples)."""
    from samplestore.catalog import query

    rows = query("SELECT v.model_version, v.samples, v.votes_up, v.votes_down, r.mean_reward FROM votes_by_version v "
                 "LEFT JOIN (SELECT model_version, avg(reward) AS mean_reward FROM samples GROUP BY model_version) r "
                 "USING (model_version)", samples_dir)
    return {r["model_version"]: {"samples": int(r["samples"]), "votes_up": int(r["votes_up"] or 0),
                                 "votes_down": int(r["votes_down"] or 0),
                                 "mean_reward": None if r["mean_reward"] is None else float(r["mean_reward"])}
            for r in rows}


def event_ids_in_samples(samples_dir: Path) -> list[str]:
    """Every feedback event_id folded into a sample (with repeats, to detect double counting)."""
    import duckdb

    if not list(Path(samples_dir).rglob("*.parquet")):
        return []
    con = duckdb.connect()
    try:
        rows = con.execute("SELECT unnest(event_ids) FROM read_parquet(?, hive_partitioning=true)",
                           [str(Path(samples_dir) / "**" / "*.parquet")]).fetchall()
    finally:
        con.close()
    return [r[0] for r in rows]


def votes_by_completion(samples_dir: Path) -> list[dict]:
    """One row per sample: ``completion_id`` (str), ``model_version``, ``split``, ``votes_up``,
    ``votes_down`` (ingest's ``samples`` view: the votes the loop itself collected)."""
    from samplestore.catalog import query

    if not list(Path(samples_dir).rglob("*.parquet")):
        return []
    return query("SELECT CAST(completion_id AS VARCHAR) AS completion_id, model_version, split, votes_up, votes_down "
                 "FROM samples", samples_dir)


def signals_by_completion(samples_dir: Path) -> dict[str, dict] | None:
    """``{completion_id: {column: value}}`` of the signal columns (:data:`SIGNAL_COLUMNS`) the
    samples carry; None when they carry none of them (shards written before the join folded
    implicit signals)."""
    from samplestore.catalog import query

    if not list(Path(samples_dir).rglob("*.parquet")):
        return None
    have = {r["column_name"] for r in query("SELECT column_name FROM (DESCRIBE samples)", samples_dir)}
    cols = [c for c in SIGNAL_COLUMNS if c in have and c != "thumb"]
    if not any(c in have for c in ("copied", "regenerated", "kept_share", "followup")):
        return None
    rows = query("SELECT CAST(completion_id AS VARCHAR) AS completion_id, " + ", ".join(cols) + " FROM samples",
                 samples_dir)
    return {r["completion_id"]: {c: r[c] for c in cols} for r in rows}
