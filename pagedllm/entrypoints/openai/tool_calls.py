"""Tool calling in chat completions: what constrains the output for each tool_choice, and the parsers (named as
vLLM's --tool-call-parser) that turn a reply into `message.tool_calls`.

- tool_choice "none": the tools are rendered by the chat template, the reply is text.
- "auto" (needs --enable-auto-tool-choice and a --tool-call-parser): the model decides; the parser finds the
  calls in its text (hermes: <tool_call>{...}</tool_call> blocks; llama3_json: a JSON object
  {"name": ..., "parameters": {...}}, several separated by ";"; mistral: [TOOL_CALLS] then a JSON array of
  {"name": ..., "arguments": {...}} (tokenizers before v11) or NAME[ARGS]{...} per call (v11 on); openai: gpt-oss'
  harmony calls, which the gpt_oss reasoning parser rewrites as <tool_call> blocks: harmony.py).
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

from pagedllm.entrypoints.openai.bodies import FunctionCall, ToolCallOut
from pagedllm.entrypoints.openai.text_markers import held_back
from pagedllm.errors import InvalidParameterError
from pagedllm.structured_output import GuidedDecodingParams

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "qwen3_coder", "mistral", "openai")
# What a chat template writes when it renders tools, and the parser that reads the calls its model then writes
# (the first that matches: Qwen3-Coder's template shows <tool_call> with <function=...> inside).
TEMPLATE_TOOL_MARKERS = (("<|channel|>", "openai"), ("<function=", "qwen3_coder"), ("<tool_call>", "hermes"),
                         ("<|python_tag|>", "llama3_json"), ("[TOOL_CALLS]", "mistral"))
# Parsers whose call marker is a special token: their requests keep special tokens in the text they read.
SPECIAL_TOKEN_PARSERS = ("mistral",)


def tool_call_parser_for_template(template: str | dict | None) -> str | None:
    """The tool call parser a chat template's own call format asks for (Qwen / Hermes: hermes; Llama 3.1+:
    llama3_json), or None where it shows none: what a server with no --tool-call-parser reads replies with."""
    if isinstance(template, dict):  # named templates: the default one, or all of them
        template = template.get("default") or "\n".join(str(t) for t in template.values())
    for marker, parser in TEMPLATE_TOOL_MARKERS:
        if template and marker in template:
            return parser
    return None


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self) -> ToolCallOut:
        """The call as `message.tool_calls[]` (a new id each time)."""
        return ToolCallOut(id=f"call_{uuid.uuid4().hex[:24]}",
                           function=FunctionCall(name=self.name, arguments=self.arguments))


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


def parse_tool_calls(parser: str, text: str, tools: dict[str, dict] | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content left, calls) of a free reply under tool_choice auto. Text that does not parse as a call stays
    content. `tools` (name -> tool): the parameter types qwen3_coder's XML values are read as."""
    if parser == "mistral":
        return _mistral_calls(text)
    if parser in ("hermes", "qwen3_coder", "openai"):  # (openai: harmony calls, rewritten as hermes blocks)
        calls = []
        for body in _HERMES.findall(text):
            call = _xml_call_of(body, tools or {}) if parser == "qwen3_coder" else _call_of(body, "arguments")
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
_MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def _mistral_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Mistral's calls after [TOOL_CALLS]: a JSON array (or object) of {"name", "arguments"} (tokenizers before
    v11), or NAME[ARGS]{...} after each [TOOL_CALLS] (v11 on; NAME[CALL_ID]ID[ARGS]{...} in v13). Any part that
    does not parse leaves the whole reply content."""
    cut = text.find(_MISTRAL_CALLS)
    if cut < 0:
        return text, []
    calls: list[ToolCall] = []
    for part in text[cut:].split(_MISTRAL_CALLS)[1:]:
        part = part.strip()
        if _MISTRAL_ARGS in part:
            name, _, args = part.partition(_MISTRAL_ARGS)
            name = name.partition(_MISTRAL_CALL_ID)[0].strip()
            try:
                parsed = json.loads(args)
            except json.JSONDecodeError:
                return text, []
            if not name or not isinstance(parsed, dict):
                return text, []
            calls.append(ToolCall(name, json.dumps(parsed, ensure_ascii=False)))
            continue
        try:
            value = json.loads(part)
        except json.JSONDecodeError:
            return text, []
        for item in value if isinstance(value, list) else [value]:
            call = _call_of(json.dumps(item), "arguments") if isinstance(item, dict) else None
            if call is None:
                return text, []
            calls.append(call)
    if not calls:
        return text, []
    return text[:cut].strip() or None, calls


_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _xml_call_of(body: str, tools: dict[str, dict]) -> ToolCall | None:
    """One Qwen3-Coder call, `<function=NAME><parameter=KEY>VALUE</parameter>...</function>`, as a ToolCall: each
    value read as its parameter's schema type says (a string stays text; numbers, booleans, objects and arrays
    are parsed as JSON), a value that does not parse as its type kept as text."""
    match = _XML_FUNCTION.fullmatch(body.strip())
    if match is None:
        return None
    name = match.group(1).strip()
    properties = _tool_schema(tools.get(name, {})).get("properties") or {}
    arguments: dict[str, Any] = {}
    for key, raw in _XML_PARAMETER.findall(match.group(2)):
        key = key.strip()
        value = raw.removeprefix("\n").removesuffix("\n")
        kind = (properties.get(key) or {}).get("type")
        if kind != "string":
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        arguments[key] = value
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def content_so_far(parser: str, text: str) -> str:
    """The beginning of a free reply (tool_choice auto) that is content whatever comes next: streamed as it is
    written. hermes (qwen3_coder, openai): the text before a <tool_call> (or before what may be the start of one);
    mistral: likewise before [TOOL_CALLS]; llama3_json: the
    whole text once it cannot be a call (it does not start with "{" or <|python_tag|>). Trailing whitespace
    waits (a finished reply's content is stripped around its calls)."""
    if parser in ("hermes", "qwen3_coder", "openai", "mistral"):
        marker = _MISTRAL_CALLS if parser == "mistral" else _HERMES_OPEN
        cut = text.find(marker)
        if cut < 0:
            cut = len(text) - held_back(text, marker)
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
    """The calls in the beginning of a reply constrained by constraint_for (one reading of the whole text)."""
    return ConstrainedCallReader(tool_choice).read(text)


class ConstrainedCallReader:
    """Reads a reply constrained by constraint_for as it grows, each character once (a stream's steps would
    otherwise rescan it all: quadratic in long arguments). The grammar fixes the shape: a named function's
    reply is its arguments object; "required" writes an array of {"name": ..., "parameters": {...}}."""

    def __init__(self, tool_choice) -> None:
        named = isinstance(tool_choice, dict)
        self.calls: list[PartialCall] = [PartialCall(tool_choice["function"]["name"], "", False)] if named else []
        self._args_depth = 1 if named else 3  # the depth inside a call's arguments object
        self._named = named
        self._read = 0  # characters read
        self._depth, self._in_string, self._escaped, self._opened = 0, False, False, 0
        self._last_key: str | None = None
        self._pending: str | None = None  # the item key whose value comes next
        self._args_start: int | None = None  # where the open call's arguments begin

    def read(self, text: str) -> list[PartialCall]:
        """The calls so far; `text` is the whole reply so far (it extends the text of the previous call)."""
        for i in range(self._read, len(text)):
            self._char(text, i)
        self._read = len(text)
        if self._args_start is not None:
            self.calls[-1].arguments = text[self._args_start:]
        return self.calls

    def _char(self, text: str, i: int) -> None:
        ch = text[i]
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                if self._depth == 2 and not self._named:
                    value = json.loads(text[self._opened:i + 1])
                    if self._pending == "name" and self.calls:
                        self.calls[-1].name, self._pending = value, None
                    else:
                        self._last_key = value
        elif ch == '"':
            self._in_string, self._opened = True, i
        elif ch == ":" and self._depth == 2 and not self._named:
            self._pending, self._last_key = self._last_key, None
        elif ch in "[{":
            self._depth += 1
            if self._depth == 2 and not self._named:
                self.calls.append(PartialCall(None, "", False))
            if (self._depth == self._args_depth and ch == "{" and self._args_start is None and self.calls
                    and (self._named or self._pending == "parameters")):
                self._args_start, self._pending = i, None
        elif ch in "]}":
            if self._depth == self._args_depth and self._args_start is not None:
                self.calls[-1].arguments, self.calls[-1].complete = text[self._args_start:i + 1], True
                self._args_start = None
            self._depth -= 1
