"""Reasoning output (`--reasoning-parser`): a thinking model's reply split into its reasoning (the think block)
and its answer, as `reasoning_content` and `content`, whole or streamed.

A think block is `<think> ... </think>`, the markers DeepSeek-R1, Qwen3 and QwQ write (vLLM's `deepseek_r1` and
`qwen3` parsers). Whether the reply starts inside one is read from the prompt, not guessed per model: some
templates open the block in the prompt (DeepSeek-R1-0528, Qwen3-*-Thinking-2507: the reply has only
`</think>`), some close an empty one there (Qwen3 with `enable_thinking: false`: no block at all), others leave it
to the model (the reply starts with `<think>`). A reply that never closes its block (max_tokens ran out while it
thought) is all reasoning.

Streaming sends exactly what the whole reply splits into: the split of a prefix of the text is a prefix of the
whole split, once the tail that could still become a marker (`</thi`) is held back.

gpt-oss' harmony channels (`gpt_oss`, vLLM's `openai_gptoss`) are read as the same split: harmony.py rewrites the
reply (read with its special tokens) as a think block and an answer.

A structured output (or a tool_choice that constrains the reply) applies to the answer: its grammar starts after
the reasoning's end (`reasoning_end`), the thinking before it is free.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.entrypoints.openai.harmony import FINAL_HEADER, is_harmony_template
from pagedllm.entrypoints.openai.text_markers import held_back

HARMONY_PARSERS = ("gpt_oss", "openai_gptoss")
REASONING_PARSERS = ("deepseek_r1", "qwen3") + HARMONY_PARSERS  # vLLM's names
START, END = "<think>", "</think>"


def reasoning_parser_for(flag: str | None, template: str | None) -> str | None:
    """The server's reasoning parser: the flag's, or gpt_oss where the chat template renders harmony (its replies'
    channels would otherwise come back as text). A parser of the other format than the template's is refused."""
    if is_harmony_template(template):
        if flag is not None and flag not in HARMONY_PARSERS:
            raise ValueError(f"--reasoning-parser {flag} reads think blocks; this model's chat template renders "
                             f"harmony channels: use gpt_oss (or leave the flag out).")
        return flag or "gpt_oss"
    if flag in HARMONY_PARSERS:
        raise ValueError(f"--reasoning-parser {flag} reads gpt-oss' harmony channels, and this model's chat template "
                         f"does not render them (deepseek_r1 and qwen3 read think blocks).")
    return flag


def reasoning_end(parser: str, prompt: str) -> str | None:
    """The text after which a reply's answer begins (a constraint's start), or None where the prompt already ended
    the reasoning (Qwen3 with enable_thinking false closes an empty block there)."""
    if parser in HARMONY_PARSERS:
        return FINAL_HEADER
    return None if prompt.rstrip().endswith(END) else END


def opens_reasoning(prompt: str) -> bool:
    """Whether the prompt ends inside an open think block (its template opened it for the reply)."""
    start = prompt.rfind(START)
    return start >= 0 and prompt.find(END, start) < 0


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the reply has no think block
    content: str


def split_reasoning(text: str, in_reasoning: bool, finished: bool = True) -> ReasoningSplit:
    """`text` (the reply so far; all of it when `finished`) as reasoning and content. `in_reasoning`: the prompt
    opened the think block. Not finished, a tail that may still become a marker is left out of both."""
    body, stripped = text, text.lstrip()
    if stripped.startswith(START):  # the model opens the block (again, where the prompt opened it: dropped)
        body, in_reasoning = stripped[len(START):], True
    elif not finished and START.startswith(stripped):  # whitespace or part of `<think>` so far: wait
        return ReasoningSplit("" if in_reasoning else None, "")
    if not in_reasoning:
        return ReasoningSplit(None, body)
    end = body.find(END)
    if end >= 0:
        return ReasoningSplit(body[:end], body[end + len(END):])
    if not finished:
        body = body[:len(body) - held_back(body, END)]
    return ReasoningSplit(body, "")


class ReasoningCursor:
    """What of a streamed reply's reasoning and content was already sent: each call gives the new pieces."""

    def __init__(self, in_reasoning: bool) -> None:
        self.in_reasoning = in_reasoning
        self.reasoning = 0
        self.content = 0

    def advance(self, text: str, finished: bool) -> tuple[str, str]:
        split = split_reasoning(text, self.in_reasoning, finished)
        reasoning = split.reasoning or ""
        new_reasoning, self.reasoning = reasoning[self.reasoning:], max(self.reasoning, len(reasoning))
        new_content, self.content = split.content[self.content:], max(self.content, len(split.content))
        return new_reasoning, new_content
