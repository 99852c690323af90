"""Voice presets (--voice-presets-dir): each voice is an audio file plus a transcript of what it says,
`NAME.wav` (or .flac, .mp3, .ogg) beside `NAME.txt`. A voice's audio becomes a reference turn of the
prompt (its transcript as the user's text, its codes as the assistant's audio), as in Higgs Audio's
zero-shot voice cloning."""
from __future__ import annotations

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
    if not voices:
        raise ValueError(f"--voice-presets-dir {directory} holds no voice (an audio file "
                         f"({', '.join(sorted(suffixes))}) with a .txt transcript of the same name)")
    return voices
