"""Losses and off-policy weights as pure functions (no model, no optimizer).

Shapes: B samples, T positions, V vocabulary. ``mask`` is the completion mask (B, T)
float32 with 1 on completion targets. All logprobs are natural-log, float32.

Importance sampling (DESIGN §4), ratio ρ = exp(log πθ − log μ) with μ the behavior
(serving) policy, always detached:

* ``"sequence"``: ρ_i = exp(Σ_t (log πθ − log μ)), weight min(ρ_i, cap), in [0, cap].
* ``"token"``:    ρ_it = exp(log πθ_t − log μ_t), weight min(ρ_it, cap), in [0, cap].
"""

from __future__ import annotations

from typing import Literal

import torch

# One definition of a token's logprob, shared with serving's aligned scoring pass.
from schemas.modelspec import token_logprobs  # noqa: F401  (re-exported)

ISLevel = Literal["sequence", "token"]


class _TokenLogprobs(torch.autograd.Function):
    """:func:`token_logprobs` with a backward that holds one vocabulary-sized buffer."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        ls = torch.log_softmax(logits.float(), dim=-1)  # the same ops as token_logprobs: the same bits
        ctx.save_for_backward(ls, target_ids)
        ctx.logits_dtype = logits.dtype
        return ls.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if ctx.needs_input_grad[0] is False:
            return None, None
        ls, tgt = ctx.saved_tensors
        # d log softmax(z)_y / dz = onehot(y) - softmax(z): built in the saved buffer itself
        grad = ls.exp_().mul_(-g.unsqueeze(-1))
        grad.scatter_add_(-1, tgt.unsqueeze(-1), g.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None


def token_logprobs_lean(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """:func:`token_logprobs` (same forward bits) whose backward needs one (B, T, V) buffer.

    Autograd through ``log_softmax(...).gather(...)`` keeps the (B, T, V) log-softmax for
    backward and then holds three more tensors of that size at once (the scattered
    incoming gradient, ``exp`` of the saved output, the logits' gradient). Here the saved
    log-softmax becomes the gradient in place: g_t · (onehot(y_t) − softmax(z_t)). Measured
    on the default model (49,152-token vocabulary), a step of 12 samples of 482 tokens peaks
    1.1 GB lower (bench/learner_memory_demo.py). The graph it builds can be run backward
    once (no ``retain_graph``).

    Args:
        logits: (B, T, V) any float dtype (computed in fp32); target_ids: (B, T) int64.

    Returns:
        (B, T) float32, equal bit for bit to :func:`token_logprobs`.
    """
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return token_logprobs(logits, target_ids)
    return _TokenLogprobs.apply(logits, target_ids)


def sequence_logprobs(token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log π(y|x) = Σ_t mask_t · log π(y_t): (B, T), (B, T) -> (B,)."""
    return (token_logps * mask).sum(-1)


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor, kl: torch.Tensor,
             beta: float, desirable_weight: float, undesirable_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample KTO loss (Ethayarajh et al. 2024, arXiv:2402.01306, eq. 8; TRL ``kto_loss``).

    r = log πθ(y|x) − log π_ref(y|x); z0 = max(kl, 0), detached;
    desirable:   λ_D · (1 − σ(β (r − z0)))
    undesirable: λ_U · (1 − σ(β (z0 − r)))

    Args:
        policy_logps: (B,) sequence logprobs under the policy (with grad).
        ref_logps: (B,) sequence logprobs under the frozen reference.
        labels: (B,) bool, True = desirable.
        kl: scalar estimate of KL(πθ ‖ π_ref) (detached and clamped at 0 here).
        beta: β > 0, sharpness of the value function.
        desirable_weight, undesirable_weight: λ_D, λ_U (class-imbalance weights).

    Returns:
        ``(losses (B,), rewards (B,))`` with rewards = β r, detached.
    """
    z0 = kl.detach().clamp(min=0)
    r = policy_logps - ref_logps
    lab = labels.bool()
    des = desirable_weight * (1 - torch.sigmoid(beta * (r - z0)))
    und = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r)))
    losses = torch.where(lab, des, und)
    return losses, (beta * r).detach()


def tis_weights(token_logps: torch.Tensor, behavior_logps: torch.Tensor, mask: torch.Tensor,
                cap: float = 2.0, level: ISLevel = "sequence") -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance-sampling weights, detached (Ionides 2008; "TIS" in verl/OpenRLHF).

    Args:
        token_logps: (B, T) log πθ of the target tokens.
        behavior_logps: (B, T) log μ logged by serving.
        mask: (B, T) completion mask.
        cap: truncation C > 0; weights lie in [0, C].
        level: ``"sequence"`` -> (B,) weights, ``"token"`` -> (B, T) weights (0 off mask).

    Returns:
        ``(weights, raw_ratios)`` of the same shape; raw = untruncated ρ (for metrics).
    """
    if cap <= 0:
        raise ValueError(f"cap: must be > 0, got {cap}")
    d = ((token_logps.detach() - behavior_logps) * mask)
    if level == "sequence":
        ratio = torch.exp(d.sum(-1))
    elif level == "token":
        ratio = torch.exp(d) * mask
    else:
        raise ValueError(f"level: must be 'sequence' or 'token', got {level!r}")
    return ratio.clamp(max=cap), ratio


def kl_to_reference(token_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """KL(πθ ‖ π_ref) estimates per completion token on samples drawn from ≈πθ (Schulman 2020).

    k1 = mean(log πθ − log π_ref); k3 = mean(exp(log π_ref − log πθ) − 1 − (log π_ref − log πθ))
    (k3 is non-negative and unbiased). Returns floats ``{"k1", "k3"}``.
    """
    d = (ref_logps - token_logps).detach()
    n = mask.sum().clamp(min=1)
    k1 = ((-d) * mask).sum() / n
    k3 = ((torch.exp(d) - 1 - d) * mask).sum() / n
    return {"k1": float(k1), "k3": float(k3)}


def loo_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline b_i = (Σ_j r_j − r_i) / (B − 1) (Kool et al. 2019; RLOO, arXiv:2402.14740).

    (B,) -> (B,); B = 1 gives baseline 0.
    """
    B = rewards.shape[0]
    if B < 2:
        return torch.zeros_like(rewards)
    return (rewards.sum() - rewards) / (B - 1)


def group_loo_baseline(rewards: torch.Tensor, groups: list) -> torch.Tensor:
    """Per-prompt leave-one-out baseline (RLOO, Ahmadian et al. 2024, arXiv:2402.14740 §3.2).

    b_i = (Σ_{j ∈ g(i)} r_j − r_i) / (|g(i)| − 1): the mean reward of the *other* completions of
    the same prompt, so A_i = r_i − b_i is zero for every completion of a prompt whose
    completions all got the same reward (nothing to learn there) and the policy gradient
    only moves probability between completions of one prompt. A prompt with a single
    completion has no other; it falls back to the leave-one-out mean over all B rows
    (:func:`loo_baseline`), which is 0 for B = 1.

    Args:
        rewards: (B,) float.
        groups: B hashable group keys (e.g. the prompt's token ids as a tuple).

    Returns:
        (B,) float, same dtype as ``rewards``.

    Raises:
        ValueError: ``len(groups) != B``.
    """
    B = rewards.shape[0]
    if len(groups) != B:
        raise ValueError(f"groups: {len(groups)} keys for {B} rewards")
    out = loo_baseline(rewards).clone()
    members: dict = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    for idx in members.values():
        if len(idx) > 1:
            ix = torch.as_tensor(idx, dtype=torch.long)
            r = rewards[ix]
            out[ix] = (r.sum() - r) / (len(idx) - 1)
    return out


def reinforce_loss(token_logps: torch.Tensor, behavior_logps: torch.Tensor, ref_logps: torch.Tensor,
                   mask: torch.Tensor, rewards: torch.Tensor, baseline: torch.Tensor, cap: float = 2.0,
                   level: ISLevel = "token", *, kl_coef: float) -> tuple[torch.Tensor, dict]:
    """REINFORCE with a baseline, truncated IS and a k3 KL penalty to the reference.

    Per token: ℓ_t = −w · A_i · log πθ(y_t) + kl_coef · k3_t, with A_i = r_i − b_i, w the TIS
    weight (sequence or token level), k3_t = exp(log π_ref − log πθ) − 1 − (log π_ref − log πθ)
    (Williams 1992; Schulman 2020 for k3). Loss = Σ ℓ_t mask_t / Σ mask_t (token mean).

    Args:
        token_logps: (B, T) with grad; behavior_logps, ref_logps, mask: (B, T);
        rewards, baseline: (B,).

    Returns:
        ``(loss scalar, metrics dict of floats)``.
    """
    w, ratio = tis_weights(token_logps, behavior_logps, mask, cap, level)
    adv = (rewards - baseline).detach()  # (B,)
    if level == "sequence":
        wt = (w * adv).unsqueeze(-1)  # (B, 1)
    else:
        wt = w * adv.unsqueeze(-1)  # (B, T)
    d = ref_logps.detach() - token_logps
    k3 = torch.exp(d) - 1 - d
    per_tok = -wt * token_logps + kl_coef * k3
    n = mask.sum().clamp(min=1)
    loss = (per_tok * mask).sum() / n
    on = mask.bool() if level == "token" else torch.ones_like(ratio, dtype=torch.bool)
    return loss, {"pg/adv_mean": float(adv.mean()), "pg/kl_k3": float((k3.detach() * mask).sum() / n),
                  "is/ratio_mean": float(ratio[on].mean()) if on.any() else 1.0}
