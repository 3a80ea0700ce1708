"""The vote's validation at consume time: the fast path against the per-record path (D96).

Every feedback value the ingest worker consumes is validated against the contract
(``schemas.events.FeedbackEvent``), checked for a repeated key and for a clock ahead of the
worker's (``ingest.join.check_clock``), as :meth:`ingest.processor.Processor.fold` does per
record. This bench measures that per-vote CPU on the realistic ingest mix
(``bench.ingest.make_events``: thumbs up and down, some with a comment, redeliveries and
flips) two ways, side by side in one process:

* **old**: ``ingest.join._parse_checked`` (the per-record path: pydantic-core's
  ``validate_json`` of the full contract, then the duplicate-key quote count), then
  ``check_clock``;
* **new**: ``ingest.join.parse_event`` (a value with no escape sequence goes through
  ``_fast_feedback``: the contract's validator less the checks such a value always passes, and
  the quote count written out for the vote's fields; anything else through the per-record
  path), then ``check_clock``.

Both are timed with ``time.process_time`` over the same ``--votes`` values, alternated,
``--reps`` times each; the best of each is reported (a loaded box only adds time). Before
timing, every vote is checked to give the same outcome both ways.

Prints, last: ``RESULT vote_validation_new_vs_old_cpu=<new / old> x`` (lower is better).

    python bench/vote_validation.py [--votes 20000] [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from bench.ingest import make_events  # noqa: E402
from ingest.join import _fast_feedback, _parse_checked, check_clock, parse_event  # noqa: E402
from schemas.events import DeadLetter, FeedbackEvent, now_ms  # noqa: E402
from schemas.settings import topic_names  # noqa: E402


def votes(n: int) -> list[tuple[bytes, bytes]]:
    """At least ``n`` ``(key, value)`` feedback records of the ingest mix (minimal completion
    bodies: only the votes are used), the first ``n``."""
    small = argparse.Namespace(prompt_tokens=2, completion_tokens=2, layers=1, experts=8, top_k=1)
    out: list[tuple[bytes, bytes]] = []
    seed = 0
    while len(out) < n:
        out += make_events(max(1000, (n - len(out)) // 2 + 1), small, seed=seed)[1]
        seed += 1
    return out[:n]


def run(path: str, recs: list[tuple[bytes, bytes]], src: str, now: int) -> float:
    """CPU seconds of this process for one pass of ``path`` (``"old"`` or ``"new"``) over ``recs``."""
    parse = parse_event if path == "new" else _parse_checked
    t = time.process_time()
    for k, v in recs:
        ev = parse(FeedbackEvent, v, src, k)
        if not isinstance(ev, DeadLetter):
            check_clock(ev, v, src, k, now)
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--votes", type=int, default=20_000, help="feedback values timed (default 20000)")
    ap.add_argument("--reps", type=int, default=5, help="passes of each path, alternated (best reported)")
    args = ap.parse_args()
    if args.votes < 1 or args.reps < 1:
        ap.error("--votes and --reps: must be >= 1")
    from ingest.worker import configure_gc

    configure_gc()  # the worker process's collector settings (ingest.worker.run)
    src = topic_names().feedback
    recs = votes(args.votes)
    now = now_ms()
    fast = 0
    for k, v in recs:  # the same outcome both ways, before anything is timed
        a, b = _parse_checked(FeedbackEvent, v, src, k), parse_event(FeedbackEvent, v, src, k)
        assert type(a) is type(b) and a.model_dump(exclude={"at"}) == b.model_dump(exclude={"at"}), v
        fast += _fast_feedback(v) is not None
    print(f"{len(recs)} votes ({sum(len(v) for _, v in recs) / len(recs):.0f} B each), the same outcome both ways; "
          f"{fast} ({100 * fast / len(recs):.1f} %) taken by the fast path", flush=True)
    times: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(args.reps):
        for path in ("old", "new"):
            times[path].append(run(path, recs, src, now))
    best = {p: min(t) for p, t in times.items()}
    for p in ("old", "new"):
        print(f"{p}: best {1e6 * best[p] / len(recs):.2f} us per vote; passes "
              f"{[round(1e6 * x / len(recs), 2) for x in times[p]]}", flush=True)
    print(f"RESULT vote_validation_new_vs_old_cpu={best['new'] / best['old']:.3f} x")


if __name__ == "__main__":
    main()
