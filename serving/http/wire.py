"""OpenAI response shapes, built from :class:`serving.params.GenResult` (pure functions).

Flywheel's extras: every choice (and every streamed chunk's choice) carries
``completion_id``, the id feedback targets; the response ``id`` is choice 0's.
"""

from __future__ import annotations

import json
from typing import Callable

from serving.params import GenResult

TokenStr = Callable[[int], str]


def wire_finish(fr: str) -> str:
    """Engine finish reason -> OpenAI's (``abort`` is reported as ``stop``)."""
    return "stop" if fr == "abort" else fr


def _steps(res: GenResult) -> list[tuple[int, float, list]]:
    tops = res.top_logprobs or [[] for _ in res.completion_token_ids]
    return list(zip(res.completion_token_ids, res.behavior_logprobs, tops))


def chat_logprobs_of(steps: list[tuple[int, float, list]], tokstr: TokenStr) -> dict:
    """Chat ``logprobs`` of tokens ``[(token id, raw logprob, [(top id, logprob), ...]), ...]``
    (a whole completion, or one streamed chunk's tokens)."""
    content = []
    for t, lp, top in steps:
        s = tokstr(t)
        tops = [{"token": tokstr(a), "logprob": b, "bytes": list(tokstr(a).encode())} for a, b in top]
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": tops})
    return {"content": content, "refusal": None}


def completion_logprobs_of(steps: list[tuple[int, float, list]], tokstr: TokenStr, offset: int = 0
                           ) -> tuple[dict, int]:
    """Text-completion ``logprobs`` of ``steps`` (as :func:`chat_logprobs_of`) whose first
    token starts at text offset ``offset``; returns it and the offset after the last token."""
    tokens, offs, off = [], [], offset
    for t, _lp, _top in steps:
        s = tokstr(t)
        tokens.append(s)
        offs.append(off)
        off += len(s)
    tops = [{tokstr(a): b for a, b in top} for _t, _lp, top in steps] if any(top for *_x, top in steps) else None
    return {"tokens": tokens, "token_logprobs": [lp for _t, lp, _top in steps], "top_logprobs": tops,
            "text_offset": offs}, off


def chat_logprobs(res: GenResult, tokstr: TokenStr) -> dict:
    """``choices[i].logprobs`` of a chat completion (raw behavior logprobs)."""
    return chat_logprobs_of(_steps(res), tokstr)


def completion_logprobs(res: GenResult, tokstr: TokenStr) -> dict:
    """``choices[i].logprobs`` of a text completion (raw behavior logprobs)."""
    return completion_logprobs_of(_steps(res), tokstr)[0]


def usage(prompt_len: int, results: list[GenResult]) -> dict:
    """The ``usage`` object (all choices' completion tokens summed)."""
    n_out = sum(len(r.completion_token_ids) for r in results)
    return {"prompt_tokens": prompt_len, "completion_tokens": n_out, "total_tokens": prompt_len + n_out}


def choice(i: int, text: str | None, res: GenResult, cid: str, *, chat: bool, logprobs: dict | None,
           tool_calls: list[dict] | None = None) -> dict:
    """One non-streamed choice; a chat choice with ``tool_calls`` (OpenAI shape) has finish
    reason ``tool_calls``."""
    if chat:
        msg: dict = {"role": "assistant", "content": text}
        finish = wire_finish(res.finish_reason)
        if tool_calls:
            msg["tool_calls"], finish = tool_calls, "tool_calls"
        return {"index": i, "message": msg, "finish_reason": finish, "logprobs": logprobs, "completion_id": cid}
    return {"index": i, "text": text, "finish_reason": wire_finish(res.finish_reason), "logprobs": logprobs,
            "completion_id": cid}


def response(rid: str, created: int, model: str, choices: list[dict], usage_: dict, *, chat: bool) -> dict:
    """A whole (non-streamed) ``chat.completion`` / ``text_completion``."""
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage_}


def chunk(rid: str, created: int, model: str, i: int, cid: str, delta_text: str | None,
          finish_reason: str | None, *, chat: bool, first: bool = False, include_usage: bool = False,
          logprobs: dict | None = None) -> dict:
    """One streamed chunk for choice ``i``: a text delta and/or its finish reason; the first
    chat chunk of a choice carries ``role``; ``logprobs`` (when the request asked for them)
    covers the tokens since the choice's previous chunk."""
    if chat:
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if delta_text is not None:
            delta["content"] = delta_text
        ch = {"index": i, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
    else:
        ch = {"index": i, "text": delta_text or "", "finish_reason": finish_reason, "logprobs": logprobs}
    ch["completion_id"] = cid
    d = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
         "model": model, "choices": [ch]}
    if include_usage:
        d["usage"] = None
    return d


def usage_chunk(rid: str, created: int, model: str, usage_: dict, *, chat: bool) -> dict:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage_}


def sse(data: dict | str) -> str:
    """One server-sent event line pair (``data: ...``), JSON with ASCII escapes."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
