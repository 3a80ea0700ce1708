"""Evaluation gate: a candidate that regresses on held-out feedback is not published.

The built-in score needs no generation: on held-out labelled samples (never trained on),
``score`` = mean per-token log π(y|x) of desirable completions − that of undesirable ones
(free routing, as serving will run the candidate). A policy that learned from feedback
raises it; one that learned the wrong direction lowers it. Any callable
``evaluate(model) -> {"score": float, ...}`` can replace it; :func:`generation_evaluator`
is the one that scores held-out *prompts* the way users score: it samples completions from
the model and passes each to a scorer; score = pass rate. The prompts and the scorer come
from the workload through :class:`GateVerifier`, named by ``flywheel learn --gate-verifier
MODULE:FUNCTION`` and loaded by :func:`load_gate_verifier`: the learner never imports a
workload (the default names the HumanEval workload's, run against the tests in the sandbox).
"""

from __future__ import annotations

import hashlib
import importlib
from typing import Callable, Protocol

import torch

from schemas.events import RewardedSample
from learner.batch import build_batch
from learner.trainer import forward_token_logprobs

Evaluator = Callable[[object], dict]


def in_holdout(completion_id, frac: float) -> bool:
    """True when sha256(completion_id) puts it in the ``frac`` held out (stable)."""
    return int(hashlib.sha256(str(completion_id).encode()).hexdigest()[:8], 16) / 2**32 < frac


def preference_margin_evaluator(holdout: list[RewardedSample], pad_id: int, chunk: int = 8) -> Evaluator:
    """``evaluate(model) -> {"score", "logp_desirable", "logp_undesirable", "n"}``: mean
    per-token logprob (nats/token) of desirable minus undesirable held-out completions.

    Raises:
        ValueError: the holdout lacks a desirable or an undesirable sample.
    """
    if not any(s.label for s in holdout) or all(s.label for s in holdout):
        raise ValueError("holdout: needs both desirable and undesirable samples")

    @torch.no_grad()
    def evaluate(model) -> dict:
        was = model.training
        model.eval()
        sums = {True: 0.0, False: 0.0}
        toks = {True: 0.0, False: 0.0}
        for s in range(0, len(holdout), chunk):
            part = holdout[s:s + chunk]
            b = build_batch(part, pad_id, with_routes=False)
            lp = forward_token_logprobs(model, b, replay=False) * b.completion_mask  # (B, T)
            for i, smp in enumerate(part):
                sums[bool(smp.label)] += float(lp[i].sum())
                toks[bool(smp.label)] += float(b.completion_mask[i].sum())
        model.train(was)
        d, u = sums[True] / toks[True], sums[False] / toks[False]
        return {"score": d - u, "logp_desirable": d, "logp_undesirable": u, "n": len(holdout)}

    return evaluate


def generation_evaluator(prompts: list[list[int]], score: Callable[[int, list[int]], bool], eos_id: int, *,
                         max_tokens: int, samples_per_prompt: int, seed: int, temperature: float = 0.8,
                         top_p: float = 0.95) -> Evaluator:
    """``evaluate(model) -> {"score": pass rate in [0, 1], "passed", "n"}`` on held-out prompts.

    For each prompt (token ids, unpadded), ``samples_per_prompt`` completions are sampled with
    transformers ``generate`` (temperature, top_p, at most ``max_tokens`` new tokens, stop at
    ``eos_id``; free routing, as serving will run the candidate) and ``score(prompt_index,
    completion_ids) -> bool`` judges each. The RNG is re-seeded per prompt with ``seed`` +
    index, so parent and candidate draw with the same random numbers (common random numbers:
    the difference of their scores has less variance than two independent draws). ``flywheel
    learn`` passes ``DaemonConfig.gate_max_tokens``, ``gate_samples`` and ``LearnerConfig.seed``.

    Raises:
        ValueError: no prompts, or a bad sampling value (the parameter is named).
    """
    if not prompts:
        raise ValueError("prompts: at least one held-out prompt is needed")
    for name, ok in (("max_tokens", max_tokens >= 1), ("samples_per_prompt", samples_per_prompt >= 1),
                     ("temperature", 0 < temperature <= 2), ("top_p", 0 < top_p <= 1)):
        if not ok:
            raise ValueError(f"{name}: out of range, got {locals()[name]!r}")

    @torch.no_grad()
    def evaluate(model) -> dict:
        was = model.training
        model.eval()
        passed = n = 0
        for i, p in enumerate(prompts):
            torch.manual_seed(seed + i)
            x = torch.tensor([p], dtype=torch.long)
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True, temperature=temperature,
                                 top_p=top_p, top_k=0, max_new_tokens=max_tokens,
                                 num_return_sequences=samples_per_prompt, eos_token_id=eos_id, pad_token_id=eos_id)
            for row in out[:, len(p):].tolist():
                comp = row[:row.index(eos_id) + 1] if eos_id in row else row
                passed += bool(score(i, comp))
                n += 1
        model.train(was)
        return {"score": passed / n, "passed": passed, "n": n}

    return evaluate


def gate_decision(parent_eval: dict, candidate_eval: dict, max_regression: float) -> tuple[bool, str]:
    """``(publish, reason)``: publish unless candidate score < parent score − max_regression."""
    p, c = float(parent_eval["score"]), float(candidate_eval["score"])
    if c < p - max_regression:
        return False, f"eval score {c:.6g} < parent {p:.6g} - max_regression {max_regression:g}"
    return True, f"eval score {c:.6g} vs parent {p:.6g} (max_regression {max_regression:g})"


class GateVerifier(Protocol):
    """A workload's held-out gate: ``(spec, tokenizer) -> (prompts, score)``.

    ``spec`` is the workload's own selection of held-out items (for HumanEval ``"120-163"``);
    ``prompts`` are chat-template token ids per item; ``score(i, completion_ids) -> bool`` says
    whether item ``i``'s completion passes, as the workload's users would judge it. Raises
    ``ValueError`` naming the bad part of ``spec``.
    """

    def __call__(self, spec: str, tokenizer) -> tuple[list[list[int]], Callable[[int, list[int]], bool]]: ...


def load_gate_verifier(name: str) -> GateVerifier:
    """Import ``MODULE:FUNCTION`` and return it as a :class:`GateVerifier`.

    Raises:
        ValueError: ``name`` is not ``MODULE:FUNCTION``, the module does not import, or it has no
            such callable (the message names which).
    """
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ValueError(f"gate verifier: {name!r} is not MODULE:FUNCTION")
    try:
        fn = getattr(importlib.import_module(module), attr, None)
    except ImportError as exc:
        raise ValueError(f"gate verifier: module {module!r} does not import ({exc})") from exc
    if not callable(fn):
        raise ValueError(f"gate verifier: {module!r} has no callable {attr!r}")
    return fn
