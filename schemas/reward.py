"""The reward policy (``[reward]`` in ``flywheel.toml``): how every kind of user signal becomes
one component of a label, how the components combine into the scalar ``reward``, and how long
a label waits for its slowest signal. Declared once here; ingest seals labels by it, and every
sample carries its :meth:`RewardPolicy.digest`, so a sample says which policy scored it and
its component columns let an analyst re-score it under another policy without re-joining
(``docs/data.md``).

Components (each in [-1, 1]; a kind no user sent is absent, not 0), from the sample's columns:

==============  ==========================  ===============================================
kind            column                      component
==============  ==========================  ===============================================
thumb           ``thumb`` = mean of users'  ``thumb_up * (1 + thumb) / 2 + thumb_down *
                last thumbs (+1 / -1)       (1 - thumb) / 2`` (the mean of each user's
                                            last thumb mapped to ``thumb_up`` /
                                            ``thumb_down``; ``thumb`` itself with the
                                            default +1 / -1)
score ``name``  ``scores[name]`` = mean of  ``2 * (mean - min) / (max - min) - 1``: the
                users' last values          declared range [min, max] mapped onto [-1, 1]
copy            ``copied`` = users who      ``+1`` when ``copied >= 1``
                copied
regenerate      ``regenerated`` = users     ``-1`` when ``regenerated >= 1`` (the user asked
                who asked again             again: this completion did not serve)
edit            ``kept_share`` = mean of    ``2 * kept_share - 1``: all kept +1, all
                users' last kept share      rewritten -1
followup        ``followup`` = mean of      ``followup`` (satisfied +1, dissatisfied -1)
                users' last judgements
==============  ==========================  ===============================================

Combination: ``reward = clip(sum over present kinds k of weight_k * component_k, -clip, clip)``.
With ``thumb_overrides`` (default on) a label with a thumb takes the thumb and the scores
only: what a user said outright replaces what the join infers from copy, regenerate, edit and
followup. ``label = reward > 0``.

Defaults (a product that asks for thumbs and sees implicit signals): thumb ±1 at weight 1,
each implicit kind at weight 0.5 (two agreeing implicit signals weigh as much as one thumb),
no score declared (a product declares its own, each with its range), clip 1, every horizon 0 s
(the label waits ``seal_after_s`` of quiet after its last signal, as for thumbs; set a kind's
horizon when it arrives later than that, e.g. ``edit_horizon_s = 1800`` for edits reported
when a document is saved). With the defaults a label of thumbs alone has the reward it had
before the policy existed: the mean of the users' last thumbs.

Horizons: a label is sealed no earlier than its completion's ``created_at`` plus the largest
horizon among the kinds with a weight above 0 (:meth:`RewardPolicy.horizon_s`), and no later
than ``max_label_age_s`` (ingest's ``JoinConfig`` refuses a horizon above it).

A kind whose weight is 0, a score whose name is not declared, and a score outside its
declared range are dead-lettered by ingest with the reason (:meth:`RewardPolicy.refusal`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

#: The largest weight, thumb value, score bound or clip, so every combined reward is in
#: [-REWARD_LIMIT, REWARD_LIMIT]; the sample contract's bound on ``reward`` and on a score's
#: value (``schemas.events.Reward``, ``SCORE_MAX_ABS``) is this constant.
REWARD_LIMIT = 1e6
#: The kinds of feedback (``schemas.events.FeedbackKind``), each a component of the reward.
KINDS = ("thumb", "score", "copy", "regenerate", "edit", "followup")
#: The environment variables of ``[reward]``: ``FLYWHEEL_REWARD__<FIELD>`` (e.g.
#: ``FLYWHEEL_REWARD__EDIT_WEIGHT=0.25``; ``FLYWHEEL_REWARD__SCORES`` takes a JSON object).
ENV_PREFIX = "FLYWHEEL_REWARD__"
SCORE_NAME_PATTERN = r"^[A-Za-z0-9_.:/-]{1,64}$"  # = schemas.events.SCORE_NAME_PATTERN

_W = {"ge": 0.0, "le": REWARD_LIMIT}
_H = {"ge": 0.0, "le": 10 * 365 * 86400.0, "json_schema_extra": {"unit": "s"}}


class RewardPolicyError(ValueError):
    """A ``[reward]`` value is wrong; the message names the field (``reward.<field>`` or the
    ``FLYWHEEL_REWARD__<FIELD>`` variable) and the reason."""


class ScoreSpec(BaseModel):
    """One declared score: its range and weight.

    Fields:
        min, max: the values a user can give (finite, ``min < max``); a value outside is
            dead-lettered. The mean of users' last values maps linearly onto [-1, 1].
        weight: the component's weight (>= 0; 0 dead-letters the score).
        horizon_s: how long after the completion this score may still arrive (s, >= 0).
    """

    # strict: a score comes as a TOML table or a JSON object, whose numbers are numbers (a
    # boolean or a string is refused, never read as 1 or parsed)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    min: float = Field(ge=-REWARD_LIMIT, le=REWARD_LIMIT, description="Lowest value a user can give.")
    max: float = Field(ge=-REWARD_LIMIT, le=REWARD_LIMIT, description="Highest value a user can give.")
    weight: float = Field(1.0, **_W, description="Weight of the score's component.")
    horizon_s: float = Field(0.0, **_H, description="How long after the completion the score may arrive.")

    @model_validator(mode="after")
    def _range(self):
        if not self.min < self.max:
            raise ValueError(f"max: must be above min ({self.min:g}), got {self.max:g}")
        return self


class RewardPolicy(BaseModel):
    """The declared reward policy (module docstring: components, combination, horizons).

    Every weight is in [0, 1e6] (0 turns the kind off: its events are dead-lettered), every
    horizon in seconds in [0, 10 years], ``thumb_up`` / ``thumb_down`` in [-1e6, 1e6],
    ``clip`` in (0, 1e6]. Unknown keys are refused.

    Raises:
        pydantic.ValidationError (a ValueError): a field out of bounds, not finite, unknown,
            a score name outside ``[A-Za-z0-9_.:/-]{1,64}`` or a score with ``max <= min``;
            the error's ``loc`` names the field.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    thumb_up: float = Field(1.0, ge=-REWARD_LIMIT, le=REWARD_LIMIT, description="Value of an up-vote.")
    thumb_down: float = Field(-1.0, ge=-REWARD_LIMIT, le=REWARD_LIMIT, description="Value of a down-vote.")
    thumb_weight: float = Field(1.0, **_W, description="Weight of the thumb component.")
    thumb_horizon_s: float = Field(0.0, **_H, description="How long after the completion a thumb may arrive.")
    scores: dict[str, ScoreSpec] = Field(default_factory=dict, description="Declared scores by name.")
    copy_weight: float = Field(0.5, **_W, description="Weight of the copy component (+1).")
    copy_horizon_s: float = Field(0.0, **_H, description="How long after the completion a copy may arrive.")
    regenerate_weight: float = Field(0.5, **_W, description="Weight of the regenerate component (-1).")
    regenerate_horizon_s: float = Field(0.0, **_H, description="How long after the completion a regenerate "
                                                               "may arrive.")
    edit_weight: float = Field(0.5, **_W, description="Weight of the edit component (2 * kept_share - 1).")
    edit_horizon_s: float = Field(0.0, **_H, description="How long after the completion an edit may arrive.")
    followup_weight: float = Field(0.5, **_W, description="Weight of the followup component (mean of +-1).")
    followup_horizon_s: float = Field(0.0, **_H, description="How long after the completion a followup "
                                                             "may arrive.")
    clip: float = Field(1.0, gt=0.0, le=REWARD_LIMIT, description="The reward is clipped to [-clip, clip].")
    thumb_overrides: bool = Field(True, description="A thumb replaces the implicit components (copy, "
                                                    "regenerate, edit, followup).")
    _horizon_ms: int = PrivateAttr(0)

    @model_validator(mode="before")
    @classmethod
    def _finite(cls, data: Any) -> Any:
        # (pydantic checks a bound before finiteness: NaN would be reported as above the limit)
        if isinstance(data, Mapping):
            for k, v in data.items():
                if isinstance(v, float) and not math.isfinite(v):
                    raise ValueError(f"{k}: must be a finite number, got {v}")
        return data

    @model_validator(mode="after")
    def _names(self):
        for name in self.scores:
            if not re.match(SCORE_NAME_PATTERN, name):
                raise ValueError(f"scores: {name!r} is not a score name ({SCORE_NAME_PATTERN})")
        return self

    def model_post_init(self, _ctx: Any) -> None:
        self._horizon_ms = int(self.horizon_s() * 1000)

    # -- declaration ---------------------------------------------------------------------
    def weight(self, kind: str, name: str | None = None) -> float:
        """The weight of ``kind`` (a score: of its ``name``; 0 when the name is not declared).

        Raises:
            ValueError: ``kind`` is not one of :data:`KINDS`."""
        if kind == "score":
            spec = self.scores.get(name or "")
            return spec.weight if spec is not None else 0.0
        if kind not in KINDS:
            raise ValueError(f"kind: {kind!r} is not one of {', '.join(KINDS)}")
        return getattr(self, f"{kind}_weight")

    def horizon_s(self) -> float:
        """The largest horizon (s) among the kinds and scores with a weight above 0: a label
        is not sealed before its completion's ``created_at`` plus this."""
        hs = [getattr(self, f"{k}_horizon_s") for k in KINDS if k != "score" and getattr(self, f"{k}_weight") > 0]
        hs += [s.horizon_s for s in self.scores.values() if s.weight > 0]
        return max(hs, default=0.0)

    @property
    def horizon_ms(self) -> int:
        """:meth:`horizon_s` in ms (computed once)."""
        return self._horizon_ms

    def slowest(self) -> str:
        """The field holding :meth:`horizon_s` (``edit_horizon_s``, ``scores.<name>.horizon_s``),
        for error messages."""
        best, field = -1.0, "thumb_horizon_s"
        for k in KINDS:
            if k != "score" and getattr(self, f"{k}_weight") > 0 and getattr(self, f"{k}_horizon_s") > best:
                best, field = getattr(self, f"{k}_horizon_s"), f"{k}_horizon_s"
        for n, s in self.scores.items():
            if s.weight > 0 and s.horizon_s > best:
                best, field = s.horizon_s, f"scores.{n}.horizon_s"
        return field

    def refusal(self, kind: str, name: str | None, value: float | None) -> tuple[str, str] | None:
        """Why an event of ``kind`` (a score: ``name`` and ``value``) cannot be a component
        under this policy, as ``(field, reason)`` for its dead letter, or None when it can:
        a weight of 0, a score name not declared, a score outside its declared range."""
        if kind == "score":
            spec = self.scores.get(name or "")
            if spec is None:
                declared = ", ".join(sorted(self.scores)) or "none"
                return "name", (f"score {name!r} is not declared in the reward policy ([reward.scores]; "
                                f"declared: {declared})")
            if spec.weight == 0:
                return "name", f"score {name!r}: weight 0 in the reward policy"
            if value is not None and not spec.min <= value <= spec.max:
                return "value", (f"score {name!r}: {value:g} is outside its declared range "
                                 f"[{spec.min:g}, {spec.max:g}] in the reward policy")
            return None
        if self.weight(kind) == 0:
            return "kind", f"kind {kind!r} is not used: weight 0 in the reward policy"
        return None

    # -- combination ---------------------------------------------------------------------
    def components(self, thumb: float | None = None, copied: int = 0, regenerated: int = 0,
                   kept_share: float | None = None, followup: float | None = None,
                   scores: Mapping[str, float] | None = None) -> dict[str, float]:
        """Each present kind's component in [-1, 1] (unweighted), from a sample's component
        columns (module docstring): keys ``thumb``, ``copy``, ``regenerate``, ``edit``,
        ``followup`` and ``score:<name>``. A score not declared here is left out."""
        out: dict[str, float] = {}
        if thumb is not None:
            out["thumb"] = self.thumb_up * (1 + thumb) / 2 + self.thumb_down * (1 - thumb) / 2
        if copied:
            out["copy"] = 1.0
        if regenerated:
            out["regenerate"] = -1.0
        if kept_share is not None:
            out["edit"] = 2 * kept_share - 1
        if followup is not None:
            out["followup"] = followup
        for name, mean in (scores or {}).items():
            spec = self.scores.get(name)
            if spec is not None:
                out[f"score:{name}"] = 2 * (mean - spec.min) / (spec.max - spec.min) - 1
        return out

    def combine(self, thumb: float | None = None, copied: int = 0, regenerated: int = 0,
                kept_share: float | None = None, followup: float | None = None,
                scores: Mapping[str, float] | None = None) -> float:
        """The reward of one label from its component columns:
        ``clip(sum of weight * component over present kinds, -clip, clip)``; with
        ``thumb_overrides`` and a thumb present, copy, regenerate, edit and followup are left
        out. 0.0 when nothing is present. The result is finite (float)."""
        comps = self.components(thumb, copied, regenerated, kept_share, followup, scores)
        if self.thumb_overrides and "thumb" in comps:
            comps = {k: v for k, v in comps.items() if k == "thumb" or k.startswith("score:")}
        total = 0.0
        for k, v in comps.items():
            total += (self.scores[k[6:]].weight if k.startswith("score:") else getattr(self, f"{k}_weight")) * v
        return float(min(self.clip, max(-self.clip, total)))

    # -- identity ------------------------------------------------------------------------
    def canonical_json(self) -> str:
        """The policy as canonical JSON: every field, keys sorted, no spaces, floats as
        Python's shortest round-trip repr (what :meth:`digest` hashes)."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """The first 16 hex characters of the SHA-256 of :meth:`canonical_json`: the
        ``reward_policy`` column of every sample this policy sealed."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    # -- configuration -------------------------------------------------------------------
    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str = "reward", strict: bool = True) -> "RewardPolicy":
        """The policy of a ``[reward]`` table (``{field: value}``).

        ``strict`` (default): every value has its field's type (a number for a weight, a
        boolean for ``thumb_overrides``; a boolean or a string is refused where a number is
        wanted, as a number is where a boolean is); False reads text values as
        :meth:`from_env` does (the scores stay strict either way).

        Raises:
            RewardPolicyError: a key that is no field, or a value refused; the message
                names ``<where>.<field>`` and the reason."""
        try:
            return cls.model_validate(dict(table), strict=True if strict else None)
        except ValidationError as exc:
            e = exc.errors()[0]
            loc = ".".join(str(x) for x in e["loc"])
            msg = e["msg"].removeprefix("Value error, ")
            if e["type"] == "extra_forbidden":
                fields = ScoreSpec.model_fields if e["loc"][0] == "scores" and len(e["loc"]) == 3 else cls.model_fields
                msg = f"unknown key; keys are {', '.join(fields)}"
            if e["type"] == "value_error" and re.match(r"^\w+: ", msg):  # a check over several fields
                sub, msg = msg.split(": ", 1)  # names its field first
                loc = f"{loc}.{sub}" if loc else sub
            raise RewardPolicyError(f"{where}{'.' + loc if loc else ''}: {msg}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "RewardPolicy":
        """The policy of this process: ``FLYWHEEL_REWARD__<FIELD>`` variables (the ``[reward]``
        table of ``flywheel --config`` is put there by ``schemas.config.FlywheelConfig.apply_env``,
        without replacing a variable already set), then ``overrides`` (a flag's value) over
        them, over the defaults. ``FLYWHEEL_REWARD__SCORES`` is a JSON object
        (``{"helpfulness": {"min": 1, "max": 5, "weight": 0.5}}``); a boolean is ``true`` /
        ``false``.

        Raises:
            RewardPolicyError: a variable that names no field, a value that is not JSON where
                JSON is needed, or a value refused (the message names the variable or field).
        """
        env = os.environ if environ is None else environ
        table: dict[str, Any] = {}
        for var, text in env.items():
            if not var.startswith(ENV_PREFIX):
                continue
            key = var[len(ENV_PREFIX):].lower()
            if key not in cls.model_fields:
                raise RewardPolicyError(f"{var}: names no field of [reward] (fields: {', '.join(cls.model_fields)})")
            if key == "scores":
                try:
                    table[key] = json.loads(text)
                except ValueError as exc:
                    raise RewardPolicyError(f"{var}: not a JSON object: {exc}") from None
            else:
                table[key] = text
        table.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.from_table(table, where="reward", strict=False)
        except RewardPolicyError as exc:
            path, msg = str(exc).split(": ", 1)
            field, _, rest = path.removeprefix("reward.").partition(".")
            if field in table and overrides.get(field) is None:  # a variable's value: named as the variable
                # (with the path inside it: FLYWHEEL_REWARD__SCORES: helpfulness.max: ...)
                raise RewardPolicyError(f"{ENV_PREFIX}{field.upper()}: {rest + ': ' if rest else ''}{msg}") from None
            raise
