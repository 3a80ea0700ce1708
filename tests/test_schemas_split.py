"""schemas.split: the stable train/eval split of prompts (hand-checked values)."""

from __future__ import annotations

import math
import random

import pytest

from schemas.split import choose_split, split_fraction


def test_fraction_by_hand():
    # sha256(b"flywheel-split-v1:1,2,3") starts 709a583d4c5c5ae9 (checked with `sha256sum`);
    # 0x709a583d4c5c5ae9 / 2**64:
    assert split_fraction([1, 2, 3]) == 0x709A583D4C5C5AE9 / 2**64
    assert split_fraction([1, 2, 3]) == pytest.approx(0.43985511299648, abs=1e-13)
    assert split_fraction((t for t in [1, 2, 3])) == split_fraction([1, 2, 3])


def test_choose_split_share_and_tag():
    ids = [1, 2, 3]  # u = 0.4399
    assert choose_split(ids, 0.44) == "eval" and choose_split(ids, 0.43) == "train"
    assert choose_split(ids, 0.0) == "train" and choose_split(ids, 1.0) == "eval"
    assert choose_split(ids, 0.0, tag="eval") == "eval" and choose_split(ids, 1.0, tag="train") == "train"


def test_share_is_respected_over_many_prompts():
    rng = random.Random(0)
    n = 20_000
    got = sum(choose_split([rng.randrange(50_000) for _ in range(6)], 0.2) == "eval" for _ in range(n)) / n
    assert abs(got - 0.2) < 4 * math.sqrt(0.2 * 0.8 / n)  # 4 sigma


@pytest.mark.parametrize("share,tag,start", [(1.5, None, "eval_share"), (float("nan"), None, "eval_share"),
                                             (-0.1, None, "eval_share"), (True, None, "eval_share"),
                                             (0.1, "test", "flywheel_split")])
def test_bad_arguments_name_themselves(share, tag, start):
    with pytest.raises(ValueError) as ei:
        choose_split([1], share, tag=tag)
    assert str(ei.value).startswith(start + ":")
