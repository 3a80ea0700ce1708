"""Train / eval split of completions: which prompts are held out from training.

Pure functions shared by serving (which stamps every ``CompletionEvent`` with its split),
ingest and the demo. A prompt's split is a stable function of its token ids, so the same
prompt always lands in the same split, on every pod and in every process:

    u = int.from_bytes(sha256(b"flywheel-split-v1:" + ",".join(ids).encode())[:8], "big") / 2**64
    split = "eval" if u < eval_share else "train"

A request may instead name its split (a tag), which wins over the hash.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable, Literal

Split = Literal["train", "eval"]
SPLITS: tuple[str, ...] = ("train", "eval")
SPLIT_TAG = "flywheel_split"  # the key in a request's ``metadata``
SPLIT_HEADER = "x-flywheel-split"
_DOMAIN = b"flywheel-split-v1:"


def split_fraction(prompt_token_ids: Iterable[int]) -> float:
    """The prompt's stable point in [0, 1): the first 8 bytes of SHA-256 over
    ``b"flywheel-split-v1:"`` + the ids as decimal text joined by commas, big-endian, / 2**64."""
    text = ",".join(str(int(t)) for t in prompt_token_ids).encode()
    return int.from_bytes(hashlib.sha256(_DOMAIN + text).digest()[:8], "big") / 2.0**64


def check_share(eval_share: float) -> float:
    """``eval_share`` as a float in [0, 1]; ValueError naming ``eval_share`` otherwise (NaN too)."""
    if isinstance(eval_share, bool) or not isinstance(eval_share, (int, float)):
        raise ValueError(f"eval_share: must be a number in [0, 1], got {eval_share!r}")
    if not math.isfinite(eval_share) or not 0.0 <= eval_share <= 1.0:
        raise ValueError(f"eval_share: must be in [0, 1], got {eval_share!r}")
    return float(eval_share)


def choose_split(prompt_token_ids: Iterable[int], eval_share: float, tag: str | None = None) -> Split:
    """The split of one completion.

    Args:
        prompt_token_ids: the prompt as token ids (what the model saw).
        eval_share: the share of prompts held out for evaluation, in [0, 1]; 0 puts every
            untagged prompt in ``train``, 1 every one in ``eval``.
        tag: ``"train"`` or ``"eval"`` chosen by the request; wins over the hash.

    Raises:
        ValueError: ``tag`` not in :data:`SPLITS` or ``eval_share`` outside [0, 1]
            (the message starts with the argument's name).
    """
    share = check_share(eval_share)
    if tag is not None:
        if tag not in SPLITS:
            raise ValueError(f"{SPLIT_TAG}: must be 'train' or 'eval', got {tag!r}")
        return tag  # type: ignore[return-value]
    if share == 0.0:
        return "train"
    return "eval" if split_fraction(prompt_token_ids) < share else "train"
