"""learner: RL updates of the served MoE policy from user feedback (DESIGN §1, §4).

Modules: ``batch`` (RewardedSamples -> left-padded batch), ``replay`` (router replay),
``losses`` (KTO, REINFORCE, truncated importance sampling, KL; pure functions),
``trainer`` (DeepSpeed cycle: staleness filter, reference pass, mismatch, K steps,
checkpoint/resume), ``gate`` (evaluation gate), ``cycle`` (Parquet -> train -> model store),
``commands`` (``flywheel learn``).
"""
