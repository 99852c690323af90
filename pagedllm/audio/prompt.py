"""Higgs Audio v2 prompts: a conversation with reference audio -> the prompt text, its token ids and
the reference clips' codes, as transformers' HiggsAudioV2Processor and chat template build them.

The text follows the reference chat template (Llama-3 headers; a system message, then turns; an
assistant turn is audio only, `<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>`; the generation prompt
ends with `<|audio_out_bos|>`, after which the model speaks). The engine expands each `<|AUDIO_OUT|>`
of the token ids into its clip's frames, as the processor does (engine/audio_inputs.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.model_executor.audio_sampling import DelayPatternSpec

AUDIO_OUT = "<|AUDIO_OUT|>"
AUDIO_OUT_BOS = "<|audio_out_bos|>"
AUDIO_EOS = "<|audio_eos|>"
AUDIO_DELAY = "<|reserved_special_token_6|>"
DEFAULT_SYSTEM = "Generate audio following instruction."
DEFAULT_SCENE = "Audio is recorded from a quiet room."


@dataclass(frozen=True)
class Turn:
    """One message: a user's text, or an assistant's reference audio (codes (frames, num_codebooks))."""

    role: str  # "user" | "assistant"
    text: str = ""
    audio: torch.Tensor | None = None


@dataclass(frozen=True)
class Conversation:
    turns: list[Turn]
    system: str = DEFAULT_SYSTEM
    scene: str | None = DEFAULT_SCENE

    def render(self, bos_token: str) -> tuple[str, list[torch.Tensor]]:
        """The prompt text with one AUDIO_OUT per reference clip, and the clips in order."""
        text = f"{bos_token}<|start_header_id|>system<|end_header_id|>\n\n{self.system.strip()}"
        if self.scene:
            text += f"\n\n<|scene_desc_start|>\n{self.scene.strip()}\n<|scene_desc_end|>"
        text += "<|eot_id|>"
        clips = []
        for turn in self.turns:
            text += f"<|start_header_id|>{turn.role}<|end_header_id|>\n\n"
            if turn.role == "assistant":
                if turn.audio is None:
                    raise ValueError("an assistant turn of a Higgs Audio prompt must be audio (a reference clip)")
                text += f"{AUDIO_OUT_BOS}{AUDIO_OUT}{AUDIO_EOS}"
                clips.append(turn.audio)
            else:
                text += turn.text.strip()
            text += "<|eot_id|>"
        return text + f"<|start_header_id|>assistant<|end_header_id|>\n\n{AUDIO_OUT_BOS}", clips


@dataclass(frozen=True)
class AudioPrompt:
    """The rendered prompt, its token ids (one AUDIO_OUT per clip), and the clips' codes in order."""

    prompt: str
    prompt_token_ids: list[int]
    clips: list[torch.Tensor] = field(default_factory=list)  # each (frames, num_codebooks)

    def to_engine_prompt(self) -> dict:
        """The engine's prompt dict: it expands each AUDIO_OUT into its clip's delayed frames."""
        prompt: dict = {"prompt": self.prompt, "prompt_token_ids": self.prompt_token_ids}
        if self.clips:
            prompt["audio"] = self.clips
        return prompt


def check_special_tokens(tokenizer, spec: DelayPatternSpec) -> None:
    """The text tokenizer must map Higgs' special tokens to the ids the model's config names."""
    expected = {AUDIO_OUT: spec.audio_token_id, AUDIO_OUT_BOS: spec.audio_bos_token_id,
                AUDIO_DELAY: spec.audio_delay_token_id}
    wrong = {tok: (tokenizer.convert_tokens_to_ids(tok), want) for tok, want in expected.items()
             if tokenizer.convert_tokens_to_ids(tok) != want}
    if wrong:
        details = ", ".join(f"{tok} is {got} (the config says {want})" for tok, (got, want) in wrong.items())
        raise ValueError(f"the text tokenizer does not match the Higgs Audio config: {details}")


def build_audio_prompt(conversation: Conversation, tokenizer) -> AudioPrompt:
    """Render and tokenize (the text holds its own bos token)."""
    text, clips = conversation.render(tokenizer.bos_token or "")
    return AudioPrompt(text, tokenizer.encode(text, add_special_tokens=False), clips)
