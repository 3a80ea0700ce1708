"""The learner cycle's settings, declared once: :class:`LearnerConfig`.

Each field holds its default, type, bounds, unit and help; ``flywheel learn``'s options, the
``[learn]`` table of ``flywheel.toml``, ``FLYWHEEL_LEARN__<FIELD>`` and the demo's and
experiment's overrides all derive from it (``schemas.options``). This module imports no
torch, so the CLI can build its options without loading a tensor library.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

_BOUND_WORDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"),
                "less_than_equal": ("le", "<="), "less_than": ("lt", "<")}


def _reason(err: dict) -> tuple[str, str]:
    """``(field, "why, got value")`` of one pydantic error, in the learner's own wording."""
    loc = err.get("loc") or ()
    kind, ctx = err.get("type", ""), err.get("ctx") or {}
    if not loc and kind == "value_error":  # a __post_init__ check: "field: why, got value"
        msg = str(err["msg"]).removeprefix("Value error, ")
        name, sep, rest = msg.partition(": ")
        return (name, rest) if sep and name.isidentifier() else ("", msg)
    name = str(loc[0]) if loc else ""
    if kind in _BOUND_WORDS:
        key, word = _BOUND_WORDS[kind]
        return name, f"must be {word} {ctx[key]}, got {err.get('input')!r}"
    if kind == "literal_error":
        return name, f"must be {ctx['expected']}, got {err.get('input')!r}"
    return name, f"{err['msg']}, got {err.get('input')!r}"


def readable_errors(cls, values, handler):
    """Wrap-mode model validator: a refused value raises a ``ValidationError`` located at its
    field whose message is ``"<field>: <why>, got <value>"`` (e.g. ``"lr: must be >= 0, got
    -1"``), whether a bound in ``Field`` or a check in ``__post_init__`` refused it.

    Raises:
        pydantic.ValidationError: (a ``ValueError``) the first refused value, as above.
    """
    try:
        return handler(values)
    except ValidationError as exc:
        name, why = _reason(exc.errors()[0])
        text = f"{name}: {why}" if name else why
        raise ValidationError.from_exception_data(cls.__name__, [{
            "type": PydanticCustomError("value_error", "{text}", {"text": text}),
            "loc": (name,) if name else (), "input": values}]) from None


#: the learner's configs refuse NaN and +-Infinity in every float field: ``--lr inf`` passed
#: ``ge=0`` and trained the weights to NaN; ``--lateness-s inf`` failed each cycle after loading
#: the model (OverflowError); ``--poll-s inf`` stopped the daemon (time.sleep)
FINITE = ConfigDict(allow_inf_nan=False)

#: the largest seed: a seed is a signed 64-bit int (torch.manual_seed, the events' int64 seed)
SEED_MAX = 2**63 - 1

#: a field read by KTO's loss only (:data:`OBJECTIVE_ONLY`)
_KTO = {"objectives": ("kto",)}


@dataclass(config=FINITE)
class LearnerConfig:
    """Configuration of one learner cycle; validated on construction.

    Each field's ``description`` is its help (``flywheel learn --help``). The groups:
    optimisation (DeepSpeed, CPU, gloo; fp32 or bf16: ``steps`` .. ``seed``); memory (a cycle
    of any size runs in bounded memory, samples are read per micro-batch: ``micro_batch_size``,
    ``precision``, ``activation_checkpointing``); objective (``objective`` .. ``baseline``);
    off-policy correction (``is_cap`` .. ``measure_free_max``); trainable set
    (``train_layers``, ``checkpoint_every``); the built-in evaluation gate (``holdout_frac``,
    ``max_regression``, ``learner.gate``); router replay (``router_replay``,
    ``allow_free_routing``).

    Raises:
        pydantic.ValidationError: (a ``ValueError``) a value out of its bounds or an
            inconsistent combination; the message starts with the field's name
            (``"lr: must be >= 0, got -1"``).
    """

    # --- optimisation
    steps: int = Field(4, ge=1, description="Optimizer steps per cycle (K).")
    batch_size: int = Field(8, ge=1, description="Samples per step; sampled without replacement, reshuffled per "
                                                 "epoch.")
    lr: float = Field(1e-5, ge=0, description="AdamW learning rate (0 leaves the weights unchanged).")
    grad_clip: float = Field(1.0, description="Global gradient-norm clip (> 0).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    zero_stage: Literal[1, 2] = Field(2, description="DeepSpeed ZeRO stage (1 or 2).")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="RNG seed (sample order, torch), 0 to 2**63-1 (a signed "
                                                        "64-bit int).")
    # --- objective
    objective: Literal["kto", "reinforce", "psr"] = Field(
        "kto", description="kto (Ethayarajh et al. 2024, arXiv:2402.01306) | reinforce (REINFORCE with a "
                           "leave-one-out baseline, Kool et al. 2019) | psr (positive sample reinforcement, Zhu "
                           "et al. 2025, arXiv:2506.01347: only samples with reward > 0, weighted by their reward, "
                           "no baseline).")
    beta: float = Field(0.1, description="KTO beta (> 0).", json_schema_extra=_KTO)
    desirable_weight: float = Field(1.0, description="KTO lambda_D (weight of desirable samples, > 0).",
                                    json_schema_extra=_KTO)
    undesirable_weight: float = Field(1.0, description="KTO lambda_U (weight of undesirable samples, > 0).",
                                      json_schema_extra=_KTO)
    balance_classes: bool = Field(
        False, description="Per cycle, raise the minority class's KTO weight so that lambda_D*n_D = lambda_U*n_U "
                           "(the KTO paper, section 4.2, recommends a ratio in [1, 4/3]; product feedback is "
                           "mostly one class).",
        json_schema_extra={**_KTO, "flags": "--balance-classes/--no-balance-classes"})
    kl_coef: float = Field(0.0, ge=0, description="k3 KL penalty to the reference.",
                           json_schema_extra={"objectives": ("reinforce", "psr")})
    baseline: Literal["batch", "prompt"] = Field(
        "batch", description="REINFORCE baseline: 'batch' (leave-one-out over the step's batch) or 'prompt' "
                             "(leave-one-out over the other completions of the same prompt in the cycle, RLOO "
                             "arXiv:2402.14740; a prompt seen once falls back to the cycle's mean).")
    # --- off-policy correction
    is_cap: float = Field(2.0, description="Truncation of the importance ratio exp(log pi_theta - log mu) (> 0).")
    is_level: Literal["sequence", "token"] = Field(
        "sequence", description="Importance ratio per 'sequence' or per 'token' (KTO: 'sequence' only).")
    max_staleness: int = Field(4, ge=0, description="Drop (and count) samples produced by a version more than "
                                                    "this many versions older than the parent.")
    min_samples: int = Field(1, ge=1, description="Skip the cycle (publish nothing, consume nothing) below this "
                                                  "many trainable samples; the reason is said and recorded in the "
                                                  "learner state, and the daemon waits for every_n samples "
                                                  "beyond those it judged.")
    lateness_s: float = Field(600.0, ge=0, description="How late a shard may appear after a newer one was consumed "
                                                       "and still be found (the watermark's allowed lateness, "
                                                       "learner.cycle).", json_schema_extra={"unit": "s"})
    measure_chunk: int = Field(1, ge=1, description="Samples per forward in the start-of-cycle reference pass "
                                                    "(1 = each alone, unpadded: the layout of --aligned-logprobs, "
                                                    "so the mismatch can be exactly 0; more is faster, ~1e-6 "
                                                    "apart).")
    measure_free_max: int = Field(0, ge=0, description="Samples that also get a replay-off forward for the "
                                                       "route-flip and free-routing mismatch figures (0 = all; "
                                                       "each costs one more forward).")
    # --- trainable set
    train_layers: int = Field(0, ge=0, description="Train only the last N decoder layers (attention, router, "
                                                   "experts) and freeze the rest (0 = all). Frozen tensors are "
                                                   "bit-identical in the new version.")
    checkpoint_every: int = Field(0, ge=0, description="Resumable DeepSpeed checkpoint every N steps (0 = off).")
    # --- evaluation gate
    holdout_frac: float = Field(0.0, description="Eval gate: fraction of new samples held out (by completion-id "
                                                   "hash) to score parent and candidate, in [0, 1) (0 = off).")
    max_regression: float = Field(0.0, ge=0, description="Eval gate: allowed score drop vs the parent (nats/token "
                                                         "for the built-in preference margin).")
    # --- router replay
    router_replay: bool = Field(True, description="Replay the logged expert routes in the training forward "
                                                  "(--no-replay: free routing).",
                                json_schema_extra={"flags": "--replay/--no-replay"})
    allow_free_routing: bool = Field(False, description="Train samples without usable routes on free routing "
                                                        "instead of refusing (and counting) them.",
                                     json_schema_extra={"flags": "--allow-free-routing/--no-allow-free-routing"})
    # --- memory
    micro_batch_size: int = Field(0, ge=0, description="Samples per forward/backward; a step's batch is "
                                                       "accumulated over micro-batches (0 = one micro-batch).")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto | fp32 | bf16. auto: the parent version's dtype. bf16: bf16 weights and "
                            "activations, fp32 master weights and AdamW state under ZeRO. The new version keeps "
                            "the parent's dtype (docs/decisions.md D41).")
    activation_checkpointing: bool = Field(
        False, description="Recompute layer activations in backward (non-reentrant gradient checkpointing).",
        json_schema_extra={"flags": "--activation-checkpointing/--no-activation-checkpointing"})

    _readable = model_validator(mode="wrap")(classmethod(readable_errors))

    def __post_init__(self):
        # open bounds (> 0, < 1) are checked here: schemas.options cannot yet make click options of them
        checks = [
            ("grad_clip", self.grad_clip > 0, "must be > 0"), ("beta", self.beta > 0, "must be > 0"),
            ("desirable_weight", self.desirable_weight > 0, "must be > 0"),
            ("undesirable_weight", self.undesirable_weight > 0, "must be > 0"),
            ("is_cap", self.is_cap > 0, "must be > 0"),
            ("holdout_frac", 0 <= self.holdout_frac < 1, "must be in [0, 1)"),
            ("baseline", self.objective == "reinforce" or self.baseline == "batch",
             "is REINFORCE's baseline: use it with objective 'reinforce'"),
            ("is_level", not (self.objective == "kto" and self.is_level == "token"),
             "KTO's loss is per sequence: use 'sequence'"),
        ]
        # a setting only one objective reads is refused with another when it is not its default,
        # never accepted and ignored (as `baseline` above)
        for name, users in OBJECTIVE_ONLY.items():
            if self.objective not in users and getattr(self, name) != getattr(type(self), name):
                which = ("objective " if len(users) == 1 else "objectives ") + " and ".join(map(repr, users))
                checks.append((name, False, f"is read by {which} only, not by objective {self.objective!r}: "
                                            f"leave it at its default ({getattr(type(self), name)!r}) or use "
                                            f"objective {' or '.join(map(repr, users))}"))
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")


#: The settings only some objectives read (field -> those objectives), declared by each field's
#: ``objectives`` (its help says "(kto only)": ``schemas.options``): :class:`LearnerConfig`
#: refuses one set away from its default with any other objective. KTO's beta, lambda_D,
#: lambda_U and class balancing are read by KTO's loss only; the k3 KL penalty by the REINFORCE
#: loss (REINFORCE and PSR) only. (``baseline`` is REINFORCE's, checked with the bounds.)
OBJECTIVE_ONLY: dict[str, tuple[str, ...]] = {
    name: tuple(info.json_schema_extra["objectives"]) for name, info in LearnerConfig.__pydantic_fields__.items()
    if isinstance(info.json_schema_extra, dict) and "objectives" in info.json_schema_extra}


def learn_flags(values: dict) -> list[str]:
    """The ``flywheel learn`` arguments that set these :class:`LearnerConfig` fields (by name),
    as the generated options spell them: ``{"steps": 8, "router_replay": False}`` ->
    ``["--steps", "8", "--no-replay"]`` (:func:`schemas.options.flags_for`).

    Raises:
        ValueError: a key that is no field of LearnerConfig, or a bool with no flag for its value.
    """
    from schemas.options import flags_for

    return flags_for([LearnerConfig], values)


def check_learner(values: dict, where: str = "learner") -> dict:
    """Check a program's changes to the learner (a demo's, an experiment's): each key a
    :class:`LearnerConfig` field whose default it does not restate, and the result a config
    the learner accepts (:func:`schemas.options.check_overrides`). Returns ``values``.

    Raises:
        ValueError: the first problem, prefixed with ``where`` (``"learner: steps: must be >= 1,
            got 0"``).
    """
    from schemas.options import check_overrides

    return check_overrides([LearnerConfig], values, where=where)
