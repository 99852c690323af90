"""A streamed chat completion's choices, one streamer each, by how its reply is read: plain text; tool calls under
a constraint (tool_choice required or a named function), streamed as they are written; a free reply with tools
(tool_choice auto), its content streamed and its calls sent once it is complete. Each turns the choice's output
so far into the chunk choices to send now. With a reasoning parser, a reply's think block streams as
reasoning_content and the streamer of its mode reads only the answer after it."""
from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from pagedllm.entrypoints.openai.bodies import (
    ChatChunkChoice,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    FunctionCallDelta,
    ToolCallDelta,
    TopLogprob,
)
from pagedllm.entrypoints.openai.reasoning import ReasoningCursor, split_reasoning
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


def chat_logprobs(token_ids: list[int], entries, top_n: int) -> ChatLogprobs:
    """`choices[].logprobs` of a chat completion (or chunk): each token's logprob and its top_n alternatives."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        def item(lp) -> dict:
            text = lp.decoded_token or ""
            return {"token": text, "logprob": json_logprob(lp.logprob), "bytes": list(text.encode("utf-8"))}

        top = sorted(entry.values(), key=lambda lp: -lp.logprob)[:top_n]
        content.append(ChatTokenLogprob(**item(entry[token_id]),
                                        top_logprobs=[TopLogprob(**item(lp)) for lp in top]))
    return ChatLogprobs(content=content)


LOWEST_LOGPROB = -9999.0


def json_logprob(logprob: float) -> float:
    """A logprob JSON can carry: a token masked out (structured outputs, logit_bias -100) has -inf, which is
    not a JSON number; like vLLM, report it as -9999.0."""
    return max(logprob, LOWEST_LOGPROB)


def _last(index: int, finish_reason: str | None, stop_reason) -> ChatChunkChoice:
    """A choice's last chunk: why it finished."""
    return ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=finish_reason, stop_reason=stop_reason)


class ChoiceStreamer(ABC):
    def __init__(self, index: int) -> None:
        self.index = index

    def opening(self) -> ChatChunkChoice:
        """The choice's first chunk: the assistant's role."""
        return ChatChunkChoice(index=self.index, delta=ChatDelta(role="assistant", content=""))

    @abstractmethod
    def chunks(self, c: CompletionOutput) -> list[ChatChunkChoice]:
        """The chunk choices `c` (the choice's output so far) adds to what was sent."""


class TextStreamer(ChoiceStreamer):
    """Plain text: each new piece as it is detokenized (held back while it may start a stop string), with its
    tokens' logprobs when asked for."""

    def __init__(self, index: int, stops: list[str], top_logprobs: int | None) -> None:
        super().__init__(index)
        self.cursor = TextCursor(stops)
        self.top_logprobs = top_logprobs  # None: no logprobs

    def chunks(self, c: CompletionOutput) -> list[ChatChunkChoice]:
        out = []
        delta, t0, t1 = self.cursor.advance(c)
        lp = None if self.top_logprobs is None else \
            chat_logprobs(c.token_ids[t0:t1], (c.logprobs or [])[t0:t1], self.top_logprobs)
        if delta or (lp and lp.content):
            out.append(ChatChunkChoice(index=self.index, delta=ChatDelta(content=delta), logprobs=lp))
        if c.finished():
            out.append(_last(self.index, c.finish_reason, c.stop_reason))
        return out


class ConstrainedCallStreamer(ChoiceStreamer):
    """Tool calls the constraint makes the model write: each call once its name is complete, then its arguments'
    new text as it comes."""

    def __init__(self, index: int, tools: ToolUse) -> None:
        super().__init__(index)
        self.tools = tools
        self.reader = ConstrainedCallReader(tools.choice)
        self.sent: list[int] = []  # characters of each call's arguments already sent

    def chunks(self, c: CompletionOutput) -> list[ChatChunkChoice]:
        out = []
        calls = self._call_deltas(c)
        if calls:
            out.append(ChatChunkChoice(index=self.index, delta=ChatDelta(tool_calls=calls)))
        if c.finished():
            out.append(_last(self.index, self.tools.reply(c)[1], c.stop_reason))
        return out

    def _call_deltas(self, c: CompletionOutput) -> list[ToolCallDelta]:
        deltas = []
        for k, call in enumerate(self.reader.read(c.text)):
            if call.name is None:
                break
            if k == len(self.sent):
                self.sent.append(0)
                deltas.append(ToolCall(call.name, "").to_openai().as_delta(k))
            if len(call.arguments) > self.sent[k]:
                deltas.append(ToolCallDelta(index=k, function=FunctionCallDelta(
                    arguments=call.arguments[self.sent[k]:])))
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

    def chunks(self, c: CompletionOutput) -> list[ChatChunkChoice]:
        out = []
        sent = self.sent
        if not self.has_stops and not c.finished():
            text = content_so_far(self.tools.parser, c.text)
            if len(text) > len(sent):
                self.sent = text
                out.append(ChatChunkChoice(index=self.index, delta=ChatDelta(content=text[len(sent):])))
        if c.finished():
            message, finish = self.tools.reply(c)
            rest = message.content
            if rest is not None and sent:
                rest = rest[len(sent):] if rest.startswith(sent) else None
            delta = ChatDelta(content=rest) if rest else ChatDelta()
            if message.tool_calls:
                delta.tool_calls = [call.as_delta(i) for i, call in enumerate(message.tool_calls)]
            out.append(ChatChunkChoice(index=self.index, delta=delta))
            out.append(_last(self.index, finish, c.stop_reason))
        return out


def answer_of(c: CompletionOutput, in_reasoning: bool) -> tuple[CompletionOutput, str | None]:
    """A finished sample's answer (the sample with its text cut to what follows the think block) and its
    reasoning (None: no block)."""
    split = split_reasoning(c.text, in_reasoning)
    return dataclasses.replace(c, text=split.content), split.reasoning


class ReasoningStreamer(ChoiceStreamer):
    """A thinking model's reply: its think block's new text as reasoning_content, then the answer's chunks from
    the streamer of the reply's mode, which sees the text after the block only. Text that may still start a
    stop string is held back here too (the engine cuts a stop string out of the text it ends)."""

    def __init__(self, index: int, answer: ChoiceStreamer, in_reasoning: bool, stops: list[str]) -> None:
        super().__init__(index)
        self.answer = answer
        self.cursor = ReasoningCursor(in_reasoning)
        self.hold = max((len(s) for s in stops), default=1) - 1

    def chunks(self, c: CompletionOutput) -> list[ChatChunkChoice]:
        finished = c.finished()
        text = c.text if finished else c.text[:max(0, len(c.text) - self.hold)]
        reasoning, _ = self.cursor.advance(text, finished)
        out = [ChatChunkChoice(index=self.index, delta=ChatDelta(reasoning_content=reasoning))] if reasoning else []
        content = split_reasoning(text, self.cursor.in_reasoning, finished).content
        return out + self.answer.chunks(dataclasses.replace(c, text=content))


def streamer_for(index: int, tools: ToolUse, stops: list[str], top_logprobs: int | None,
                 reasoning: bool = False, in_reasoning: bool = False) -> ChoiceStreamer:
    """The choice's streamer; `reasoning`: the server reads think blocks (`in_reasoning`: the prompt opened one)."""
    if tools.constraint is not None:
        answer: ChoiceStreamer = ConstrainedCallStreamer(index, tools)
    elif tools.active:
        answer = FreeReplyStreamer(index, tools, bool(stops))
    else:
        answer = TextStreamer(index, stops, top_logprobs)
    return ReasoningStreamer(index, answer, in_reasoning, stops) if reasoning else answer


async def chunk_payloads(events: AsyncIterator[str]) -> AsyncIterator[dict]:
    """A streamed chat completion's events (create_chat_completion's) as their JSON payloads, up to [DONE]: what
    the other APIs' streams (messages_api.py, responses_api.py) are made from. An error event is a payload with
    "error" and no "choices"."""
    async for line in events:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)
