"""Waveform I/O: audio files (bytes) <-> mono float32 samples, and resampling.

Reading and writing go through soundfile (libsndfile): WAV, FLAC, MP3 and Ogg (Opus, Vorbis), as far as
the libsndfile it carries supports them (checked at run time). Resampling uses soxr. Raw PCM is
16-bit little-endian mono, OpenAI's `pcm` response format. A format we cannot read or write raises
AudioFormatError (a ValueError), which the server answers with 400 naming the supported formats.
"""
from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from functools import cache

import numpy as np


class AudioFormatError(ValueError):
    """Audio bytes in a format we cannot read, or a requested output format we cannot write."""


@dataclass(frozen=True)
class _Codec:
    format: str  # libsndfile's major format
    subtype: str | None  # libsndfile's subtype when writing
    content_type: str


# Output formats by OpenAI's response_format names. "pcm" is written by hand (no header).
_WRITERS = {
    "wav": _Codec("WAV", "PCM_16", "audio/wav"),
    "flac": _Codec("FLAC", "PCM_16", "audio/flac"),
    "mp3": _Codec("MP3", "MPEG_LAYER_III", "audio/mpeg"),
    "opus": _Codec("OGG", "OPUS", "audio/ogg"),
}
PCM_CONTENT_TYPE = "audio/pcm"
AUDIO_CONTENT_TYPES = (PCM_CONTENT_TYPE, *(c.content_type for c in _WRITERS.values()))  # what speech may answer
# Input formats by name (OpenAI's input_audio.format; file suffixes of voice presets).
_READERS = {"wav": "WAV", "flac": "FLAC", "mp3": "MP3", "ogg": "OGG", "opus": "OGG"}
# Opus encodes only these rates; other rates are resampled to the next one up before writing.
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


@cache
def _libsndfile_formats() -> dict[str, set[str]]:
    import soundfile as sf

    return {fmt: set(sf.available_subtypes(fmt)) for fmt in sf.available_formats()}


def output_formats() -> list[str]:
    """response_format values this machine can write: pcm, and those libsndfile supports."""
    have = _libsndfile_formats()
    return ["pcm"] + [name for name, c in _WRITERS.items() if c.subtype in have.get(c.format, ())]


def input_formats() -> list[str]:
    """Formats of input audio this machine can read."""
    have = _libsndfile_formats()
    return [name for name, fmt in _READERS.items() if fmt in have]


def content_type(response_format: str) -> str:
    return PCM_CONTENT_TYPE if response_format == "pcm" else _WRITERS[response_format].content_type


def check_output_format(response_format: str, param: str = "response_format") -> str:
    if response_format not in output_formats():
        raise AudioFormatError(f"{param} {response_format!r} is not supported; supported: "
                               f"{', '.join(output_formats())}.")
    return response_format


def read_audio(data: bytes, fmt: str | None = None) -> tuple[np.ndarray, int]:
    """Audio file bytes -> (mono float32 samples in [-1, 1], sampling rate). Channels are averaged.

    `fmt` (wav, mp3, ...) is checked against what we read; libsndfile detects the container itself.
    """
    import soundfile as sf

    if fmt is not None and fmt.lower() not in input_formats():
        raise AudioFormatError(f"audio format {fmt!r} is not supported; supported: {', '.join(input_formats())}.")
    if not data:
        raise AudioFormatError("the audio is empty (0 bytes).")
    try:
        samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        named = f" as {fmt}" if fmt else ""
        raise AudioFormatError(f"the audio could not be decoded{named}: {_reason(e)}. Supported formats: "
                               f"{', '.join(input_formats())}.") from None
    if samples.shape[0] == 0:
        raise AudioFormatError("the audio holds no samples.")
    return np.ascontiguousarray(samples.mean(axis=1), dtype=np.float32), int(rate)


def audio_container(data: bytes) -> str:
    """The input format name (wav, flac, mp3, ogg) of audio file bytes that read_audio reads."""
    import soundfile as sf

    major = sf.info(io.BytesIO(data)).format
    return next((name for name, fmt in _READERS.items() if fmt == major), major.lower())


def _reason(e: Exception) -> str:
    text = str(e)
    return text.split(": ", 1)[-1] if "Error opening" in text else text


def resample(samples: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    """Mono float32 samples from `rate` to `target_rate` (soxr, high quality)."""
    if rate == target_rate:
        return samples
    import soxr

    return np.asarray(soxr.resample(samples, rate, target_rate, quality="HQ"), dtype=np.float32)


def to_pcm16(samples: np.ndarray, rate: int = 24000) -> bytes:
    """float32 samples -> 16-bit little-endian PCM, converted by libsndfile as in a WAV file's data
    (so streamed PCM and a whole WAV file hold the same samples)."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.asarray(samples, dtype=np.float32), rate, format="RAW", subtype="PCM_16", endian="LITTLE")
    return buf.getvalue()


def write_audio(samples: np.ndarray, rate: int, response_format: str) -> bytes:
    """Mono float32 samples -> a whole file in `response_format` (wav, flac, mp3, opus) or raw pcm."""
    import soundfile as sf

    check_output_format(response_format)
    if response_format == "pcm":
        return to_pcm16(samples, rate)
    codec = _WRITERS[response_format]
    if response_format == "opus" and rate not in _OPUS_RATES:
        target = next((r for r in _OPUS_RATES if r >= rate), _OPUS_RATES[-1])
        samples, rate = resample(samples, rate, target), target
    buf = io.BytesIO()
    sf.write(buf, np.asarray(samples, dtype=np.float32), rate, format=codec.format, subtype=codec.subtype)
    return buf.getvalue()


def wav_stream_header(rate: int) -> bytes:
    """A 16-bit mono WAV header for a stream of unknown length: the RIFF and data sizes are 0xFFFFFFFF,
    which players read as 'until the end of the stream'."""
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", unknown))
