"""What chat front-ends need of a plain `pagedllm serve`: tools with no tool_choice answered in the call format
the model's template shows (no --tool-call-parser), and CORS for pages on other origins (--allowed-origins)."""
from __future__ import annotations

import sys

import httpx
import pytest

from pagedllm.entrypoints.openai.tool_calls import tool_call_parser_for_template
from tests.server.conftest import _stop_server, start_command

QWEN_LIKE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> Call one as "
             "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{% endif %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ORIGIN = "http://chat.example"
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("template,parser", [
    (QWEN_LIKE, "hermes"),
    ("<tools>{{ tools }}</tools> reply as <tool_call>\n<function=example_function_name>\n<parameter=p>\nv\n"
     "</parameter>\n</function>\n</tool_call>", "qwen3_coder"),
    ("{{ bos_token }}Environment: ipython ... <|python_tag|>{{ m }}", "llama3_json"),
    ({"default": QWEN_LIKE, "rag": "plain"}, "hermes"),
    ("{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %} ... [TOOL_CALLS]", "mistral"),
    ("<|start|>assistant to=functions.{{ name }}<|channel|>commentary json<|message|>{{ args }}<|call|>", "openai"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", None),
    (None, None),
])
def test_the_tool_call_parser_is_read_from_the_template(template, parser):
    assert tool_call_parser_for_template(template) == parser


@pytest.fixture(scope="module")
def front_end_server(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("front-end")
    template = folder / "qwen_like.jinja"
    template.write_text(QWEN_LIKE)
    proc, url = start_command(lambda port: [
        sys.executable, "-m", "pagedllm", "serve", str(tiny_llama), "--served-model-name", "tiny", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "512", "--chat-template", str(template), "--api-key", "k",
        "--allowed-origins", ORIGIN], folder)
    yield url, folder
    _stop_server(proc)


def test_tools_with_no_tool_choice_are_answered_without_parser_flags(front_end_server):
    """Open WebUI's first message: tools, no tool_choice, on a server started with no tool flags. The template
    renders <tool_call>, so hermes reads the reply; the start-up log says so."""
    url, folder = front_end_server
    r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer k"}, timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "time?"}], "tools": TOOLS, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    log = "".join(p.read_text() for p in folder.glob("server-*.std*"))
    assert "tool_choice auto reads hermes tool calls" in log


def test_a_browser_preflight_from_an_allowed_origin_is_answered_before_the_key_check(front_end_server):
    url, _ = front_end_server
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(f"{url}/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    r = httpx.get(f"{url}/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{url}/v1/chat/completions", headers={**preflight, "Origin": "http://elsewhere.example"})
    assert "access-control-allow-origin" not in other.headers


def test_no_cors_headers_unless_asked_for(http):
    """The default server sends none: a page on another origin cannot read its answers."""
    r = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
