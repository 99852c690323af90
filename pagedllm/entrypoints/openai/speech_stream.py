"""WS /v1/audio/speech/stream: text in while it is still being written (an LLM's reply, token by token), speech out
as soon as each sentence of it is spoken.

The client sends, as text frames of JSON:
    {"voice": "alice" | "ref_audio": ..., "ref_text": ..., "seed": 1, "max_tokens": 200, ...}   first: the config
    {"text": "Hello the"}  {"text": "re. How are"}  ...                                        the text, in pieces
    {"end": true}                                                                              no more text
The server answers with binary frames of 16-bit mono PCM at the codec's rate, as each chunk is decoded, and JSON
events: {"type": "sentence", "index", "text"} when a sentence starts, {"type": "sentence.done", "index", "frames"},
{"type": "done", "sentences", "frames"} at the end, {"type": "error", "error": {"message", "param"}} (then close).

Text is cut into pieces at sentence ends (. ! ? and their CJK forms, a new line) or, in text with none, at a space
past MAX_PIECE_CHARS; each piece is one engine request, spoken in the session's voice with the previous piece's
text and audio codes as context (as Higgs Audio's long-form generation does), so the voice holds across pieces.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import re

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import Field, ValidationError

from pagedllm.audio.io import to_pcm16
from pagedllm.audio.prompt import DEFAULT_SCENE, Conversation, Turn
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import MAX_AUDIO_CHUNK_FRAMES, MAX_AUDIO_OVERLAP_FRAMES, LenientModel
from pagedllm.entrypoints.openai.serving import check_text
from pagedllm.entrypoints.openai.serving_audio import (
    AudioServing,
    _audio_chunks,
    _codes_of,
    _decoder,
    speech_sampling_params,
)
from pagedllm.sampling_params import SamplingParams

SENTENCE_END = re.compile(r"[.!?。！？…]+[\"')\]]*(?=\s)|\n+")
MAX_PIECE_CHARS = 300  # text with no sentence end is cut at a space past this many characters


class SpeechStreamConfig(LenientModel):
    """The session's first message: the voice and sampling, as /v1/audio/speech takes them."""

    model: str | None = None
    voice: str | None = None
    ref_audio: str | None = Field(default=None, min_length=1)
    ref_text: str | None = Field(default=None, min_length=1)
    instructions: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, le=2**63 - 1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    max_tokens: int | None = Field(default=None, ge=1)  # frames per sentence at most
    audio_chunk_size: int | None = Field(default=None, ge=1, le=MAX_AUDIO_CHUNK_FRAMES)
    audio_chunk_overlap_size: int | None = Field(default=None, ge=0, le=MAX_AUDIO_OVERLAP_FRAMES)
    stop_after_silence_frames: int | None = Field(default=None, ge=0)


def split_sentences(text: str, final: bool) -> tuple[list[str], str]:
    """(complete pieces, the rest still being written) of the text so far; `final`: no more text comes."""
    pieces, start = [], 0
    for match in SENTENCE_END.finditer(text):
        piece = text[start:match.end()].strip()
        if piece:
            pieces.append(piece)
        start = match.end()
    rest = text[start:]
    while len(rest) > MAX_PIECE_CHARS and (cut := rest.find(" ", MAX_PIECE_CHARS)) > 0:
        pieces.append(rest[:cut].strip())
        rest = rest[cut:]
    if final and rest.strip():
        pieces.append(rest.strip())
        rest = ""
    return pieces, rest


async def speech_stream(a: AudioServing, ws: WebSocket) -> None:
    await ws.accept()
    pieces: asyncio.Queue = asyncio.Queue()
    reader = None
    try:
        config = await _config(a, ws)
        reference = await a.reference_turns(config.voice, config.ref_audio, config.ref_text, "voice")
        params = speech_sampling_params(config)
        reader = asyncio.create_task(_read_text(ws, pieces))
        await _speak(a, ws, config, reference, params, pieces)
    except WebSocketDisconnect:
        return
    except APIError as e:
        await _close_with_error(ws, e.message, e.param)
    except ValueError as e:
        await _close_with_error(ws, str(e), None)
    finally:
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect, Exception):
                await reader


async def _json_message(ws: WebSocket, what: str) -> dict:
    """The client's next message, a JSON object in a text frame; anything else is a 400 saying what was expected."""
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    try:
        body = json.loads(message.get("text") or "")
    except json.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        raise APIError(400, f"expected {what}: a JSON object in a text frame", "config" if "config" in what else "text")
    return body


async def _config(a: AudioServing, ws: WebSocket) -> SpeechStreamConfig:
    message = await _json_message(ws, "the session's config first")
    try:
        config = SpeechStreamConfig(**message)
    except ValidationError as e:
        first = e.errors()[0]
        raise APIError(400, f"config: {'.'.join(map(str, first['loc']))}: {first['msg']}",
                       ".".join(map(str, first["loc"]))) from None
    a.ctx.model_name(config.model)
    a.check_limit(int(config.voice is not None or config.ref_audio is not None), "voice")
    return config


async def _read_text(ws: WebSocket, pieces: asyncio.Queue) -> None:
    """The client's text messages, cut into pieces as sentences complete; None once it says the text ended. What
    goes wrong here (bad input, the client leaving) goes into the queue, for the speaker to raise."""
    text = ""
    try:
        while True:
            body = await _json_message(ws, '{"text": ...} or {"end": true}')
            text += check_text(str(body.get("text", "")), "text")
            done = bool(body.get("end"))
            complete, text = split_sentences(text, final=done)
            for piece in complete:
                await pieces.put(piece)
            if done:
                await pieces.put(None)
                return
    except (ValueError, APIError, WebSocketDisconnect) as e:
        await pieces.put(e)


async def _speak(a: AudioServing, ws: WebSocket, config: SpeechStreamConfig, reference: list[Turn],
                 params: SamplingParams, pieces: asyncio.Queue) -> None:
    """Each piece in turn: its audio chunks as they are decoded, in the session's voice, the last piece as context."""
    rate, scene = a.tokenizer.sampling_rate, config.instructions or DEFAULT_SCENE
    previous: list[Turn] = []
    index = total_frames = 0
    while (piece := await pieces.get()) is not None:
        if isinstance(piece, Exception):
            raise piece
        await ws.send_json({"type": "sentence", "index": index, "text": piece})
        conversation = Conversation(reference + previous + [Turn("user", piece)], scene=scene)
        stream = await a.generate(conversation, params, "speech-ws")
        final = None
        async with contextlib.aclosing(_audio_chunks(a, stream, _decoder(a, config))) as chunks:
            async for out, samples, _ in chunks:
                final = out
                for chunk in samples:
                    await ws.send_bytes(to_pcm16(chunk, rate))
        codes = _codes_of(final)[1]
        previous = [Turn("user", piece), Turn("assistant", audio=codes)]  # the voice, carried to the next piece
        await ws.send_json({"type": "sentence.done", "index": index, "frames": len(codes)})
        index, total_frames = index + 1, total_frames + len(codes)
    await ws.send_json({"type": "done", "sentences": index, "frames": total_frames})
    await ws.close()


async def _close_with_error(ws: WebSocket, message: str, param: str | None) -> None:
    with contextlib.suppress(Exception):  # (the client may be gone)
        await ws.send_json({"type": "error", "error": {"message": message, "param": param, "code": 400}})
        await ws.close(code=1008)
