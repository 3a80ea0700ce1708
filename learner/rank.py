"""Which torch.distributed rank this learner process is: :func:`is_rank0`.

Under ``torchrun`` every rank trains and only rank 0 writes (publishes the version, saves the
learner state, serves the metrics, shows progress); a single process has no ``RANK`` and is
rank 0 (``learner.trainer.ensure_dist_env`` then sets ``RANK=0``). No torch import: the daemon
and the CLI read it before any model loads.
"""

from __future__ import annotations

import os

RANK_ENV = "RANK"


class RankError(ValueError):
    """``$RANK`` is set but names no rank; the message is ``RANK: <reason>``, ``reason`` the reason."""

    def __init__(self, reason: str):
        super().__init__(f"{RANK_ENV}: {reason}")
        self.reason = reason


def is_rank0() -> bool:
    """Whether this process is rank 0, from ``$RANK`` (torchrun's global rank): True when it is
    unset or names rank 0, False for any other rank. Read at every call (never cached).

    ``$RANK`` is read as torch's env:// rendezvous reads it (``int()``: surrounding whitespace
    allowed); anything else is refused rather than taken as rank 0, since a second process that
    took itself for rank 0 would publish and save state beside the real one.

    Raises:
        RankError: (a ValueError) ``$RANK`` is set but is not a whole number >= 0 (the empty
            string included), or names a rank > 0 with no ``$WORLD_SIZE`` above it (such a
            process would wait forever for rank 0); the message names ``RANK`` and quotes the value.
    """
    raw = os.environ.get(RANK_ENV)
    if raw is None:
        return True
    try:
        rank = int(raw)
    except ValueError:
        rank = -1
    if rank < 0:
        raise RankError(f"must be a whole number >= 0 (this process's torch.distributed rank, as torchrun "
                        f"sets it) or unset (one process, rank 0), got {raw[:40]!r}")
    if rank > 0:  # a rank with no world of its own waits forever for a rank 0 that never comes
        world = os.environ.get("WORLD_SIZE")
        try:
            size = int(world) if world is not None else 0
        except ValueError:
            size = 0
        if rank >= size:
            raise RankError(f"{rank} needs WORLD_SIZE greater than it (torchrun sets both; a single process "
                            f"leaves both unset), got WORLD_SIZE={world[:40] if world is not None else None!r}")
    return rank == 0
