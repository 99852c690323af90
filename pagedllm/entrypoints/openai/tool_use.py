"""A chat request's tools: checked, rendered into the chat template, turned into a constraint (tool_choice required
or a named function), and the reply read back into calls."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.entrypoints.openai.bodies import ChatMessageOut
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_calls import calls_from_constrained, check_tools, constraint_for, parse_tool_calls
from pagedllm.errors import InvalidParameterError
from pagedllm.outputs import CompletionOutput
from pagedllm.structured_output import GuidedDecodingParams


@dataclass
class ToolUse:
    """A chat request's tools: what the template renders, what constrains the reply, how the reply is read."""

    choice: str | dict | None = None
    tools: dict[str, dict] = field(default_factory=dict)
    parser: str | None = None  # the server's --tool-call-parser, for tool_choice auto
    constraint: GuidedDecodingParams | None = None

    @classmethod
    def of(cls, req: ChatCompletionRequest, tool_call_parser: str | None) -> ToolUse:
        """The request's tools and tool_choice, checked; `tool_call_parser`: the server's (None: tool_choice auto
        is refused)."""
        try:
            tools = check_tools(req.tools, req.tool_choice)
        except InvalidParameterError as e:
            raise APIError(400, str(e), e.param) from None
        if not tools:
            return cls()
        choice = req.tool_choice if req.tool_choice is not None else "auto"
        if choice == "auto" and tool_call_parser is None:
            raise APIError(400, "tool_choice auto (the default with tools) needs a tool call parser: this model's "
                                "chat template shows no call format to pick one from, so start the server with "
                                "--enable-auto-tool-choice --tool-call-parser NAME; or pass tool_choice required, "
                                "a named function, or none", "tool_choice")
        return cls(choice, tools, tool_call_parser,
                   constraint_for(tools, choice, parallel=req.parallel_tool_calls is not False))

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def rendered(self) -> list[dict] | None:
        """The tools the chat template is given (none with tool_choice none, as vLLM by default)."""
        return list(self.tools.values()) if self.active else None

    def reply(self, c: CompletionOutput) -> tuple[ChatMessageOut, str | None]:
        """(message, finish_reason) of a finished sample."""
        message = ChatMessageOut(content=c.text)
        if not self.active:
            return message, c.finish_reason
        if self.constraint is not None:
            if c.finish_reason != "stop":  # cut by max_tokens: the calls are incomplete
                return message, c.finish_reason
            calls = calls_from_constrained(c.text, self.choice)
            finish = "stop" if isinstance(self.choice, dict) else "tool_calls"  # (as OpenAI)
            return ChatMessageOut(content=None, tool_calls=[t.to_openai() for t in calls]), finish
        content, calls = parse_tool_calls(self.parser, c.text, self.tools)
        if not calls:
            return message, c.finish_reason
        return ChatMessageOut(content=content, tool_calls=[t.to_openai() for t in calls]), "tool_calls"
