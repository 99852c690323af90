"""`pagedllm serve --data-parallel-size 2`: two replicas behind one server. 32 concurrent streams all answer
what one engine answers, spread over both replicas; a repeated prompt goes back to the replica that has its
prefix; /metrics has each replica's series under a `replica` label; SIGTERM stops the replicas too."""
from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import httpx

from tests.distributed.test_tp_server import alive
from tests.server.conftest import start_command


def stream_text(url: str, name: str, prompt: list[int]) -> tuple[str, str]:
    """The streamed completion's text and the replica that served it."""
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                      json={"model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                            "stream": True}) as r:
        assert r.status_code == 200
        replica = r.headers["x-pagedllm-replica"]
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text), replica


def test_two_replicas_answer_32_streams_as_one_engine_does(tiny_models, tmp_path):
    from pagedllm import LLM, SamplingParams

    model = tiny_models["llama"]
    prompts = [[3 + i, 4 + 2 * i, 5, 6 + i % 7] for i in range(32)]
    with LLM(str(model), dtype="float32", max_model_len=256) as one:
        expected = [o.outputs[0].text for o in one.generate([{"prompt_token_ids": p} for p in prompts],
                                                            SamplingParams(temperature=0, max_tokens=12),
                                                            use_tqdm=False)]
    proc, url = start_command(lambda port: [sys.executable, "-m", "pagedllm", "serve", str(model), "--port", str(port),
                                            "--dtype", "float32", "--max-model-len", "256", "-dp", "2"], tmp_path)
    try:
        name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        results: dict[int, tuple[str, str]] = {}

        def run(i: int) -> None:
            results[i] = stream_text(url, name, prompts[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i][0] for i in range(32)] == expected
        assert {replica for _, replica in results.values()} == {"0", "1"}
        again = [stream_text(url, name, [9, 9, 9, 9])[1] for _ in range(3)]
        assert len(set(again)) == 1  # the replica holding the prompt's prefix
        metrics = httpx.get(f"{url}/metrics").text
        for replica in ("0", "1"):
            assert f'pagedllm:generation_tokens_total{{replica="{replica}",model_name=' in metrics
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        children = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    assert code == 0
    assert children and not any(alive(c) for c in children)
