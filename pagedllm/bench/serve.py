"""`pagedllm bench serve`: load an OpenAI-compatible server and report vLLM's serving metrics.

TTFT: request start to the first streamed token. TPOT per request: (latency - TTFT) /
(output tokens - 1). ITL: every gap between streamed chunks. E2E: start to the last byte.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from pagedllm.bench.load import finish_report, percentiles, send_all


@dataclass
class RequestRecord:
    """What one request saw: its start, the arrival time of each streamed chunk with text, its end."""

    start: float
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ok: bool = True
    error: str = ""


def compute_metrics(records: list[RequestRecord], duration: float) -> dict:
    """vLLM's definitions over successful requests; times in milliseconds."""
    done = [r for r in records if r.ok and r.chunk_times]
    ttft = [(r.chunk_times[0] - r.start) * 1000 for r in done]
    e2e = [(r.end - r.start) * 1000 for r in done]
    tpot = [((r.end - r.start) - (r.chunk_times[0] - r.start)) * 1000 / (r.output_tokens - 1)
            for r in done if r.output_tokens > 1]
    itl = [(b - a) * 1000 for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    return {
        "completed": len(done), "failed": len(records) - len(done), "duration_s": duration,
        "total_input_tokens": prompt, "total_output_tokens": output,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "total_token_throughput": (prompt + output) / duration if duration else 0.0,
        **{f"{k}_ttft_ms": v for k, v in percentiles(ttft).items()},
        **{f"{k}_tpot_ms": v for k, v in percentiles(tpot).items()},
        **{f"{k}_itl_ms": v for k, v in percentiles(itl).items()},
        **{f"{k}_e2e_latency_ms": v for k, v in percentiles(e2e).items()},
    }


def random_prompts(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                   seed: int) -> list[tuple[list[int], int]]:
    from pagedllm.bench.throughput import random_requests

    return [(r.prompt_token_ids, r.output_len)
            for r in random_requests(num, input_len, output_len, range_ratio, vocab_size, seed)]


async def _one(client, url: str, body: dict, headers: dict, record: RequestRecord, chat: bool) -> None:
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                record.ok, record.error = False, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.ok, record.error = False, chunk["error"].get("message", "")
                    break
                if chunk.get("usage"):
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content") if chat else choice.get("text")
                    # A chunk carries new tokens when it has text, or (a model served without a
                    # tokenizer) when it is not the closing chunk.
                    if text or (text == "" and choice.get("finish_reason") is None):
                        record.chunk_times.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        record.ok, record.error = False, repr(e)
    finally:
        record.end = time.perf_counter()


async def run_load(base_url: str, endpoint: str, model: str | None, prompts: list[tuple[list[int], int]],
                   max_concurrency: int | None, request_rate: float, ignore_eos: bool, seed: int,
                   api_key: str | None = None, show_progress: bool = True) -> tuple[list[RequestRecord], float]:
    import logging

    import httpx
    from tqdm.auto import tqdm

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request

    chat = "chat" in endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    records = [RequestRecord(0.0) for _ in prompts]
    bar = tqdm(total=len(prompts), desc="requests", disable=not show_progress)

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        texts = await _chat_texts(client, base_url, headers, [ids for ids, _ in prompts]) if chat else []

        async def fire(i: int, ids: list[int], out_len: int) -> None:
            async with limit:
                body = {"model": model, "max_tokens": out_len, "stream": True, "ignore_eos": ignore_eos,
                        "stream_options": {"include_usage": True}, "temperature": 0.0}
                if chat:
                    body["messages"] = [{"role": "user", "content": texts[i]}]
                else:
                    body["prompt"] = ids
                records[i].start = time.perf_counter()
                await _one(client, base_url.rstrip("/") + endpoint, body, headers, records[i], chat)
                bar.update(1)

        duration = await send_all([lambda i=i, p=p: fire(i, *p) for i, p in enumerate(prompts)], request_rate, rng)
    bar.close()
    return records, duration


async def _chat_texts(client, base_url: str, headers: dict, prompts: list[list[int]]) -> list[str]:
    """A chat message is text: the random ids as the server's /detokenize writes them (about as many tokens
    again, as vLLM's random dataset does), before the timed run; "w<id>" words where it has no /detokenize."""
    texts = []
    for ids in prompts:
        r = await client.post(base_url.rstrip("/") + "/detokenize", json={"tokens": ids}, headers=headers)
        texts.append(r.json()["prompt"] if r.status_code == 200 else " ".join(f"w{t}" for t in ids))
    return texts


def format_metrics(m: dict) -> str:
    lines = [f"{'successful requests':<32}{m['completed']}", f"{'failed requests':<32}{m['failed']}",
             f"{'duration (s)':<32}{m['duration_s']:.2f}",
             f"{'request throughput (req/s)':<32}{m['request_throughput']:.2f}",
             f"{'output token throughput (tok/s)':<32}{m['output_throughput']:.2f}",
             f"{'total token throughput (tok/s)':<32}{m['total_token_throughput']:.2f}"]
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        for stat in ("mean", "median", "p99"):
            value = m[f"{stat}_{name}_ms"]
            lines.append(f"{f'{stat} {name.upper()} (ms)':<32}{'-' if value is None else f'{value:.2f}'}")
    return "\n".join(lines)


def prefix_cache_counts(base_url: str) -> tuple[float, float] | None:
    """(queries, hits) in tokens from the server's /metrics (pagedllm's or vLLM's names); None without them."""
    import httpx

    try:
        text = httpx.get(base_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    totals = {"queries": 0.0, "hits": 0.0}
    found = False
    for line in text.splitlines():
        for kind in totals:
            if line.split("{")[0].split(" ")[0].endswith(f"prefix_cache_{kind}_total"):
                totals[kind] += float(line.rsplit(" ", 1)[1])
                found = True
    return (totals["queries"], totals["hits"]) if found else None


def plot_run(records: list[RequestRecord], path: str, title: str) -> None:
    """The run as a picture: each request's time to first token against when it was sent (queueing shows as a
    rising line), and the histogram of inter-token latencies."""
    from pagedllm.plotting import pyplot

    plt = pyplot()
    done = [r for r in records if r.ok and r.chunk_times]
    t0 = min((r.start for r in done), default=0.0)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.scatter([r.start - t0 for r in done], [(r.chunk_times[0] - r.start) * 1000 for r in done], s=10)
    left.set_xlabel("sent at (s after the first)")
    left.set_ylabel("time to first token (ms)")
    itl = [(b - a) * 1000 for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    right.hist(itl, bins=40, color="#2ca02c")
    right.set_xlabel("inter-token latency (ms)")
    right.set_ylabel("tokens")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedllm bench serve")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions", "speech", "chat-audio"],
                   help="speech: /v1/audio/speech streamed; chat-audio: chat completions streaming delta.audio "
                        "(--random-input-len words of text, --random-output-len frames at most)")
    p.add_argument("--model", default=None, help="served model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset-name", default="random", choices=["random"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (default: all at once)")
    p.add_argument("--vocab-size", type=int, default=None, help="default: from the server's /tokenizer_info")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=None,
                   help="prompts' seed (default: a fresh one per run, printed; a repeated seed repeats the prompts, "
                        "which the server's prefix cache then serves)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="draw the run: FILE.png or FILE.svg (each request's TTFT by when it was sent, the "
                        "inter-token latencies' histogram; needs matplotlib)")
    p.add_argument("--voice", default=None, help="speech endpoints: a voice of the server's --voice-presets-dir")
    p.add_argument("--ref-audio", default=None, metavar="FILE",
                   help="speech endpoints: a reference clip sent in every request (ref_audio), with --ref-text")
    p.add_argument("--ref-text", default=None, help="speech endpoints: what the --ref-audio clip says")
    p.add_argument("--audio-chunk-size", type=int, default=None, help="speech endpoints: frames per streamed chunk")
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**31)
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    if args.plot is not None:
        from pagedllm.plotting import check_plot_path

        check_plot_path(args.plot)

    if args.endpoint in ("speech", "chat-audio"):
        from pagedllm.bench.speech import run_speech_bench

        return run_speech_bench(args)

    import httpx

    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    vocab = args.vocab_size
    if vocab is None:
        info = httpx.get(base + "/tokenizer_info", headers=headers, timeout=30).json()
        vocab = info.get("vocab_size") or 1000
    cache_before = prefix_cache_counts(base)
    prompts = random_prompts(args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio, vocab, args.seed)
    records, duration = asyncio.run(run_load(args.base_url, args.endpoint, args.model, prompts,
                                             args.max_concurrency, args.request_rate, args.ignore_eos,
                                             args.seed, args.api_key))
    metrics = compute_metrics(records, duration)
    if args.plot is not None:
        plot_run(records, args.plot, f"bench serve {args.endpoint}: {args.num_prompts} requests, concurrency "
                                     f"{args.max_concurrency or 'all'}, {metrics['output_throughput']:.1f} output tok/s")
    cache_after = prefix_cache_counts(base)
    if cache_before is not None and cache_after is not None:
        metrics["prefix_cache_queries"] = cache_after[0] - cache_before[0]
        metrics["prefix_cache_hits"] = cache_after[1] - cache_before[1]
    print(f"prompts' seed: {args.seed}")
    print(format_metrics(metrics))
    if "prefix_cache_hits" in metrics:
        print(f"prefix cache hits in this run: {metrics['prefix_cache_hits']:.0f} of "
              f"{metrics['prefix_cache_queries']:.0f} prompt tokens")
    return finish_report(args, metrics, [r.error for r in records if not r.ok])
