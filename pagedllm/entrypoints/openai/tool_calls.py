"""Tool calling in chat completions: what constrains the output for each tool_choice, and the parsers (named as
vLLM's --tool-call-parser) that turn a reply into `message.tool_calls`.

- tool_choice "none": the tools are rendered by the chat template, the reply is text.
- "auto" (needs --enable-auto-tool-choice and a --tool-call-parser): the model decides; the parser finds the
  calls in its text (hermes: <tool_call>{...}</tool_call> blocks; llama3_json: a JSON object
  {"name": ..., "parameters": {...}}, several separated by ";").
- "required": the reply is constrained (JSON schema grammar) to a non-empty array of
  {"name": <a tool>, "parameters": <that tool's schema>}, so every call parses and validates (one call only
  with parallel_tool_calls false).
- a named function: the reply is constrained to that function's parameters schema.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import InvalidParameterError
from pagedllm.structured_output import GuidedDecodingParams

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _tool_schema(tool: dict) -> dict:
    params = (tool.get("function") or {}).get("parameters")
    return params if isinstance(params, dict) else {"type": "object"}


def check_tools(tools: list[dict] | None, tool_choice) -> dict[str, dict]:
    """name -> tool, after checking their shape and the choice against them (400s naming the field)."""
    by_name: dict[str, dict] = {}
    for k, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidParameterError("tools", f"tools[{k}] must be {{\"type\": \"function\", \"function\": "
                                                 f"{{\"name\": ..., \"parameters\": {{...}}}}}}")
        by_name[fn["name"]] = tool
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if name not in by_name:
            raise InvalidParameterError("tool_choice", f"tool_choice names the function {name!r}, which is not "
                                                       f"among the tools ({', '.join(by_name) or 'none'})")
    elif tool_choice not in (None, "none", "auto", "required"):
        raise InvalidParameterError("tool_choice", f"tool_choice must be none, auto, required or "
                                                   f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}; "
                                                   f"got {tool_choice!r}")
    if tool_choice == "required" and not by_name:
        raise InvalidParameterError("tool_choice", "tool_choice required needs tools")
    return by_name


def constraint_for(tools: dict[str, dict], tool_choice, parallel: bool = True) -> GuidedDecodingParams | None:
    """The grammar a tool choice puts on the reply (None: free text); without `parallel` calls, one call."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return GuidedDecodingParams(json=_tool_schema(tools[name]), param="tool_choice")
    if tool_choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": _tool_schema(tool)},
                  "required": ["name", "parameters"], "additionalProperties": False} for name, tool in tools.items()]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        return GuidedDecodingParams(json=schema, param="tool_choice")
    return None


def calls_from_constrained(text: str, tool_choice) -> list[ToolCall]:
    """The calls of a finished reply constrained by constraint_for (they parse: the grammar made them). The
    arguments are the model's text, as streamed."""
    return [ToolCall(call.name, call.arguments) for call in partial_calls(text, tool_choice)]


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content left, calls) of a free reply under tool_choice auto. Text that does not parse as a call stays
    content."""
    if parser == "hermes":
        calls = []
        for body in _HERMES.findall(text):
            call = _call_of(body, "arguments")
            if call is None:
                return text, []
            calls.append(call)
        content = _HERMES.sub("", text).strip() if calls else text
        return (content or None) if calls else text, calls
    if parser == "llama3_json":
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = [_call_of(part, "parameters") for part in body.split(";") if part.strip()]
        if not calls or any(c is None for c in calls):
            return text, []
        return None, calls
    raise ValueError(f"unknown tool call parser {parser!r}; known: {', '.join(TOOL_CALL_PARSERS)}")


_HERMES_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def content_so_far(parser: str, text: str) -> str:
    """The beginning of a free reply (tool_choice auto) that is content whatever comes next: streamed as it is
    written. hermes: the text before a <tool_call> (or before what may be the start of one); llama3_json: the
    whole text once it cannot be a call (it does not start with "{" or <|python_tag|>). Trailing whitespace
    waits (a finished reply's content is stripped around its calls)."""
    if parser == "hermes":
        cut = text.find(_HERMES_OPEN)
        if cut < 0:
            cut = len(text)
            for k in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):
                if _HERMES_OPEN.startswith(text[-k:]):
                    cut = len(text) - k
                    break
        return text[:cut].rstrip()
    head = text.lstrip()
    if not head or head.startswith("{") or _PYTHON_TAG.startswith(head[:len(_PYTHON_TAG)]):
        return ""
    return text.rstrip()


def _call_of(body: str, arguments_key: str) -> ToolCall | None:
    try:
        value: Any = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    return ToolCall(value["name"], args if isinstance(args, str) else json.dumps(args))


@dataclass
class PartialCall:
    """A call as far as a constrained reply has been written: its name once complete, its arguments' text so far."""

    name: str | None
    arguments: str
    complete: bool


def partial_calls(text: str, tool_choice) -> list[PartialCall]:
    """The calls in the beginning of a reply constrained by constraint_for, read as it streams (the grammar
    fixes the shape: a named function's reply is its arguments; "required" writes an array of
    {"name": ..., "parameters": {...}})."""
    if isinstance(tool_choice, dict):
        end = _value_end(text, text.index("{")) if "{" in text else None
        return [PartialCall(tool_choice["function"]["name"], text.strip() if end is None else text[:end].strip(),
                            end is not None)]
    calls: list[PartialCall] = []
    depth, last_key, pending_key = 0, None, None  # pending: the item key whose value comes next
    skip_to = 0  # the scan resumes past a call's arguments
    for i, kind, string in _json_tokens(text):
        if i < skip_to:
            continue
        if kind == '"' and depth == 2:
            if pending_key == "name" and calls:
                calls[-1].name, pending_key = json.loads(string), None
            else:
                last_key = json.loads(string)
        elif kind == ":" and depth == 2:
            pending_key, last_key = last_key, None
            if pending_key == "parameters" and calls:
                start = len(text) - len(text[i + 1:].lstrip(" \t\r\n"))
                if start >= len(text) or text[start] != "{":
                    return calls
                end = _value_end(text, start)
                calls[-1].arguments = text[start:end]  # (to the end of the text while open)
                if end is None:
                    return calls
                calls[-1].complete, pending_key, skip_to = True, None, end
        elif kind in "[{":
            depth += 1
            if depth == 2:
                calls.append(PartialCall(None, "", False))
        elif kind in "]}":
            depth -= 1
    return calls


def _value_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array opening at `start`; None while it is still open."""
    depth = 0
    for i, kind, _ in _json_tokens(text, start):
        if kind in "[{":
            depth += 1
        elif kind in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _json_tokens(text: str, start: int = 0):
    """(index, kind, string) for JSON text's structure: kind is one of [ ] { } : , for those characters outside
    strings, or '"' with the whole string literal (quotes included) where a string closes."""
    in_string, escaped, opened = False, False, 0
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                yield i, '"', text[opened:i + 1]
        elif ch == '"':
            in_string, opened = True, i
        elif ch in "[]{}:,":
            yield i, ch, None
