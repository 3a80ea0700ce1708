"""The torch engine's parts, behind the facade :class:`serving.engine.TorchEngine`.

- :mod:`serving.torch_engine.loader`: model loading. A checkpoint or a version's state dict
  becomes a :class:`serving.engine_base.LoadedModel` (hashes verified, expert-route hooks,
  prefix cache); several are served side by side, one per weight slot.
- :mod:`serving.torch_engine.scheduler`: the waiting queue, admission (continuous or static
  batching, ``waiting_served_ratio``) and the worker thread's loop over running batches.
- :mod:`serving.torch_engine.batch`: one running batch on one set of weights: its KV cache,
  prefill, decode, joins (fused into a decode forward or not), prefix-cache prefill, results.
- :mod:`serving.torch_engine.sampler`: what each step records per token: the sampled token
  (greedy, or temperature/top-k/top-p with a per-request seeded generator), its behavior
  logprob, top logprobs, the expert routes of a forward, and the aligned rescoring pass.

Imports go one way: ``serving.engine`` -> ``scheduler`` -> ``batch`` -> ``sampler``;
``serving.engine`` -> ``loader``; all of them -> ``serving.engine_base`` / ``serving.params``.
This package imports nothing into its namespace.
"""
