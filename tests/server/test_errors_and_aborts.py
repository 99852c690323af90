"""Bad requests get OpenAI-shaped 4xx answers and leave the server serving; clients that go away
mid-request have their requests aborted and their KV blocks freed; refused start-up flags."""
from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pagedllm import SamplingParams
from tests.server.conftest import API_KEY, MAX_MODEL_LEN, kv_idle, metric, sse_events, wait_until

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "hi"}]
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}


def greedy(http: httpx.Client, max_tokens: int = 16) -> str:
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def expected_greedy(reference_llm) -> str:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return reference_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text


def finished_requests(server_url: str) -> float:
    """Samples that ran to their end (stop or length): an aborted request must not add to it."""
    return sum(metric(server_url, "pagedllm:request_success_total", finished_reason=reason)
               for reason in ("stop", "length"))


def assert_openai_error(r: httpx.Response, status: int, param: str | None, *needles: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["code"] == status and err["type"] == ERROR_TYPES.get(status, err["type"]), err
    assert err["param"] == param, err
    for needle in needles:
        assert needle in err["message"], (needle, err["message"])
    return err["message"]


# -- errors, one by one ---------------------------------------------------------------------------

CASES = [
    # (id, path, body (dict, or raw bytes), status, param, substrings of the message)
    ("invalid-json", "/v1/completions", b'{"prompt": "hi",', 400, None, ["Invalid JSON"]),
    ("wrong-type", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens",
     ["max_tokens", "'ten'"]),
    ("temperature", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature",
     ["temperature", "-1"]),
    ("top_p", "/v1/completions", {"prompt": "hi", "top_p": 2}, 400, "top_p", ["top_p", "got 2"]),
    ("n-zero", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", ["n: ", "greater than or equal to 1", "got 0"]),
    ("chat-temperature", "/v1/chat/completions", {"messages": CHAT, "temperature": -1}, 400, "temperature",
     ["temperature", "-1"]),
    ("empty-prompt-list", "/v1/completions", {"prompt": []}, 400, "prompt", ["empty"]),
    ("empty-token-prompt", "/v1/completions", {"prompt": [[]]}, 400, "prompt", ["empty"]),
    ("token-outside-vocab", "/v1/completions", {"prompt": [5, 99999]}, 400, "prompt",
     ["99999", "vocabulary"]),
    ("negative-token", "/v1/completions", {"prompt": [[5], [-1]]}, 400, "prompt", ["-1", "vocabulary"]),
    ("unknown-model", "/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model", ["nope"]),
    ("chat-unknown-model", "/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}, 404, "model", ["gpt-4"]),
    ("logit_bias-not-a-token", "/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1.0}}, 400, "logit_bias",
     ["token ids"]),
    ("functions", "/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, 400, "functions",
     ["functions"]),
    ("tools-auto-without-parser", "/v1/chat/completions",
     {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     ["--enable-auto-tool-choice"]),
    # Values that used to fail the engine step (503 for everyone, for good) or stall its thread.
    ("logprobs-huge", "/v1/completions", {"prompt": "hi", "logprobs": 10**6}, 400, "logprobs", ["20", "1000000"]),
    ("top_logprobs-huge", "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 10**6}, 400,
     "top_logprobs", ["20"]),
    ("prompt_logprobs-huge", "/v1/completions", {"prompt": "hi", "prompt_logprobs": 10**5}, 400, "prompt_logprobs",
     ["20"]),
    ("top_k-overflow", "/v1/completions", {"prompt": "hi", "top_k": 2**70}, 400, "top_k", ["top_k"]),
    ("n-huge", "/v1/completions", {"prompt": "hi", "n": 2**70}, 400, "n", ["n must be at most"]),
    ("lone-surrogate", "/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt", ["Unicode"]),
    ("not-utf8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, []),
    ("tokenize-unknown-model", "/tokenize", {"model": "nope", "prompt": "hi"}, 404, "model", ["nope"]),
    ("detokenize-outside-vocab", "/detokenize", {"tokens": [1, 10**6]}, 400, "tokens", ["1000000"]),
    ("unknown-route", "/v1/nothing", {"prompt": "hi"}, 404, None, []),
    # Strict where OpenAI is: token ids are integers, flags booleans; the param comes from where the error is.
    ("detokenize-not-ints", "/detokenize", {"tokens": [False, True, 1.0]}, 400, "tokens.0", ["integer"]),
    ("stream-as-string", "/v1/completions", {"prompt": "hi", "stream": "false"}, 400, "stream", ["boolean"]),
    ("prompt-float-ids", "/v1/completions", {"prompt": [1.0, 2.0]}, 400, "prompt", ["prompt"]),
    ("min-over-max", "/v1/completions", {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens",
     ["min_tokens must be <= max_tokens"]),
]


@pytest.mark.parametrize("path,body,status,param,needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_an_openai_error(http, path, body, status, param, needles):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert_openai_error(r, status, param, *needles)


def test_prompt_plus_max_tokens_over_max_model_len_names_the_counts(http):
    r = http.post("/v1/completions", json={"prompt": list(range(10, 40)), "max_tokens": 100})
    numbers = set(re.findall(r"\d+", assert_openai_error(r, 400, "prompt")))
    assert {"30", "100", "130", str(MAX_MODEL_LEN)} <= numbers

    prompt_tokens = http.post("/tokenize", json={"messages": CHAT}).json()["count"]
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 120})
    numbers = set(re.findall(r"\d+", assert_openai_error(r, 400, "prompt")))
    assert {str(prompt_tokens), "120", str(prompt_tokens + 120), str(MAX_MODEL_LEN)} <= numbers

    # At the limit exactly is fine.
    r = http.post("/v1/completions", json={"prompt": list(range(10, 40)), "max_tokens": MAX_MODEL_LEN - 30,
                                           "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 30


def test_rejected_requests_hold_nothing_and_the_server_still_serves(http, expected_greedy):
    # The first prompt is valid and submitted before the second is found invalid: it must be aborted.
    r = http.post("/v1/completions", json={"prompt": [[5, 6, 7], [8, 10**6]], "max_tokens": 100,
                                           "ignore_eos": True})
    assert_openai_error(r, 400, "prompt", "1000000")
    wait_until(lambda: kv_idle(http), "an idle engine after a rejected request")
    assert http.get("/health").status_code == 200
    assert greedy(http) == expected_greedy


def test_openai_client_raises_typed_errors(server_url):
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", top_p=2)
    assert e.value.status_code == 400 and e.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server_url}/v1", api_key="sk-wrong", max_retries=0).models.list()


# -- API key --------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": "Basic sk-test"}], ids=["none", "wrong", "no-bearer", "basic"])
def test_v1_needs_the_api_key(server_url, headers):
    with httpx.Client(base_url=server_url, headers=headers, timeout=30) as c:
        for method, path, body in [("GET", "/v1/models", None), ("GET", "/v1/memory", None),
                                   ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                                   ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
                                   ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
                                   ("GET", "/tokenizer_info", None), ("GET", "/no/such/route", None)]:
            r = c.request(method, path, json=body)
            assert_openai_error(r, 401, None, "API key")
            assert r.headers["www-authenticate"] == "Bearer"
        # Liveness, metrics, the version and the API's description stay open for probes, scrapers and clients.
        assert c.get("/health").status_code == 200
        assert c.get("/version").status_code == 200 and c.get("/openapi.json").status_code == 200
        r = c.get("/metrics")
        assert r.status_code == 200 and "pagedllm:num_requests_running" in r.text
    with httpx.Client(base_url=server_url, headers={"authorization": f"bearer {API_KEY}"}) as c:
        assert c.get("/v1/models").status_code == 200  # the scheme is case-insensitive


# -- a burst of malformed bodies ------------------------------------------------------------------

def _malformed_bodies() -> list[tuple[str, bytes]]:
    nested = b"[" * 100_000 + b"]" * 100_000
    raw = [
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1'),
        ("/v1/completions", b"{"),
        ("/v1/completions", b""),
        ("/v1/completions", b"null"),
        ("/v1/completions", b'"just a string"'),
        ("/v1/completions", b"[1, 2, 3]"),
        ("/v1/completions", b'{"prompt": "hi"}}'),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1e400}'),
        ("/v1/completions", b'{"prompt": "hi", "seed": 1e400}'),
        ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}'),
        ("/v1/completions", b'{"prompt": "hi", "top_p": Infinity}'),
        ("/v1/completions", b'{"prompt": "\xff\xfe\xfd"}'),
        ("/v1/completions", b'\x80\x81{"prompt": "hi"}'),
        ("/v1/completions", b'{"prompt": "\\udfff"}'),
        ("/v1/completions", b'{"prompt": ' + nested + b"}"),
        ("/v1/chat/completions", b'{"messages": ' + nested + b"}"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}'),
    ]
    objs = [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2**70}),
        ("/v1/completions", {"prompt": "hi", "seed": 2**70}),
        ("/v1/completions", {"prompt": "hi", "seed": -(2**70)}),
        ("/v1/completions", {"prompt": "hi", "n": 2**70}),
        ("/v1/completions", {"prompt": "hi", "logprobs": 2**70}),
        ("/v1/completions", {"prompt": "hi", "top_k": 2**70}),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 2**70}),
        ("/v1/completions", {"prompt": [2**70]}),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**70]}),
        ("/v1/completions", {"prompt": 5}),
        ("/v1/completions", {"prompt": {"text": "hi"}}),
        ("/v1/completions", {"prompt": [1, "a"]}),
        ("/v1/completions", {"prompt": "hi", "n": "many"}),
        ("/v1/completions", {"prompt": "hi", "stream": "yes please"}),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
        ("/v1/completions", {"prompt": "word " * 200_000}),  # a 1 MB prompt: far over max_model_len
        ("/v1/chat/completions", {"messages": "hi"}),
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{% for %}"}),
        ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ raise_exception('no') }}"}),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}),
        ("/tokenize", {"prompt": "\udfff"}),
        ("/tokenize", {"prompt": "hi", "messages": CHAT}),
        ("/detokenize", {"tokens": [2**70]}),
    ]
    return raw + [(path, json.dumps(obj).encode()) for path, obj in objs]


def test_a_burst_of_malformed_bodies_gets_4xx_and_changes_nothing(server_url, http, expected_greedy):
    before = greedy(http)
    assert before == expected_greedy
    bodies = _malformed_bodies()

    def send(item):
        path, body = item
        with httpx.Client(base_url=server_url, headers={"Authorization": f"Bearer {API_KEY}",
                                                        "Content-Type": "application/json"}, timeout=60) as c:
            return c.post(path, content=body)

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(send, bodies))
    for (path, body), r in zip(bodies, answers):
        assert 400 <= r.status_code < 500, (path, body[:80], r.status_code, r.text[:300])
        assert "message" in r.json()["error"], (path, body[:80], r.text[:300])
    assert http.get("/health").status_code == 200
    wait_until(lambda: kv_idle(http), "an idle engine after the burst")
    assert greedy(http) == before


# -- aborts ---------------------------------------------------------------------------------------

def test_streaming_clients_that_disconnect_are_aborted(server_url, http, expected_greedy):
    wait_until(lambda: kv_idle(http), "an idle engine")
    finished_before = finished_requests(server_url)
    tokens_before = metric(server_url, "pagedllm:generation_tokens_total")
    clients, n, max_tokens = 4, 2, 120
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "n": n,
            "stream": True}
    with httpx.Client(base_url=server_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        for k in range(clients):
            # Each stream lives for a few milliseconds; its 120 tokens take 120 engine steps.
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                events = sse_events(itertools.islice(lines, 4))  # two chunks, two blank lines
                assert len(events) == 2 and all(isinstance(e, dict) and e["choices"] for e in events)
                if k == 0:
                    mem = http.get("/v1/memory").json()
                    assert mem["kv_cache_usage"]["blocks_used"] > 0 and len(mem["requests"]) == n, mem
            # Leaving the block closed the connection with the response half read.
    mem = wait_until(lambda: kv_idle(http), "the disconnected streams' blocks to be freed")
    assert mem["kv_cache_usage"]["blocks_free"] == mem["kv_cache_usage"]["blocks_total"]
    # The gauges say so too: the last requests ended by abort, after which no step ran (an idle server must
    # not look busy to dashboards and autoscalers).
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric(server_url, f"pagedllm:{gauge}") == 0, gauge
    assert finished_requests(server_url) == finished_before, "a disconnected stream ran to completion"
    assert metric(server_url, "pagedllm:generation_tokens_total") - tokens_before < clients * n * max_tokens
    assert greedy(http) == expected_greedy


def test_non_streaming_client_that_times_out_is_aborted(server_url, http, expected_greedy):
    wait_until(lambda: kv_idle(http), "an idle engine")
    finished_before = finished_requests(server_url)
    # 16 prompts x n=8 x 115 tokens: 115 steps of 128 sequences, far more than the 0.1 s read timeout.
    # (However early the client gives up, the server has queued the request before it looks.)
    body = {"model": "tiny", "prompt": [f"{PROMPT} {i}" for i in range(16)], "n": 8, "max_tokens": 115,
            "ignore_eos": True}
    with httpx.Client(base_url=server_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=httpx.Timeout(30, read=0.1)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body)
    wait_until(lambda: kv_idle(http), "the timed-out request's blocks to be freed")
    assert finished_requests(server_url) == finished_before, "the abandoned request ran to completion"
    assert greedy(http) == expected_greedy


# -- start-up refusal -----------------------------------------------------------------------------

@pytest.mark.parametrize("flag,value,says", [("--pipeline-parallel-size", "2", "--pipeline-parallel-size"),
                                             ("--tensor-parallel-size", "3", "Sizes that work: 1, 2, 4")])
def test_unimplemented_vllm_flags_are_refused_at_start(tiny_llama, flag, value, says):
    """A flag pagedllm does not implement, or a tensor-parallel size the model's 4 heads cannot take: exit 2
    before any weight is loaded."""
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--model", str(tiny_llama),
                          "--port", "1", flag, value], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert flag in res.stderr and says in res.stderr and "Traceback" not in res.stderr
    assert "memory plan" not in res.stderr, "the model was loaded before the flag was refused"
    assert time.monotonic() - start < 60
