"""Waveform I/O: formats in and out, PCM as in a WAV file, resampling, clear errors."""
from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from pagedllm.audio.io import (
    AudioFormatError,
    check_output_format,
    content_type,
    input_formats,
    output_formats,
    read_audio,
    resample,
    to_pcm16,
    wav_stream_header,
    write_audio,
)
from tests.audio_helpers import sine_wave

RATE = 24000


def test_formats_this_libsndfile_has():
    assert {"pcm", "wav", "flac"} <= set(output_formats())
    assert {"wav", "flac"} <= set(input_formats())
    assert content_type("wav") == "audio/wav" and content_type("pcm") == "audio/pcm"


@pytest.mark.parametrize("fmt", [f for f in ("wav", "flac", "mp3", "opus") if f in output_formats()])
def test_write_then_read_every_output_format(fmt):
    x = sine_wave(0.5)
    samples, rate = read_audio(write_audio(x, RATE, fmt), "ogg" if fmt == "opus" else fmt)
    assert rate in (RATE, 48000)
    assert abs(len(samples) / rate - 0.5) < 0.05
    if fmt in ("wav", "flac"):  # lossless at 16 bits
        np.testing.assert_allclose(samples, x, atol=1 / 32768 + 1e-7)


def test_pcm_is_the_wav_data_and_a_stream_header_makes_a_readable_wav():
    x = np.random.default_rng(0).normal(0, 0.6, 5000).astype(np.float32)  # some samples clip
    wav, _ = sf.read(io.BytesIO(write_audio(x, RATE, "wav")), dtype="int16")
    pcm = np.frombuffer(to_pcm16(x, RATE), dtype="<i2")
    np.testing.assert_array_equal(pcm, wav)
    assert write_audio(x, RATE, "pcm") == to_pcm16(x, RATE)
    streamed, rate = sf.read(io.BytesIO(wav_stream_header(RATE) + to_pcm16(x, RATE)), dtype="int16")
    assert rate == RATE
    np.testing.assert_array_equal(streamed, wav)


def test_stereo_is_averaged_to_mono():
    left, right = sine_wave(0.1), np.zeros(2400, dtype=np.float32)
    buf = io.BytesIO()
    sf.write(buf, np.stack([left, right], axis=1), RATE, format="FLAC")
    samples, _ = read_audio(buf.getvalue(), "flac")
    np.testing.assert_allclose(samples, left / 2, atol=1e-4)


def test_unreadable_and_unsupported_audio_raise_a_typed_error_naming_the_formats():
    with pytest.raises(AudioFormatError, match="could not be decoded as wav.*Supported formats: wav"):
        read_audio(b"RIFF not really a wave file" * 4, "wav")
    with pytest.raises(AudioFormatError, match="'aac' is not supported; supported: wav"):
        read_audio(b"x", "aac")
    with pytest.raises(AudioFormatError, match="empty"):
        read_audio(b"", "wav")
    with pytest.raises(AudioFormatError, match="response_format 'aac' is not supported; supported: pcm, wav"):
        check_output_format("aac")
    assert issubclass(AudioFormatError, ValueError)


def test_resample_with_soxr_keeps_duration_and_tone():
    x = sine_wave(1.0, rate=16000, freq=300.0)
    y = resample(x, 16000, RATE)
    assert y.dtype == np.float32 and len(y) == RATE
    ref = sine_wave(1.0, rate=RATE, freq=300.0)
    assert float(np.abs(y[500:-500] - ref[500:-500]).max()) < 1e-2
    assert resample(x, 16000, 16000) is x
