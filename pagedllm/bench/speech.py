"""`pagedllm bench serve --endpoint speech|chat-audio`: load a speech server with streamed requests and report
what a voice application feels: time to the first audio chunk (TTFA), each request's real-time factor (RTF:
seconds to make it / seconds of audio it holds), and seconds of audio made per wall second.

speech: POST /v1/audio/speech, stream true, WAV (its header gives the sample rate, then PCM16).
chat-audio: POST /v1/chat/completions with modalities ["text", "audio"], stream true: delta.audio chunks of
base64 PCM16 at the rate a speech request reported (asked once before the run).
"""
from __future__ import annotations

import asyncio
import base64
import functools
import json
import random
import struct
import time
from dataclasses import dataclass

from pagedllm.bench.load import finish_report, percentiles, send_all

WORDS = ("the morning light falls on quiet water while a small boat drifts past green hills and far away a "
         "bell rings twice as people walk along the old stone road toward the market").split()
WAV_HEADER_BYTES = 44


@dataclass
class AudioRecord:
    """What one request saw: its start, its first audio bytes, its end, and the samples it got."""

    start: float = 0.0
    first_audio: float | None = None
    end: float = 0.0
    samples: int = 0
    ok: bool = True
    error: str = ""


def texts_for(num: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "." for _ in range(num)]


def compute_audio_metrics(records: list[AudioRecord], duration: float, rate: int) -> dict:
    """TTFA and RTF over the requests that completed with audio; times in milliseconds."""
    done = [r for r in records if r.ok and r.samples and r.first_audio is not None]
    ttfa = [(r.first_audio - r.start) * 1000 for r in done]
    rtf = [(r.end - r.start) / (r.samples / rate) for r in done]
    audio_s = sum(r.samples for r in done) / rate
    return {"completed": len(done), "failed": len(records) - len(done), "duration_s": duration,
            "audio_seconds": audio_s, "audio_seconds_per_second": audio_s / duration if duration else 0.0,
            **{f"{k}_ttfa_ms": v for k, v in percentiles(ttfa).items()},
            **{f"{k}_rtf": v for k, v in percentiles(rtf).items()}}


_REF_PLACEHOLDER = "\x00ref_audio\x00"


def _json_body(body: dict) -> bytes:
    """The request's JSON, a reference clip's base64 spliced in as JSON text made once per clip: the load
    generator shares the machine's cores with the server, and re-encoding 384 kB per request took a share of them."""
    clip = body.get("ref_audio")
    if clip is None:
        return json.dumps(body).encode()
    text = json.dumps(body | {"ref_audio": _REF_PLACEHOLDER})
    return text.replace(json.dumps(_REF_PLACEHOLDER), _clip_json(clip), 1).encode()


@functools.lru_cache(maxsize=1)
def _clip_json(clip: str) -> str:
    """(The same str object every request: its hash is computed once.)"""
    return json.dumps(clip)


async def _speech(client, base: str, body: dict, headers: dict, record: AudioRecord) -> int | None:
    """One streamed /v1/audio/speech; returns the WAV header's sample rate."""
    rate, got = None, b""
    content = _json_body(body | {"stream": True, "response_format": "wav"})
    async with client.stream("POST", f"{base}/v1/audio/speech", content=content,
                             headers=headers | {"content-type": "application/json"}) as resp:
        if resp.status_code != 200:
            record.ok, record.error = False, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return None
        async for data in resp.aiter_bytes():
            if rate is None:
                got += data
                if len(got) < WAV_HEADER_BYTES:
                    continue
                rate = struct.unpack("<I", got[24:28])[0]
                data = got[WAV_HEADER_BYTES:]
            if data and record.first_audio is None:
                record.first_audio = time.perf_counter()
            record.samples += len(data) // 2
    return rate


async def _chat_audio(client, base: str, body: dict, headers: dict, record: AudioRecord) -> None:
    chat = {"model": body.get("model"), "modalities": ["text", "audio"], "stream": True,
            "audio": {"voice": body.get("voice"), "format": "pcm16"}, "max_tokens": body["max_tokens"],
            "messages": [{"role": "user", "content": body["input"]}]}
    for key in ("audio_chunk_size", "ref_audio", "ref_text"):
        if body.get(key):
            chat[key] = body[key]
    async with client.stream("POST", f"{base}/v1/chat/completions", content=_json_body(chat),
                             headers=headers | {"content-type": "application/json"}) as resp:
        if resp.status_code != 200:
            record.ok, record.error = False, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                record.ok, record.error = False, event["error"].get("message", "")
                return
            for choice in event.get("choices", []):
                audio = (choice.get("delta") or {}).get("audio")
                if audio and audio.get("data"):
                    if record.first_audio is None:
                        record.first_audio = time.perf_counter()
                    record.samples += len(base64.b64decode(audio["data"])) // 2


async def run_speech_load(base_url: str, endpoint: str, texts: list[str], max_tokens: int,
                          max_concurrency: int | None, request_rate: float, seed: int, model: str | None = None,
                          voice: str | None = None, audio_chunk_size: int | None = None,
                          api_key: str | None = None, show_progress: bool = True,
                          reference: tuple[bytes, str] | None = None) -> tuple[list[AudioRecord], float, int]:
    """(records, duration, sample rate): the sample rate from one speech request before the run. `reference`: a
    clip and its transcript sent in every request (ref_audio, ref_text), instead of a preset voice."""
    import logging

    import httpx
    from tqdm.auto import tqdm

    logging.getLogger("httpx").setLevel(logging.WARNING)
    base = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    common = {"model": model, "voice": voice, "max_tokens": max_tokens, "temperature": 1.0}
    if reference is not None:
        common |= {"ref_audio": base64.b64encode(reference[0]).decode("ascii"), "ref_text": reference[1]}
    if audio_chunk_size:
        common["audio_chunk_size"] = audio_chunk_size
    limit = asyncio.Semaphore(max_concurrency or len(texts))
    records = [AudioRecord() for _ in texts]
    bar = tqdm(total=len(texts), desc="requests", disable=not show_progress)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        probe = AudioRecord()
        rate = await _speech(client, base, common | {"input": "Hello.", "max_tokens": 8}, headers, probe)
        if rate is None:
            raise RuntimeError(f"the server's /v1/audio/speech did not answer: {probe.error}")

        async def fire(i: int) -> None:
            async with limit:
                records[i].start = time.perf_counter()
                try:
                    body = common | {"input": texts[i]}
                    if endpoint == "speech":
                        await _speech(client, base, body, headers, records[i])
                    else:
                        await _chat_audio(client, base, body, headers, records[i])
                except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
                    records[i].ok, records[i].error = False, repr(e)
                records[i].end = time.perf_counter()
                bar.update(1)

        duration = await send_all([lambda i=i: fire(i) for i in range(len(texts))], request_rate,
                                  random.Random(seed))
    bar.close()
    return records, duration, rate


def format_audio_metrics(m: dict) -> str:
    lines = [f"{'successful requests':<32}{m['completed']}", f"{'failed requests':<32}{m['failed']}",
             f"{'duration (s)':<32}{m['duration_s']:.2f}", f"{'audio (s)':<32}{m['audio_seconds']:.2f}",
             f"{'audio seconds per second':<32}{m['audio_seconds_per_second']:.2f}"]
    for name, unit in (("ttfa", " (ms)"), ("rtf", "")):
        for stat in ("mean", "median", "p99"):
            value = m[f"{stat}_{name}" + ("_ms" if unit else "")]
            lines.append(f"{f'{stat} {name.upper()}{unit}':<32}{'-' if value is None else f'{value:.3f}'}")
    return "\n".join(lines)


def run_speech_bench(args) -> int:
    """The speech endpoints of `bench serve` (its parsed arguments)."""
    texts = texts_for(args.num_prompts, args.random_input_len, args.seed)
    if (args.ref_audio is None) != (args.ref_text is None):
        raise ValueError("--ref-audio and --ref-text go together: a clip and what it says")
    reference = None if args.ref_audio is None else (open(args.ref_audio, "rb").read(), args.ref_text)
    records, duration, rate = asyncio.run(run_speech_load(
        args.base_url, args.endpoint, texts, args.random_output_len, args.max_concurrency, args.request_rate,
        args.seed, args.model, args.voice, args.audio_chunk_size, args.api_key, reference=reference))
    metrics = compute_audio_metrics(records, duration, rate)
    print(f"texts' seed: {args.seed}; sample rate {rate} Hz")
    print(format_audio_metrics(metrics))
    return finish_report(args, metrics, [r.error for r in records if not r.ok])
