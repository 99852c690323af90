"""Tiny Higgs Audio v2 checkpoints and transformers' reference generation, for parity tests.

The tiny config keeps every special id inside a 64-token vocabulary and the stream bos/eos ids
inside a 32-id codebook (as the real checkpoint's codebook_size 1026 holds 1024 codes + bos + eos).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from pagedllm.model_executor.audio_sampling import (
    DelayPatternSpec,
    audio_placeholder_ids,
    build_delay_pattern,
)
from tests.helpers import SEED, _reinit_weights

TINY_HIGGS_CONFIG: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    # The real checkpoint's llama3 factors; with head_dim 16 and original length 64, the three
    # frequency bands (kept, smoothed, scaled) are all hit.
    "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
        "low_freq_factor": 0.125, "high_freq_factor": 0.5, "original_max_position_embeddings": 64,
    },
    "num_codebooks": 4,
    "codebook_size": 32,
    "audio_stream_bos_id": 30,
    "audio_stream_eos_id": 31,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "audio_bos_token_id": 60,
    "audio_token_id": 61,
    "audio_delay_token_id": 62,
    "eos_token_id": 63,
}
TEXT_TOKENS = range(2, 60)  # ids that are neither special nor placeholders
TINY_SPEC = DelayPatternSpec(
    num_codebooks=4, codebook_size=32, stream_bos_id=30, stream_eos_id=31, audio_bos_token_id=60,
    audio_token_id=61, audio_delay_token_id=62, eos_token_id=63,
)


def audio_prompt(seed: int, num_codes: int = 6) -> tuple[list[int], torch.Tensor]:
    """Text, a reference-voice span (as the processor builds it), more text, then audio bos.
    Returns the prompt ids and the span's delayed frames (one per placeholder)."""
    spec = TINY_SPEC
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, spec.stream_bos_id, (num_codes, spec.num_codebooks), generator=gen)
    frames = build_delay_pattern(codes, spec)  # (num_codes + K + 1, K)
    text = [int(t) for t in torch.randint(TEXT_TOKENS.start, TEXT_TOKENS.stop, (9,), generator=gen)]
    span = [spec.audio_bos_token_id, *audio_placeholder_ids(len(frames), spec), text[8]]  # text[8]: "audio eos"
    return [1, *text[:5], *span, *text[5:8], spec.audio_bos_token_id], frames


def text_prompt(seed: int, length: int = 11) -> list[int]:
    """Random text tokens between bos and audio bos: the model speaks the text."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(TEXT_TOKENS.start, TEXT_TOKENS.stop, (length,), generator=gen).tolist()
    return [1, *ids, TINY_SPEC.audio_bos_token_id]


def make_tiny_higgs_model(path: Path | str, seed: int = SEED, text_head: bool = True, **overrides: Any) -> Path:
    """Write a tiny random-weight HiggsAudioV2ForConditionalGeneration checkpoint (safetensors).

    With `text_head` the checkpoint also holds text_lm_head.weight, as the converted 3B one does.
    """
    from transformers import HiggsAudioV2Config, HiggsAudioV2ForConditionalGeneration

    path = Path(path)
    cfg = HiggsAudioV2Config(**copy.deepcopy({**TINY_HIGGS_CONFIG, **overrides}))
    torch.manual_seed(seed)
    model = HiggsAudioV2ForConditionalGeneration(cfg, use_text_head=text_head).to(torch.float32)
    _reinit_weights(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    return path


_HF_MODELS: dict[str, Any] = {}


def load_hf_higgs(path: Path | str) -> Any:
    """transformers' model for a checkpoint (once per path), float32, eval mode."""
    from transformers import HiggsAudioV2ForConditionalGeneration

    key = str(Path(path).resolve())
    if key not in _HF_MODELS:
        _HF_MODELS[key] = HiggsAudioV2ForConditionalGeneration.from_pretrained(key, dtype=torch.float32).eval()
    return _HF_MODELS[key]


def hf_higgs_generate(path: Path | str, prompt_ids: list[int], prompt_frames: torch.Tensor | None,
                      max_new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """Greedy `generate` of the reference: (generated frames (T, K), tokens appended after the prompt)."""
    model = load_hf_higgs(path)
    input_ids = torch.tensor([prompt_ids])
    kwargs: dict[str, Any] = {}
    if prompt_frames is not None:
        kwargs["audio_input_ids"] = prompt_frames[None]
        kwargs["audio_input_ids_mask"] = torch.ones((1, len(prompt_frames)), dtype=torch.bool)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new_tokens, return_dict_in_generate=True, **kwargs)
    num_prompt_frames = 0 if prompt_frames is None else len(prompt_frames)
    return out.audio_sequences[0, num_prompt_frames:], out.sequences[0, len(prompt_ids):].tolist()
