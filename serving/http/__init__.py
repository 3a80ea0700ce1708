"""The serving pod's HTTP layer, split the way vLLM's entrypoints are.

* :mod:`serving.http.auth`: who may call what (API keys, feedback-only keys, admin token),
  checked by an ASGI middleware before any body is read.
* :mod:`serving.http.limits`: request bodies over a bound (8 MiB) refused 413.
* :mod:`serving.http.errors`: every error in the OpenAI shape; no exception resets a
  keep-alive connection.
* :mod:`serving.http.metrics`: the Prometheus registry (vLLM's names and units) and the
  per-request HTTP counter.
* :mod:`serving.http.prompts`: request -> prompt token ids, budgets, stop strings, text.
* :mod:`serving.http.wire`: OpenAI response and stream-chunk builders (pure functions).
* :mod:`serving.http.streaming`: server-sent events for the n choices of a streamed request.
* :mod:`serving.http.completion_log`: one ``CompletionEvent`` per completion.
* :mod:`serving.http.serving_openai` / :mod:`serving.http.serving_feedback`: the logic of
  the endpoints, one class each.
* ``router_*``: the routes (v1 inference, feedback, admin, ops), thin.

:func:`serving.app.create_app` assembles them.
"""
