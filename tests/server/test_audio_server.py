"""The seed's command, as written (our module name, a free port), serving a tiny Higgs Audio v2 model
with a tiny audio tokenizer: speech, chat with audio, voices, limits, the encoded-audio cache, errors.

Two servers: the seed command itself (no voices, no cache, 50 audio items), and one with voices, a
cache and a limit of 2 audio items. Both start as subprocesses and are polled on /health.
"""
from __future__ import annotations

import base64
import io
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from tests.audio_helpers import (
    make_tiny_audio_tokenizer,
    make_tiny_higgs_tts,
    sine_wave,
)
from tests.server.conftest import (
    _stop_server,
    kv_idle,
    metric,
    metric_samples,
    start_command,
    wait_until,
)

NAME = "higgs-audio-base-test"
TEXT = "The sun rises in the east."


def seed_command(model: Path, codec: Path, port: int) -> list[str]:
    """The seed's command with our module name (and a free port instead of 8300)."""
    return [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", NAME, "--audio-tokenizer-type", str(codec), "--limit-mm-per-prompt", "audio=50",
            "--max-model-len", "2048", "--port", str(port), "--gpu-memory-utilization", "0.8", "--swap-space", "4",
            "--disable-mm-preprocessor-cache", "--enforce-eager"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("audio-server")
    voices = root / "voices"
    voices.mkdir()
    sf.write(voices / "alice.wav", sine_wave(0.6), 24000)
    (voices / "alice.txt").write_text("Hello there.")
    sf.write(voices / "bob.flac", sine_wave(0.5, rate=16000, freq=150.0), 16000)
    (voices / "bob.txt").write_text("Good morning.")
    return {"model": make_tiny_higgs_tts(root / "model", long_audio=True),
            "codec": make_tiny_audio_tokenizer(root / "codec"), "voices": voices, "logs": root}


@pytest.fixture(scope="module")
def seed_url(files) -> Iterator[str]:
    proc, url = start_command(lambda port: seed_command(files["model"], files["codec"], port), files["logs"])
    try:
        yield url
    finally:
        _stop_server(proc)


@pytest.fixture(scope="module")
def voices_url(files) -> Iterator[str]:
    def cmd(port):
        return [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--model", str(files["model"]),
                "--served-model-name", NAME, "--audio-tokenizer-path", str(files["codec"]), "--port", str(port),
                "--max-model-len", "512", "--limit-mm-per-prompt", '{"audio": 2}', "--mm-processor-cache-gb", "0.01",
                "--voice-presets-dir", str(files["voices"])]
    proc, url = start_command(cmd, files["logs"])
    try:
        yield url
    finally:
        _stop_server(proc)


@pytest.fixture(scope="module")
def offline(files):
    """The offline engine on the same model: the codes the server must speak."""
    from pagedllm import LLM

    return LLM(str(files["model"]), max_model_len=2048)


def speech(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/audio/speech", json={"model": NAME, **body}, timeout=120)


def wav_samples(data: bytes) -> tuple[np.ndarray, int]:
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    return samples, rate


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# -- the seed command -----------------------------------------------------------------------------

def test_the_seed_command_serves_and_plans_the_audio_tokenizer(seed_url):
    models = httpx.get(f"{seed_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [NAME]
    plan = httpx.get(f"{seed_url}/v1/memory").json()
    (codec,) = [c for c in plan["components"] if c["name"] == "audio tokenizer"]
    assert codec["source"].startswith("measured") and codec["weight_bytes"] > 0 and codec["activation_peak_bytes"] > 0
    assert plan["swap_space_bytes"] == 4 << 30  # --swap-space 4


def test_speech_is_a_wav_of_transformers_decode_of_the_offline_codes(seed_url, offline, files):
    from pagedllm import SamplingParams
    from pagedllm.audio.prompt import Conversation, Turn, build_audio_prompt
    from pagedllm.audio.tokenizer import audio_tokenizer_class

    r = speech(seed_url, input=TEXT, response_format="wav", temperature=0.0, max_tokens=48)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/wav"
    got, rate = wav_samples(r.content)
    assert rate == 24000

    prompt = build_audio_prompt(Conversation([Turn("user", TEXT)]), offline.get_tokenizer())
    (out,) = offline.generate([prompt.to_engine_prompt()], SamplingParams(temperature=0.0, max_tokens=48),
                              use_tqdm=False)
    codes = out.outputs[0].audio_codes
    assert len(codes) > 10 and r.headers["x-audio-frames"] == str(len(codes))
    with torch.no_grad():
        reference = audio_tokenizer_class().from_pretrained(str(files["codec"])).eval().decode(
            codes.T[None], return_dict=False)[0, 0].numpy()
    buf = io.BytesIO()
    sf.write(buf, reference, 24000, format="WAV", subtype="PCM_16")
    expected, _ = wav_samples(buf.getvalue())
    assert len(got) == len(codes) * 960
    np.testing.assert_array_equal(got, expected)


def test_streamed_speech_is_the_same_audio(seed_url):
    body = {"input": TEXT, "temperature": 0.0, "max_tokens": 60}
    whole, _ = wav_samples(speech(seed_url, response_format="wav", **body).content)
    with httpx.stream("POST", f"{seed_url}/v1/audio/speech", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        chunks = list(r.iter_bytes())
    streamed, rate = wav_samples(b"".join(chunks))
    assert rate == 24000 and streamed.shape == whole.shape
    assert np.abs(streamed.astype(int) - whole).max() <= 1  # float rounding: at most one 16-bit step
    pcm = speech(seed_url, response_format="pcm", stream=True, **body)
    assert pcm.headers["content-type"] == "audio/pcm" and len(pcm.content) == 2 * len(whole)
    # Listening for silence decodes chunk by chunk as frames come: the same audio when none is heard.
    listened = speech(seed_url, response_format="wav", stop_after_silence_frames=25, **body)
    assert "x-audio-finish-reason" not in listened.headers
    assert np.abs(wav_samples(listened.content)[0].astype(int) - whole).max() <= 1


def test_flac_and_mp3(seed_url):
    body = {"input": TEXT, "temperature": 0.0, "max_tokens": 30}
    wav, _ = wav_samples(speech(seed_url, response_format="wav", **body).content)
    flac = speech(seed_url, response_format="flac", **body)
    assert flac.headers["content-type"] == "audio/flac"
    # libsndfile rounds float samples to 16 bits differently for FLAC and WAV: one step at most.
    assert np.abs(wav_samples(flac.content)[0].astype(int) - wav).max() <= 1
    mp3 = speech(seed_url, response_format="mp3", **body)
    assert mp3.status_code == 200 and mp3.headers["content-type"] == "audio/mpeg"
    assert sf.info(io.BytesIO(mp3.content)).format == "MP3"


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": "aac"}, "response_format", "response_format 'aac' is not supported; supported: pcm, wav"),
    ({"speed": 4.5}, "speed", "speed must be between 0.25 and 4.0, got 4.5"),
    ({"speed": 1.5, "stream": True}, "speed", "stream at speed 1.0"),
    ({"stream": True, "response_format": "flac"}, "response_format", "streaming sends wav or pcm"),
    ({"voice": "nova2"}, "voice", "unknown voice 'nova2'; voices: none (start the server with --voice-presets-dir)"),
    ({"max_tokens": 5000}, None, "maximum context length is 2048 tokens"),
    ({"top_p": 2.0}, "top_p", "top_p"),
    ({"temperature": "hot"}, "temperature", "valid number"),  # (unknown fields are ignored, as in every route)
])
def test_bad_speech_requests_get_a_400_and_the_server_stays_healthy(seed_url, body, param, message):
    err = error_of(speech(seed_url, input=TEXT, **body))
    assert message in err["message"]
    if param is not None:
        assert err["param"] == param
    assert httpx.get(f"{seed_url}/health").status_code == 200


def test_other_bad_inputs(seed_url):
    assert error_of(speech(seed_url, input=""))["param"] == "input"
    assert error_of(httpx.post(f"{seed_url}/v1/audio/speech", json={"model": "other", "input": "x"}), 404)
    assert "audio=N" not in httpx.get(f"{seed_url}/v1/audio/voices").text  # an empty list, not an error
    assert httpx.get(f"{seed_url}/v1/audio/voices").json() == {"object": "list", "data": [], "voices": []}


def test_clients_that_leave_abort_their_requests(seed_url):
    """1500 frames take the tiny model well over 5 s; a client leaving frees the blocks at once."""
    long = {"model": NAME, "input": TEXT, "max_tokens": 1500, "temperature": 0.0}  # greedy: no early end
    with httpx.Client(base_url=seed_url, timeout=30) as client:
        def running():
            return client.get("/v1/memory").json()["requests"]

        with httpx.stream("POST", f"{seed_url}/v1/audio/speech", json={**long, "stream": True}, timeout=120) as r:
            assert r.status_code == 200
            chunks = r.iter_bytes()  # kept: dropping the iterator would close the response
            next(chunks)  # the WAV header
            wait_until(running, "the streamed request to run")
        wait_until(lambda: kv_idle(client), "the streamed request's blocks to be freed", attempts=50, interval_s=0.1)
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/audio/speech", json=long, timeout=1.0)
        wait_until(lambda: kv_idle(client), "the whole-file request's blocks to be freed", attempts=50, interval_s=0.1)
    assert httpx.get(f"{seed_url}/health").status_code == 200
    assert speech(seed_url, input="Still here.", max_tokens=8).status_code == 200


def test_concurrent_speech_requests_run_in_one_batch(seed_url):
    def multi_step_count() -> float:
        """Engine steps that ran more than one sequence, from the step-size histogram."""
        samples = metric_samples(seed_url)
        total = sum(v for n, _, v in samples if n == "pagedllm:iteration_num_sequences_count")
        single = sum(v for n, lab, v in samples if n == "pagedllm:iteration_num_sequences_bucket" and lab["le"] == "1.0")
        return total - single

    before = multi_step_count()
    results: list[int] = []
    threads = [threading.Thread(target=lambda i=i: results.append(
        speech(seed_url, input=f"Sentence number {i}.", max_tokens=40, temperature=0.0).status_code)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 4
    assert multi_step_count() - before >= 10  # steps that advanced several speech requests at once


def test_sixteen_concurrent_speech_streams_all_complete_with_their_length(seed_url):
    """Each stream's PCM is as long as the same request's whole file (frames x 960 samples)."""
    body = {"temperature": 0.0, "max_tokens": 40, "response_format": "pcm"}
    whole = speech(seed_url, input="Sentence number 0.", **body)
    frames = int(whole.headers["x-audio-frames"])
    lengths: dict[int, int] = {}

    def stream(i: int) -> None:
        with httpx.stream("POST", f"{seed_url}/v1/audio/speech", timeout=300,
                          json={"input": f"Sentence number {i}.", "stream": True, **body}) as r:
            lengths[i] = len(b"".join(r.iter_bytes())) if r.status_code == 200 else -r.status_code

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert frames > 0 and len(whole.content) == frames * 960 * 2
    assert lengths == {i: frames * 960 * 2 for i in range(16)}


def test_a_seed_gives_the_same_audio_every_run_and_a_batch_changes_no_greedy_frame(seed_url):
    """Sampling at temperature 1 with a seed: the same audio on every run, another seed other audio. Beside
    other requests a greedy request's audio is the same as alone. (A seeded request's draws come from its own
    generator, but beside others its logits differ by float rounding of the batched matmuls, ~1e-5 in fp32,
    which now and then moves a draw across a boundary; `--batch-invariant` removes that rounding difference:
    tests/engine/test_batch_invariant.py.)"""
    body = {"input": TEXT, "temperature": 1.0, "seed": 1234, "max_tokens": 30, "response_format": "pcm"}
    first = speech(seed_url, **body).content
    assert len(first) > 0 and speech(seed_url, **body).content == first
    assert speech(seed_url, **{**body, "seed": 4321}).content != first
    greedy = {**body, "temperature": 0.0}
    alone = speech(seed_url, **greedy).content
    results: dict[str, bytes] = {}

    def run(name: str, **extra) -> None:
        results[name] = speech(seed_url, **{**greedy, **extra}).content

    threads = [threading.Thread(target=run, args=("greedy",))] + [
        threading.Thread(target=run, args=(f"other{i}",), kwargs={"input": f"Other text {i}.", "temperature": 1.0,
                                                                  "seed": i}) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["greedy"] == alone


def test_chat_with_audio_output_through_the_openai_client(seed_url):
    from openai import OpenAI

    client = OpenAI(base_url=f"{seed_url}/v1", api_key="none")
    reference = base64.b64encode(_wav_bytes(sine_wave(0.8, freq=180.0))).decode()
    r = client.chat.completions.create(
        model=NAME, modalities=["text", "audio"], audio={"voice": None, "format": "wav"}, max_tokens=40,
        temperature=0.0,
        messages=[{"role": "system", "content": "Generate audio following instruction."},
                  {"role": "user", "content": [
                      {"type": "text", "text": "Hello there."},
                      {"type": "input_audio", "input_audio": {"data": reference, "format": "wav"}}]},
                  {"role": "user", "content": TEXT}])
    message = r.choices[0].message
    assert message.content is None and message.audio.transcript == TEXT and message.audio.id.startswith("audio_")
    samples, rate = wav_samples(base64.b64decode(message.audio.data))
    assert rate == 24000 and len(samples) > 0 and len(samples) % 960 == 0
    assert r.usage.prompt_tokens > 40  # the reference clip's frames are part of the prompt


def test_streamed_chat_audio_through_the_openai_client_is_the_whole_audio(seed_url):
    """delta.audio chunks of base64 PCM16, read by the openai client's iterator; joined, the samples of the
    non-streamed reply's WAV (within one 16-bit step: float rounding), whatever the chunking."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{seed_url}/v1", api_key="none")
    common = dict(model=NAME, modalities=["text", "audio"], max_tokens=60, temperature=0.0,
                  messages=[{"role": "user", "content": TEXT}])
    whole = client.chat.completions.create(audio={"voice": None, "format": "wav"}, **common)
    expected, _ = wav_samples(base64.b64decode(whole.choices[0].message.audio.data))
    num_pieces = []
    for chunking in ({}, {"audio_chunk_size": 2, "audio_chunk_overlap_size": 16}):
        pieces, ids, transcripts, finish, usage = [], set(), [], None, None
        for chunk in client.chat.completions.create(audio={"format": "pcm16"}, stream=True,
                                                    stream_options={"include_usage": True}, extra_body=chunking,
                                                    **common):
            usage = chunk.usage or usage
            for c in chunk.choices:
                audio = c.delta.audio  # the client's own model of a streamed audio delta
                if audio:
                    pieces.append(base64.b64decode(audio.data))
                    ids.add(audio.id)
                    transcripts.append(audio.transcript)
                finish = c.finish_reason or finish
        streamed = np.frombuffer(b"".join(pieces), dtype="<i2")
        assert streamed.shape == expected.shape and np.abs(streamed.astype(int) - expected).max() <= 1
        assert len(ids) == 1 and transcripts[0] == TEXT and all(t is None for t in transcripts[1:])
        assert finish == whole.choices[0].finish_reason and usage.completion_tokens == whole.usage.completion_tokens
        num_pieces.append(len(pieces))
    assert num_pieces[1] > num_pieces[0] >= 2, num_pieces  # smaller chunks: more of them


def test_a_client_leaving_a_streamed_chat_frees_its_request(seed_url):
    body = {"model": NAME, "modalities": ["text", "audio"], "audio": {"format": "pcm16"}, "stream": True,
            "max_tokens": 1500, "temperature": 0.0, "messages": [{"role": "user", "content": TEXT}]}
    with httpx.Client(base_url=seed_url, timeout=30) as client:
        with httpx.stream("POST", f"{seed_url}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if '"audio"' in line)  # audio is flowing
        wait_until(lambda: kv_idle(client), "the streamed chat's blocks to be freed", attempts=50, interval_s=0.1)


def test_bad_audio_inputs_get_a_400(seed_url):
    def chat(messages, **extra):
        body = {"model": NAME, "modalities": ["text", "audio"], "audio": {"format": "wav"}, "messages": messages}
        return httpx.post(f"{seed_url}/v1/chat/completions", json=body | extra, timeout=60)

    def ref(data: str, fmt: str = "wav"):
        return [{"role": "user", "content": [{"type": "text", "text": "Hi."},
                                             {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}]},
                {"role": "user", "content": TEXT}]

    garbage = base64.b64encode(b"RIFF....WAVEfmt this is not audio" * 3).decode()
    assert "could not be decoded as wav" in error_of(chat(ref(garbage)))["message"]
    assert "Supported formats: wav" in error_of(chat(ref(garbage)))["message"]
    assert "not valid base64" in error_of(chat(ref("@@not base64@@")))["message"]
    assert "'aac' is not supported" in error_of(chat(ref(garbage, "aac")))["message"]
    last_with_audio = [{"role": "user", "content": [{"type": "text", "text": TEXT}, {"type": "input_audio",
                        "input_audio": {"data": base64.b64encode(_wav_bytes(sine_wave(0.2))).decode()}}]}]
    assert "the last message is the text to speak" in error_of(chat(last_with_audio))["message"]
    assert "must be audio" in error_of(chat([{"role": "assistant", "content": "hi"},
                                             {"role": "user", "content": TEXT}]))["message"]
    assert "audio.format 'aac'" in error_of(chat([{"role": "user", "content": TEXT}], audio={"format": "aac"}))[
        "message"]
    assert error_of(chat([{"role": "user", "content": TEXT}], modalities=["text"]))["param"] == "modalities"
    assert error_of(chat([{"role": "user", "content": TEXT}], stream=True))["param"] == "audio.format"  # wav
    streamed = {"audio": {"format": "pcm16"}, "stream": True}
    assert error_of(chat([{"role": "user", "content": TEXT}], n=2, **streamed))["param"] == "n"
    assert error_of(chat([{"role": "user", "content": TEXT}], audio_chunk_size=0, **streamed))[
        "param"] == "audio_chunk_size"
    assert error_of(chat([{"role": "user", "content": TEXT}], audio_chunk_overlap_size=65, **streamed))[
        "param"] == "audio_chunk_overlap_size"
    assert error_of(speech(seed_url, input=TEXT, stream=True, audio_chunk_size=251))["param"] == "audio_chunk_size"
    assert error_of(speech(seed_url, input=TEXT, stop_after_silence_frames=-1))["param"] == "stop_after_silence_frames"
    assert httpx.get(f"{seed_url}/health").status_code == 200


def test_a_text_model_refuses_audio(http):
    r = http.post("/v1/chat/completions", json={"model": "tiny", "modalities": ["text", "audio"],
                                                "messages": [{"role": "user", "content": "hi"}]})
    assert "has no audio" in error_of(r)["message"]
    assert "has no audio" in error_of(http.post("/v1/audio/speech", json={"input": "hi"}))["message"]


# -- voices, limits and the cache of encoded audio -------------------------------------------------

def test_voices_from_the_presets_folder(voices_url):
    data = httpx.get(f"{voices_url}/v1/audio/voices").json()["data"]
    assert [(v["id"], v["transcript"], v["format"]) for v in data] == [
        ("alice", "Hello there.", "wav"), ("bob", "Good morning.", "flac")]
    r = speech(voices_url, input=TEXT, voice="bob", max_tokens=20, temperature=0.0)
    assert r.status_code == 200 and wav_samples(r.content)[1] == 24000
    # On CPU (and unified memory) the cache's host memory is the device's: planned, at its size limit.
    components = {c["name"]: c for c in httpx.get(f"{voices_url}/v1/memory").json()["components"]}
    assert components["multimodal cache (--mm-processor-cache-gb)"]["weight_bytes"] == int(0.01 * (1 << 30))


def test_speech_through_the_openai_client(voices_url):
    import openai

    client = openai.OpenAI(base_url=f"{voices_url}/v1", api_key="none")
    r = client.audio.speech.with_raw_response.create(
        model=NAME, voice="alice", input=TEXT, response_format="wav", instructions="A windy beach.",
        extra_body={"max_tokens": 24, "temperature": 0.0})
    assert r.headers["content-type"] == "audio/wav" and r.headers["x-audio-frames"] == "20"
    samples, rate = wav_samples(r.content)
    assert rate == 24000 and len(samples) == 20 * 960
    fast = client.audio.speech.with_raw_response.create(
        model=NAME, voice="alice", input=TEXT, response_format="wav", speed=2.0,
        extra_body={"max_tokens": 24, "temperature": 0.0})  # the same 20 frames, played in half the time
    assert fast.headers["x-audio-frames"] == "20" and len(wav_samples(fast.content)[0]) == 20 * 960 // 2
    with pytest.raises(openai.BadRequestError, match="speed must be between 0.25 and 4.0, got 5.0"):
        client.audio.speech.create(model=NAME, voice="alice", input=TEXT, speed=5.0)


def test_chat_with_a_preset_voice_and_a_reference_clip_through_the_openai_client(voices_url):
    import openai

    client = openai.OpenAI(base_url=f"{voices_url}/v1", api_key="none")
    clip = {"type": "input_audio", "input_audio": {"data": base64.b64encode(_wav_bytes(sine_wave(0.4))).decode(),
                                                   "format": "wav"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "One."}, clip]},
                {"role": "user", "content": TEXT}]
    r = client.chat.completions.create(model=NAME, modalities=["text", "audio"], messages=messages, max_tokens=20,
                                       audio={"voice": "alice", "format": "flac"})  # 2 audio items: the limit
    assert sf.info(io.BytesIO(base64.b64decode(r.choices[0].message.audio.data))).format == "FLAC"
    too_many = [{"role": "user", "content": [{"type": "text", "text": "Two."}, clip]}] + messages
    with pytest.raises(openai.BadRequestError, match=r"at most 2 audio items per prompt \(--limit-mm-per-prompt "
                                                     r"audio=2\); this request has 3"):
        client.chat.completions.create(model=NAME, modalities=["text", "audio"], messages=too_many, max_tokens=20,
                                       audio={"voice": "alice", "format": "wav"})
    assert httpx.get(f"{voices_url}/health").status_code == 200


def test_encoded_reference_audio_is_cached_by_content(voices_url, seed_url):
    def counts(url):
        return (metric(url, "pagedllm:mm_cache_queries_total"), metric(url, "pagedllm:mm_cache_hits_total"))

    q0, h0 = counts(voices_url)
    for _ in range(2):
        assert speech(voices_url, input="Again.", voice="bob", max_tokens=4).status_code == 200
    q1, h1 = counts(voices_url)
    assert q1 - q0 == 2 and h1 - h0 >= 1  # the second request found bob's codes (the first may have too)
    clip = base64.b64encode(_wav_bytes(sine_wave(0.3, freq=97.0))).decode()  # new content: a miss, then a hit
    body = {"model": NAME, "modalities": ["text", "audio"], "max_tokens": 4, "audio": {"format": "wav"},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hm."}, {
                "type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}]},
                {"role": "user", "content": "Yes."}]}
    for _ in range(2):
        assert httpx.post(f"{voices_url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    assert counts(voices_url) == (q1 + 2, h1 + 1)
    assert counts(seed_url) == (0, 0)  # --disable-mm-preprocessor-cache: no cache, no lookups


def _wav_bytes(samples: np.ndarray, rate: int = 24000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.mark.parametrize("endpoint", ["speech", "chat-audio"])
def test_bench_serve_loads_the_speech_endpoints(seed_url, endpoint, tmp_path):
    """`pagedllm bench serve --endpoint speech|chat-audio`: every request streams audio; the report's audio
    seconds are the samples received; TTFA comes before the request's end (RTF > 0)."""
    import json

    from pagedllm.bench.serve import main as bench_serve

    out = tmp_path / "speech.json"
    code = bench_serve(["--base-url", seed_url, "--endpoint", endpoint, "--num-prompts", "4", "--max-concurrency",
                        "2", "--random-input-len", "5", "--random-output-len", "30", "--seed", "3",
                        "--audio-chunk-size", "4", "--output-json", str(out)])
    m = json.loads(out.read_text())["metrics"]
    assert code == 0 and m["completed"] == 4 and m["failed"] == 0
    assert 0 < m["audio_seconds"] <= 4 * 30 * 960 / 24000  # at most max_tokens frames each
    assert 0 < m["median_ttfa_ms"] <= m["p99_ttfa_ms"] and m["median_rtf"] > 0
    assert m["audio_seconds_per_second"] == pytest.approx(m["audio_seconds"] / m["duration_s"])
