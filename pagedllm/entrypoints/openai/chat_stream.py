"""A streamed chat completion's choices, one streamer each, by how its reply is read: plain text; tool calls under
a constraint (tool_choice required or a named function), streamed as they are written; a free reply with tools
(tool_choice auto), its content streamed and its calls sent once it is complete. Each turns the choice's output
so far into the chunk choices to send now. A new mode (reasoning output) is a new streamer."""
from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.entrypoints.openai.tool_calls import ConstrainedCallReader, ToolCall, content_so_far
from pagedllm.entrypoints.openai.tool_use import ToolUse
from pagedllm.outputs import CompletionOutput


class TextCursor:
    """What of a sample's text and tokens was already sent. Text that could still turn out to be
    the start of a stop string is held back until the sample finishes."""

    def __init__(self, stops: list[str]) -> None:
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = 0
        self.tokens = 0

    def advance(self, c: CompletionOutput) -> tuple[str, int, int]:
        end = len(c.text) if c.finished() else max(self.text, len(c.text) - self.hold)
        delta, self.text = c.text[self.text:end], end
        first_token, self.tokens = self.tokens, len(c.token_ids)
        return delta, first_token, self.tokens


def chat_logprobs(token_ids: list[int], entries, top_n: int) -> dict:
    """`choices[].logprobs` of a chat completion (or chunk): each token's logprob and its top_n alternatives."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]

        def item(lp):
            text = lp.decoded_token or ""
            return {"token": text, "logprob": json_logprob(lp.logprob), "bytes": list(text.encode("utf-8"))}

        top = sorted(entry.values(), key=lambda lp: -lp.logprob)[:top_n]
        content.append(item(chosen) | {"top_logprobs": [item(lp) for lp in top]})
    return {"content": content}


LOWEST_LOGPROB = -9999.0


def json_logprob(logprob: float) -> float:
    """A logprob JSON can carry: a token masked out (structured outputs, logit_bias -100) has -inf, which is
    not a JSON number; like vLLM, report it as -9999.0."""
    return max(logprob, LOWEST_LOGPROB)


def _choice(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None,
            stop_reason=None, final: bool = False) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return choice | {"stop_reason": stop_reason} if final else choice


class ChoiceStreamer(ABC):
    def __init__(self, index: int) -> None:
        self.index = index

    def opening(self) -> dict:
        """The choice's first chunk: the assistant's role."""
        return _choice(self.index, {"role": "assistant", "content": ""})

    @abstractmethod
    def chunks(self, c: CompletionOutput) -> list[dict]:
        """The chunk choices `c` (the choice's output so far) adds to what was sent."""


class TextStreamer(ChoiceStreamer):
    """Plain text: each new piece as it is detokenized (held back while it may start a stop string), with its
    tokens' logprobs when asked for."""

    def __init__(self, index: int, stops: list[str], top_logprobs: int | None) -> None:
        super().__init__(index)
        self.cursor = TextCursor(stops)
        self.top_logprobs = top_logprobs  # None: no logprobs

    def chunks(self, c: CompletionOutput) -> list[dict]:
        out = []
        delta, t0, t1 = self.cursor.advance(c)
        lp = None if self.top_logprobs is None else \
            chat_logprobs(c.token_ids[t0:t1], (c.logprobs or [])[t0:t1], self.top_logprobs)
        if delta or (lp and lp["content"]):
            out.append(_choice(self.index, {"content": delta}, logprobs=lp))
        if c.finished():
            out.append(_choice(self.index, {}, c.finish_reason, stop_reason=c.stop_reason, final=True))
        return out


class ConstrainedCallStreamer(ChoiceStreamer):
    """Tool calls the constraint makes the model write: each call once its name is complete, then its arguments'
    new text as it comes."""

    def __init__(self, index: int, tools: ToolUse) -> None:
        super().__init__(index)
        self.tools = tools
        self.reader = ConstrainedCallReader(tools.choice)
        self.sent: list[int] = []  # characters of each call's arguments already sent

    def chunks(self, c: CompletionOutput) -> list[dict]:
        out = []
        calls = self._call_deltas(c)
        if calls:
            out.append(_choice(self.index, {"tool_calls": calls}))
        if c.finished():
            out.append(_choice(self.index, {}, self.tools.reply(c)[1], stop_reason=c.stop_reason, final=True))
        return out

    def _call_deltas(self, c: CompletionOutput) -> list[dict]:
        deltas = []
        for k, call in enumerate(self.reader.read(c.text)):
            if call.name is None:
                break
            if k == len(self.sent):
                self.sent.append(0)
                deltas.append(ToolCall(call.name, "").to_openai(index=k))
            if len(call.arguments) > self.sent[k]:
                deltas.append({"index": k, "function": {"arguments": call.arguments[self.sent[k]:]}})
                self.sent[k] = len(call.arguments)
        return deltas


class FreeReplyStreamer(ChoiceStreamer):
    """A reply that may call tools (tool_choice auto): its content streams while it cannot be a call (and, with
    stop strings, only at the end); its calls, read by the server's parser, come when it is complete."""

    def __init__(self, index: int, tools: ToolUse, has_stops: bool) -> None:
        super().__init__(index)
        self.tools = tools
        self.has_stops = has_stops
        self.sent = ""  # the content sent so far

    def chunks(self, c: CompletionOutput) -> list[dict]:
        out = []
        sent = self.sent
        if not self.has_stops and not c.finished():
            text = content_so_far(self.tools.parser, c.text)
            if len(text) > len(sent):
                self.sent = text
                out.append(_choice(self.index, {"content": text[len(sent):]}))
        if c.finished():
            message, finish = self.tools.reply(c)
            rest = message["content"]
            if rest is not None and sent:
                rest = rest[len(sent):] if rest.startswith(sent) else None
            delta = {"content": rest} if rest else {}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            out.append(_choice(self.index, delta))
            out.append(_choice(self.index, {}, finish, stop_reason=c.stop_reason, final=True))
        return out


def streamer_for(index: int, tools: ToolUse, stops: list[str], top_logprobs: int | None) -> ChoiceStreamer:
    if tools.constraint is not None:
        return ConstrainedCallStreamer(index, tools)
    if tools.active:
        return FreeReplyStreamer(index, tools, bool(stops))
    return TextStreamer(index, stops, top_logprobs)
