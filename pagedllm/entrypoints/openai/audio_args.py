"""The server's audio flags, with vLLM's names (and the Higgs Audio vLLM fork's tokenizer flags).

    --audio-tokenizer-type NAME|PATH   the codec (folder, hub name in the local cache, or preset)
    --audio-tokenizer-path PATH        its folder, when the type is only a name
    --limit-mm-per-prompt audio=N      at most N audio items per request (also JSON: '{"audio": N}')
    --mm-processor-cache-gb GIB        size of the cache of encoded reference audio (vLLM's default 4)
    --disable-mm-preprocessor-cache    no such cache
    --voice-presets-dir DIR            voices: NAME.wav (or .flac, .mp3, .ogg) + NAME.txt (its transcript)
    --stop-after-silence-frames N      end audio after N frames in a row of near-silence (default: off)
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from pagedllm.utils import gib_to_bytes

MODALITIES = ("audio",)  # the modalities --limit-mm-per-prompt may name
DEFAULT_MM_CACHE_GB = 4.0  # vLLM's default --mm-processor-cache-gb


@dataclass(frozen=True)
class AudioServerConfig:
    tokenizer: str | None = None
    tokenizer_path: str | None = None
    limit_audio_per_prompt: int | None = None  # None: no limit
    mm_cache_bytes: int = 0  # 0: no cache of encoded reference audio
    voice_presets_dir: str | None = None
    stop_after_silence_frames: int | None = None  # None: off (a request may still ask)
    max_reference_seconds: float = 60.0  # the longest reference clip (ref_audio, input_audio, an upload)

    @property
    def enabled(self) -> bool:
        return self.tokenizer is not None or self.tokenizer_path is not None


def add_audio_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    """The codec flags: `serve` and `plan` take them (the plan counts the codec's memory)."""
    g = parser.add_argument_group("audio tokenizer (speech models)")
    g.add_argument("--audio-tokenizer-type", default=None, metavar="NAME|PATH",
                   help="the audio tokenizer (codec) of a speech model: an HF folder (HiggsAudioV2TokenizerModel), "
                        "a hub name in the local HF cache, or the preset higgs-audio-v2-tokenizer (its shape only)")
    g.add_argument("--audio-tokenizer-path", default=None, metavar="PATH",
                   help="the audio tokenizer's folder, when --audio-tokenizer-type is only a name")


def add_audio_server_args(parser: argparse.ArgumentParser) -> None:
    add_audio_tokenizer_args(parser)
    g = parser.add_argument_group("multimodal (speech models)")
    g.add_argument("--limit-mm-per-prompt", type=parse_limit_mm_per_prompt, default=None, metavar="audio=N",
                   help="at most N audio items (reference clips, a preset voice) per request; also JSON '{\"audio\": N}'")
    g.add_argument("--mm-processor-cache-gb", type=float, default=DEFAULT_MM_CACHE_GB,
                   help="GiB of host memory for encoded reference audio, found again by content hash (LRU)")
    g.add_argument("--disable-mm-preprocessor-cache", action="store_true",
                   help="encode reference audio every time (no cache)")
    g.add_argument("--voice-presets-dir", default=None, metavar="DIR",
                   help="voices for /v1/audio/speech and chat audio: NAME.wav (.flac, .mp3, .ogg) + NAME.txt "
                        "transcript; voices uploaded with POST /v1/audio/voices are kept here")
    g.add_argument("--max-reference-audio-seconds", type=float, default=60.0, metavar="S",
                   help="the longest reference clip a request (ref_audio, input_audio) or an upload may give")
    g.add_argument("--stop-after-silence-frames", type=int, default=None, metavar="N",
                   help="end generated audio after N frames in a row of near-silence (RMS below -50 dBFS), for "
                        "models that run on; a request's stop_after_silence_frames overrides it (default: off)")


def parse_limit_mm_per_prompt(value: str) -> dict[str, int]:
    """vLLM's `audio=2,image=1` syntax, or a JSON object. Only `audio` exists here."""
    text = value.strip()
    try:
        if text.startswith("{"):
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise ValueError
            items = list(raw.items())
        else:
            items = [part.split("=", 1) for part in text.split(",") if part.strip()]
            if any(len(kv) != 2 for kv in items):
                raise ValueError
        limits = {str(k).strip(): int(v) for k, v in items}
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"expected audio=N or JSON like '{{\"audio\": N}}', got {value!r}") from None
    unknown = sorted(set(limits) - set(MODALITIES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modality {', '.join(unknown)}: pagedllm's models take "
                                         f"{', '.join(MODALITIES)}")
    if any(n < 0 for n in limits.values()):
        raise argparse.ArgumentTypeError(f"limits must be >= 0, got {value!r}")
    return limits


def audio_server_config(ns: argparse.Namespace) -> AudioServerConfig:
    limits = ns.limit_mm_per_prompt or {}
    if ns.mm_processor_cache_gb < 0:
        raise ValueError(f"--mm-processor-cache-gb must be >= 0, got {ns.mm_processor_cache_gb}")
    cache_bytes = 0 if ns.disable_mm_preprocessor_cache else gib_to_bytes(ns.mm_processor_cache_gb)
    silence = getattr(ns, "stop_after_silence_frames", None)
    if silence is not None and silence < 1:
        raise ValueError(f"--stop-after-silence-frames must be >= 1, got {silence}")
    seconds = getattr(ns, "max_reference_audio_seconds", 60.0)
    if not seconds > 0:
        raise ValueError(f"--max-reference-audio-seconds must be > 0, got {seconds}")
    config = AudioServerConfig(ns.audio_tokenizer_type, ns.audio_tokenizer_path, limits.get("audio"), cache_bytes,
                               ns.voice_presets_dir, silence, seconds)
    if not config.enabled:
        used = [flag for flag, set_ in (("--limit-mm-per-prompt", ns.limit_mm_per_prompt is not None),
                                        ("--voice-presets-dir", ns.voice_presets_dir is not None),
                                        ("--stop-after-silence-frames", silence is not None)) if set_]
        if used:
            raise ValueError(f"{', '.join(used)} need an audio model's codec: pass --audio-tokenizer-type")
    return config
