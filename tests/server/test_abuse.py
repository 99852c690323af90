"""One request cannot hold the server: each abusive request of issue 35 gets its answer (status, time) while a
normal client beside it keeps getting answers within 1 s. The limits with their defaults are checked on the
shared server; what needs other flags (request templates allowed, a short compile deadline, short read
timeouts) on a server of this module's own."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.server.conftest import AUTH, BESIDE_LIMIT_S, NormalClient, _start_server, _stop_server, wait_until
from tests.server.test_production import _children



def _post(url: str, path: str, body: dict, timeout: float = 60) -> tuple[httpx.Response, float]:
    t = time.monotonic()
    r = httpx.post(f"{url}{path}", headers=AUTH, json=body, timeout=timeout)
    return r, time.monotonic() - t


def _refused(r: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == status, error
    for word in words:
        assert word in error["message"], error["message"]


def _optional_int_properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- limits with their defaults (the shared server) ------------------------------------------------

def test_a_request_chat_template_is_refused_unless_the_operator_trusts_them(server_url):
    with NormalClient(server_url):
        r, took = _post(server_url, "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template": "{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}hello"})
    _refused(r, 400, "chat_template", "--trust-request-chat-template")
    assert took < BESIDE_LIMIT_S


@pytest.mark.parametrize("schema, flag", [
    (_optional_int_properties(600), "--structured-outputs-max-properties"),
    ({"anyOf": [{"type": "object", "properties": {"k": {"type": "string", "pattern": f"^a{i}[0-9]+$"}}}
                for i in range(200)]}, "--structured-outputs-max-alternatives"),
    ({"type": "array", "items": {"type": "string", "pattern": "x" * 70_000}}, "--structured-outputs-max-bytes"),
], ids=["properties", "anyOf", "bytes"])
def test_a_schema_over_a_limit_is_refused_before_any_compile(server_url, schema, flag):
    with NormalClient(server_url):
        r, took = _post(server_url, "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}})
    _refused(r, 400, "response_format", flag)
    assert took < BESIDE_LIMIT_S


@pytest.mark.parametrize("body, param, flag", [
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(300)]}, "stop", "--max-stop-strings"),
    ({"prompt": "hi", "stop": ["x" * 20_000, "y" * 20_000]}, "stop", "--max-stop-bytes"),
    ({"prompt": ["hi"] * 64, "n": 17}, "n", "--max-sequences-per-request"),
    ({"prompt": "hi", "n": 250, "max_tokens": 100, "logprobs": 20}, "logprobs", "--max-logprobs-entries"),
], ids=["stop-strings", "stop-bytes", "sequences", "logprobs"])
def test_a_request_over_a_limit_is_refused_before_any_work(server_url, body, param, flag):
    with NormalClient(server_url):
        r, took = _post(server_url, "/v1/completions", {"model": "tiny", "max_tokens": 2, **body})
    _refused(r, 400, param, flag)
    assert took < BESIDE_LIMIT_S


def test_chat_logprobs_over_the_limit_are_refused_naming_top_logprobs(server_url):
    r, _ = _post(server_url, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 250, "max_tokens": 100,
        "logprobs": True, "top_logprobs": 20})
    _refused(r, 400, "top_logprobs", "--max-logprobs-entries")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_chat_message_that_cannot_fit_is_refused_before_templating(server_url, path):
    message = "word " * 1_400_000  # 7 MB: under the body limit, ~1.4M tokens
    body = {"model": "tiny", "messages": [{"role": "user", "content": message}]}
    with NormalClient(server_url):
        r, took = _post(server_url, path, body)
    _refused(r, 400, "messages", "maximum context length")
    assert took < 3.0  # mostly sending 7 MB


def test_a_token_id_prompt_longer_than_the_context_is_refused_off_the_event_loop(server_url):
    ids = [7] * 1_000_000  # 2 MB of JSON
    with NormalClient(server_url):
        r, took = _post(server_url, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 1})
    _refused(r, 400, "prompt", "maximum context length", "1000000 token ids")
    assert took < 3.0


def test_a_token_id_prompt_that_fits_still_works(server_url):
    r, _ = _post(server_url, "/v1/completions", {"model": "tiny", "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 1,
                                                  "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    r, _ = _post(server_url, "/v1/completions", {"model": "tiny", "prompt": [5, True], "max_tokens": 1})
    assert r.status_code == 400  # a boolean is not a token id (the one-pass check keeps the strict types)


def test_an_empty_api_key_is_refused_at_start(tiny_llama, tmp_path):
    for args, env_key, source in [(["--api-key", ""], None, "--api-key"), ([], " ", "PAGEDLLM_API_KEY")]:
        env = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_API_KEY"}
        if env_key is not None:
            env["PAGEDLLM_API_KEY"] = env_key
        done = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--model",
                               str(tiny_llama), "--port", "0", *args], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2, done.stderr[-2000:]
        assert f"{source} is empty" in done.stderr and "Uvicorn running" not in done.stderr


# -- bounded work under this module's flags --------------------------------------------------------

OWN_FLAGS = ["--api-key", AUTH["Authorization"].removeprefix("Bearer "), "--trust-request-chat-template",
             "--request-chat-template-timeout", "2", "--structured-outputs-compile-timeout", "2",
             "--structured-outputs-max-properties", "100000", "--structured-outputs-max-bytes", "10000000",
             "--header-timeout", "2", "--body-timeout", "2", "--require-api-key-for-metrics",
             "--max-connections", "200"]  # above test_slow_headers's 160 sockets


@pytest.fixture(scope="module")
def own_server(tiny_llama, tmp_path_factory) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    proc, url, log = _start_server(tiny_llama, tmp_path_factory.mktemp("abuse"), OWN_FLAGS)
    try:
        yield proc, url, log
    finally:
        _stop_server(proc)


def _chat(template: str | None = None, **extra) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
            **extra}
    if template is not None:
        body["chat_template"] = template
    return body


def test_a_trusted_request_template_renders_and_a_looping_one_is_stopped_at_its_deadline(own_server):
    proc, url, _ = own_server
    r, _ = _post(url, "/v1/chat/completions", _chat("{% for m in messages %}<<{{ m.content }}>>{% endfor %}",
                                                    echo=False))
    assert r.status_code == 200, r.text
    r, _ = _post(url, "/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    rss = _rss_bytes(proc.pid)
    loop = "{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}hello"
    with NormalClient(url):
        r, took = _post(url, "/v1/chat/completions", _chat(loop))
    _refused(r, 400, "chat_template", "did not render within 2 s", "--request-chat-template-timeout")
    assert 2.0 <= took < 5.0
    with NormalClient(url):
        r, took = _post(url, "/v1/chat/completions", _chat("{% set s = 'x' * 3000000000 %}{{ s|length }}"))
    _refused(r, 400, "chat_template", "GiB to render")
    r, _ = _post(url, "/v1/chat/completions", _chat("{{ 'x' * 5000000 }}"))
    _refused(r, 400, "chat_template", "5000000 characters")
    r, _ = _post(url, "/v1/chat/completions", _chat("{{ raise_exception('no system role') }}"))
    _refused(r, 400, "chat_template", "no system role")
    assert _rss_bytes(proc.pid) - rss < 200 << 20  # the gigabytes were the worker's, not the server's


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def test_a_schema_past_its_compile_deadline_is_a_400_and_the_others_never_wait(own_server):
    proc, url, _ = own_server
    small = _json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    r, _ = _post(url, "/v1/chat/completions", _chat(response_format=small, max_tokens=12))
    assert r.status_code == 200, r.text  # (the compiler and its worker are up: not counted in a deadline)
    rss = _rss_bytes(proc.pid)
    with NormalClient(url):
        r, took = _post(url, "/v1/chat/completions", _chat(response_format=_json_schema(
            _optional_int_properties(4000))))
    _refused(r, 400, "response_format", "did not compile within 2 s", "--structured-outputs-compile-timeout")
    assert took < 2.0 + 3.0  # the deadline, and the killed worker's restart for the next call
    assert _rss_bytes(proc.pid) - rss < 300 << 20
    r, _ = _post(url, "/v1/chat/completions", _chat(response_format=small, max_tokens=12))
    assert r.status_code == 200, r.text


def test_a_compile_whose_client_left_is_cancelled(own_server):
    _, url, log = own_server
    warm = _json_schema({"type": "object", "properties": {"cancel_test": {"type": "integer"}}})
    r, _ = _post(url, "/v1/chat/completions", _chat(response_format=warm))  # the worker is up and idle
    assert r.status_code == 200, r.text
    before = log.read_text().count("(cancelled)")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=0.5,
                   json=_chat(response_format=_json_schema(_optional_int_properties(5000))))
    t = time.monotonic()
    wait_until(lambda: log.read_text().count("(cancelled)") > before, "the compile's worker to be stopped",
               attempts=100)
    assert time.monotonic() - t < 3.0


def test_metrics_need_the_key_only_when_the_operator_says_so(own_server, server_url):
    _, url, _ = own_server
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401
    assert httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(f"{server_url}/metrics", timeout=10).status_code == 200  # open by default, as vLLM's
    spec = httpx.get(f"{url}/openapi.json", timeout=10).json()
    assert "401" in spec["paths"]["/metrics"]["get"]["responses"]


def test_the_connection_cap_stays_below_the_open_files_limit():
    import resource

    from pagedllm.entrypoints.openai.connections import RESERVED_FILES, default_max_connections

    cap = default_max_connections()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)  # raised to the hard limit by the call
    assert cap == max(32, soft - RESERVED_FILES) and cap < soft


def _partial_socket(url: str) -> socket.socket:
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    return s


def _closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except (ConnectionResetError, TimeoutError):
        return True


def test_slow_headers_are_cut_at_the_header_timeout_with_one_log_line(own_server):
    _, url, log = own_server
    lines_before = log.read_text().count("head did not arrive")
    with NormalClient(url):
        idle = [_partial_socket(url) for _ in range(150)]
        dripping = [_partial_socket(url) for _ in range(10)]
        t = time.monotonic()
        for _ in range(12):  # a header byte every 0.25 s: still cut at the deadline
            for s in dripping:
                try:
                    s.sendall(b"X")
                except (BrokenPipeError, ConnectionResetError):
                    pass
            time.sleep(0.25)
        for s in idle + dripping:
            s.settimeout(10)
            assert _closed_by_server(s)
            s.close()
        assert time.monotonic() - t < 10
    assert log.read_text().count("head did not arrive") - lines_before <= 2


def test_past_the_connection_cap_a_request_gets_an_openai_503_at_once(own_server):
    """200 sockets holding the cap (--max-connections 200): a request gets 503 with OpenAI's error body and
    Retry-After in well under a second, and is served again once the header timeout has closed them."""
    _, url, log = own_server
    held = [_partial_socket(url) for _ in range(200)]
    try:
        r = wait_until(lambda: (lambda r: r if r.status_code == 503 else None)(_post(url, "/v1/completions", {
            "model": "tiny", "prompt": "hi", "max_tokens": 2})[0]), "a request past the cap", attempts=20)
        assert r.elapsed.total_seconds() < BESIDE_LIMIT_S
        assert r.headers["content-type"] == "application/json" and int(r.headers["retry-after"]) >= 1
        error = r.json()["error"]
        assert error["code"] == 503 and "--max-connections" in error["message"], error
    finally:
        for s in held:
            s.close()
    wait_until(lambda: _post(url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})[0]
               .status_code == 200, "a request served once the sockets are gone", attempts=100)
    assert log.read_text().count("Exceeded concurrency limit") <= 2  # one line per interval, not per request


def test_a_stalled_body_gets_408_at_the_body_timeout(own_server):
    _, url, _ = own_server
    u = urlparse(url)
    with NormalClient(url):
        with socket.create_connection((u.hostname, u.port), timeout=15) as s:
            t = time.monotonic()
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"{'Authorization: ' + AUTH['Authorization']}\r\nContent-Length: 1000\r\n\r\n{{\"pro".encode())
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = s.recv(65536)
                if not chunk:
                    break
                answer += chunk
            took = time.monotonic() - t
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert 2.0 <= took < 5.0


# -- shutdown that always ends ---------------------------------------------------------------------

@pytest.mark.parametrize("how", ["timeout", "second-signal"])
def test_shutdown_ends_with_a_slow_body_and_a_compile_in_flight(tiny_llama, tmp_path, how):
    timeout = "2" if how == "timeout" else "600"
    proc, url, log = _start_server(tiny_llama, tmp_path, [
        "--api-key", AUTH["Authorization"].removeprefix("Bearer "), "--shutdown-timeout", timeout,
        "--body-timeout", "600", "--structured-outputs-compile-timeout", "600",
        "--structured-outputs-max-properties", "100000", "--structured-outputs-max-bytes", "10000000"])
    try:
        u = urlparse(url)
        slow = socket.create_connection((u.hostname, u.port), timeout=30)
        slow.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Authorization: {AUTH['Authorization']}\r\nContent-Length: 1000\r\n\r\n{{".encode())
        compiled: list = []
        compile_thread = threading.Thread(target=lambda: compiled.append(_post(url, "/v1/chat/completions", _chat(
            response_format=_json_schema(_optional_int_properties(8000))), timeout=120)[0]), daemon=True)
        compile_thread.start()
        wait_until(lambda: any("pagedllm.isolated_worker" in Path(f"/proc/{pid}/cmdline").read_text()
                               for pid in _children(proc.pid)), "the compile's worker", attempts=600)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        if how == "second-signal":
            wait_until(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 503, "draining")
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 1  # forced: requests were ended
        assert time.monotonic() - t < 12  # the drain (2 s) or the second signal, the close grace, and a margin
        compile_thread.join(30)
        assert compiled and compiled[0].status_code == 503, compiled
        slow.close()
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
