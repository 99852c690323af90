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

import numpy as np
import torch
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedllm.audio.io import (
    AudioFormatError,
    check_output_format,
    content_type,
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
from pagedllm.audio.streaming import CHUNK_FRAMES, CONTEXT_FRAMES, SilenceStop, StreamingDecoder
from pagedllm.audio.tokenizer import AudioTokenizer
from pagedllm.audio.voices import VoicePreset
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
        frames = math.ceil(len(samples) / rate * self.tokenizer.frame_rate)
        if frames > self.ctx.max_model_len:
            raise APIError(400, f"{param}: the reference audio lasts {len(samples) / rate:.1f} s = {frames} frames, "
                                f"more than the context holds (max_model_len {self.ctx.max_model_len})", param)
        codes = await self.codec(self.tokenizer.encode, samples, rate)
        if self.cache is not None:
            self.cache.put(key, codes)
        return codes

    async def voice_turns(self, voice: str | None, param: str) -> list[Turn]:
        """A preset voice as reference turns: its transcript (user), then its audio (assistant)."""
        if voice is None:
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


def _speech_sampling_params(req: SpeechRequest) -> SamplingParams:
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
    if req.speed != 1.0:
        raise APIError(400, f"speed {req.speed} is not supported: the model speaks at its own pace (1.0)", "speed")
    check_text(req.input, "input")
    a.check_limit(0 if req.voice is None else 1, "voice")
    turns = await a.voice_turns(req.voice, "voice")
    scene = check_text(req.instructions, "instructions") if req.instructions else DEFAULT_SCENE
    conversation = Conversation(turns + [Turn("user", req.input)], scene=scene)
    stream = await a.generate(conversation, _speech_sampling_params(req), "speech")
    rate = a.tokenizer.sampling_rate
    decoder, silence = _decoder(a, req), _silence_stop(a, req)
    if req.stream:
        return StreamingResponse(_stream_audio(a, stream, fmt, decoder, silence), media_type=content_type(fmt))
    out, samples, silent = await _whole_audio(a, stream, decoder, silence, raw)
    frames = len(samples) // a.tokenizer.hop_length if silent else len(_codes_of(out)[1])
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
    a.check_limit(_num_input_audio(req) + (voice is not None), "messages")  # before encoding any of them
    system, turns = await _conversation(a, req)
    turns = await a.voice_turns(voice, "audio.voice") + turns
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

def list_voices(a: AudioServing) -> VoiceList:
    return VoiceList(data=[Voice(id=v.name, name=v.name, format=v.format, transcript=v.transcript)
                           for v in a.voices.values()])
