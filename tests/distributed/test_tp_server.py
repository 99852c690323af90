"""`pagedllm serve --tensor-parallel-size 2` as a process: it serves what one rank serves; a worker killed
mid-request fails that request, turns the server away from serving and makes it exit non-zero, leaving no
worker behind; SIGTERM stops the server and its worker."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import httpx

from tests.server.conftest import start_command, wait_until


def worker_pids(parent: int) -> list[int]:
    """Live `pagedllm.executor.worker` processes whose parent is `parent` (read from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"pagedllm.executor.worker" in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's parent is init: the parent pid cannot tell)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def serve(model: Path, log_dir: Path, *extra: str):
    return start_command(lambda port: [sys.executable, "-m", "pagedllm", "serve", str(model), "--port", str(port),
                                       "--dtype", "float32", "--max-model-len", "256", "-tp", "2", *extra], log_dir)


def completion(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": body.pop("model", None) or "m", **body}, timeout=60)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "The forecast?"}]


def check_constraints_served(url: str, name: str, one) -> None:
    """Through the `openai` client, as a user's script: a json_schema response, a required tool call and a
    logit_bias hold on two ranks, the greedy ones word for word what one rank (`one`, offline) says."""
    import jsonschema
    import openai

    from pagedllm import SamplingParams
    from pagedllm.structured_output import GuidedDecodingParams
    from tests.server.test_tool_calls import SCHEMAS, TOOLS, USER

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=name, messages=MESSAGES, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    offline = one.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=60, guided_decoding=GuidedDecodingParams(
        json=SCHEMA)), use_tqdm=False)[0].outputs[0].text
    assert reply.choices[0].message.content == offline
    for seed in range(2):
        reply = client.chat.completions.create(model=name, messages=[USER], tools=TOOLS, tool_choice="required",
                                               max_tokens=80, temperature=1.0, seed=seed, parallel_tool_calls=False)
        [call] = reply.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    biased = client.completions.create(model=name, prompt=[3, 4, 5], max_tokens=6, temperature=0,
                                       logit_bias={"17": 100})
    offline = one.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0, max_tokens=6,
                           logit_bias={17: 100.0}), use_tqdm=False)[0].outputs[0]
    assert offline.token_ids == [17] * 6 and biased.choices[0].text == offline.text


def test_a_killed_worker_fails_its_requests_and_the_server_exits(tiny_models, tmp_path):
    """Also: structured outputs, tool_choice required and logit_bias on the two ranks (check_constraints_served)."""
    from pagedllm import LLM, SamplingParams

    model = tiny_models["llama"]
    one = LLM(str(model), dtype="float32", max_model_len=256)
    expected = one.generate({"prompt_token_ids": [3, 4, 5, 6]}, SamplingParams(temperature=0, max_tokens=16),
                            use_tqdm=False)[0].outputs[0].text
    proc, url = serve(model, tmp_path)
    try:
        name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": [3, 4, 5, 6], "max_tokens": 16, "temperature": 0}
        assert completion(url, **body).json()["choices"][0]["text"] == expected  # what one rank says
        check_constraints_served(url, name, one)
        [worker] = worker_pids(proc.pid)
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={**body, "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if len(events) == 3:  # mid-request
                    os.kill(worker, signal.SIGKILL)
        assert "error" in events[-1], events[-1]  # the stream ends with an error event, not 200 tokens
        assert proc.wait(timeout=60) != 0
        assert not alive(worker)
        log = "".join(p.read_text() for p in tmp_path.glob("server-*.stderr"))
        assert "tensor-parallel rank 1" in log and "exiting" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_stops_the_server_and_its_worker(tiny_models, tmp_path):
    proc, url = serve(tiny_models["qwen2"], tmp_path)
    workers = worker_pids(proc.pid)
    assert len(workers) == 1
    assert httpx.post(f"{url}/v1/completions", json={"model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"],
                                                     "prompt": [3, 4], "max_tokens": 4}, timeout=60).status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    wait_until(lambda: not alive(workers[0]), "the worker to exit", attempts=100, interval_s=0.1)
