"""The ``flywheel demo``'s settings, declared once: :class:`DemoConfig` and the settings it
gives the other roles (``DEMO_LEARNER``, ``QUICK_LEARNER``, ``DEMO_SERVE``, ``DEMO_INGEST``,
``DEMO_CONTROLLER``), the ``--quick`` sizing (:data:`QUICK`) and how the simulated users ask
(shared with ``flywheel experiment``). The run itself is :mod:`flywheel.demo`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from pydantic import Field, field_validator
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError, core_schema

from flywheel.users import SIGNALS, UserBehaviour
from flywheel.workload import GYM_VARIANTS
from learner.config import SEED_MAX, LearnerConfig, check_learner
from schemas.options import check_overrides

DEFAULT_HELD_OUT = ("gcd",)  # the unseen kind: a family no version trains on
_PROGRAM = {"cli": False}  # a setting programs change (DemoConfig(...), for_mode); not a flag of `flywheel demo`

# How the simulated users ask, in the demo and in the experiment (flywheel.experiment), which
# serves the same users: declared here once, the default of both configs' fields.
HUMANEVAL_PROBLEMS = 40  # the first N HumanEval problems are asked
HUMANEVAL_MAX_TOKENS = 160  # new tokens per HumanEval reply
TEMPERATURE = 0.8
TOP_P = 0.95

# The learner's settings the demo changes, by LearnerConfig field name (`flywheel learn` flags of
# the same names); every other learner setting is LearnerConfig's default. REINFORCE with a
# leave-one-out batch baseline: the pilot's settings (docs/experiments.md, experiment 3); the
# last 8 decoder layers train (docs/decisions.md D6); the reference pass takes 8 samples per
# forward (57-89 s per cycle one at a time); 2 samples get a replay-off forward (route flips).
DEMO_LEARNER = {"objective": "reinforce", "steps": 8, "batch_size": 12, "train_layers": 8, "lr": 3e-5,
                "measure_free_max": 2, "measure_chunk": 8}
# --quick: one short cycle of KTO (the learner's default objective); few thumbs-up among many
# downs, so KTO lambda_D*n_D = lambda_U*n_U
QUICK_LEARNER = {"balance_classes": True, "steps": 2, "batch_size": 4, "train_layers": 2,
                 "lr": 2e-5, "measure_free_max": 2, "measure_chunk": 8}
# the other roles' settings the demo changes, by field name (checked against each role's models
# in DemoConfig.__post_init__, passed as the generated flags)
# joins wait until floor(0.3 x running) requests can be prefilled together (TGI's default):
# runs F and G of experiment 3 used it; bench/joins.py measured no throughput gain on CPU (D28)
# the simulated users post every signal themselves (D75); serving's own regenerate/followup
# derivation would add signals unrelated to a reply's quality (one user drawing the same
# HumanEval problem twice within the window), so it is off in the demo
DEMO_SERVE = {"prefix_caching": True, "waiting_served_ratio": 0.3, "derive_regenerate": False,
              "derive_followup": False}
# votes arrive within seconds of their reply; a label lives 15 min, an orphan vote waits 2 min
DEMO_INGEST = {"seal_after_s": 3.0, "tick_s": 0.5, "max_label_age_s": 900.0, "orphan_ttl_s": 120.0}
# the relative non-inferiority margin 0.5 (delta for the thumbs-up test, reward_delta for the
# reward test, D113): the candidate must keep more than half the stable's thumbs-up rate, or
# half its distance from the worst reward; ~450 votes per canary cannot show more (bench/canary.py, demo settings: a
# half-as-good candidate promoted <= 0.05; production uses 0.2 with far more votes). The step
# deadline 600 s (an undecided step is rolled back; at the 0.37 votes/s of runs H-J an equal
# candidate needs ~200 votes per arm, D61); 20 votes per arm of burn-in.
# Guards read every served completion; "no answer" is judged by the workload's verifiers.
# min_length_ratio 0: the workload asks for "the answer as a number", so a candidate that learns
# to answer directly is shorter by design; a reply that loses its answer fails the no-answer
# guard (the verifiers' has_answer) instead (D62)
# max_p99_ratio 4: both arms share one pod whose engine steps both arms' batches every iteration,
# so a request's latency is its reply length in decode steps; over ~100 requests an arm's p99 is
# its longest reply or two, and one HumanEval reply (160 tokens) against none in the other arm
# (48) is a ratio of ~3.3 (D63)
DEMO_CONTROLLER = {"steps": "0.5,1.0", "min_votes": 20, "delta": 0.5, "reward_delta": 0.5, "deadline_s": 600.0,
                   "min_length_ratio": 0.0, "max_p99_ratio": 4.0,
                   "guards_from": "completions", "reply_judge": "flywheel.workload:reply_judge"}
# --quick sizes the run down (about 4 min, one cycle, too few votes for the canary to decide);
# a setting given on the command line or to for_mode wins. Its deadline_s 45 is a floor: the
# controller runs with step_deadline_s (DEADLINE_REQUESTS request times when that is longer)
QUICK = dict(prompts_per_phase=8, problems=8, max_tokens=64, cycles=1,
             controller={**DEMO_CONTROLLER, "min_votes": 2, "deadline_s": 45.0},
             concurrency=8, final_prompts=0, between_prompts=0, eval_share=0.25, learner=QUICK_LEARNER,
             fixed_per_family=4, fixed_humaneval=2,
             # a few harder and unseen prompts; the one short cycle keeps its train samples
             family_weights={"chain_sum_3terms": 0.25, "gcd": 0.25})



# upper bounds of the run's size (DemoConfig): a full run of the defaults takes 25-28 min on 2
# cores; these allow runs of days, not of centuries
MAX_CYCLES = 100
MAX_PROMPTS = 10_000
# the default model (SmolLM2-135M-Instruct) reads 8192 tokens (config.json
# max_position_embeddings): a reply may take half, the prompt keeps the rest
MAX_REPLY_TOKENS = 4096


def _finite(name: str, v: float, lo: float, hi: float, lo_open: bool = False) -> float:
    """``v`` when it is a number in [lo, hi] ((lo, hi] with ``lo_open``).

    Raises:
        ValueError: nan, an infinity or a value outside; the message starts with ``name``.
    """
    span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if math.isnan(v):
        raise ValueError(f"{name}: nan is not a number; give a finite number in {span}")
    if not (lo < v if lo_open else lo <= v) or not v <= hi:
        raise ValueError(f"{name}: must be a finite number in {span}, got {v}")
    return v


def _nonempty_path(v: Any) -> Any:
    """``v`` for pydantic's ``Path`` validation (a :class:`ReportDir` as a plain ``Path``).

    Raises:
        PydanticCustomError: ``v`` is an empty or blank string, or names (or lies under) an
            existing file that is not a directory (the demo writes its report into it).
    """
    if isinstance(v, (str, bytes)) and not v.strip():
        raise PydanticCustomError("empty_path", "out: an empty path names no directory (Path('') is the current "
                                                "one); give a directory, or . for the current one")
    if isinstance(v, (str, Path)):
        p = Path(v)
        for above in (p, *p.parents):  # the nearest existing path must be a directory
            if above.exists() or above.is_symlink():
                if not above.is_dir():
                    where = "" if above == p else f" (in {p})"
                    raise PydanticCustomError("not_a_directory",
                                              "out: {path}{where} is a file, not a directory; give a directory "
                                              "(new or existing)", {"path": str(above), "where": where})
                break
    return Path(v) if isinstance(v, ReportDir) else v


class ReportDir(type(Path())):
    """The type of :attr:`DemoConfig.out`: a path, refused when empty. ``Path("")`` is the
    current directory, so an empty ``--out ""`` would write there silently; typer validates an
    option of a ``Path`` subclass with the subclass's pydantic schema, which sees the string
    before it becomes a path. Values are plain ``pathlib.Path``."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        return core_schema.no_info_before_validator_function(_nonempty_path, handler(Path))


def role_models(role: str) -> list[type]:
    """The config models of ``flywheel <role>``, whose fields the demo's overrides name
    (``serve``, ``ingest``, ``controller``)."""
    if role == "serve":
        from serving.config import EngineConfig, ServeConfig

        return [EngineConfig, ServeConfig]
    if role == "ingest":
        from ingest.app import IngestConfig
        from ingest.join import JoinConfig

        return [JoinConfig, IngestConfig]
    from deploy.analysis import AnalysisConfig
    from deploy.controller import ControllerConfig
    from deploy.wiring import ControllerRunConfig

    return [ControllerRunConfig, ControllerConfig, AnalysisConfig]


@dataclass
class DemoConfig:
    """Knobs of one demo run. The defaults are the full run (experiment 3 in
    docs/experiments.md: 25-28 min on 2 cores); ``quick`` is the small sizing (:data:`QUICK`).
    Fields whose ``json_schema_extra`` says ``cli: False`` are set by programs, not by flags.

    Raises:
        pydantic.ValidationError: (a ``ValueError``) a value out of bounds, or ``learner``
            names no ``LearnerConfig`` field, restates its default or is refused by it; the
            message starts with the field's name.
    """

    out: ReportDir = Field(Path("flywheel-demo"), description="Report directory (a non-empty path); the home an earlier "
                                                              "run left in it is replaced.")
    quick: bool = Field(False, description="Small run (about 4 min on 2 cores; one cycle).",
                        json_schema_extra={"flags": "--quick"})
    cycles: int = Field(2, ge=1, le=MAX_CYCLES, description=f"Learner cycles, each canaried, at most {MAX_CYCLES} "
                                                            f"(--quick: {QUICK['cycles']}).")
    prompts_per_phase: int = Field(288, ge=1, le=MAX_PROMPTS,
                                   description=f"Requests per traffic phase (the first version's traffic, before the "
                                               f"first learner cycle), at most {MAX_PROMPTS} "
                                               f"(--quick: {QUICK['prompts_per_phase']}).",
                                   json_schema_extra={"flags": "--prompts"})
    between_prompts: int = Field(128, description="The stable version's traffic before each later cycle.",
                                 json_schema_extra=_PROGRAM)
    problems: int = Field(HUMANEVAL_PROBLEMS, description="HumanEval problems asked (the first N).",
                          json_schema_extra=_PROGRAM)
    # the families where v000000 is right 10-60 % of the time (docs/demo.md, measured), plus
    # two kinds of prompt no version trains on besides the eval split's fresh instances
    # (flywheel.workload.KINDS): a harder variant (chain_sum with three terms) and an unseen
    # family (gcd, held out)
    families: tuple[str, ...] = Field(("basic_arithmetic", "chain_sum", "humaneval", "chain_sum_3terms", "gcd"),
                                      description="Task families asked.", json_schema_extra=_PROGRAM)
    # a HumanEval request costs ~4x an arithmetic one (160-token reply): asked 1 time in 26;
    # the harder and unseen kinds are asked a quarter as often as a trained family: at a half
    # they took a third of the traffic, none of it trained on (runs N-P); at a quarter the
    # train and fresh kinds each get 40 % of requests instead of 34 % (D64)
    family_weights: Optional[dict[str, float]] = Field(
        default_factory=lambda: {"humaneval": 0.1, "chain_sum_3terms": 0.25, "gcd": 0.25},
        description="Relative weight of a family (1 when absent; None: uniform).", json_schema_extra=_PROGRAM)
    held_out: tuple[str, ...] = Field(DEFAULT_HELD_OUT, description="Families asked only in the eval split (the "
                                                                    "default: gcd when asked).",
                                      json_schema_extra=_PROGRAM)
    # half the prompts are never trained on: the eval figures need the votes. Its bounds are
    # checked by _floats, not ge/le: a click range would refuse nan as "not <= 1"
    eval_share: float = Field(0.5, description=f"Share of the other prompts in the eval split, a finite number in "
                                               f"[0, 1] (--quick: {QUICK['eval_share']}).")
    max_tokens: int = Field(HUMANEVAL_MAX_TOKENS, ge=1, le=MAX_REPLY_TOKENS,
                            description=f"New tokens per HumanEval completion, at most {MAX_REPLY_TOKENS}: half the "
                                        f"default model's 8192-token context (--quick: {QUICK['max_tokens']}).")
    max_tokens_short: int = Field(48, description="New tokens per reasoning-gym reply (a number, perhaps with a "
                                                  "sentence).", json_schema_extra=_PROGRAM)
    bad_candidate: bool = Field(False, description="End with a deliberately degraded candidate; its canary must "
                                                   "roll it back on evidence.",
                                json_schema_extra={"flags": "--bad-candidate"})
    final_prompts: int = Field(288, description="Requests served after the last canary: the last stable's eval "
                                                "figures.", json_schema_extra=_PROGRAM)
    temperature: float = Field(TEMPERATURE, description="Sampling temperature of the users' requests, in [0, 2].",
                               json_schema_extra=_PROGRAM)
    top_p: float = Field(TOP_P, description="Nucleus sampling of the users' requests, in (0, 1].",
                         json_schema_extra=_PROGRAM)
    # requests in flight, and the pod's --max-batch: a CPU decode step reads every expert's
    # weights whatever the batch, so 32 rows cost 11.3 ms per token against 15.9 ms at 16
    concurrency: int = Field(32, description="Requests in flight, and the pod's --max-batch.",
                             json_schema_extra=_PROGRAM)
    # users are split between the arms by a salted hash (sticky): 256 keep a 50 % step's arms
    # within a few % of even, where 32 gave 31/69 in run J (D61)
    users: int = Field(256, description="Simulated users.", json_schema_extra=_PROGRAM)
    learner: dict[str, Any] = Field(default_factory=lambda: dict(DEMO_LEARNER),
                                    description="LearnerConfig fields the demo changes, by name (DEMO_LEARNER).",
                                    json_schema_extra=_PROGRAM)
    serve: dict[str, Any] = Field(default_factory=lambda: dict(DEMO_SERVE),
                                  description="`flywheel serve` settings the demo changes, by name (DEMO_SERVE; "
                                              "the pod's --max-batch is `concurrency`).", json_schema_extra=_PROGRAM)
    ingest: dict[str, Any] = Field(default_factory=lambda: dict(DEMO_INGEST),
                                   description="`flywheel ingest` settings the demo changes, by name (DEMO_INGEST).",
                                   json_schema_extra=_PROGRAM)
    controller: dict[str, Any] = Field(default_factory=lambda: dict(DEMO_CONTROLLER),
                                       description="`flywheel controller` settings the demo changes, by name "
                                                   "(DEMO_CONTROLLER).", json_schema_extra=_PROGRAM)
    seed: Optional[int] = Field(None, ge=0, le=SEED_MAX - MAX_CYCLES,
                                description=f"RNG seed of the workload and the users, at most 2**63-1 - {MAX_CYCLES} "
                                            "(learner cycle c trains with seed + c, a signed 64-bit int; default: the "
                                            "learner's seed, LearnerConfig.seed).")
    behaviour: UserBehaviour = Field(default_factory=UserBehaviour, description="How the users vote.",
                                     json_schema_extra=_PROGRAM)
    # thumbs by default: every figure in README and docs/experiments.md up to experiment 3 was
    # measured with thumbs on 80 % of replies; experiment 4 measures the others first
    signals: str = Field("thumbs", description="What the users send: thumbs (a thumb on 80 % of replies), "
                                               "implicit (no thumbs: copy, edit, regenerate, followup on 70 %), "
                                               "all (a thumb on 10 % and the implicit ones).")
    # the fixed held-out set every version is scored on at the end (flywheel.workload.fixed_eval_set):
    # per reasoning-gym family asked, and HumanEval problems 120.. when HumanEval is asked
    fixed_per_family: int = Field(24, ge=0, description="Fixed eval prompts per reasoning-gym family.",
                                  json_schema_extra=_PROGRAM)
    fixed_humaneval: int = Field(8, ge=0, le=44, description="Fixed eval HumanEval problems (from 120).",
                                 json_schema_extra=_PROGRAM)

    @field_validator("eval_share", "temperature", "top_p")
    @classmethod
    def _floats(cls, v: float, info) -> float:
        lo, hi, lo_open = {"eval_share": (0, 1, False), "temperature": (0, 2, False), "top_p": (0, 1, True)}[
            info.field_name]
        return _finite(info.field_name, v, lo, hi, lo_open)

    def __post_init__(self):
        if self.seed is None:  # the run's seed starts where the learner's does
            self.seed = LearnerConfig.seed
        if self.signals not in SIGNALS:
            raise ValueError(f"signals: one of {', '.join(SIGNALS)}, got {self.signals!r}")
        for f, w in (self.family_weights or {}).items():
            if not (math.isfinite(w) and w >= 0):
                raise ValueError(f"family_weights: the weight of {f!r} must be a finite number >= 0, got {w}")
        check_learner(self.learner)
        for where, values in (("serve", self.serve), ("ingest", self.ingest), ("controller", self.controller)):
            check_overrides(role_models(where), values, where=where)
        # the default held-out family applies when it is asked (--families may leave it out)
        if self.held_out == DEFAULT_HELD_OUT:
            self.held_out = tuple(f for f in self.held_out if f in self.families)
        self._check_held_out()

    def _check_held_out(self) -> None:
        """Check that no held-out family is the base of a harder variant asked (the base must
        be trained on) and that some family asked is trained on.

        Raises:
            ValueError: the message starts with ``held_out:``.
        """
        for variant in self.families:
            base = GYM_VARIANTS.get(variant, (None,))[0]
            if base in self.held_out:
                raise ValueError(f"held_out: {base!r} is the base family of {variant!r}, a harder variant asked, "
                                 f"which must be trained on: hold out another family or leave {variant!r} out of "
                                 "--families")
        trained = [f for f in self.families if f not in self.held_out and f not in GYM_VARIANTS]
        if self.families and not trained:
            raise ValueError(f"held_out: no family asked is trained on (families {','.join(self.families)}, held "
                             f"out {','.join(self.held_out) or 'none'}): leave at least one family of --families "
                             "out of --held-out (--held-out '' holds out none)")

    def weights(self) -> dict[str, float] | None:
        """``family_weights`` restricted to the families asked (None: uniform)."""
        w = {f: x for f, x in (self.family_weights or {}).items() if f in self.families}
        return w or None

    def learner_setting(self, name: str):
        """The learner's value of LearnerConfig field ``name`` in this run (override or default)."""
        return self.learner.get(name, getattr(LearnerConfig, name))

    def sized(self, keep: set[str] = frozenset()) -> "DemoConfig":
        """This config with ``quick`` set and :data:`QUICK`'s sizing, except the fields in ``keep``
        (the ones a user chose).

        Raises:
            pydantic.ValidationError: the result is refused (see the class).
        """
        return replace(self, quick=True, **{k: v for k, v in QUICK.items() if k not in keep})

    @classmethod
    def for_mode(cls, out: Path, quick: bool, **kw) -> "DemoConfig":
        """The full run, or with ``quick`` :data:`QUICK`'s; ``kw`` (None values ignored) wins."""
        kw = {k: v for k, v in kw.items() if v is not None}
        cfg = cls(out=out, **kw)
        return cfg.sized(set(kw)) if quick else cfg
