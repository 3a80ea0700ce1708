"""The learner's batch: RewardedSamples laid out for one forward pass (DESIGN §4).

Layout follows the serving side exactly so recomputed logprobs line up with the behavior
logprobs serving logged: **left padding** and ``position_ids = cumsum(mask) - 1``
(:func:`schemas.modelspec.left_pad` / :func:`schemas.modelspec.position_ids`).

For a sample with prompt ``p`` (P tokens) and completion ``c`` (C tokens):

* input  ``x = p + c[:-1]``               (P + C - 1 tokens, one forward row each)
* target ``y = (p + c)[1:]``              (the token each input position predicts)
* the last C target positions are the completion (``completion_mask``)
* logged routes ``(P + C - 1, L, k)`` give exactly one row per input token.

This module knows nothing about DeepSpeed or losses.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from schemas.events import RewardedSample
from schemas.modelspec import left_pad, position_ids


class RefusedSample(ValueError):
    """A sample that cannot be trained on; ``reason`` is a short counted key."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class LearnerBatch:
    """One left-padded batch of B samples, T = longest input.

    Fields (shape, symbol):
        input_ids: (B, T) int64, x = prompt + completion[:-1], left padded.
        attention_mask: (B, T) int64, 1 on real tokens.
        position_ids: (B, T) int64, cumsum(mask) - 1, clamped at 0 on padding.
        target_ids: (B, T) int64, y_t = token predicted at position t (0 where unused).
        completion_mask: (B, T) float32, 1 where y_t is a completion token (the loss support).
        behavior_logprobs: (B, T) float32, log μ(y_t | x_<=t) as logged by serving
            (raw, temperature 1), 0 outside ``completion_mask``.
        routes: (B, T, L, k) int64 logged expert indices per input token and MoE layer
            (0 on padding), or None when the batch trains with free routing.
        labels: (B,) bool, True = desirable (KTO): the reward policy's sign, ``reward > 0``,
            as the join wrote it in the sample's ``label`` (never re-derived from votes).
        rewards: (B,) float32, the reward policy's scalar (the sample's ``reward``), which
            REINFORCE's advantage r_i - b_i reads.
        versions: B model versions that produced each completion (behavior policy).
        completion_ids: B completion ids (str).
        ref_logprobs: (B, T) float32 log π_ref(y_t) filled by the trainer from the frozen
            reference (the parent policy), kept apart from ``behavior_logprobs``.
        baselines: (B,) float32 REINFORCE baseline b_i computed over the whole cycle (e.g.
            per-prompt leave-one-out), or None: the step then uses the batch's own LOO mean.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    target_ids: torch.Tensor
    completion_mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    routes: torch.Tensor | None
    labels: torch.Tensor
    rewards: torch.Tensor
    versions: list[str]
    completion_ids: list[str]
    ref_logprobs: torch.Tensor | None = None
    baselines: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_completion_tokens(self) -> int:
        return int(self.completion_mask.sum().item())

    def trim(self) -> "LearnerBatch":
        """Drop the leading columns that are padding in every row (T shrinks; still left padded)."""
        real = self.attention_mask.bool().any(0)
        start = int(real.nonzero()[0]) if real.any() else 0
        if start == 0:
            return self
        cut = lambda t: None if t is None else t[:, start:]  # noqa: E731
        return LearnerBatch(
            input_ids=cut(self.input_ids), attention_mask=cut(self.attention_mask),
            position_ids=cut(self.position_ids), target_ids=cut(self.target_ids),
            completion_mask=cut(self.completion_mask), behavior_logprobs=cut(self.behavior_logprobs),
            routes=cut(self.routes), labels=self.labels, rewards=self.rewards, versions=self.versions,
            completion_ids=self.completion_ids, ref_logprobs=cut(self.ref_logprobs), baselines=self.baselines)

    def select(self, idx: list[int]) -> "LearnerBatch":
        """Sub-batch of rows ``idx`` (padding columns kept; still left padded)."""
        ix = torch.as_tensor(idx, dtype=torch.long)
        pick = lambda t: None if t is None else t[ix]  # noqa: E731
        return LearnerBatch(
            input_ids=pick(self.input_ids), attention_mask=pick(self.attention_mask),
            position_ids=pick(self.position_ids), target_ids=pick(self.target_ids),
            completion_mask=pick(self.completion_mask), behavior_logprobs=pick(self.behavior_logprobs),
            routes=pick(self.routes), labels=pick(self.labels), rewards=pick(self.rewards),
            versions=[self.versions[i] for i in idx], completion_ids=[self.completion_ids[i] for i in idx],
            ref_logprobs=pick(self.ref_logprobs), baselines=pick(self.baselines))


def check_sample(s: RewardedSample, num_layers: int, top_k: int, num_experts: int,
                 allow_free_routing: bool = False) -> None:
    """Refuse a sample that cannot be trained on, naming the field and the reason.

    Raises:
        RefusedSample: reason in ``eval_split`` (feedback on eval prompts measures versions
            and is never trained on), ``empty_completion``, ``logprobs_misaligned``,
            ``routes_missing``, ``routes_misaligned``, ``routes_out_of_range``.
            Route checks are skipped when ``num_layers == 0`` (dense model) or
            ``allow_free_routing``.
    """
    if s.split != "train":
        raise RefusedSample("eval_split", f"split: completion {s.completion_id} is in the {s.split!r} split, "
                            "which is never trained on")
    P, C = len(s.prompt_token_ids), len(s.completion_token_ids)
    if C == 0 or P == 0:
        raise RefusedSample("empty_completion", f"completion {s.completion_id}: prompt {P} / completion {C} tokens")
    if len(s.behavior_logprobs) != C:
        raise RefusedSample("logprobs_misaligned", f"behavior_logprobs: {len(s.behavior_logprobs)} values for {C} "
                            f"completion tokens ({s.completion_id})")
    if num_layers == 0 or allow_free_routing:
        return
    if s.expert_routes is None:
        raise RefusedSample("routes_missing", f"expert_routes: absent for {s.completion_id}; router replay "
                            "needs them (pass allow_free_routing to train on free routing)")
    want = (P + C - 1, num_layers, top_k)
    if tuple(s.expert_routes.shape) != want:
        raise RefusedSample("routes_misaligned", f"expert_routes: shape {tuple(s.expert_routes.shape)}, expected "
                            f"(prompt+completion-1, layers, top_k) = {want} ({s.completion_id})")
    arr = s.expert_routes.to_array()
    if arr.size and int(arr.max()) >= num_experts:
        raise RefusedSample("routes_out_of_range", f"expert_routes: expert id {int(arr.max())} >= "
                            f"{num_experts} experts ({s.completion_id})")


def filter_samples(samples: list[RewardedSample], num_layers: int, top_k: int, num_experts: int,
                   allow_free_routing: bool = False) -> tuple[list[RewardedSample], Counter]:
    """Keep the trainable samples; count refused ones by reason (``Counter``)."""
    keep, refused = [], Counter()
    for s in samples:
        try:
            check_sample(s, num_layers, top_k, num_experts, allow_free_routing)
        except RefusedSample as exc:
            refused[exc.reason] += 1
            continue
        keep.append(s)
    return keep, refused


def build_batch(samples: list[RewardedSample], pad_id: int, with_routes: bool = True) -> LearnerBatch:
    """Lay ``samples`` out as a left-padded :class:`LearnerBatch`.

    Args:
        samples: already checked with :func:`check_sample` (B >= 1).
        pad_id: token id used for padding (its value never matters: masked).
        with_routes: include ``routes``; every sample must then carry ``expert_routes``.

    Raises:
        ValueError: empty list, or ``with_routes`` and a sample has no routes / wrong rows.
    """
    if not samples:
        raise ValueError("samples: empty batch")
    seqs = [list(s.prompt_token_ids) + list(s.completion_token_ids)[:-1] for s in samples]
    ids, mask = left_pad(seqs, pad_id)  # (B, T)
    B, T = ids.shape
    tgt = torch.zeros((B, T), dtype=torch.long)
    cmask = torch.zeros((B, T), dtype=torch.float32)
    blp = torch.zeros((B, T), dtype=torch.float32)
    for i, s in enumerate(samples):
        full = list(s.prompt_token_ids) + list(s.completion_token_ids)
        n, C = len(full) - 1, len(s.completion_token_ids)
        tgt[i, T - n:] = torch.tensor(full[1:], dtype=torch.long)
        cmask[i, T - C:] = 1.0
        blp[i, T - C:] = torch.tensor(s.behavior_logprobs, dtype=torch.float32)
    routes = None
    if with_routes:
        first = samples[0].expert_routes
        if first is None:
            raise ValueError(f"expert_routes: absent for {samples[0].completion_id}")
        L, k = first.shape[1], first.shape[2]
        routes = torch.zeros((B, T, L, k), dtype=torch.long)
        for i, s in enumerate(samples):
            if s.expert_routes is None:
                raise ValueError(f"expert_routes: absent for {s.completion_id}")
            arr = torch.from_numpy(s.expert_routes.to_array().astype("int64"))
            if arr.shape[0] != len(seqs[i]) or tuple(arr.shape[1:]) != (L, k):
                raise ValueError(f"expert_routes: shape {tuple(arr.shape)} for {len(seqs[i])} input tokens "
                                 f"({s.completion_id})")
            routes[i, T - arr.shape[0]:] = arr
    return LearnerBatch(
        input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), target_ids=tgt,
        completion_mask=cmask, behavior_logprobs=blp, routes=routes,
        labels=torch.tensor([bool(s.label) for s in samples], dtype=torch.bool),
        rewards=torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
        versions=[s.model_version for s in samples], completion_ids=[str(s.completion_id) for s in samples])
