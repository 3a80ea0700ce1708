"""learner: RL updates of the served MoE policy from user feedback (DESIGN §1, §4).

Modules: ``batch`` (RewardedSamples -> left-padded batch), ``data`` (a cycle's samples read
in micro-batches), ``replay`` (router replay), ``losses`` (KTO, REINFORCE, PSR, truncated
importance sampling, KL; pure functions), ``trainer`` (DeepSpeed cycle: staleness filter,
reference pass, mismatch, K steps, checkpoint/resume), ``gate`` (evaluation gate), ``cycle``
(Parquet -> train -> model store), ``config`` and ``daemon_config`` (the settings, declared
once), ``daemon`` (the role assembled), ``metrics`` (Prometheus), ``rank`` (is this rank 0),
``extensions`` (stale JIT-build locks), ``commands`` (``flywheel learn``).
"""
