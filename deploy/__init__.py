"""deploy: the rollout controller with canary analysis, the ledger, and the on-call CLI; the
model store and the fleet's desired-state record it changes are the shared :mod:`modelstore`.

Public API: ``deploy.serving_client.ServingAdmin`` / ``ServingAdminError``, ``deploy.analysis.analyze``,
``deploy.metrics.ServingMetricsSource``, ``deploy.ledger.Ledger`` / ``record`` / ``decisions``,
``deploy.controller.RolloutController`` / ``status_from_ledger`` / ``current_status``,
``deploy.fleet.reconcile_pods`` (every pod to it), ``deploy.operator.run_action`` (an operator
action: record, converge, per-pod outcomes), ``deploy.wiring.build_controller`` (the
controller's assembly from ``ControllerRunConfig``, ``deploy.controller.ControllerConfig`` and
``deploy.analysis.AnalysisConfig``, the config models its CLI options come from),
``deploy.status.gather_status`` (what ``flywheel status`` shows), ``deploy.commands.register``
(and ``pause_learner`` / ``resume_learner`` / ``learner_paused``).
Benchmarks live in ``bench/delta.py`` and ``bench/rollback.py``.
"""
