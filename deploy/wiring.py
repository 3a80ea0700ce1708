"""The controller's assembly: store, fleet record, pod discovery, metrics, guards, loop.

:func:`build_controller` wires a :class:`deploy.controller.RolloutController` from three
validated models (where it runs, :class:`ControllerRunConfig`; the rollout policy,
:class:`deploy.controller.ControllerConfig`; the canary analysis,
:class:`deploy.analysis.AnalysisConfig`) and the paths of ``schemas.settings``. ``flywheel
controller`` only parses its options into these models, calls it and runs the loop; tests
and other programs call it the same way. Setup errors are :class:`SetupError` (the CLI maps
them to exit 2 for a bad setting, 1 otherwise), never a process exit.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Optional

from pydantic import Field, field_validator
from pydantic.dataclasses import dataclass

from deploy.controller import ControllerConfig, RolloutController
from modelstore.desired import DesiredState, FleetRecord
from deploy.discovery import PodDiscovery
from deploy.serving_client import ServingAdmin, ServingAdminError
from modelstore.store import ModelStore
from schemas import settings

log = logging.getLogger(__name__)

GUARD_SOURCES = ("samples", "completions")
PROMETHEUS_URL_ENV = "FLYWHEEL_PROMETHEUS_URL"


@dataclass
class ControllerRunConfig:
    """Where and how ``flywheel controller`` runs (the rollout policy is
    :class:`deploy.controller.ControllerConfig`); each field's ``description`` is its help.

    Raises:
        ValueError (pydantic's ValidationError): a value out of bounds, naming the field.
    """

    serving: Optional[list[str]] = Field(
        None, description="serving pod URL, or dns+http://SERVICE:PORT for every pod behind a headless Service "
        "(asked again before each step); repeat for several; recorded in the fleet's desired state for operator "
        "commands (default: the pods recorded there, else $FLYWHEEL_SERVING_URL)")
    poll_s: float = Field(5.0, ge=0, description="seconds between reconcile steps", json_schema_extra={"unit": "s"})
    metrics_port: int = Field(0, ge=0, le=65535, description="serve the controller's Prometheus /metrics on this "
                              "port (0 = off)")
    metrics_provider: str = Field("scrape", description="canary metrics from 'scrape' (every pod's /metrics, the "
                                  "default) or 'prometheus' (PromQL on --prometheus-url)")
    prometheus_url: Optional[str] = Field(None, description=f"Prometheus base URL for --metrics-provider prometheus "
                                          f"(default ${PROMETHEUS_URL_ENV})")
    prometheus_selector: str = Field("", description="label matchers added to every PromQL series, e.g. "
                                     "job=\"flywheel-serving\"")
    guards_from: str = Field("samples", description="reward-hacking guards over 'samples' (voted completions) or "
                             "'completions' (every served completion, read from the completions topic; "
                             "deploy/replies.py)")
    reply_judge: Optional[str] = Field(None, description="module:attribute of the workload's has_answer judge for "
                                       "the no-answer guard (with --guards-from completions; default: an empty "
                                       "reply has no answer)")

    @field_validator("guards_from")
    @classmethod
    def _guards_from(cls, v: str) -> str:
        if v not in GUARD_SOURCES:
            raise ValueError(f"must be 'samples' or 'completions', got {v!r}")
        return v


class SetupError(Exception):
    """The controller cannot be assembled. ``usage``: a bad setting (the CLI exits 2, naming
    ``param_hint`` when given), else a state or runtime error (exit 1)."""

    def __init__(self, msg: str, usage: bool = False, param_hint: str | None = None):
        super().__init__(msg)
        self.usage, self.param_hint = usage, param_hint


def rollout_status_path() -> Path:
    """Where the controller persists its :class:`deploy.controller.RolloutStatus` (a cache of the ledger)."""
    return settings.home(create=False) / "deploy" / "rollout.json"  # RolloutStatus.save creates its directory


def bootstrap() -> str | None:
    """The Kafka bootstrap of ``schemas.settings``, or None when none is configured."""
    try:
        return settings.bootstrap()
    except RuntimeError:
        return None


def admin(serving: str | None, timeout_s: float) -> ServingAdmin:
    """The admin client of one pod (``serving``, else ``$FLYWHEEL_SERVING_URL``); each call
    bounded by ``timeout_s`` (s)."""
    return ServingAdmin(serving or settings.serving_url(), os.environ.get("FLYWHEEL_ADMIN_TOKEN"), timeout_s=timeout_s)


def _with_pods(specs: list[str], d: DesiredState) -> DesiredState:
    d.pods = list(specs)
    return d


def _discovery(fleet: FleetRecord, serving: list[str] | None, timeout_s: float) -> tuple[PodDiscovery, list]:
    """The pods the controller reaches (``serving``, else the pods recorded in the fleet's
    desired state, else ``$FLYWHEEL_SERVING_URL``), recorded there for the operator
    commands, and the admins it finds now (none yet: asked again each step)."""
    try:
        recorded = fleet.read().pods
    except ValueError as exc:
        raise SetupError(f"fleet desired-state record: {exc}") from None
    specs = serving or recorded or [settings.serving_url()]
    try:
        pods = PodDiscovery(specs, lambda u: admin(u, timeout_s))
    except ValueError as exc:
        raise SetupError(str(exc), usage=True) from None
    try:
        if fleet.read().pods != specs:  # operator commands reach the pods the controller reaches
            fleet.change(functools.partial(_with_pods, specs), "controller", "pods", f"serving specs {', '.join(specs)}")
    except ValueError as exc:
        raise SetupError(f"fleet desired-state record: {exc}") from None
    try:
        return pods, pods()
    except ValueError as exc:
        raise SetupError(str(exc), usage=True) from None
    except ServingAdminError as exc:  # no ready pod yet: the controller asks again each step
        log.warning("%s", exc)
        return pods, []


def _arm_metrics(run: ControllerRunConfig):
    """The canary's metric provider: None for ``scrape`` (the controller's default over the pods)."""
    if run.metrics_provider == "scrape":
        return None
    from deploy.metrics import metric_provider

    try:
        return metric_provider(run.metrics_provider, prometheus_url=run.prometheus_url or os.environ.get(
            PROMETHEUS_URL_ENV), selector=run.prometheus_selector)
    except ValueError as exc:
        raise SetupError(str(exc), usage=True, param_hint="--metrics-provider/--prometheus-url") from exc


def _served(run: ControllerRunConfig):
    """Every served completion read from the completions topic (``guards_from`` completions), else None."""
    if run.guards_from != "completions":
        return None
    from deploy.replies import ServedCompletions, load_judge

    try:
        judge = load_judge(run.reply_judge) if run.reply_judge else None
    except ValueError as exc:
        raise SetupError(str(exc), usage=True, param_hint="--reply-judge") from exc
    if bootstrap() is None:
        raise SetupError("needs a Kafka bootstrap (FLYWHEEL_KAFKA_BOOTSTRAP) to read the completions topic",
                         usage=True, param_hint="--guards-from")
    return ServedCompletions(bootstrap(), judge=judge).start()


def build_controller(run: ControllerRunConfig, policy: ControllerConfig, serving_timeout_s: float) -> RolloutController:
    """The rollout controller of this deployment: the store, ledger and samples of
    ``schemas.settings``, the fleet's desired-state record (the pods recorded there), the
    pods' discovery (each call bounded by ``serving_timeout_s``, s), the canary metrics and
    guard sources of ``run``, the policy ``policy``; its /metrics served when
    ``run.metrics_port``. Does not start the loop (:meth:`RolloutController.run_forever`).

    Raises:
        SetupError: the fleet record is unreadable, a pod spec, the metrics provider or the
            reply judge is invalid, or completions guards lack a Kafka bootstrap.
    """
    store = ModelStore(settings.store_dir())
    fleet = FleetRecord(store)
    pods, admins = _discovery(fleet, run.serving, serving_timeout_s)
    arm_metrics = _arm_metrics(run)
    served = _served(run)
    ctl = RolloutController(store, admins, settings.samples_dir(), settings.ledger_path(), rollout_status_path(),
                            policy, bootstrap=bootstrap(), discover=pods, arm_metrics=arm_metrics, fleet=fleet,
                            served=served)
    if run.metrics_port:
        ctl.exported.serve(run.metrics_port)
    return ctl
