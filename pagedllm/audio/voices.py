"""Voice presets (--voice-presets-dir): each voice is an audio file plus a transcript of what it says,
`NAME.wav` (or .flac, .mp3, .ogg) beside `NAME.txt`. A voice's audio becomes a reference turn of the
prompt (its transcript as the user's text, its codes as the assistant's audio), as in Higgs Audio's
zero-shot voice cloning."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pagedllm.audio.io import input_formats


@dataclass(frozen=True)
class VoicePreset:
    name: str
    audio_path: Path
    transcript: str

    @property
    def format(self) -> str:
        return self.audio_path.suffix.lstrip(".").lower()

    def read_bytes(self) -> bytes:
        return self.audio_path.read_bytes()


def load_voice_presets(directory: str | Path) -> dict[str, VoicePreset]:
    """name -> preset, for every audio file of a readable format that has a transcript beside it."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"--voice-presets-dir {directory}: not a folder")
    suffixes = {f".{f}" for f in input_formats()}
    voices: dict[str, VoicePreset] = {}
    for audio in sorted(p for p in root.iterdir() if p.suffix.lower() in suffixes and p.is_file()):
        transcript = audio.with_suffix(".txt")
        if not transcript.is_file():
            raise FileNotFoundError(f"voice preset {audio.name} has no transcript: write what it says into "
                                    f"{transcript.name}")
        if audio.stem in voices:
            raise ValueError(f"two voice presets are called {audio.stem!r}: {voices[audio.stem].audio_path.name} "
                             f"and {audio.name}")
        voices[audio.stem] = VoicePreset(audio.stem, audio, transcript.read_text(encoding="utf-8").strip())
    return voices  # (an empty folder: uploads, POST /v1/audio/voices, go there)


VOICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_voice_name(name: str) -> str:
    """A voice's name: a file name in the presets folder, so letters, digits, _ . - (64 at most), no path."""
    if not VOICE_NAME.fullmatch(name) or name.endswith(".") or ".." in name:
        raise ValueError(f"voice name {name!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter "
                         f"or digit")
    return name


def save_voice(directory: str | Path, name: str, audio: bytes, fmt: str, transcript: str) -> VoicePreset:
    """Write an uploaded voice into the presets folder (NAME.FMT and NAME.txt): it survives a restart."""
    root = Path(directory).expanduser()
    audio_path = root / f"{check_voice_name(name)}.{fmt}"
    audio_path.write_bytes(audio)
    audio_path.with_suffix(".txt").write_text(transcript, encoding="utf-8")
    return VoicePreset(name, audio_path, transcript)


def delete_voice(voice: VoicePreset) -> None:
    voice.audio_path.unlink(missing_ok=True)
    voice.audio_path.with_suffix(".txt").unlink(missing_ok=True)
