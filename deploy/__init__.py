"""deploy: model store (bit-exact deltas), rollout controller with canary analysis, ledger,
and the on-call CLI.

Public API: ``deploy.store.ModelStore`` / ``CorruptVersionError``,
``deploy.serving_client.ServingAdmin`` / ``ServingAdminError``, ``deploy.analysis.analyze``,
``deploy.ledger.Ledger`` / ``record`` / ``decisions``, ``deploy.controller.RolloutController``,
``deploy.commands.register``.
"""
