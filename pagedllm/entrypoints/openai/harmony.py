"""gpt-oss' harmony replies (`--reasoning-parser gpt_oss`, vLLM's `openai_gptoss`; picked from a harmony chat
template when no parser is named). A reply is a run of messages after the prompt's `<|start|>assistant`:

    <|channel|>analysis<|message|>THINKING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
    ...<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the recipient may also follow the channel). The reply, read with its special tokens, is rewritten in the forms the
rest of the server already reads: the analysis channel as a think block (`<think>...</think>`, reasoning.py), the
final channel (and commentary addressed to no one: a preamble the user sees) as the answer's text, and each
function call (commentary to `functions.NAME`) as a `<tool_call>{"name": ..., "arguments": ...}</tool_call>` block
that the `openai` tool call parser (hermes' reading) turns into `tool_calls`, whole or streamed. A prefix of a reply
is rewritten as a prefix of the whole reply's rewrite: a stream sends what the whole reply would."""
from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.text_markers import held_back

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
FINAL_HEADER = f"{CHANNEL}final{MESSAGE}"  # where the answer (and a structured output) begins
_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")


def is_harmony_template(template: str | None) -> bool:
    """A chat template that renders harmony (gpt-oss')."""
    return bool(template) and CHANNEL in template and MESSAGE in template


def _messages(raw: str, finished: bool) -> list[tuple[str, str, bool]]:
    """(header, body, closed) of each message whose header is complete, in order. Not finished, an open body's tail
    that may still become an end marker (`<|en`) is left out."""
    out, i = [], 0
    while True:
        m = raw.find(MESSAGE, i)
        if m < 0:
            return out
        body_start = m + len(MESSAGE)
        ends = [(p, t) for t in ENDS if (p := raw.find(t, body_start)) >= 0]
        if not ends:
            body = raw[body_start:]
            if not finished:
                body = body[:len(body) - max(held_back(body, end) for end in ENDS)]
            out.append((raw[i:m], body, False))
            return out
        p, t = min(ends)
        out.append((raw[i:m], raw[body_start:p], True))
        i = p + len(t)


def _header(header: str) -> tuple[str, str | None]:
    """(channel, recipient) of a message header (`<|start|>assistant to=X<|channel|>commentary json`)."""
    channel = ""
    if CHANNEL in header:
        channel = re.split(r"\s|<\|", header.split(CHANNEL, 1)[1].strip(), maxsplit=1)[0]
    recipient = _RECIPIENT.search(header)
    return channel, recipient.group(1) if recipient else None


def harmony_to_text(raw: str, finished: bool) -> str:
    """The reply so far (`raw`, special tokens kept; all of it when `finished`) rewritten as think block, answer
    text and <tool_call> blocks (the module's docstring)."""
    reasoning: list[str] = []
    answer: list[str] = []
    for header, body, closed in _messages(raw, finished):
        channel, recipient = _header(header)
        if channel == "analysis" and not answer:
            reasoning.append(body)
        elif recipient is not None and recipient.startswith("functions."):
            end = "}</tool_call>" if closed or finished else ""
            answer.append(f'<tool_call>{{"name": {json.dumps(recipient[len("functions."):])}, "arguments": '
                          f'{body}{end}')
        else:  # final, a preamble, or analysis after the answer began (kept: nothing the model wrote is dropped)
            answer.append(body)
    if not reasoning:
        return "".join(answer)
    thinking = "<think>" + "\n\n".join(reasoning)
    return thinking + ("</think>" + "".join(answer) if answer or finished else "")
