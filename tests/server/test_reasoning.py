"""Reasoning output (`--reasoning-parser`): the think-block split of a reply, whole and streamed (on scripted
replies cut at every point, markers split across pieces included)."""
from __future__ import annotations

import json
import random

import pytest

from pagedllm.entrypoints.openai.reasoning import ReasoningCursor, opens_reasoning, split_reasoning

# (reply, the prompt opened the block, reasoning, content)
CASES = [
    ("<think>\nweigh it</think>\n\nThe answer is 4.", False, "\nweigh it", "\n\nThe answer is 4."),
    ("  <think>a</think>b", False, "a", "b"),
    ("weigh it</think>\n\n4", True, "weigh it", "\n\n4"),  # the template opened the block
    ("<think>again</think>4", True, "again", "4"),  # the model opens it too: the marker is dropped
    ("The answer is 4.", False, None, "The answer is 4."),  # thinking off: no block
    ("still thinking when max_tokens ran", True, "still thinking when max_tokens ran", ""),
    ("<think>cut short <", False, "cut short <", ""),
    ("4 <think>not at the start</think>", False, None, "4 <think>not at the start</think>"),
    ("<think></think>", False, "", ""),
    ("<thinking about it", False, None, "<thinking about it"),
    ("a < b </thin k> c", True, "a < b </thin k> c", ""),
]


@pytest.mark.parametrize("reply,opened,reasoning,content", CASES)
def test_the_whole_reply_splits_at_the_block(reply, opened, reasoning, content):
    split = split_reasoning(reply, opened)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize("reply,opened,reasoning,content", CASES)
@pytest.mark.parametrize("seed", range(8))
def test_streamed_pieces_join_to_the_whole_split(reply, opened, reasoning, content, seed):
    """Cut into random pieces (1 character at a time for seed 0: every marker split at every point), the
    streamed reasoning and content join to exactly the whole reply's, and no piece is taken back."""
    rng = random.Random(seed)
    cuts = sorted({rng.randrange(1, len(reply) + 1) for _ in range(len(reply) // 3 + 1)} | {len(reply)}) \
        if seed else range(1, len(reply) + 1)
    cursor = ReasoningCursor(opened)
    sent_reasoning, sent_content = "", ""
    for end in cuts:
        new_reasoning, new_content = cursor.advance(reply[:end], finished=False)
        sent_reasoning += new_reasoning
        sent_content += new_content
        # Nothing sent is ever contradicted by more text: what was sent is a prefix of the final split.
        assert (reasoning or "").startswith(sent_reasoning) and content.startswith(sent_content)
    new_reasoning, new_content = cursor.advance(reply, finished=True)
    assert (sent_reasoning + new_reasoning, sent_content + new_content) == (reasoning or "", content)


@pytest.mark.parametrize("prompt,opened", [
    ("<|im_start|>assistant\n<think>\n", True),  # Qwen3-Thinking-2507, DeepSeek-R1-0528
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3 with enable_thinking: false
    ("<|im_start|>assistant\n", False),  # the model opens it itself
    ("<think>old</think> user turn <|im_start|>assistant\n", False),  # an earlier turn's block, closed
])
def test_the_prompt_says_whether_the_reply_starts_inside_the_block(prompt, opened):
    assert opens_reasoning(prompt) is opened


# A chat template that opens the think block for the reply unless the request turns thinking off (as Qwen3's
# -Thinking-2507 and DeepSeek-R1-0528 templates open it, and Qwen3's closes an empty one for enable_thinking false).
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}")
REPLY = r"[a-z]{2,12} [a-z]{2,12}</think>\n\n[a-z]{2,12} [a-z]{2,12}"  # scripts the tiny model's reply
PLAIN = r"[a-z]{2,12} [a-z]{2,12}"


@pytest.fixture(scope="module")
def thinking_url(tiny_llama, tmp_path_factory):
    import sys

    from tests.server.conftest import _stop_server, start_command

    template = tmp_path_factory.mktemp("template") / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    proc, url = start_command(lambda port: [
        sys.executable, "-m", "pagedllm", "serve", str(tiny_llama), "--served-model-name", "tiny", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "256", "--reasoning-parser", "qwen3", "--chat-template",
        str(template), "--structured-outputs-config", '{"enable_in_reasoning": true}'],  # (the regex scripts it all)
        tmp_path_factory.mktemp("reasoning"))
    yield url
    _stop_server(proc)


def _ask(url: str, regex: str, stream: bool, **extra):
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2 + 2?"}],
                                          max_tokens=60, temperature=1.0, seed=3, stream=stream,
                                          extra_body={"guided_regex": regex, **extra})


def test_reasoning_content_streamed_equals_whole_as_a_chat_front_end_reads_it(thinking_url):
    """The template opened the block, so the reply has only `</think>`: what precedes it is reasoning_content,
    what follows is content. Streamed (as Open WebUI reads it: reasoning_content deltas, then content deltas),
    the pieces come in that order and join to the whole reply's."""
    whole = _ask(thinking_url, REPLY, stream=False).choices[0].message
    reasoning, answer = whole.model_extra["reasoning_content"], whole.content
    assert reasoning and " " in reasoning and "think>" not in reasoning
    assert answer.startswith("\n\n") and "think>" not in answer
    kinds, joined = [], {"reasoning_content": "", "content": ""}
    for chunk in _ask(thinking_url, REPLY, stream=True):
        for choice in chunk.choices:
            for kind in joined:
                piece = (choice.delta.model_extra or {}).get(kind) if kind != "content" else choice.delta.content
                if piece:
                    joined[kind] += piece
                    kinds.append(kind)
    assert joined == {"reasoning_content": reasoning, "content": answer}
    assert kinds.count("reasoning_content") >= 2 and kinds.index("content") > max(
        i for i, k in enumerate(kinds) if k == "reasoning_content")


def test_enable_thinking_false_reaches_the_template(thinking_url):
    """chat_template_kwargs goes to the template: with thinking off it closes the block in the prompt, and the
    whole reply is content."""
    message = _ask(thinking_url, PLAIN, stream=False, chat_template_kwargs={"enable_thinking": False}).choices[0].message
    assert message.model_extra["reasoning_content"] is None and " " in message.content
    message = _ask(thinking_url, PLAIN, stream=False).choices[0].message  # thinking on: cut short, all reasoning
    assert message.content == "" and " " in message.model_extra["reasoning_content"]


def test_chat_template_kwargs_may_not_set_what_the_request_sets(thinking_url):
    import httpx

    r = httpx.post(f"{thinking_url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template_kwargs": {"add_generation_prompt": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert "add_generation_prompt" in r.json()["error"]["message"]


# gpt-oss' harmony replies (read with their special tokens), rewritten by harmony.py: (reply, reasoning, content,
# calls). The prompt ends with `<|start|>assistant`: the reply starts in a message's header.
HARMONY = [
    ("<|channel|>analysis<|message|>User greets.<|end|><|start|>assistant<|channel|>final<|message|>Hello!",
     "User greets.", "Hello!", []),
    ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather"
     "<|channel|>commentary <|constrain|>json<|message|>{\"city\": \"Paris\"}", "Need the weather.", None,
     [("get_weather", {"city": "Paris"})]),
    # the recipient after the channel, a preamble the user sees, two analysis messages
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.add <|constrain|>json<|message|>{\"x\": 1}", "a\n\nb", "Checking.", [("add", {"x": 1})]),
    ("<|channel|>final<|message|>No thinking.", None, "No thinking.", []),
    ("<|channel|>analysis<|message|>max_tokens ran out while thinking", "max_tokens ran out while thinking", "", []),
    # a call whose arguments do not parse stays content (as every parser's malformed calls)
    ("<|channel|>commentary to=functions.add<|message|>{not json", None,
     '<tool_call>{"name": "add", "arguments": {not json}</tool_call>', []),
]


@pytest.mark.parametrize("raw,reasoning,content,calls", HARMONY)
def test_a_harmony_reply_splits_by_channel(raw, reasoning, content, calls):
    from pagedllm.entrypoints.openai.harmony import harmony_to_text
    from pagedllm.entrypoints.openai.tool_calls import parse_tool_calls

    split = split_reasoning(harmony_to_text(raw, finished=True), in_reasoning=False)
    assert split.reasoning == reasoning
    got_content, got_calls = parse_tool_calls("openai", split.content)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


@pytest.mark.parametrize("raw", [case[0] for case in HARMONY])
def test_a_streamed_harmony_reply_joins_to_the_whole_split(raw):
    """Cut at every character (special tokens arrive whole from the detokenizer; cut inside, they are held back
    too): the rewrite of each prefix is a prefix of the whole reply's, so the stream sends what the whole does."""
    from pagedllm.entrypoints.openai.harmony import harmony_to_text

    whole = harmony_to_text(raw, finished=True)
    cursor, sent_reasoning, sent_content = ReasoningCursor(False), "", ""
    for end in range(1, len(raw) + 1):
        text = harmony_to_text(raw[:end], finished=False)
        assert whole.startswith(text), (raw[:end], text)
        new_reasoning, new_content = cursor.advance(text, finished=False)
        sent_reasoning, sent_content = sent_reasoning + new_reasoning, sent_content + new_content
    new_reasoning, new_content = cursor.advance(whole, finished=True)
    split = split_reasoning(whole, False)
    assert (sent_reasoning + new_reasoning, sent_content + new_content) == (split.reasoning or "", split.content)


@pytest.mark.parametrize("parser,prompt,marker", [
    ("qwen3", "<|im_start|>assistant\n", "</think>"),  # the model opens (and closes) its block
    ("deepseek_r1", "<|im_start|>assistant\n<think>\n", "</think>"),  # the template opened it
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", None),  # enable_thinking false: closed already
    ("gpt_oss", "<|start|>assistant", "<|channel|>final<|message|>"),
])
def test_a_constraint_starts_where_the_reasoning_ends(parser, prompt, marker):
    from pagedllm.entrypoints.openai.reasoning import reasoning_end

    assert reasoning_end(parser, prompt) == marker


HARMONY_TEMPLATE = "{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}<|end|>{% endfor %}"


def test_a_harmony_template_picks_the_gpt_oss_parser_and_refuses_a_think_block_one():
    from pagedllm.entrypoints.openai.reasoning import reasoning_parser_for

    assert reasoning_parser_for(None, HARMONY_TEMPLATE) == "gpt_oss"
    assert reasoning_parser_for("openai_gptoss", HARMONY_TEMPLATE) == "openai_gptoss"
    assert reasoning_parser_for(None, "{{ messages }}") is None and reasoning_parser_for("qwen3", None) == "qwen3"
    with pytest.raises(ValueError, match="renders harmony channels: use gpt_oss"):
        reasoning_parser_for("qwen3", HARMONY_TEMPLATE)
    with pytest.raises(ValueError, match="does not render them"):
        reasoning_parser_for("gpt_oss", "<think>{{ messages }}")
