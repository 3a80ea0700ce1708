"""The canary's CUPED covariate: each voting user's thumbs-up rate before the canary started.

Read from the sample shards (the same Parquet the controller counts votes in; every sample
carries the salted ``user_hash``), so any deployment has it. For a canary that started at
``since_ms``, a user's covariate is their thumbs-up rate over the votes on samples created in
the ``lookback_ms`` before ``since_ms`` (all versions), shrunk toward the pooled rate ``p0``
of that window by ``prior_votes`` pseudo-votes: ``x = (up + prior_votes p0) / (n +
prior_votes)``; a user with no earlier vote gets ``x = p0``. ``x`` is fixed before the canary
assigned anyone to an arm, which is what keeps the CUPED-adjusted test unbiased
(:func:`deploy.stats.cuped_rate`). Per version the sufficient statistics over its votes since
``since_ms`` are returned: ``x_sum = sum n_u x_u``, ``xx_sum = sum n_u x_u^2``,
``xy_sum = sum up_u x_u`` (user ``u`` cast ``n_u`` votes, ``up_u`` of them up, on that
version's samples). This module knows nothing of the rollout; it reads and aggregates.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from samplestore.source import samples_source

DAY_MS = 86_400_000


def user_history_covariate(samples_dir: Path, since_ms: int, versions: tuple[str, ...],
                           lookback_ms: int = 7 * DAY_MS, prior_votes: float = 2.0) -> dict[str, dict]:
    """``{version: {"x_sum", "xx_sum", "xy_sum"}}`` for the versions asked (module docstring).

    Returns ``{}`` when there are no shards or no vote before ``since_ms`` in the window (no
    covariate: the test uses the plain rates). Raises what DuckDB raises on unreadable shards.
    """
    samples_dir = Path(samples_dir)
    if not versions or not samples_dir.exists() or not any(samples_dir.rglob("*.parquet")):
        return {}
    con = duckdb.connect()
    try:
        src, created, _ = samples_source(con, samples_dir)
        vlist = ", ".join("'" + v.replace("'", "''") + "'" for v in versions)
        rows = con.execute(f"""
            WITH s AS (SELECT CAST(model_version AS VARCHAR) AS v, user_hash AS u, votes_up AS up,
                              votes_up + votes_down AS n, {created} AS t FROM {src}),
                 pre AS (SELECT u, sum(up) AS up, sum(n) AS n FROM s WHERE t >= ? AND t < ? GROUP BY u),
                 p0 AS (SELECT sum(up) / sum(n) AS p0, sum(n) AS n0 FROM pre),
                 cur AS (SELECT v, u, sum(up) AS y, sum(n) AS n FROM s WHERE t >= ? AND v IN ({vlist})
                         GROUP BY v, u),
                 xs AS (SELECT cur.v, cur.y, cur.n,
                               coalesce((pre.up + ? * p0.p0) / (pre.n + ?), p0.p0) AS x
                        FROM cur CROSS JOIN p0 LEFT JOIN pre ON cur.u = pre.u)
            SELECT v, sum(n * x), sum(n * x * x), sum(y * x), (SELECT n0 FROM p0) FROM xs GROUP BY v
        """, [int(since_ms) - int(lookback_ms), int(since_ms), int(since_ms), float(prior_votes),
              float(prior_votes)]).fetchall()
    finally:
        con.close()
    out = {}
    for v, x_sum, xx_sum, xy_sum, n0 in rows:
        if not n0 or x_sum is None:
            return {}  # no vote before the canary: no covariate
        out[v] = {"x_sum": float(x_sum), "xx_sum": float(xx_sum), "xy_sum": float(xy_sum)}
    return out
