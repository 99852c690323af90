"""--voice-presets-dir: audio files with transcripts."""
from __future__ import annotations

import pytest
import soundfile as sf

from pagedllm.audio.voices import load_voice_presets
from tests.audio_helpers import sine_wave


def test_voices_are_audio_files_with_transcripts(tmp_path):
    sf.write(tmp_path / "alice.wav", sine_wave(0.2), 24000)
    (tmp_path / "alice.txt").write_text("  Hello there.\n")
    sf.write(tmp_path / "bob.flac", sine_wave(0.2), 16000)
    (tmp_path / "bob.txt").write_text("Hi.")
    (tmp_path / "notes.md").write_text("not a voice")
    voices = load_voice_presets(tmp_path)
    assert sorted(voices) == ["alice", "bob"]
    assert voices["alice"].transcript == "Hello there." and voices["bob"].format == "flac"
    assert voices["alice"].read_bytes()[:4] == b"RIFF"


def test_a_voice_without_transcript_is_refused_and_an_empty_folder_waits_for_uploads(tmp_path):
    assert load_voice_presets(tmp_path) == {}
    sf.write(tmp_path / "carol.wav", sine_wave(0.2), 24000)
    with pytest.raises(FileNotFoundError, match="carol.wav has no transcript.*carol.txt"):
        load_voice_presets(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a folder"):
        load_voice_presets(tmp_path / "missing")


def test_a_saved_voice_loads_again_and_names_are_file_names(tmp_path):
    from pagedllm.audio.voices import check_voice_name, delete_voice, save_voice

    voice = save_voice(tmp_path, "dave_2.0", b"RIFFdata", "wav", "Good evening.")
    assert load_voice_presets(tmp_path)["dave_2.0"] == voice  # (a restart finds it)
    delete_voice(voice)
    assert load_voice_presets(tmp_path) == {}
    for bad in ("../etc", "a/b", "", ".hidden", "x" * 65, "end.", "a..b"):
        with pytest.raises(ValueError, match="voice name"):
            check_voice_name(bad)
