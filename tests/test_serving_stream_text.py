"""Streaming text without a whole-completion decode per token: :class:`serving.http.prompts.TextStream`
(incremental detokenization, stop strings) and :class:`serving.engine_base.LoopInbox` (engine
steps handed to the event loop in bursts, in order)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from serving.http.prompts import PromptBuilder, TextStream

# multi-byte UTF-8 (2, 3 and 4 bytes) that the tiny byte-level BPE (trained on ASCII) splits into
# one token per byte; ASCII words it merges; a stop string made of multi-byte characters
TEXT = "def add(a, b): héllo wörld — 日本語 🙂 the quick brown fox ∑ done"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.conftest import make_tiny_moe

    return AutoTokenizer.from_pretrained(make_tiny_moe(tmp_path_factory.mktemp("tiny")))


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _reference(ids: list[int], stops: list[str]) -> str:
    """Independent reference: the UTF-8 bytes of the tokens (the byte-level alphabet mapped back
    to bytes: GPT-2's bytes_to_unicode), decoded, cut before the earliest stop string."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_of = {chr(c): b for b, c in zip(bs, cs)}
    return _cut(bytes(byte_of[ch] for t in ids for ch in TOK_STRS[t]).decode("utf-8", errors="replace"), stops)


def _cut(text: str, stops: list[str]) -> str:
    at = [text.find(s) for s in stops if s in text]
    return text[:min(at)] if at else text


TOK_STRS: dict[int, str] = {}


@pytest.mark.parametrize("stops", [[], ["wörld"], ["日本"], ["🙂", "quick"], ["b", "add(a, b): hé"], ["∑ done"]])
@pytest.mark.parametrize("per_step", [1, 3])
def test_text_stream_equals_whole_decode_token_by_token(tok, stops, per_step):
    """At every step the streamed text is the whole-completion text cut at stops (what
    PromptBuilder.text gives), minus an incomplete trailing character; at the end it is equal."""
    ids = _ids(tok, TEXT)
    TOK_STRS.update({t: tok.convert_ids_to_tokens(t) for t in ids})
    assert len(ids) > len(TEXT.encode()) // 4  # multi-byte characters really are split over tokens
    assert any(_reference(ids[:k], []).endswith("\ufffd") for k in range(1, len(ids)))
    pb = PromptBuilder(tok, 256, 8192)
    s = pb.text_stream(stops)
    assert isinstance(s, TextStream) and s._ds is not None  # the incremental path is the one tested
    shown = ""
    for k in range(0, len(ids), per_step):
        shown = s.add(ids[k:k + per_step])
        whole = _reference(ids[:k + per_step], stops)
        assert whole.rstrip("\ufffd") == shown  # all whole characters, nothing of an incomplete one
    assert shown == _reference(ids, stops) == pb.text(ids, stops)


def test_text_stream_stop_that_starts_earlier_wins(tok):
    """A longer stop string completed later but starting before an earlier-found one moves the
    cut back (as the whole-text search does)."""
    ids = _ids(tok, "xabcd tail")
    pb = PromptBuilder(tok, 256, 8192)
    s = pb.text_stream(["bc", "abcd"])
    got = [s.add([t]) for t in ids]
    assert got[-1] == "x" == pb.text(ids, ["bc", "abcd"])
    s2 = pb.text_stream([""])  # an empty stop string cuts everything, as "" in text does
    assert s2.add(ids) == "" == pb.text(ids, [""])


def test_text_stream_skips_special_tokens_and_falls_back_without_backend(tok):
    ids = _ids(tok, "hello wörld") + [tok.convert_tokens_to_ids("<|im_end|>")] + _ids(tok, " fox")
    pb = PromptBuilder(tok, 256, 8192)
    fast, slow = pb.text_stream([]), TextStream(tok, ["fox"])
    assert slow._ds is None
    for t in ids:
        a, b = fast.add([t]), slow.add([t])
    assert a == "hello wörld fox" and b == "hello wörld "


def test_choice_streams_with_text_stream_send_the_same_text(tok):
    from serving.http.streaming import ChoiceStreams
    from serving.params import GenResult, StepOutput

    ids = _ids(tok, TEXT)
    pb = PromptBuilder(tok, 256, 8192)
    stops = ["brown"]

    def run(text_stream):
        s = ChoiceStreams("r", ["c0"], 0, "v1", chat=True, text=lambda x: pb.text(x, stops), token_str=pb.token_str,
                          want_logprobs=True, include_usage=False, prompt_len=3, text_stream=text_stream)
        out, lps = [], 0
        for t in ids:
            c = s.on_step(0, StepOutput("r", [t], [-0.25], []))
            if c is not None:
                d = json.loads(c.removeprefix("data: "))["choices"][0]
                out.append(d["delta"]["content"])
                lps += len(d["logprobs"]["content"])
        res = GenResult(completion_token_ids=ids, behavior_logprobs=[-0.25] * len(ids), top_logprobs=[],
                        expert_routes=None, finish_reason="stop", ttft_ms=1, latency_ms=2, version="v1")
        for c in s.on_finish(0, res):
            d = json.loads(c.removeprefix("data: "))["choices"][0]
            out.append(d["delta"].get("content") or "")
        return out, lps

    fast, lps = run(lambda: pb.text_stream(stops))
    assert "".join(fast) == _cut(TEXT, stops) and lps <= len(ids)
    assert all("\ufffd" not in d for d in fast)
    slow, _ = run(None)
    assert "".join(slow) == "".join(fast)


def test_loop_inbox_keeps_order_and_batches_wakeups():
    """Items put from another thread reach their queues in order, before a callback that thread
    scheduled after its puts; one burst wakes the loop about once."""
    from serving.engine_base import LoopInbox

    async def main():
        loop = asyncio.get_running_loop()
        inbox = LoopInbox(loop)
        qs = [asyncio.Queue() for _ in range(3)]
        wakes = {"n": 0}
        drain = inbox._drain

        def counted():
            wakes["n"] += 1
            drain()
        inbox._drain = counted
        seen_at_end = []

        def producer():
            for k in range(300):
                inbox.put(qs[k % 3], k)
            loop.call_soon_threadsafe(lambda: seen_at_end.append(sum(q.qsize() for q in qs)))
        th = threading.Thread(target=producer)
        th.start()
        th.join()
        while not seen_at_end:
            await asyncio.sleep(0.01)
        got = [[q.get_nowait() for _ in range(q.qsize())] for q in qs]
        return got, seen_at_end[0], wakes["n"]

    got, seen, wakes = asyncio.run(main())
    assert seen == 300  # every item was delivered before the later callback ran
    assert got == [list(range(i, 300, 3)) for i in range(3)]
    assert 1 <= wakes < 300


def test_stop_prefix_len_by_hand():
    from serving.http.streaming import stop_prefix_len

    assert stop_prefix_len("Hello\n", ["\n\nW"]) == 1
    assert stop_prefix_len("Hello\n\n", ["\n\nW"]) == 2
    assert stop_prefix_len("abc", ["xyz"]) == 0
    assert stop_prefix_len("ab", ["b", "abc"]) == 2  # a whole stop string is cut, never held
    assert stop_prefix_len("T", ["TT"]) == 1 and stop_prefix_len("", ["TT"]) == 0
    assert stop_prefix_len("x😊", ["😊!", "x😊?"]) == 2


@pytest.mark.parametrize("stops", [["wörld —"], ["brownie", "fox ∑"], ["日本語 🙂 thx"], ["e"]])
def test_streamed_text_never_shows_what_a_stop_string_cuts(tok, stops):
    """A stop string that spans tokens: at every chunk the text streamed so far is a prefix of
    the final (cut) text, and all chunks together equal it. A held-back start of a stop string
    that does not complete ("brown" of "brownie", "日本語 🙂 th" of "...thx") is sent later."""
    from serving.http.streaming import ChoiceStreams
    from serving.params import GenResult, StepOutput

    ids = _ids(tok, TEXT)
    pb = PromptBuilder(tok, 256, 8192)
    final = _cut(TEXT, stops)
    for text_stream in (lambda: pb.text_stream(stops), None):
        s = ChoiceStreams("r", ["c0"], 0, "v1", chat=False, text=lambda x: pb.text(x, stops), token_str=pb.token_str,
                          want_logprobs=False, include_usage=False, prompt_len=3, text_stream=text_stream,
                          stops=stops)
        sent = ""
        for t in ids:
            c = s.on_step(0, StepOutput("r", [t], [-0.25], []))
            if c is not None:
                sent += json.loads(c.removeprefix("data: "))["choices"][0]["text"]
                assert final.startswith(sent), (sent, final)
        res = GenResult(completion_token_ids=ids, behavior_logprobs=[-0.25] * len(ids), top_logprobs=[],
                        expert_routes=None, finish_reason="stop", ttft_ms=1, latency_ms=2, version="v1")
        for c in s.on_finish(0, res):
            sent += json.loads(c.removeprefix("data: "))["choices"][0]["text"]
        assert sent == final
