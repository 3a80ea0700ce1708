"""Server-sent events for ``n`` choices running at once (OpenAI's streaming shape).

:class:`ChoiceStreams` turns engine step outputs into text deltas per choice: the text of
all tokens so far (incrementally decoded when a ``text_stream`` is given, see
:class:`serving.http.prompts.TextStream`), cut at stop strings; a delta is sent only when the
text grew as a prefix extension and does not end in an incomplete UTF-8 sequence (U+FFFD), and
never shows the start of a stop string that the next tokens may complete; each
chunk carries the logprobs of the tokens since that choice's previous chunk. A choice's last
text is decoded from its whole completion once (:meth:`ChoiceStreams.on_finish`).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from serving.http import wire
from serving.params import GenResult, StepOutput


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that is the start (shorter than the whole) of a
    stop string: characters a stream must hold back, since the next tokens may complete the
    stop string and cut them (vLLM's server holds back the same). 0 without stop strings."""
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held


class ChoiceStreams:
    """Chunks of one streamed request.

    Args:
        rid: the response id (choice 0's completion id).
        cids: completion id of each choice, as strings.
        created: creation time (s since the epoch).
        model: the version serving the request.
        chat: chat (``chat.completion.chunk``) or text completion chunks.
        text: ``text(token_ids) -> str``, the decoded completion cut at stop strings.
        text_stream: ``text_stream()`` -> a new per-choice object whose ``add(new_token_ids)``
            returns the same text as ``text(all token ids so far)`` (an incomplete trailing
            UTF-8 sequence may be held back instead of shown as U+FFFD), e.g.
            :meth:`serving.http.prompts.PromptBuilder.text_stream`; None: ``text`` per step.
        token_str: one token's text (for logprobs).
        want_logprobs: chunks carry logprobs.
        include_usage: ``stream_options.include_usage`` (a last chunk with usage).
        prompt_len: prompt tokens (usage).
        stops: the request's stop strings: text that may be the start of one is held back
            until the next tokens show it is not (:func:`stop_prefix_len`), so the streamed
            text never shows what the stop string then cuts.
    """

    def __init__(self, rid: str, cids: list[str], created: int, model: str, *, chat: bool,
                 text: Callable[[list[int]], str], token_str: Callable[[int], str], want_logprobs: bool,
                 include_usage: bool, prompt_len: int, text_stream: Callable[[], object] | None = None,
                 stops: list[str] | None = None):
        self.rid, self.cids, self.created, self.model, self.chat = rid, cids, created, model, chat
        self.text, self.token_str = text, token_str
        self.want_logprobs, self.include_usage, self.prompt_len = want_logprobs, include_usage, prompt_len
        self.stops = [x for x in (stops or []) if x]
        n = len(cids)
        self.toks: list[list[int]] = [[] for _ in range(n)]  # without text_stream only
        self.streams = [text_stream() for _ in range(n)] if text_stream is not None else None
        self.sent = [""] * n  # text already sent, per choice
        self.lp_toks: list[list[tuple[int, float, list]]] = [[] for _ in range(n)]  # logprobs not yet sent
        self.lp_off = [0] * n  # text offset of choice i's next token (completions' text_offset)

    def _logprobs(self, i: int) -> dict | None:
        if not self.want_logprobs or not self.lp_toks[i]:
            return None
        steps, self.lp_toks[i] = self.lp_toks[i], []
        if self.chat:
            return wire.chat_logprobs_of(steps, self.token_str)
        out, self.lp_off[i] = wire.completion_logprobs_of(steps, self.token_str, self.lp_off[i])
        return out

    def chunk(self, i: int, delta_text: str | None, finish_reason: str | None, first: bool = False) -> str:
        """One SSE line pair for choice ``i``."""
        return wire.sse(wire.chunk(self.rid, self.created, self.model, i, self.cids[i], delta_text, finish_reason,
                                   chat=self.chat, first=first, include_usage=self.include_usage,
                                   logprobs=None if first else self._logprobs(i)))

    def on_step(self, i: int, step: StepOutput) -> str | None:
        """Choice ``i`` produced ``step``: its chunk, or None while there is no new text."""
        if self.want_logprobs:
            tops = step.top_logprobs or [[] for _ in step.token_ids]
            self.lp_toks[i] += zip(step.token_ids, step.logprobs, tops)
        if self.streams is not None:
            text = self.streams[i].add(step.token_ids)
        else:
            self.toks[i] += step.token_ids
            text = self.text(self.toks[i])
        if text.endswith("\ufffd"):
            return None  # incomplete UTF-8 sequence: wait for the next token
        if self.stops:
            text = text[:len(text) - stop_prefix_len(text, self.stops)]
        if len(text) > len(self.sent[i]) and text.startswith(self.sent[i]):
            delta, self.sent[i] = text[len(self.sent[i]):], text
            return self.chunk(i, delta, None)
        return None

    def on_finish(self, i: int, res: GenResult) -> list[str]:
        """Choice ``i`` ended: the rest of its text (if any) and its finish chunk."""
        out = []
        text = self.text(res.completion_token_ids)
        if len(text) > len(self.sent[i]) and text.startswith(self.sent[i]):
            out.append(self.chunk(i, text[len(self.sent[i]):], None))
        out.append(self.chunk(i, None if self.chat else "", wire.wire_finish(res.finish_reason)))
        return out

    async def events(self, q: asyncio.Queue, on_close: Callable[[], None]) -> AsyncIterator[str]:
        """The whole stream: reads ``(i, step, None)`` (a step of choice i) and ``(i, None,
        result or exception)`` (choice i ended) from ``q`` until every choice ended; an
        engine failure ends the stream with an OpenAI error event. ``on_close`` runs when the
        stream ends for any reason (a client that went away included)."""
        n = len(self.cids)
        try:
            if self.chat:
                for i in range(n):
                    yield self.chunk(i, "", None, first=True)
            results: list[GenResult | None] = [None] * n
            left = n
            while left:
                i, step, x = await q.get()
                if step is not None:
                    c = self.on_step(i, step)
                    if c is not None:
                        yield c
                    continue
                left -= 1
                if isinstance(x, BaseException):
                    yield wire.sse({"error": {"message": f"internal error: {type(x).__name__}",
                                              "type": "server_error", "param": None, "code": None}})
                    yield wire.sse("[DONE]")
                    return
                results[i] = x
                for c in self.on_finish(i, x):
                    yield c
            if self.include_usage:
                yield wire.sse(wire.usage_chunk(self.rid, self.created, self.model,
                                                wire.usage(self.prompt_len, results), chat=self.chat))
            yield wire.sse("[DONE]")
        finally:
            on_close()
