"""learner.losses against hand-derived values and finite-difference gradients."""

from __future__ import annotations

import math

import pytest
import torch

from learner.losses import (group_loo_baseline, kl_to_reference, kto_loss, loo_baseline, reinforce_loss, sequence_logprobs,
                            tis_weights, token_logprobs)


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_token_and_sequence_logprobs_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(2.0), 0.0]]])  # (1, 2, 2)
    tgt = torch.tensor([[1, 0]])
    lp = token_logprobs(logits, tgt)
    assert torch.allclose(lp, torch.tensor([[math.log(3 / 4), math.log(2 / 3)]]), atol=1e-6)
    seq = sequence_logprobs(lp, torch.tensor([[0.0, 1.0]]))
    assert seq.shape == (1,) and abs(float(seq) - math.log(2 / 3)) < 1e-6


def test_kto_loss_values_eq8():
    pol = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    labels = torch.tensor([True, False])
    beta, lam_d, lam_u, kl = 0.5, 1.0, 1.5, 0.2
    losses, rewards = kto_loss(pol, ref, labels, torch.tensor(kl), beta, lam_d, lam_u)
    # r = [0.5, -1.0]
    want = [lam_d * (1 - sig(beta * (0.5 - kl))), lam_u * (1 - sig(beta * (kl - (-1.0))))]
    assert losses.tolist() == pytest.approx(want, abs=1e-7)
    assert rewards.tolist() == pytest.approx([0.25, -0.5])


def test_kto_negative_kl_clamped_and_detached():
    pol = torch.tensor([-1.0], requires_grad=True)
    kl = torch.tensor(-0.3, requires_grad=True)
    losses, _ = kto_loss(pol, torch.tensor([-1.2]), torch.tensor([True]), kl, 0.1, 1.0, 1.0)
    assert float(losses[0].detach()) == pytest.approx(1 - sig(0.1 * 0.2), abs=1e-7)  # z0 = 0, not -0.3
    losses.sum().backward()
    assert kl.grad is None  # z0 carries no gradient


def test_kto_gradient_hand_derived():
    # d/dr λ_D (1 - σ(β(r - z0))) = -λ_D β σ(x)(1-σ(x)), x = β(r - z0)
    # d/dr λ_U (1 - σ(β(z0 - r))) = +λ_U β σ(y)(1-σ(y)), y = β(z0 - r)
    pol = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    beta, lam_d, lam_u, z0 = 0.7, 1.3, 0.6, 0.1
    losses, _ = kto_loss(pol, ref, torch.tensor([True, False]), torch.tensor(z0), beta, lam_d, lam_u)
    losses.sum().backward()
    x = beta * (0.5 - z0)
    y = beta * (z0 + 1.0)
    want = [-lam_d * beta * sig(x) * (1 - sig(x)), lam_u * beta * sig(y) * (1 - sig(y))]
    assert pol.grad.tolist() == pytest.approx(want, abs=1e-7)


def test_tis_sequence_and_token():
    lp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -0.1]])
    mu = torch.tensor([[0.0, -1.5, -2.2], [0.0, -0.1, -0.3]])
    m = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    w, raw = tis_weights(lp, mu, m, cap=1.5, level="sequence")
    want_raw = [math.exp(0.5 + 0.2), math.exp(-0.4 + 0.2)]
    assert raw.tolist() == pytest.approx(want_raw, rel=1e-6)
    assert w.tolist() == pytest.approx([1.5, want_raw[1]], rel=1e-6)
    wt, rawt = tis_weights(lp, mu, m, cap=1.5, level="token")
    assert torch.allclose(wt, torch.tensor([[0.0, 1.5, math.exp(0.2)], [0.0, math.exp(-0.4), math.exp(0.2)]]), rtol=1e-6)
    with pytest.raises(ValueError, match="level"):
        tis_weights(lp, mu, m, level="episode")
    with pytest.raises(ValueError, match="cap"):
        tis_weights(lp, mu, m, cap=0)


def test_tis_identical_policies_weight_exactly_one():
    lp = torch.randn(3, 5)
    w, raw = tis_weights(lp, lp.clone(), torch.ones(3, 5))
    assert torch.equal(w, torch.ones(3)) and torch.equal(raw, torch.ones(3))


def test_kl_to_reference_by_hand():
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    m = torch.tensor([[1.0, 1.0]])
    kl = kl_to_reference(lp, ref, m)
    assert kl["k1"] == pytest.approx(((-1.0 + 1.5) + (-2.0 + 1.0)) / 2)
    d = [-0.5, 1.0]
    assert kl["k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 2, rel=1e-6)


def test_loo_baseline():
    assert loo_baseline(torch.tensor([1.0, 0.0, 0.0, 1.0])).tolist() == pytest.approx([1 / 3, 2 / 3, 2 / 3, 1 / 3])
    assert loo_baseline(torch.tensor([5.0])).tolist() == [0.0]


def test_group_loo_baseline_by_hand():
    r = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 0.5])
    b = group_loo_baseline(r, ["a", "a", "a", "b", "b", "c"])
    # a: others' mean -> (-1-1)/2, (1-1)/2, (1-1)/2; b: 1, -1; c alone: LOO over all six,
    # (sum - 0.5) / 5 with sum = -0.5 -> -0.2
    assert b.tolist() == pytest.approx([-1.0, 0.0, 0.0, 1.0, -1.0, -0.2])
    same = torch.tensor([-1.0, -1.0, -1.0])
    assert (same - group_loo_baseline(same, [7, 7, 7])).tolist() == [0.0, 0.0, 0.0]  # nothing to learn
    with pytest.raises(ValueError, match="groups"):
        group_loo_baseline(r, ["a"])


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_reinforce_value_and_finite_difference_grad(level):
    torch.manual_seed(0)
    lp0 = (torch.randn(3, 4, dtype=torch.float64) * 0.3 - 1.0)
    mu = lp0 + torch.randn(3, 4, dtype=torch.float64) * 0.2
    ref = lp0 + torch.randn(3, 4, dtype=torch.float64) * 0.2
    m = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.float64)
    r = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    b = loo_baseline(r)
    cap, kc = 1.2, 0.3
    lp = lp0.clone().requires_grad_(True)
    loss, _ = reinforce_loss(lp, mu, ref, m, r, b, cap=cap, level=level, kl_coef=kc)

    def hand(x):  # independent re-implementation of the docstring formula (weights held fixed)
        n = m.sum()
        tot = 0.0
        for i in range(3):
            A = float(r[i] - b[i])
            seq_w = min(math.exp(float(((lp0[i] - mu[i]) * m[i]).sum())), cap)
            for t in range(4):
                if m[i, t] == 0:
                    continue
                w = seq_w if level == "sequence" else min(math.exp(float(lp0[i, t] - mu[i, t])), cap)
                d = float(ref[i, t] - x[i, t])
                tot += -w * A * float(x[i, t]) + kc * (math.exp(d) - 1 - d)
        return tot / float(n)

    assert float(loss.detach()) == pytest.approx(hand(lp0), rel=1e-9)
    loss.backward()
    eps = 1e-6
    for i in range(3):
        for t in range(4):
            xp, xm = lp0.clone(), lp0.clone()
            xp[i, t] += eps
            xm[i, t] -= eps
            fd = (hand(xp) - hand(xm)) / (2 * eps)
            assert float(lp.grad[i, t]) == pytest.approx(fd, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_lean_equals_autograd(dtype):
    """Same forward bits as serving's token_logprobs; the gradient of a weighted sum of the
    token logprobs equals autograd's through log_softmax + gather (and the hand formula
    g_t (onehot(y_t) - softmax(z_t))) within float rounding."""
    from learner.losses import token_logprobs_lean

    g = torch.Generator().manual_seed(0)
    z = (torch.randn(3, 5, 11, generator=g) * 3).to(dtype)
    y = torch.randint(0, 11, (3, 5), generator=g)
    w = torch.randn(3, 5, generator=g)
    a, b = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    lean, ref = token_logprobs_lean(a, y), token_logprobs(b, y)
    assert lean.dtype == torch.float32 and torch.equal(lean, ref)
    (lean * w).sum().backward()
    (ref * w).sum().backward()
    assert a.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(a.grad.float(), b.grad.float(), atol=tol, rtol=0)
    hand = w.unsqueeze(-1) * (torch.nn.functional.one_hot(y, 11) - torch.softmax(z.float(), -1))
    assert torch.allclose(a.grad.float(), hand, atol=tol, rtol=0)
    with torch.no_grad():  # no graph: the plain function
        assert torch.equal(token_logprobs_lean(z, y), token_logprobs(z, y))
