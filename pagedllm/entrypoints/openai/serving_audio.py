"""Speech endpoints: /v1/audio/speech, chat completions with audio output, /v1/audio/voices.

A request becomes a Higgs Audio prompt (pagedllm/audio/prompt.py): reference voices (a preset, or
`input_audio` parts) are encoded by the audio tokenizer, through the cache of encoded audio, and
placed as reference turns; the engine generates codes; the codec decodes them to a waveform, whole
or in chunks while frames arrive (streaming). Codec work runs on one thread, one call at a time, so
its memory peak is the one the plan counts, and the event loop never waits on it.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedllm.audio.io import (
    AudioFormatError,
    audio_container,
    check_output_format,
    content_type,
    input_formats,
    read_audio,
    to_pcm16,
    wav_stream_header,
    write_audio,
)
from pagedllm.audio.mm_cache import EncodedAudioCache, content_key
from pagedllm.audio.prompt import (
    DEFAULT_SCENE,
    DEFAULT_SYSTEM,
    Conversation,
    Turn,
    build_audio_prompt,
)
from pagedllm.audio.stretch import MAX_SPEED, MIN_SPEED, time_stretch
from pagedllm.audio.streaming import CHUNK_FRAMES, CONTEXT_FRAMES, SilenceStop, StreamingDecoder
from pagedllm.audio.tokenizer import AudioTokenizer
from pagedllm.audio.voices import VoicePreset, check_voice_name, delete_voice, save_voice
from pagedllm.entrypoints.openai.bodies import (
    ChatAudio,
    ChatAudioDelta,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    Voice,
    VoiceList,
)
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, SpeechRequest
from pagedllm.entrypoints.openai.serving import (
    ServingContext,
    _chunk_usage,
    _collect,
    _sampling_params,
    _sse,
    _start,
    _usage,
    check_text,
    stream_error,
    unless_disconnected,
)
from pagedllm.model_executor.audio_sampling import DelayPatternSpec
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

STREAM_FORMATS = ("wav", "pcm")  # formats that can be sent before their length is known
# OpenAI's built-in voice names (clients such as Open WebUI send "alloy" unless told otherwise): where no preset has
# the name, the model speaks in its own voice.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse")
MIN_REFERENCE_RATE = 8000  # Hz: below it a clip is no speech recording to clone (and the codec resamples from it)
DATA_URL_FORMATS = {"audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav", "audio/vnd.wave": "wav",
                    "audio/mpeg": "mp3", "audio/mp3": "mp3", "audio/flac": "flac", "audio/x-flac": "flac",
                    "audio/ogg": "ogg"}
CHAT_AUDIO_FORMATS = {"pcm16": "pcm"}  # OpenAI's chat names -> response_format names
AUDIO_EXPIRES_S = 3600  # OpenAI's message.audio.expires_at: we keep nothing, so any value is honest enough


@dataclass
class AudioServing:
    """What the audio endpoints share: the codec and its thread, voices, the cache, the limits."""

    ctx: ServingContext
    tokenizer: AudioTokenizer
    text_tokenizer: object
    spec: DelayPatternSpec
    voices: dict[str, VoicePreset]
    cache: EncodedAudioCache | None = None
    limit_audio: int | None = None
    on_cache_lookup: Callable[[bool], None] | None = None  # metrics: called with hit=True/False
    stop_after_silence_frames: int | None = None  # --stop-after-silence-frames (None: off unless asked)
    voices_dir: Path | None = None  # --voice-presets-dir: where uploaded voices are kept (None: no uploads)
    max_reference_seconds: float = 60.0  # --max-reference-audio-seconds: the longest reference clip

    def __post_init__(self) -> None:
        self._codec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-codec")

    def shutdown(self) -> None:
        self._codec.shutdown(wait=False, cancel_futures=True)

    async def codec(self, fn, *args):
        """Run a codec call on the codec thread."""
        return await asyncio.get_running_loop().run_in_executor(self._codec, fn, *args)

    # -- inputs -------------------------------------------------------------------------------
    async def encode_reference(self, data: bytes, fmt: str | None, param: str) -> torch.Tensor:
        """Audio file bytes -> codes (frames, num_codebooks), through the cache of encoded audio."""
        key = content_key(data, fmt)
        if self.cache is not None:
            codes = self.cache.get(key)
            if self.on_cache_lookup is not None:
                self.on_cache_lookup(codes is not None)
            if codes is not None:
                return codes
        try:
            samples, rate = await self.codec(read_audio, data, fmt)
        except AudioFormatError as e:
            raise APIError(400, f"{param}: {e}", param) from None
        seconds = len(samples) / rate
        if rate < MIN_REFERENCE_RATE:
            raise APIError(400, f"{param}: the reference audio is sampled at {rate} Hz; a voice to clone needs at "
                                f"least {MIN_REFERENCE_RATE} Hz (the codec works at {self.tokenizer.sampling_rate} Hz)",
                           param)
        if seconds > self.max_reference_seconds:
            raise APIError(400, f"{param}: the reference audio lasts {seconds:.1f} s; at most "
                                f"{self.max_reference_seconds:g} s (--max-reference-audio-seconds)", param)
        frames = math.ceil(seconds * self.tokenizer.frame_rate)
        if frames > self.ctx.max_model_len:
            raise APIError(400, f"{param}: the reference audio lasts {len(samples) / rate:.1f} s = {frames} frames, "
                                f"more than the context holds (max_model_len {self.ctx.max_model_len})", param)
        codes = await self.codec(self.tokenizer.encode, samples, rate)
        if self.cache is not None:
            self.cache.put(key, codes)
        return codes

    async def reference_turns(self, voice: str | None, ref_audio: str | None, ref_text: str | None,
                              voice_param: str) -> list[Turn]:
        """The request's voice as reference turns: a clip in the request (`ref_audio`, with its transcript
        `ref_text`), else a preset (`voice`), else none (the model's own voice)."""
        if ref_audio is None:
            if ref_text is not None:
                raise APIError(400, "ref_text is the transcript of ref_audio: give both, or neither", "ref_text")
            return await self.voice_turns(voice, voice_param)
        if voice is not None and voice not in OPENAI_VOICES:
            raise APIError(400, f"give {voice_param} (a preset) or ref_audio (a clip), not both", "ref_audio")
        if ref_text is None:
            raise APIError(400, "ref_audio needs ref_text, the transcript of what the clip says", "ref_text")
        data, fmt = decode_audio_field(ref_audio, "ref_audio")
        codes = await self.encode_reference(data, fmt, "ref_audio")
        return [Turn("user", check_text(ref_text, "ref_text")), Turn("assistant", audio=codes)]

    async def voice_turns(self, voice: str | None, param: str) -> list[Turn]:
        """A preset voice as reference turns: its transcript (user), then its audio (assistant)."""
        if voice is None or (voice in OPENAI_VOICES and voice not in self.voices):
            return []
        preset = self.voices.get(voice)
        if preset is None:
            known = ", ".join(sorted(self.voices)) or "none (start the server with --voice-presets-dir)"
            raise APIError(400, f"unknown voice {voice!r}; voices: {known}", param)
        codes = await self.encode_reference(await self.codec(preset.read_bytes), preset.format, param)
        return [Turn("user", preset.transcript), Turn("assistant", audio=codes)]

    def check_limit(self, num_audio: int, param: str) -> None:
        if self.limit_audio is not None and num_audio > self.limit_audio:
            raise APIError(400, f"at most {self.limit_audio} audio items per prompt (--limit-mm-per-prompt "
                                f"audio={self.limit_audio}); this request has {num_audio}", param)

    # -- generation ---------------------------------------------------------------------------
    async def generate(self, conversation: Conversation, params: SamplingParams, prefix: str,
                       cache_salt: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        prompt = build_audio_prompt(conversation, self.text_tokenizer)
        (stream,) = await _start(self.ctx, prefix, [prompt.to_engine_prompt()], params, cache_salt, priority)
        return stream

    async def decode(self, codes: torch.Tensor | None):
        codes = codes if codes is not None else torch.empty((0, self.tokenizer.num_codebooks), dtype=torch.long)
        return await self.codec(self.tokenizer.decode, codes)


def decode_audio_field(value: str, param: str) -> tuple[bytes, str | None]:
    """A clip given in JSON: base64, or a data: URL (`data:audio/wav;base64,...`, whose type names the format).
    -> (bytes, format; None: read from the bytes)."""
    fmt = None
    if value.startswith("data:"):
        header, _, value = value.partition(",")
        mime, _, encoding = header[len("data:"):].partition(";")
        if encoding != "base64":
            raise APIError(400, f"{param}: a data URL of audio must be base64 (data:audio/wav;base64,...)", param)
        fmt = DATA_URL_FORMATS.get(mime.lower())
        if fmt is None:
            raise APIError(400, f"{param}: audio type {mime!r} is not supported; supported: "
                                f"{', '.join(sorted(DATA_URL_FORMATS))}", param)
    try:
        return base64.b64decode(value, validate=True), fmt
    except (binascii.Error, ValueError):
        raise APIError(400, f"{param} is not valid base64 (nor a data: URL)", param) from None


def speech_sampling_params(req) -> SamplingParams:
    """A speech request's sampling (a SpeechRequest's fields, or a speech WebSocket's config's)."""
    try:
        return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                              seed=req.seed, max_tokens=req.max_tokens)
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(" ", 1)[0]) from None


def _output_format(name: str, param: str) -> str:
    try:
        return check_output_format(CHAT_AUDIO_FORMATS.get(name, name), param)
    except AudioFormatError as e:
        raise APIError(400, str(e), param) from None


def _codes_of(out: RequestOutput) -> tuple[CompletionOutput, torch.Tensor]:
    c = out.outputs[0]
    if c.audio_codes is None:
        raise APIError(400, "this model generates no audio codes")
    return c, c.audio_codes


# -- POST /v1/audio/speech --------------------------------------------------------------------------

async def create_speech(a: AudioServing, req: SpeechRequest, raw: Request) -> Response:
    a.ctx.model_name(req.model)
    fmt = _output_format(req.response_format, "response_format")
    if req.stream and fmt not in STREAM_FORMATS:
        raise APIError(400, f"streaming sends {' or '.join(STREAM_FORMATS)} (a length-less WAV header, then PCM); "
                            f"response_format {fmt!r} needs the whole audio first", "response_format")
    if not MIN_SPEED <= req.speed <= MAX_SPEED:
        raise APIError(400, f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {req.speed}", "speed")
    if req.stream and req.speed != 1.0:
        raise APIError(400, f"speed {req.speed} stretches the whole audio (same pitch): stream at speed 1.0, or "
                            f"leave stream out", "speed")
    check_text(req.input, "input")
    a.check_limit(int(req.voice is not None or req.ref_audio is not None), "voice")
    turns = await a.reference_turns(req.voice, req.ref_audio, req.ref_text, "voice")
    scene = check_text(req.instructions, "instructions") if req.instructions else DEFAULT_SCENE
    conversation = Conversation(turns + [Turn("user", req.input)], scene=scene)
    stream = await a.generate(conversation, speech_sampling_params(req), "speech")
    rate = a.tokenizer.sampling_rate
    decoder, silence = _decoder(a, req), _silence_stop(a, req)
    if req.stream:
        return StreamingResponse(_stream_audio(a, stream, fmt, decoder, silence), media_type=content_type(fmt))
    out, samples, silent = await _whole_audio(a, stream, decoder, silence, raw)
    frames = len(samples) // a.tokenizer.hop_length if silent else len(_codes_of(out)[1])
    if req.speed != 1.0:
        samples = await a.codec(time_stretch, samples, rate, req.speed)
    return Response(write_audio(samples, rate, fmt), media_type=content_type(fmt),
                    headers={"x-audio-frames": str(frames)}
                    | ({"x-audio-finish-reason": "silence"} if silent else {}))


def _decoder(a: AudioServing, req: ChatCompletionRequest | SpeechRequest) -> StreamingDecoder:
    """The request's chunking: audio_chunk_size frames per chunk (at least), audio_chunk_overlap_size frames of
    context decoded each side. With the default context (more than the codec's receptive field) the streamed
    samples are those of one decode of all the frames."""
    return StreamingDecoder(a.tokenizer.hop_length,
                            chunk_frames=req.audio_chunk_size or CHUNK_FRAMES,
                            context_frames=CONTEXT_FRAMES if req.audio_chunk_overlap_size is None
                            else req.audio_chunk_overlap_size)


def _silence_stop(a: AudioServing, req: ChatCompletionRequest | SpeechRequest) -> SilenceStop | None:
    """The request's stop_after_silence_frames (0: off), else the server's flag."""
    frames = req.stop_after_silence_frames
    frames = a.stop_after_silence_frames if frames is None else frames
    return SilenceStop(frames, a.tokenizer.hop_length) if frames else None


async def _audio_chunks(a: AudioServing, stream: AsyncIterator[RequestOutput], decoder: StreamingDecoder,
                        silence: SilenceStop | None = None) -> AsyncIterator[tuple[RequestOutput, list, bool]]:
    """Each engine output with the float samples of the chunks its frames completed (often none), and whether
    the silence stop ended the audio (the last item then). Ending early (the silence stop, or a client that
    disconnects) closes the engine stream, which aborts the request."""
    async with contextlib.aclosing(stream) as outputs:
        async for out in outputs:
            c, codes = _codes_of(out)
            chunks = []
            while (window := decoder.next_window(len(codes), final=c.finished())) is not None:
                samples = await a.decode(codes[window.start:window.stop])
                decoder.commit(window)
                chunk = samples[window.keep_from:window.keep_to]
                keep = silence.feed(chunk) if silence is not None else None
                if keep is not None:
                    chunks.append(chunk[:keep])
                    yield out, chunks, True
                    return
                chunks.append(chunk)
            yield out, chunks, False


async def _stream_audio(a: AudioServing, stream: AsyncIterator[RequestOutput], fmt: str,
                        decoder: StreamingDecoder, silence: SilenceStop | None) -> AsyncIterator[bytes]:
    """A WAV header (wav), then 16-bit PCM chunks as frames are decoded."""
    rate = a.tokenizer.sampling_rate
    if fmt == "wav":
        yield wav_stream_header(rate)
    async with contextlib.aclosing(_audio_chunks(a, stream, decoder, silence)) as chunks:
        async for _, samples, _ in chunks:
            for chunk in samples:
                yield to_pcm16(chunk, rate)


async def _whole_audio(a: AudioServing, stream: AsyncIterator[RequestOutput], decoder: StreamingDecoder,
                       silence: SilenceStop | None, raw: Request) -> tuple[RequestOutput, np.ndarray, bool]:
    """(final output, samples, ended by the silence stop) of a request answered whole. Without a silence stop
    the codes are decoded once at the end; with one, chunk by chunk as they come (to hear the silence)."""
    if silence is None:
        (out,) = await _collect([stream], raw)
        return out, await a.decode(_codes_of(out)[1]), False

    async def run():
        parts, last, stopped = [], None, False
        async with contextlib.aclosing(_audio_chunks(a, stream, decoder, silence)) as chunks:
            async for out, samples, stopped in chunks:
                parts += samples
                last = out
        return last, np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32), stopped

    return await unless_disconnected(run(), raw)


# -- POST /v1/chat/completions with modalities ["text", "audio"] ------------------------------------

def _num_input_audio(req: ChatCompletionRequest) -> int:
    return sum(1 for m in req.messages if isinstance(m.content, list)
               for p in m.content if p.get("type") == "input_audio")


def wants_audio(req: ChatCompletionRequest) -> bool:
    """Audio output asked for, or audio input given: the speech path's business."""
    return "audio" in (req.modalities or []) or req.audio is not None or _num_input_audio(req) > 0


async def create_audio_chat_completion(a: AudioServing, req: ChatCompletionRequest,
                                      raw: Request) -> dict | AsyncIterator[str]:
    model = a.ctx.model_name(req.model)
    if "audio" not in (req.modalities or []):
        raise APIError(400, "this model answers with audio: pass modalities [\"text\", \"audio\"] and audio "
                            "{voice, format}", "modalities")
    for param, bad in (("n", req.n != 1), ("logprobs", req.logprobs),
                       ("tools", bool(req.tools)), ("echo", req.echo), ("stop", bool(req.stop)),
                       ("stop_token_ids", bool(req.stop_token_ids)), ("prompt_logprobs", req.prompt_logprobs),
                       ("chat_template", req.chat_template), ("add_generation_prompt", not req.add_generation_prompt),
                       ("ignore_eos", req.ignore_eos), ("min_tokens", req.min_tokens != 0)):  # audio ends by its codes
        if bad:
            raise APIError(400, f"{param} is not supported with audio output", param)
    audio = req.audio
    fmt = _output_format((audio.format if audio is not None else None) or ("pcm16" if req.stream else "wav"),
                         "audio.format")
    voice = audio.voice if audio is not None else None
    a.check_limit(_num_input_audio(req) + (voice is not None or req.ref_audio is not None),
                  "messages")  # before encoding any of them
    system, turns = await _conversation(a, req)
    turns = await a.reference_turns(voice, req.ref_audio, req.ref_text, "audio.voice") + turns
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _sampling_params(a.ctx, req, max_tokens, None, None, "top_logprobs")
    if req.stream and fmt != "pcm":
        raise APIError(400, f"streamed audio is 16-bit PCM: audio.format must be pcm16, got {audio.format!r}",
                       "audio.format")
    stream = await a.generate(Conversation(turns, system=system), params, "chatcmpl", req.cache_salt, req.priority)
    created = int(time.time())
    ids = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": created, "model": model}
    audio_id, transcript = f"audio_{uuid.uuid4().hex}", turns[-1].text
    decoder, silence = _decoder(a, req), _silence_stop(a, req)
    if req.stream:
        return _chat_audio_events(a, stream, decoder, silence, req, ids, audio_id, transcript)
    out, samples, silent = await _whole_audio(a, stream, decoder, silence, raw)
    data = base64.b64encode(write_audio(samples, a.tokenizer.sampling_rate, fmt)).decode("ascii")
    message = ChatMessageOut(content=None, audio=ChatAudio(id=audio_id, data=data, transcript=transcript,
                                                           expires_at=created + AUDIO_EXPIRES_S))
    choice = ChatChoice(index=0, message=message, logprobs=None,
                        finish_reason="stop" if silent else out.outputs[0].finish_reason)
    return ChatCompletionResponse(**ids, choices=[choice], usage=_usage([out]))


async def _chat_audio_events(a: AudioServing, stream: AsyncIterator[RequestOutput], decoder: StreamingDecoder,
                             silence: SilenceStop | None, req: ChatCompletionRequest, ids: dict, audio_id: str,
                             transcript: str) -> AsyncIterator[str]:
    """SSE chunks as the reference server sends them: `delta.audio` {id, data: base64 PCM16 at the codec's
    rate, mono} per decoded chunk (the first also has the transcript and expires_at), then finish_reason, then
    usage when asked for."""
    usage_field = _chunk_usage(req.stream_options)

    def chunk(delta: ChatDelta, out: RequestOutput | None, finish: str | None = None) -> str:
        choice = ChatChunkChoice(index=0, delta=delta, finish_reason=finish)
        return _sse(ChatCompletionChunk(**ids, choices=[choice], **usage_field(out)))

    yield chunk(ChatDelta(role="assistant", content=None), None)
    final, first, silent = None, True, False
    rate = a.tokenizer.sampling_rate
    try:
        async with contextlib.aclosing(_audio_chunks(a, stream, decoder, silence)) as chunks:
            async for out, samples, silent in chunks:
                final = out
                for chunk_samples in samples:
                    data = to_pcm16(chunk_samples, rate)
                    opening = {"transcript": transcript, "expires_at": ids["created"] + AUDIO_EXPIRES_S}
                    opening, first = (opening if first else {}), False
                    audio = ChatAudioDelta(id=audio_id, data=base64.b64encode(data).decode("ascii"), **opening)
                    yield chunk(ChatDelta(audio=audio), out)
        yield chunk(ChatDelta(), final, "stop" if silent else final.outputs[0].finish_reason)
        if req.stream_options and req.stream_options.include_usage:
            yield _sse(ChatCompletionChunk(**ids, choices=[], usage=_usage([final])))
    except Exception as e:
        yield _sse(stream_error(e))
    yield _sse("[DONE]")


async def _conversation(a: AudioServing, req: ChatCompletionRequest) -> tuple[str, list[Turn]]:
    """OpenAI messages -> (system text, turns). A user message's input_audio parts
    are reference clips of its text (their transcript), placed as the assistant's audio turn after it;
    an assistant message must be input_audio. The last message is the user's text to speak."""
    system, turns = DEFAULT_SYSTEM, []
    for k, m in enumerate(req.messages):
        texts, clips = await _parts(a, m.content, f"messages[{k}]")
        if m.role in ("system", "developer"):
            if clips:
                raise APIError(400, f"messages[{k}]: a system message holds text only", "messages")
            system = "\n".join(texts)
        elif m.role == "user":
            if k == len(req.messages) - 1 and clips:
                raise APIError(400, f"messages[{k}]: the last message is the text to speak; put reference audio "
                                    f"(with its transcript as text) in an earlier user message", "messages")
            turns.append(Turn("user", "\n".join(texts)))
            turns += [Turn("assistant", audio=codes) for codes in clips]
        elif m.role == "assistant":
            if texts or not clips:
                raise APIError(400, f"messages[{k}]: an assistant message of this speech model must be audio "
                                    f"(input_audio parts)", "messages")
            turns += [Turn("assistant", audio=codes) for codes in clips]
        else:
            raise APIError(400, f"messages[{k}]: role {m.role!r} is not supported (system, user, assistant)",
                           "messages")
    if not turns or turns[-1].role != "user" or not turns[-1].text.strip():
        raise APIError(400, "the last message must be a user message with the text to speak", "messages")
    return system, turns


async def _parts(a: AudioServing, content, where: str) -> tuple[list[str], list[torch.Tensor]]:
    if content is None:
        return [], []
    if isinstance(content, str):
        return [check_text(content, "messages")], []
    texts, clips = [], []
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind == "text":
            texts.append(check_text(str(part.get("text", "")), "messages"))
        elif kind == "input_audio":
            clips.append(await _input_audio(a, part.get("input_audio"), f"{where}.content[{i}].input_audio"))
        else:
            raise APIError(400, f"{where}.content[{i}]: part type {kind!r} is not supported (text, input_audio)",
                           "messages")
    return texts, clips


async def _input_audio(a: AudioServing, spec, where: str) -> torch.Tensor:
    if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
        raise APIError(400, f"{where} must be {{\"data\": base64, \"format\": \"wav\"}}", "messages")
    try:
        data = base64.b64decode(spec["data"], validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{where}.data is not valid base64", "messages") from None
    fmt = spec.get("format")
    return await a.encode_reference(data, str(fmt) if fmt is not None else None, "messages")


# -- GET /v1/audio/voices ---------------------------------------------------------------------------

def _voice(v: VoicePreset) -> Voice:
    return Voice(id=v.name, name=v.name, format=v.format, transcript=v.transcript)


def list_voices(a: AudioServing) -> VoiceList:
    voices = [_voice(v) for v in a.voices.values()]
    return VoiceList(data=voices, voices=voices)


# -- POST /v1/audio/voices, DELETE /v1/audio/voices/{name} ---------------------------------------------------

async def upload_voice(a: AudioServing, name: str, clip: bytes, filename: str | None, transcript: str) -> Voice:
    """A voice uploaded once (a clip and its transcript), then `voice: name`: kept in --voice-presets-dir, so it
    survives a restart; its codes are encoded now (the cache has them for the first request)."""
    if a.voices_dir is None:
        raise APIError(400, "uploaded voices are kept in --voice-presets-dir: start the server with one", "name")
    try:
        check_voice_name(name)
    except ValueError as e:
        raise APIError(400, str(e), "name") from None
    if name in a.voices or name in OPENAI_VOICES:
        raise APIError(409, f"voice {name!r} exists{'' if name in a.voices else ' (an OpenAI voice name)'}: "
                            f"DELETE /v1/audio/voices/{name} first, or pick another name", "name")
    fmt = Path(filename or "").suffix.lstrip(".").lower() or None
    if fmt is not None and fmt not in input_formats():
        raise APIError(400, f"audio: a {fmt!r} file is not supported; supported: {', '.join(input_formats())}",
                       "audio")
    transcript = check_text(transcript.strip(), "transcript")
    if not transcript:
        raise APIError(400, "transcript: write what the clip says", "transcript")
    await a.encode_reference(clip, fmt, "audio")  # (refuses what cannot be read, too long, too low a rate)
    fmt = fmt or (await a.codec(audio_container, clip))
    preset = await asyncio.to_thread(save_voice, a.voices_dir, name, clip, fmt, transcript)
    a.voices[name] = preset
    return _voice(preset)


async def delete_voice_named(a: AudioServing, name: str) -> Voice:
    preset = a.voices.get(name)
    if preset is None:
        raise APIError(404, f"no voice {name!r}; voices: {', '.join(sorted(a.voices)) or 'none'}", "name")
    await asyncio.to_thread(delete_voice, preset)
    del a.voices[name]
    return _voice(preset)
