"""The OpenAI-compatible server driven by the official `openai` client (and raw HTTP where the
client has no method): every answer is checked against the offline engine on the same weights."""
from __future__ import annotations

import asyncio
import json
import math
import string

import httpx
import openai
import pytest

import pagedllm
from pagedllm import SamplingParams
from tests.server.conftest import API_KEY, MAX_MODEL_LEN, SERVED_NAMES, kv_idle, metric, metric_samples, wait_until

PROMPT = "Once upon a time"
PROMPTS = ["Once upon a time", "The weather today"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def oai(server_url):
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    yield client
    client.close()


def greedy_ref(llm, prompts, max_tokens, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return llm.generate(prompts, params, use_tqdm=False)


# -- models, tokenizer, version, metrics ----------------------------------------------------------

def test_models_lists_every_served_name_with_max_model_len(oai, http):
    assert [m.id for m in oai.models.list()] == list(SERVED_NAMES)
    cards = http.get("/v1/models").json()["data"]
    assert [c["max_model_len"] for c in cards] == [MAX_MODEL_LEN] * len(SERVED_NAMES)
    assert all(c["object"] == "model" and c["owned_by"] == "pagedllm" for c in cards)


def test_tokenize_and_detokenize_round_trip(http, reference_llm):
    tok = reference_llm.get_tokenizer()
    r = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["tokens"][0] == tok.bos_token_id
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN

    plain = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert plain == r["tokens"][1:]
    assert http.post("/detokenize", json={"tokens": plain}).json() == {"prompt": PROMPT}
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == tok.bos_token + PROMPT

    # Chat messages tokenize exactly as the chat endpoint renders them.
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    ref = reference_llm.chat(CHAT, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert chat["tokens"] == ref.prompt_token_ids


def test_tokenizer_info_has_special_tokens_and_chat_template(http, reference_llm):
    tok = reference_llm.get_tokenizer()
    info = http.get("/tokenizer_info").json()  # open, like /tokenize: no /v1 prefix
    assert (info["bos_token"], info["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert (info["bos_token_id"], info["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
    assert info["chat_template"] == tok.chat_template and "messages" in info["chat_template"]
    assert info["model_max_length"] == MAX_MODEL_LEN
    assert info["vocab_size"] == reference_llm.llm_engine.config.model.vocab_size


def test_version(http):
    assert http.get("/version").json() == {"version": pagedllm.__version__}


def test_metrics_count_one_request_exactly(server_url, oai, http):
    wait_until(lambda: kv_idle(http), "an idle engine")  # nothing else adds to the counters meanwhile
    names = {n for n, _, _ in metric_samples(server_url)}
    for name in ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc",
                 "pagedllm:generation_tokens_total", "pagedllm:prompt_tokens_total",
                 "pagedllm:time_to_first_token_seconds_count", "pagedllm:e2e_request_latency_seconds_count",
                 "pagedllm:inter_token_latency_seconds_bucket", "pagedllm:iteration_num_sequences_bucket"):
        assert name in names, f"{name} missing from /metrics"

    def snapshot():
        return {k: metric(server_url, k) for k in (
            "pagedllm:generation_tokens_total", "pagedllm:prompt_tokens_total",
            "pagedllm:time_to_first_token_seconds_count", "pagedllm:e2e_request_latency_seconds_count",
            "pagedllm:inter_token_latency_seconds_count")} | {
            "length": metric(server_url, "pagedllm:request_success_total", finished_reason="length")}

    before = snapshot()
    r = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, **GREEDY)
    want = dict(before)
    want["pagedllm:generation_tokens_total"] += 10
    want["pagedllm:prompt_tokens_total"] += r.usage.prompt_tokens
    want["pagedllm:time_to_first_token_seconds_count"] += 1
    want["pagedllm:e2e_request_latency_seconds_count"] += 1
    want["pagedllm:inter_token_latency_seconds_count"] += 9  # one per token after the first
    want["length"] += 1
    # The engine thread updates the metrics right after the step that answered: poll briefly.
    wait_until(lambda: snapshot() == want, f"metrics {want}")
    assert metric(server_url, "pagedllm:num_requests_running") == 0


# -- completions ----------------------------------------------------------------------------------

def test_greedy_completion_equals_the_offline_engine(oai, reference_llm):
    (ref,) = greedy_ref(reference_llm, PROMPT, 24)
    for model in SERVED_NAMES:
        r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=24, **GREEDY)
        assert r.model == model and r.object == "text_completion"
        (choice,) = r.choices
        assert choice.text == ref.outputs[0].text and choice.finish_reason == "length" and choice.index == 0
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 24)
        assert r.usage.total_tokens == r.usage.prompt_tokens + 24


def test_empty_string_prompt_is_just_bos(oai, reference_llm):
    bos = reference_llm.get_tokenizer().bos_token_id
    (ref,) = greedy_ref(reference_llm, {"prompt_token_ids": [bos]}, 5)
    r = oai.completions.create(model="tiny", prompt="", max_tokens=5, **GREEDY)
    assert r.usage.prompt_tokens == 1 and r.choices[0].text == ref.outputs[0].text


def test_streamed_deltas_concatenate_to_the_non_streamed_text(oai, reference_llm):
    (ref,) = greedy_ref(reference_llm, PROMPT, 24)
    chunks = list(oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY))
    *content, usage = chunks
    assert len(content) > 1, "the answer came in one chunk: nothing was streamed"
    assert all(len(c.choices) == 1 and c.usage is None for c in content)
    assert "".join(c.choices[0].text for c in content) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert usage.choices == [] and usage.usage.completion_tokens == 24
    assert usage.usage.prompt_tokens == len(ref.prompt_token_ids)

    # Without stream_options there is no usage chunk.
    plain = list(oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, stream=True, **GREEDY))
    assert all(c.choices and c.usage is None for c in plain)


def test_n_samples_of_several_prompts_have_global_indices(oai, reference_llm):
    refs = [o.outputs[0].text for o in greedy_ref(reference_llm, PROMPTS, 12)]
    assert refs[0] != refs[1], "the check below needs prompts with different answers"
    n = 3
    r = oai.completions.create(model="tiny", prompt=PROMPTS, n=n, max_tokens=12, **GREEDY)
    assert sorted(c.index for c in r.choices) == list(range(len(PROMPTS) * n))
    for c in r.choices:  # choice i*n+j is sample j of prompt i
        assert c.text == refs[c.index // n], c.index
    assert r.usage.completion_tokens == len(PROMPTS) * n * 12

    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in oai.completions.create(model="tiny", prompt=PROMPTS, n=n, max_tokens=12, stream=True, **GREEDY):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                assert c.index not in finished, f"choice {c.index} finished twice"
                finished[c.index] = c.finish_reason
    assert texts == {k: refs[k // n] for k in range(len(PROMPTS) * n)}
    assert finished == {k: "length" for k in range(len(PROMPTS) * n)}


def test_completion_logprobs_match_the_offline_engine(oai, reference_llm):
    (ref,) = greedy_ref(reference_llm, PROMPT, 8, logprobs=2)
    out = ref.outputs[0]
    tok = reference_llm.get_tokenizer()
    r = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for k, (token_id, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.tokens[k] == tok.decode([token_id])
        assert lp.token_logprobs[k] == pytest.approx(entry[token_id].logprob, abs=1e-4)
        top = lp.top_logprobs[k]
        assert 1 <= len(top) <= 3  # the sampled token and the top 2 (it is one of them when greedy)
        assert max(top.values()) <= lp.token_logprobs[k] + 1e-6  # greedy picked the most likely
    assert lp.text_offset == sorted(lp.text_offset)


def test_stop_string_cuts_the_text_before_it(oai, reference_llm):
    full = greedy_ref(reference_llm, PROMPT, 24)[0].outputs[0].text
    allowed = set(string.ascii_letters + " ")
    stop = next((full[k:k + 3] for k in range(2, len(full) - 3)
                 if set(full[k:k + 3]) <= allowed and full.find(full[k:k + 3]) == k), None)
    assert stop is not None, f"no plain-ASCII stop string candidate in {full!r}"
    cut = full[:full.find(stop)]

    r = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stop=[stop, "\x00never"], **GREEDY)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    assert r.usage.completion_tokens < 24

    chunks = list(oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stop=stop, stream=True,
                                         **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == cut  # held-back text never leaks the stop
    assert chunks[-1].choices[0].finish_reason == "stop"

    kept = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stop=stop, temperature=0,
                                  extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop


def test_seed_makes_sampling_reproducible(oai, reference_llm):
    def sample(seed, n=1):
        r = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=1.0, seed=seed, n=n)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample(7)
    assert sample(7) == first
    others = [sample(s)[0] for s in (8, 9, 10)]
    assert any(t != first[0] for t in others), "different seeds gave the same 32 sampled tokens"
    # Seeded sampling does not depend on the batch: the offline engine draws the same tokens.
    ref = reference_llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=7, max_tokens=32), use_tqdm=False)
    assert first == [ref[0].outputs[0].text]
    ref3 = reference_llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=32),
                                  use_tqdm=False)
    assert sample(7, n=3) == [c.text for c in ref3[0].outputs]


def test_echo_with_logprobs_scores_the_prompt(http, reference_llm):
    """lm-eval's loglikelihood request: echo + logprobs + max_tokens=1 over /v1/completions."""
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    r = http.post("/v1/completions", json=body).json()
    choice = r["choices"][0]
    assert choice["text"].startswith(PROMPT)
    lp = choice["logprobs"]
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # Every token is a string, the first prompt token's too (OpenAI's schema; vLLM decodes it).
    tokens, offsets = lp["tokens"], lp["text_offset"]
    assert all(isinstance(t, str) for t in tokens) and tokens[0] == http.post(
        "/detokenize", json={"tokens": ids[:1]}).json()["prompt"]
    assert offsets == sorted(offsets) and offsets[1] == len(tokens[0])
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(isinstance(t, dict) and 1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])

    # Alignment: entry k scores prompt token k given tokens < k. Append the greedy next token to the
    # prompt: its prompt logprob must be the logprob it had when it was generated.
    (ref,) = greedy_ref(reference_llm, {"prompt_token_ids": ids}, 1, logprobs=0)
    next_id = ref.outputs[0].token_ids[0]
    generated_lp = ref.outputs[0].logprobs[0][next_id].logprob
    assert lp["token_logprobs"][-1] == pytest.approx(generated_lp, abs=1e-4)
    r2 = http.post("/v1/completions", json=body | {"prompt": ids + [next_id]}).json()
    lp2 = r2["choices"][0]["logprobs"]
    assert lp2["token_logprobs"][len(ids)] == pytest.approx(generated_lp, abs=1e-4)
    assert lp2["token_logprobs"][1:len(ids)] == pytest.approx(lp["token_logprobs"][1:len(ids)], abs=1e-4)


# -- chat -----------------------------------------------------------------------------------------

def test_chat_equals_the_offline_chat_streamed_and_not(oai, reference_llm):
    ref = reference_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    want = ref.outputs[0].text
    r = oai.chat.completions.create(model="alias", messages=CHAT, max_tokens=20, **GREEDY)
    assert r.object == "chat.completion" and r.model == "alias"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == want
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 20)

    chunks = list(oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    *content, usage = chunks
    assert "".join(c.choices[0].delta.content or "" for c in content) == want
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert usage.choices == [] and usage.usage.completion_tokens == 20


def test_chat_logprobs_and_n(oai, reference_llm):
    ref = reference_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
                             use_tqdm=False)[0].outputs[0]
    r = oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, logprobs=True, top_logprobs=2,
                                    **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for item, token_id, entry in zip(content, ref.token_ids, ref.logprobs):
        assert item.logprob == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert (item.top_logprobs[0].token, item.top_logprobs[0].logprob) == (item.token, item.logprob)
        assert bytes(item.bytes).decode("utf-8") == item.token

    r = oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 8


# -- many clients at once -------------------------------------------------------------------------

def test_32_concurrent_streams_are_correct_and_batched(server_url, reference_llm):
    prompts = [f"Story {i}: once" for i in range(32)]
    max_tokens = 24
    refs = [o.outputs[0].text for o in greedy_ref(reference_llm, prompts, max_tokens)]

    def big_steps() -> float:  # engine steps that ran more than 8 sequences
        total = metric(server_url, "pagedllm:iteration_num_sequences_count")
        return total - metric(server_url, "pagedllm:iteration_num_sequences_bucket", le="8.0")

    before = big_steps()

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None, int]:
        text, reason, chunks = "", None, 0
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 **GREEDY)
        async for chunk in stream:
            chunks += 1
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason, chunks

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    for i, (text, reason, chunks) in enumerate(results):
        assert text == refs[i], f"stream {i}"
        assert reason == "length" and chunks > 1, f"stream {i}"
    assert big_steps() > before, "no engine step ran more than 8 of the 32 concurrent requests"


def test_metrics_text_is_prometheus_exposition(server_url, http):
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "# TYPE pagedllm:time_to_first_token_seconds histogram" in r.text
    ttft = [v for n, lab, v in metric_samples(server_url)
            if n == "pagedllm:time_to_first_token_seconds_sum" and lab["model_name"] == SERVED_NAMES[0]]
    assert len(ttft) == 1 and math.isfinite(ttft[0]) and ttft[0] > 0


def test_the_openapi_document_lists_the_statuses_and_bodies_the_server_sends(server_url):
    doc = httpx.get(f"{server_url}/openapi.json", timeout=30).json()
    assert "422" not in json.dumps(doc) and "HTTPValidationError" not in doc["components"]["schemas"]
    completions = doc["paths"]["/v1/completions"]["post"]
    responses = completions["responses"]
    assert set(responses) == {"200", "400", "401", "404", "413", "503"}
    for status in ("400", "401", "404", "413", "503"):
        assert responses[status]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    ok = responses["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/CompletionResponse"}
    assert "CompletionResponse" in json.dumps(ok["text/event-stream"]["schema"])
    assert completions["security"] == [{"bearer": []}]  # this server has a key
    assert doc["paths"]["/health"]["get"]["security"] == []
    for path in ("/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/v1/memory"):
        assert "200" in next(iter(doc["paths"][path].values()))["responses"]
    assert "/v1/audio/speech" not in doc["paths"]  # a text model: no audio routes documented
    tokens = doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert tokens["type"] == "integer" and tokens["minimum"] == 0 and tokens["maximum"] > 0
    top = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["top_logprobs"]["anyOf"][0]
    assert top == {"type": "integer", "minimum": 0, "maximum": 20}  # the server's --max-logprobs


def test_what_third_party_clients_send_is_accepted(server_url, http):
    """OpenAI fields at values that do not change the answer, unknown fields (ignored with a warning), guidellm's
    stream_options, the SDK's models.retrieve."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra in [{"store": False}, {"metadata": {"k": "v"}}, {"service_tier": "auto"}, {"reasoning_effort": "low"},
                  {"verbosity": "low"}, {"prompt_cache_key": "abc"}, {"safety_identifier": "u1"},
                  {"prediction": None}, {"functions": None}, {"web_search_options": None},
                  {"some_future_field": {"x": 1}}]:
        r = http.post("/v1/chat/completions", json=chat | extra)
        assert r.status_code == 200, (extra, r.text)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True,
                                           "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert all("usage" in e for e in events) and events[-1]["usage"]["completion_tokens"] == 3
    assert [e["usage"]["completion_tokens"] for e in events[:-1] if e["choices"]] == list(range(1, 4))
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True,
                                           "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["total_tokens"] > 3
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0)
    assert client.models.retrieve("alias").id == "alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
