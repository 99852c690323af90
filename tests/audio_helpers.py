"""Tiny random audio tokenizers and a tiny Higgs Audio v2 folder with a text tokenizer, for the
audio tests and the audio server.

The tiny tokenizer keeps the real one's time structure (24 kHz in, hop 960 = 25 frames/s, HuBERT's
conv strides at 16 kHz, semantic features downsampled by 2), so framing, padding and resampling run
as in the real codec; only widths and depths are small. Its 4 codebooks of 30 codes fit the tiny
Higgs model (codebook_size 32 = 30 codes + stream bos 30 + stream eos 31).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.higgs_helpers import make_tiny_higgs_model

RATIOS = [8, 5, 4, 2, 3]  # the real tokenizer's DAC strides: hop 960 at 24 kHz
TINY_AUDIO_TOKENIZER_CONFIG: dict[str, Any] = {
    "target_bandwidths": [0.5],  # 0.5 kbps / (25 frames/s x 5 bits) = 4 codebooks
    "codebook_size": 30,
    "codebook_dim": 8,
    "acoustic_model_config": {"encoder_hidden_size": 4, "decoder_hidden_size": 64, "hidden_size": 8,
                              "downsampling_ratios": RATIOS, "upsampling_ratios": RATIOS},
    "semantic_model_config": {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                              "intermediate_size": 32, "conv_dim": [8] * 7, "num_conv_pos_embeddings": 16,
                              "num_conv_pos_embedding_groups": 4},
}
SAMPLE_RATE = 24000


def make_tiny_audio_tokenizer(path: Path | str, seed: int = 0) -> Path:
    """Write a tiny random HiggsAudioV2TokenizerModel in HF format (config.json + safetensors)."""
    from transformers.models.higgs_audio_v2_tokenizer import HiggsAudioV2TokenizerConfig

    from pagedllm.audio.tokenizer import audio_tokenizer_class, randomize_codebooks

    path = Path(path)
    cfg = HiggsAudioV2TokenizerConfig(**json.loads(json.dumps(TINY_AUDIO_TOKENIZER_CONFIG)))
    torch.manual_seed(seed)
    model = audio_tokenizer_class()(cfg).to(torch.float32)
    randomize_codebooks(model, seed)
    _unit_gain(model.acoustic_encoder, seed)
    _unit_gain(model.acoustic_decoder, seed)
    with torch.no_grad():
        model.acoustic_decoder.conv2.weight.mul_(0.2)  # the output layer: mostly within [-1, 1]
    model.save_pretrained(path, safe_serialization=True)
    return path


def _unit_gain(module: torch.nn.Module, seed: int) -> None:
    """DAC's default init (std 0.02, zero biases) shrinks the signal layer after layer into denormal
    floats, which CPUs compute about 50x slower; weights of std 1/sqrt(fan_in) keep it near unit scale."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                fan_in = m.weight[0].numel() if isinstance(m, torch.nn.Conv1d) else m.weight[:, 0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) / fan_in ** 0.5)


# The Llama-3 / Higgs special tokens the chat format uses, after the 256 byte tokens.
HIGGS_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|audio_bos|>", "<|audio_eos|>", "<|audio_out_bos|>", "<|AUDIO|>", "<|AUDIO_OUT|>",
    "<|reserved_special_token_6|>", "<|scene_desc_start|>", "<|scene_desc_end|>",
]


def _special_id(token: str) -> int:
    return 256 + HIGGS_SPECIAL_TOKENS.index(token)


def make_tiny_higgs_tts(path: Path | str, seed: int = 0, long_audio: bool = False) -> Path:
    """A tiny Higgs Audio v2 checkpoint plus a byte-level text tokenizer with the Higgs special tokens
    at the ids its config names (audio bos / placeholder / delay / eos), and a 2048-token context.

    A random model ends its audio after a few frames. `long_audio` zeroes the stream-eos rows of the
    audio head: their logit is then 0 while some of the 31 others are far above it, so the audio goes
    on until max_tokens (for tests of long requests: aborts, batching)."""
    path = Path(path)
    vocab = 256 + len(HIGGS_SPECIAL_TOKENS)
    make_tiny_higgs_model(
        path, seed=seed, vocab_size=vocab, max_position_embeddings=2048,
        bos_token_id=_special_id("<|begin_of_text|>"), pad_token_id=_special_id("<|end_of_text|>"),
        eos_token_id=_special_id("<|eot_id|>"), audio_bos_token_id=_special_id("<|audio_out_bos|>"),
        audio_token_id=_special_id("<|AUDIO_OUT|>"), audio_delay_token_id=_special_id("<|reserved_special_token_6|>"),
    )
    write_byte_tokenizer(path)
    if long_audio:
        _silence_stream_eos(path)
    return path


def _silence_stream_eos(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    cfg = json.loads((path / "config.json").read_text())
    weights = load_file(path / "model.safetensors")
    head = weights["audio_lm_head.weight"].view(cfg["num_codebooks"], cfg["codebook_size"], -1)
    head[:, cfg["audio_stream_eos_id"]] = 0.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer without merges (every byte one token) plus the special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=_byte_of))}
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HIGGS_SPECIAL_TOKENS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>", "add_bos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 2048,
    }, indent=2))


def _byte_of(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode, inverted)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def sine_wave(seconds: float, rate: int = SAMPLE_RATE, freq: float = 220.0) -> np.ndarray:
    t = np.arange(int(seconds * rate), dtype=np.float32) / rate
    return (0.4 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
