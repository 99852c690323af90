"""Voices as voice products use them (issue 42), on the tiny random Higgs model and codec: a reference clip in the
request (`ref_audio` + `ref_text`, base64 or a data: URL) speaks as the same clip from the presets folder does; a
voice uploaded once (POST /v1/audio/voices) speaks the same by name, survives a restart (a file in the folder),
and is removed by DELETE; the second request with a clip skips the codec's encoder (the cache's counters); bad
clips (not audio, too long, too low a rate) get a 400 and the server stays healthy; and what Open WebUI's TTS
settings read (`voices`, /v1/audio/models, OpenAI's voice names) works."""
from __future__ import annotations

import base64
import io
import json
import sys

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.audio_helpers import make_tiny_audio_tokenizer, make_tiny_higgs_tts, sine_wave
from tests.server.conftest import _stop_server, metric, start_command

NAME = "higgs-tiny"
TEXT = "The sun rises in the east."
MAX_SECONDS = 3.0


def _wav(samples: np.ndarray, rate: int = 24000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("voice-cloning")
    voices = root / "voices"
    voices.mkdir()
    (voices / "alice.wav").write_bytes(_wav(sine_wave(0.6)))
    (voices / "alice.txt").write_text("Hello there.")
    model, codec = make_tiny_higgs_tts(root / "model"), make_tiny_audio_tokenizer(root / "codec")

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "pagedllm", "serve", str(model), "--served-model-name", NAME,
                "--audio-tokenizer-path", str(codec), "--port", str(port), "--max-model-len", "512",
                "--voice-presets-dir", str(voices), "--max-reference-audio-seconds", str(MAX_SECONDS)]

    proc, url = start_command(command, root)
    yield {"url": url, "voices": voices, "root": root, "command": command}
    _stop_server(proc)


def speech(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/audio/speech", json={"model": NAME, "input": TEXT, "max_tokens": 16, "seed": 7,
                                                      "response_format": "wav", **body}, timeout=120)


def ok(r: httpx.Response) -> bytes:
    assert r.status_code == 200, r.text
    return r.content


def error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_a_clip_in_the_request_speaks_as_the_same_clip_from_the_presets_folder(server):
    url = server["url"]
    preset = ok(speech(url, voice="alice"))
    clip = (server["voices"] / "alice.wav").read_bytes()
    inline = ok(speech(url, ref_audio=base64.b64encode(clip).decode(), ref_text="Hello there."))
    as_url = ok(speech(url, ref_audio="data:audio/wav;base64," + base64.b64encode(clip).decode(),
                       ref_text="Hello there."))
    assert inline == preset == as_url
    other = ok(speech(url, ref_audio=base64.b64encode(_wav(sine_wave(0.6, freq=300.0))).decode(),
                      ref_text="Hello there."))
    assert other != preset  # (the reference is what the model hears)
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": NAME, "modalities": ["text", "audio"], "audio": {"format": "wav"}, "max_tokens": 16, "seed": 7,
        "messages": [{"role": "user", "content": TEXT}], "ref_audio": base64.b64encode(clip).decode(),
        "ref_text": "Hello there."}).json()
    assert chat["choices"][0]["message"]["audio"]["data"]


def test_an_uploaded_voice_speaks_by_name_and_lives_in_the_folder(server):
    url, voices = server["url"], server["voices"]
    clip = _wav(sine_wave(0.5, freq=180.0))
    up = httpx.post(f"{url}/v1/audio/voices", data={"name": "carol", "transcript": "Good evening."},
                    files={"audio": ("carol.wav", clip, "audio/wav")}, timeout=60)
    assert up.status_code == 200, up.text
    assert up.json() | {} == {"id": "carol", "object": "voice", "name": "carol", "format": "wav",
                              "transcript": "Good evening."}
    assert (voices / "carol.wav").read_bytes() == clip and (voices / "carol.txt").read_text() == "Good evening."
    listed = httpx.get(f"{url}/v1/audio/voices").json()
    assert [v["id"] for v in listed["voices"]] == [v["id"] for v in listed["data"]] == ["alice", "carol"]
    by_name = ok(speech(url, voice="carol"))
    inline = ok(speech(url, ref_audio=base64.b64encode(clip).decode(), ref_text="Good evening."))
    assert by_name == inline
    again = httpx.post(f"{url}/v1/audio/voices", data={"name": "carol", "transcript": "x"},
                       files={"audio": ("c.wav", clip, "audio/wav")})
    assert "DELETE /v1/audio/voices/carol first" in error(again, 409)["message"]
    bad_name = httpx.post(f"{url}/v1/audio/voices", data={"name": "../etc", "transcript": "x"},
                          files={"audio": ("c.wav", clip, "audio/wav")})
    assert error(bad_name)["param"] == "name"
    gone = httpx.delete(f"{url}/v1/audio/voices/carol")
    assert gone.status_code == 200 and not (voices / "carol.wav").exists()
    assert error(httpx.delete(f"{url}/v1/audio/voices/carol"), 404)["param"] == "name"
    assert "unknown voice 'carol'" in error(speech(url, voice="carol"))["message"]


def test_the_second_request_with_a_clip_skips_the_encoder(server):
    url = server["url"]
    clip = base64.b64encode(_wav(sine_wave(0.7, freq=410.0))).decode()  # (a clip no other test sends)
    queries, hits = metric(url, "pagedllm:mm_cache_queries_total"), metric(url, "pagedllm:mm_cache_hits_total")
    first = ok(speech(url, ref_audio=clip, ref_text="A tone."))
    assert metric(url, "pagedllm:mm_cache_hits_total") == hits  # encoded
    second = ok(speech(url, ref_audio=clip, ref_text="A tone."))
    assert metric(url, "pagedllm:mm_cache_hits_total") == hits + 1  # found: the encoder did not run
    assert metric(url, "pagedllm:mm_cache_queries_total") == queries + 2 and first == second


@pytest.mark.parametrize("clip,param,message", [
    (base64.b64encode(b"not audio at all").decode(), "ref_audio", "could not be decoded"),
    (base64.b64encode(_wav(sine_wave(MAX_SECONDS + 1.0))).decode(), "ref_audio", "--max-reference-audio-seconds"),
    (base64.b64encode(_wav(sine_wave(0.5, rate=4000), rate=4000)).decode(), "ref_audio", "at least 8000 Hz"),
    ("%%%not base64", "ref_audio", "not valid base64"),
    ("data:video/mp4;base64,AAAA", "ref_audio", "audio type 'video/mp4' is not supported"),
])
def test_bad_clips_get_a_400_and_the_server_stays_healthy(server, clip, param, message):
    url = server["url"]
    e = error(speech(url, ref_audio=clip, ref_text="x"))
    assert e["param"] == param and message in e["message"], e
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_clip_needs_its_transcript_and_not_a_preset_beside_it(server):
    clip = base64.b64encode(_wav(sine_wave(0.3))).decode()
    assert error(speech(server["url"], ref_audio=clip))["param"] == "ref_text"
    assert error(speech(server["url"], ref_text="x"))["param"] == "ref_text"
    assert error(speech(server["url"], ref_audio=clip, ref_text="x", voice="alice"))["param"] == "ref_audio"


def test_what_open_webui_reads(server):
    """Open WebUI's OpenAI TTS settings: GET {base}/audio/voices (`voices`: id, name), GET {base}/audio/models
    (`models`: id), then POST {base}/audio/speech with {model, input, voice}, "alloy" unless the user picks."""
    url = server["url"]
    voices = httpx.get(f"{url}/v1/audio/voices").json()["voices"]
    assert {v["id"]: v["name"] for v in voices}["alice"] == "alice"
    assert httpx.get(f"{url}/v1/audio/models").json() == {"models": [{"id": NAME}]}
    r = httpx.post(f"{url}/v1/audio/speech", json={"model": NAME, "input": TEXT, "voice": "alloy",
                                                   "max_tokens": 16, "seed": 7}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    assert r.content == ok(speech(url))  # OpenAI's voice names: the model's own voice


def test_text_streamed_in_is_spoken_sentence_by_sentence_over_a_websocket(server):
    """The first audio arrives before the last text is sent; the joined PCM is every sentence's frames, in the
    voice of the config; the events name each sentence."""
    from websockets.sync.client import connect

    url = server["url"].replace("http://", "ws://") + "/v1/audio/speech/stream"
    audio, events = bytearray(), []
    with connect(url, open_timeout=30, close_timeout=30) as ws:
        ws.send('{"voice": "alice", "max_tokens": 10, "seed": 3}')
        for piece in ("The sun ", "rises. It ", "sets in the west. And"):
            ws.send(f'{{"text": "{piece}"}}')
        first = ws.recv(timeout=120)  # two sentences are complete: speaking began before the text ended
        while isinstance(first, str):
            events.append(first)
            first = ws.recv(timeout=120)
        audio += first
        ws.send('{"text": " then night falls."}')
        ws.send('{"end": true}')
        for message in ws:
            if isinstance(message, bytes):
                audio += message
            else:
                events.append(message)
    parsed = [json.loads(e) for e in events]
    sentences = [e["text"] for e in parsed if e["type"] == "sentence"]
    assert sentences == ["The sun rises.", "It sets in the west.", "And then night falls."]
    done = parsed[-1]
    assert done["type"] == "done" and done["sentences"] == 3
    frames = sum(e["frames"] for e in parsed if e["type"] == "sentence.done")
    assert done["frames"] == frames and 3 <= frames <= 30
    pcm = np.frombuffer(bytes(audio), dtype="<i2")
    assert len(audio) % 2 == 0 and len(pcm) == frames * 960  # 960 samples (40 ms at 24 kHz) per frame


def test_a_websocket_refuses_a_bad_config_and_the_server_stays_healthy(server):
    from websockets.sync.client import connect

    url = server["url"].replace("http://", "ws://") + "/v1/audio/speech/stream"
    with connect(url, open_timeout=30) as ws:
        ws.send('{"voice": "nobody"}')
        message = json.loads(ws.recv(timeout=60))
    assert message["type"] == "error" and message["error"]["param"] == "voice"
    assert "unknown voice 'nobody'" in message["error"]["message"]
    for first in (b"\x00binary", "not json"):  # a config that is no JSON object: said so, not a dropped connection
        with connect(url, open_timeout=30) as ws:
            ws.send(first)
            message = json.loads(ws.recv(timeout=60))
        assert message["error"]["param"] == "config" and "config first" in message["error"]["message"]
    with connect(url, open_timeout=30) as ws:  # a text piece that is no JSON object, after a good config
        ws.send('{"voice": "alice", "max_tokens": 4}')
        ws.send("plain text")
        message = json.loads(ws.recv(timeout=60))
    assert message["error"]["param"] == "text"
    assert httpx.get(f"{server['url']}/health").status_code == 200


def test_a_websocket_needs_the_api_key(server_url):
    """The key holds for the handshake (a header, or ?api_key= where a browser cannot set one); a text model's
    server then says it has no speech model."""
    from websockets.exceptions import ConnectionClosed, InvalidStatus
    from websockets.sync.client import connect

    from tests.server.conftest import API_KEY

    url = server_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with pytest.raises(InvalidStatus, match="403"):
        connect(url, open_timeout=30)
    for kwargs in ({"additional_headers": {"Authorization": f"Bearer {API_KEY}"}}, {"uri": f"{url}?api_key={API_KEY}"}):
        with connect(kwargs.pop("uri", url), open_timeout=30, **kwargs) as ws:
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=30)
        assert closed.value.rcvd.code == 1008 and "no speech model" in closed.value.rcvd.reason


def test_every_format_decodes_to_the_same_length(server):
    """OpenAI's response formats this libsndfile writes (aac: none can, refused by name), each decoding to the
    length of the WAV within one frame (960 samples)."""
    url = server["url"]
    wav, rate = sf.read(io.BytesIO(ok(speech(url, voice="alice"))), dtype="int16")
    for fmt in ("flac", "mp3", "opus"):
        samples, fmt_rate = sf.read(io.BytesIO(ok(speech(url, voice="alice", response_format=fmt))), dtype="int16")
        assert abs(len(samples) * rate / fmt_rate - len(wav)) <= 960, fmt
    pcm = ok(speech(url, voice="alice", response_format="pcm"))
    assert len(pcm) == 2 * len(wav)
    aac = error(speech(url, voice="alice", response_format="aac"))
    assert aac["param"] == "response_format" and "mp3" in aac["message"]


def test_bench_serve_sends_a_clip_in_every_request(server, tmp_path):
    """`pagedllm bench serve --endpoint speech --ref-audio FILE --ref-text TEXT`: every request carries the clip
    (the cache answers all but the first), and every request speaks."""
    from pagedllm.bench.serve import main as bench_serve

    clip = tmp_path / "clip.wav"
    clip.write_bytes(_wav(sine_wave(0.8, freq=520.0)))
    url = server["url"]
    hits = metric(url, "pagedllm:mm_cache_hits_total")
    out = tmp_path / "bench.json"
    code = bench_serve(["--base-url", url, "--endpoint", "speech", "--num-prompts", "6", "--max-concurrency", "3",
                        "--random-input-len", "6", "--random-output-len", "8", "--seed", "1", "--ref-audio",
                        str(clip), "--ref-text", "A tone.", "--output-json", str(out)])
    assert code == 0 and json.loads(out.read_text())["metrics"]["completed"] == 6
    assert metric(url, "pagedllm:mm_cache_hits_total") - hits >= 6  # (the probe's encode, then 6 hits)
