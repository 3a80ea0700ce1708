"""The HTTP side of ``tools`` and ``response_format`` on an engine that has structured outputs
(the vLLM engine's ``supports_structured``), over real HTTP with the official ``openai``
client, as LangChain's ``ChatOpenAI`` calls it.

vLLM itself is not needed here: the engine is the torch engine on the tiny MoE with the two
vLLM-only hooks replaced (``submit`` records and drops ``GenRequest.structured``;
``parse_tool_calls`` answers a fixed call and records what it was given). What vLLM does with
them (JSON-schema-constrained decoding, its tool parsers) is tested in
``tests/test_serving_vllm.py``. Checked here: the tools reach the chat template (the prompt's
tokens decode to the tool's name and description), the engine's parser gets the generated text
and the request's tools, the reply is an OpenAI tool call that the openai client parses
(``finish_reason`` ``tool_calls``, ``content`` None), the next turn with the assistant's
``tool_calls`` and a ``tool`` message is rendered and served, ``response_format`` reaches the
engine as vLLM structured-outputs keywords, and what is not supported is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from serving.app import create_app
from serving.engine import TorchEngine
from servers import ServerThread
from serving.slots import CheckpointStore, Slots

# a chat template that renders tools, an assistant's tool calls and tool results (Hermes-like)
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}: "
    "{{ t['function']['description'] }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}call {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
SCHEMA = TOOLS[0]["function"]["parameters"]
CALL = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}


class StructuredTorchEngine(TorchEngine):
    """The torch engine wearing the vLLM engine's two structured-output hooks."""

    supports_structured = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.tokenizer.chat_template = TEMPLATE
        self.structured_seen: list = []  # GenRequest.structured of every request
        self.prompts_seen: list[list[int]] = []
        self.parsed: list[tuple[str, list]] = []  # parse_tool_calls(text, tools) arguments

    def submit(self, req):
        self.structured_seen.append(req.structured)
        self.prompts_seen.append(list(req.prompt_token_ids))
        req.structured = None  # the torch engine would refuse it
        return super().submit(req)

    def parse_tool_calls(self, text: str, tools: list[dict]):
        self.parsed.append((text, tools))
        return None, [CALL]


@pytest.fixture(scope="module")
def served(tiny_moe_dir):
    eng = StructuredTorchEngine(tiny_moe_dir, max_batch=4)
    slots = Slots(eng, CheckpointStore(tiny_moe_dir))
    slots.start("v000000")
    srv = ServerThread(create_app(slots, None, pod="tools-test", salt="s")).start()
    yield eng, srv
    srv.stop()
    eng.close()


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_tools_reach_the_template_and_the_reply_is_a_tool_call(served):
    eng, srv = served
    n = len(eng.parsed)
    msgs = [{"role": "user", "content": "what is 1 + 2?"}]
    r = client(srv).chat.completions.create(model="flywheel", messages=msgs, tools=TOOLS, max_tokens=4,
                                            temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert (call.id, call.type, call.function.name) == ("call_0", "function", "add")
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2}
    prompt = eng.tokenizer.decode(eng.prompts_seen[-1])
    assert "Tools: add: adds two integers" in prompt and "what is 1 + 2?" in prompt
    (text, tools), = eng.parsed[n:]
    assert tools == TOOLS and isinstance(text, str) and r.usage.completion_tokens >= 1

    # the agent's next turn: its own call and the tool's result are rendered and served
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "call_0", "content": "3"}]
    r2 = client(srv).chat.completions.create(model="flywheel", messages=follow, tools=TOOLS, max_tokens=4,
                                             temperature=0)
    assert r2.choices[0].finish_reason == "tool_calls"
    prompt = eng.tokenizer.decode(eng.prompts_seen[-1])
    assert 'call add {"a": 1, "b": 2}' in prompt and "<|im_start|>tool\n3<|im_end|>" in prompt


def test_no_tools_or_tool_choice_none_is_plain_text(served):
    eng, srv = served
    n = len(eng.parsed)
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        r = client(srv).chat.completions.create(model="flywheel", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, temperature=0, **extra)
        assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)
        assert r.choices[0].finish_reason in ("length", "stop")
        assert "Tools:" not in eng.tokenizer.decode(eng.prompts_seen[-1])
    assert len(eng.parsed) == n  # the parser only runs when the model may call a tool


@pytest.mark.parametrize("rf,want", [
    ({"type": "json_schema", "json_schema": {"name": "o", "strict": True, "schema": SCHEMA}}, {"json": SCHEMA}),
    ({"type": "json_object"}, {"json_object": True}),
    ({"type": "text"}, None),
])
def test_response_format_reaches_the_engine_as_structured_outputs(served, rf, want):
    """LangChain's ``with_structured_output`` (method json_schema, its default) sends the first
    shape, ``json_mode`` the second."""
    eng, srv = served
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(srv.url + path, timeout=60,
                       json={"model": "flywheel", "max_tokens": 2, "temperature": 0, "response_format": rf, **body})
        assert r.status_code == 200, r.text
        assert eng.structured_seen[-1] == want, path


@pytest.mark.parametrize("extra,param", [
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": TOOLS, "stream": True}, "stream"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "o"}}}, "response_format.json_schema.schema"),
])
def test_what_is_not_supported_is_a_400_naming_the_field(served, extra, param):
    eng, srv = served
    n = len(eng.prompts_seen)
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": "flywheel", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert len(eng.prompts_seen) == n  # refused before the engine


def test_tool_call_parser_is_a_vllm_engine_option(tmp_path):
    from typer.testing import CliRunner

    from flywheel.cli import app
    from schemas.settings import free_port

    r = CliRunner().invoke(app, ["serve", "--tool-call-parser", "pythonic", "--model-dir", str(tmp_path),
                                 "--port", str(free_port())])
    out = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 2 and "--tool-call-parser" in out and "vLLM engine only" in out, out


VLLM_CHILD = """
import json, sys
from typer.testing import CliRunner
import serving.pod
from flywheel.cli import app
got = {}
def build_pod(*a, **kw):  # what the serve command hands the pod, without loading a model
    got.update(kw["vllm_config"].model_dump())
    got["loop"] = type(kw["loop"]).__module__  # the loop the HTTP server will run on
    raise SystemExit(0)
serving.pod.build_pod = build_pod
out = {}
for parser in ("pythonic", "nope"):
    r = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--model-dir", sys.argv[1], "--port", sys.argv[2],
                                 "--tool-call-parser", parser])
    out[parser] = {"code": r.exit_code, "output": " ".join(r.output.replace("│", " ").split())}
out["engine_options"] = got
print("CHILD_JSON " + json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_tool_call_parser_reaches_the_vllm_engine_and_an_unknown_one_is_refused(tiny_moe_dir, tmp_path):
    """In the vLLM venv: ``--tool-call-parser pythonic`` reaches the engine's options; a name
    that vLLM's registry does not hold is a usage error naming the flag and the known parsers,
    before any model load."""
    import subprocess
    from pathlib import Path

    from schemas.settings import free_port

    root = Path(__file__).resolve().parents[1]
    vpy = root / ".venv-vllm" / "bin" / "python"
    if not vpy.exists():
        pytest.skip("no vLLM venv (flywheel vllm-venv)")
    p = subprocess.run([str(vpy), "-c", VLLM_CHILD, str(tiny_moe_dir), str(free_port())], cwd=root,
                       capture_output=True, text=True, timeout=280,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "FLYWHEEL_HOME": str(tmp_path)})
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("CHILD_JSON ")]
    assert p.returncode == 0 and line, p.stdout[-2000:] + p.stderr[-3000:]
    out = json.loads(line[0].removeprefix("CHILD_JSON "))
    assert out["pythonic"]["code"] == 0 and out["engine_options"]["tool_call_parser"] == "pythonic", out
    assert out["engine_options"]["loop"].startswith("uvloop"), out  # one uvloop loop for HTTP and AsyncLLM
    bad = out["nope"]
    assert bad["code"] == 2 and "--tool-call-parser" in bad["output"], bad
    assert "'nope' is not a vLLM tool parser" in bad["output"] and "hermes" in bad["output"], bad
