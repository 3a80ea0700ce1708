"""VLLMEngine's blocking calls on a loop it shares with the HTTP server (``flywheel serve
--engine vllm``): :meth:`VLLMEngine._call` before the loop runs, from a thread while it runs,
and on the loop itself. Runs without vLLM: only the loop plumbing is under test, so the
engine object is made without its constructor (which starts vLLM)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from serving.engine_vllm import VLLMEngine, new_event_loop


def _engine_on(loop) -> VLLMEngine:
    eng = object.__new__(VLLMEngine)
    eng._loop, eng._thread = loop, None
    return eng


async def _double(x: int) -> int:
    await asyncio.sleep(0)
    return 2 * x


def test_call_before_the_loop_runs_runs_it_to_completion():
    loop = new_event_loop()
    try:
        assert _engine_on(loop)._call(_double(21)) == 42  # startup: load_base before uvicorn runs
        assert not loop.is_running()
    finally:
        loop.close()


def test_call_from_a_thread_while_the_loop_runs_and_refused_on_the_loop():
    loop = new_event_loop()
    eng = _engine_on(loop)
    got: dict = {}

    def admin_thread():  # /admin/load runs slots.load_candidate in the thread pool
        got["thread"] = eng._call(_double(5), timeout_s=10)

    async def main():
        t = threading.Thread(target=admin_thread)
        t.start()
        await asyncio.to_thread(t.join, 10)
        with pytest.raises(RuntimeError, match="own event loop"):
            eng._call(_double(1))  # would wait for itself: refused at once
        got["loop"] = "alive"

    try:
        loop.run_until_complete(asyncio.wait_for(main(), 20))
    finally:
        loop.close()
    assert got == {"thread": 10, "loop": "alive"}
