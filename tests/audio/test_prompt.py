"""Higgs Audio prompts: the reference chat format, and the processor's token ids and frames."""
from __future__ import annotations

import pytest
import torch

from pagedllm.audio.prompt import (
    Conversation,
    Turn,
    build_audio_prompt,
    check_special_tokens,
)
from pagedllm.engine.audio_inputs import AudioGeneration
from pagedllm.model_executor.audio_sampling import DelayPatternSpec
from tests.audio_helpers import make_tiny_higgs_tts, sine_wave


@pytest.fixture(scope="module")
def higgs_dir(tmp_path_factory):
    return make_tiny_higgs_tts(tmp_path_factory.mktemp("higgs") / "tts")


@pytest.fixture(scope="module")
def text_tokenizer(higgs_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(higgs_dir))


@pytest.fixture(scope="module")
def spec(higgs_dir):
    from transformers import AutoConfig

    return DelayPatternSpec.from_hf_config(AutoConfig.from_pretrained(str(higgs_dir)))


def test_the_text_is_the_reference_chat_template():
    """What the reference template (transformers' Higgs Audio v2 processor tests) renders for a system
    message, a scene, a reference pair (user text, assistant audio) and the text to speak."""
    conv = Conversation([Turn("user", " Hello there. "), Turn("assistant", audio=torch.zeros(3, 4)),
                         Turn("user", "The sun rises.")], system="Generate audio following instruction.",
                        scene="Audio is recorded from a quiet room.")
    text, clips = conv.render("<|begin_of_text|>")
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nGenerate audio following instruction."
        "\n\n<|scene_desc_start|>\nAudio is recorded from a quiet room.\n<|scene_desc_end|><|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello there.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|><|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nThe sun rises.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n<|audio_out_bos|>")
    assert len(clips) == 1
    no_scene, _ = Conversation([Turn("user", "Hi")], scene=None).render("")
    assert "scene_desc" not in no_scene
    with pytest.raises(ValueError, match="assistant turn .* must be audio"):
        Conversation([Turn("assistant", "text")]).render("")


def test_ids_and_frames_equal_the_reference_processor(higgs_dir, text_tokenizer, spec, tmp_path):
    """Our prompt, expanded by the engine, against HiggsAudioV2Processor on the same audio and codec."""
    from transformers import DacFeatureExtractor
    from transformers.models.higgs_audio_v2.processing_higgs_audio_v2 import (
        HiggsAudioV2Processor,
    )

    from pagedllm.audio.tokenizer import (
        AudioTokenizer,
        audio_tokenizer_class,
        resolve_audio_tokenizer,
    )
    from tests.audio_helpers import make_tiny_audio_tokenizer

    codec_dir = make_tiny_audio_tokenizer(tmp_path / "codec")
    codec = AudioTokenizer.load(resolve_audio_tokenizer(str(codec_dir)), "cpu")
    wave = sine_wave(1.3)
    prompt = build_audio_prompt(Conversation([Turn("user", "Hello there."), Turn("assistant", audio=codec.encode(
        wave, 24000)), Turn("user", "The sun rises in the east.")]), text_tokenizer)

    # transformers' lazy top-level name for the codec class is a placeholder when torchaudio did not
    # import at `import transformers` time (our stand-in registers later): check the audio tokenizer's
    # class against the module's own class instead.
    class Processor(HiggsAudioV2Processor):
        def check_argument_for_proper_class(self, name, arg):
            if name == "audio_tokenizer":
                assert isinstance(arg, audio_tokenizer_class())
                return type(arg)
            return super().check_argument_for_proper_class(name, arg)

    processor = Processor(DacFeatureExtractor(sampling_rate=24000, hop_length=960), text_tokenizer,
                          audio_tokenizer_class().from_pretrained(str(codec_dir)).eval(),
                          audio_stream_bos_id=spec.stream_bos_id, audio_stream_eos_id=spec.stream_eos_id)
    ref = processor(text=prompt.prompt, audio=[wave], return_tensors="pt")
    ours = AudioGeneration(spec, None).prompt(prompt.to_engine_prompt(), prompt.prompt_token_ids)
    assert ref["input_ids"][0].tolist() == ours.token_ids
    assert torch.equal(ref["audio_input_ids"][0], ours.codes)


def test_the_tokenizer_must_match_the_config(text_tokenizer, spec):
    check_special_tokens(text_tokenizer, spec)
    wrong = DelayPatternSpec(**{**spec.__dict__, "audio_token_id": 3})
    with pytest.raises(ValueError, match=r"<\|AUDIO_OUT\|> is 265 \(the config says 3\)"):
        check_special_tokens(text_tokenizer, wrong)


def test_without_audio_the_prompt_has_no_audio_key(text_tokenizer):
    prompt = build_audio_prompt(Conversation([Turn("user", "Hi")]), text_tokenizer)
    assert "audio" not in prompt.to_engine_prompt()
    assert prompt.prompt_token_ids[0] == text_tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
