"""Higgs Audio v2 (text-to-speech): a Llama backbone with dual-FFN layers and a multi-codebook head.

Per token, a boolean audio mask picks the path through each decoder layer: text tokens take the
usual input norm / MLP / post-attention norm, audio tokens a second set (`audio_*`); attention, and
so the KV cache, is shared. An audio position's input is a frame of `num_codebooks` codes whose
embedding is the sum of per-codebook embeddings; its output is `num_codebooks x codebook_size`
logits from `audio_lm_head`. The model has no text head: like transformers' reference
(HiggsAudioV2ForConditionalGeneration, use_text_head=False), every generated step is an audio frame,
and a checkpoint's `text_lm_head.weight` is ignored. The sampling rules are in audio_sampling.py.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.distributed.parallel_state import tp_group
from pagedllm.distributed.sharding import ShardLayout
from pagedllm.errors import UnsupportedModelError
from pagedllm.model_executor.audio_sampling import DelayPatternSpec
from pagedllm.model_executor.layers import RMSNorm, RotaryEmbedding, vocab_parallel_embed
from pagedllm.model_executor.linear import Embedding, Linear
from pagedllm.model_executor.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)

# Checkpoint tensors the reference skips on load (it builds no text head for generation).
IGNORED_WEIGHTS = frozenset({"text_lm_head.weight"})


@dataclass(frozen=True)
class TokenRouting:
    """Which rows of a step take the audio path; built once per forward and shared by every layer."""

    text_rows: torch.Tensor | None  # None: every row is audio
    audio_rows: torch.Tensor | None  # None: every row is text

    @classmethod
    def from_mask(cls, audio_mask: torch.Tensor) -> TokenRouting:
        audio_rows = torch.nonzero(audio_mask).flatten()
        if len(audio_rows) == 0:
            return cls(text_rows=None, audio_rows=None)
        if len(audio_rows) == len(audio_mask):
            return cls(text_rows=None, audio_rows=audio_rows)
        return cls(text_rows=torch.nonzero(~audio_mask).flatten(), audio_rows=audio_rows)

    @classmethod
    def every_row_audio(cls, num_rows: int, device: torch.device) -> TokenRouting:
        """Every row audio, known without reading a mask (a decode step of frames: what CUDA graphs capture)."""
        return cls(text_rows=None, audio_rows=torch.arange(num_rows, device=device))

    @property
    def all_text(self) -> bool:
        return self.audio_rows is None

    def split(self, x: torch.Tensor, text_fn, audio_fn) -> torch.Tensor:
        """text_fn on the text rows and audio_fn on the audio rows of x, reassembled in order."""
        if self.all_text:
            return text_fn(x)
        if self.text_rows is None:
            return audio_fn(x)
        out = torch.empty_like(x)
        out[self.text_rows] = text_fn(x[self.text_rows])
        out[self.audio_rows] = audio_fn(x[self.audio_rows])
        return out


class HiggsAudioV2DecoderLayer(LlamaDecoderLayer):
    """A Llama layer plus the audio path's norms and MLP; attention is shared by both paths."""

    def __init__(self, cfg, rotary, qkv_bias, o_bias, qk_norm, mlp_bias) -> None:
        super().__init__(cfg, rotary, qkv_bias, o_bias, qk_norm, LlamaMLP(cfg, mlp_bias))
        self.audio_mlp = LlamaMLP(cfg, mlp_bias)
        self.audio_input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.audio_post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, routing: TokenRouting) -> torch.Tensor:
        if routing.all_text:
            x, residual = super().forward(positions, h)
            return residual + x
        tp = tp_group()  # o_proj and both MLPs' down_proj give this rank's partial sums
        h = h + tp.all_reduce(self.self_attn(positions, routing.split(h, self.input_layernorm,
                                                                       self.audio_input_layernorm)))
        return h + tp.all_reduce(routing.split(h, self._text_ffn, self._audio_ffn))

    def _text_ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(x))

    def _audio_ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.audio_mlp(self.audio_post_attention_layernorm(x))


class AudioCodeEmbedding(nn.Module):
    """One table for all codebooks (codebook k's ids offset by k * codebook_size); a frame's
    embedding is the sum over its codebooks."""

    def __init__(self, num_codebooks: int, codebook_size: int, hidden_size: int) -> None:
        super().__init__()
        self.num_codebooks, self.codebook_size = num_codebooks, codebook_size
        self.embed_audio_tokens = nn.Embedding(num_codebooks * codebook_size, hidden_size)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        # codes: (frames, K). Offsets are made here, not kept as a buffer: the loader builds
        # models on the meta device, and to_empty() would leave such a buffer uninitialised.
        offsets = torch.arange(self.num_codebooks, device=codes.device) * self.codebook_size
        return self.embed_audio_tokens(codes + offsets).sum(dim=-2)  # (frames, hidden)


class HiggsAudioV2Model(nn.Module):
    """Embeddings (text and audio), dual-FFN decoder layers, final norm."""

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        self.spec = DelayPatternSpec.from_hf_config(cfg)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = RotaryEmbedding(head_dim, max_positions, cfg.rope_parameters)
        attention_bias, mlp_bias = getattr(cfg, "attention_bias", False), getattr(cfg, "mlp_bias", False)
        self.embed_tokens = Embedding(ShardLayout.of(cfg).vocab_rows, cfg.hidden_size)  # this rank's rows
        self.embed_audio_tokens = AudioCodeEmbedding(cfg.num_codebooks, cfg.codebook_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            HiggsAudioV2DecoderLayer(cfg, rotary, attention_bias, attention_bias, False, mlp_bias)
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def placeholder_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The reference's audio mask: positions holding an audio or delay placeholder token."""
        return (input_ids == self.spec.audio_token_id) | (input_ids == self.spec.audio_delay_token_id)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, audio_codes: torch.Tensor | None,
                audio_mask: torch.Tensor | None, all_audio: bool = False) -> torch.Tensor:
        if all_audio:
            routing = TokenRouting.every_row_audio(len(input_ids), input_ids.device)
        else:
            if audio_mask is None:
                audio_mask = self.placeholder_mask(input_ids)
            routing = TokenRouting.from_mask(audio_mask.to(input_ids.device))
        h = self._embed(input_ids, audio_codes, routing)  # (tokens, hidden)
        for layer in self.layers:
            h = layer(positions, h, routing)
        return self.norm(h)

    def _embed(self, input_ids: torch.Tensor, audio_codes: torch.Tensor | None, routing: TokenRouting):
        """Text embeddings, with each audio position's replaced by its frame's (when codes are given).

        Without codes, audio positions keep their placeholder's text embedding (and still take the
        audio path), as in the reference called with input_ids and no audio_input_ids.
        """
        if audio_codes is None:
            return vocab_parallel_embed(self.embed_tokens, input_ids)
        num_audio = 0 if routing.all_text else len(routing.audio_rows)
        if audio_codes.shape != (num_audio, self.spec.num_codebooks):
            raise ValueError(f"audio_codes must have shape ({num_audio}, {self.spec.num_codebooks}): one frame "
                             f"per audio position; got {tuple(audio_codes.shape)}")
        if routing.all_text:
            return vocab_parallel_embed(self.embed_tokens, input_ids)
        audio = self.embed_audio_tokens(audio_codes)
        if routing.text_rows is None:
            return audio
        h = vocab_parallel_embed(self.embed_tokens, input_ids)
        h[routing.audio_rows] = audio.to(h.dtype)
        return h


class HiggsAudioV2ForConditionalGeneration(LlamaForCausalLM):
    """Higgs Audio v2 generation model. Reuses LlamaForCausalLM's weight loading (stacked q/k/v and
    gate/up, audio MLPs included), config checks and layer accessors; its __init__ is replaced, as
    that one would build a text LM head this model does not have.

    For the engine: `forward(input_ids, positions, audio_codes, audio_mask)` under a forward_context,
    `compute_logits(hidden) -> (rows, num_codebooks, codebook_size)`, and `audio_spec` for sampling.
    """

    generates_audio = True  # positions are frames of several codebooks (no speculative decoding)

    ignored_weight_names = IGNORED_WEIGHTS  # not even read from the checkpoint
    logits_split_by_vocab = False  # the audio head is replicated on every rank (distributed/sharding.py)

    def __init__(self, cfg, max_positions: int) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.tie_word_embeddings = False
        self.model = HiggsAudioV2Model(cfg, max_positions)
        self.audio_spec = self.model.spec
        self.num_codebooks, self.codebook_size = cfg.num_codebooks, cfg.codebook_size
        self.audio_lm_head = Linear(cfg.hidden_size, cfg.num_codebooks * cfg.codebook_size, bias=False)

    @classmethod
    def verify_config(cls, cfg, max_model_len: int) -> None:
        super().verify_config(cfg, max_model_len)
        for name in ("audio_stream_bos_id", "audio_stream_eos_id"):
            if not 0 <= getattr(cfg, name) < cfg.codebook_size:
                raise UnsupportedModelError(
                    f"{name}={getattr(cfg, name)} is outside the codebook (codebook_size={cfg.codebook_size}): "
                    f"a codebook holds its codes plus stream bos/eos, e.g. codebook_size 1026 for 1024 codes."
                )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, audio_codes: torch.Tensor | None = None,
                audio_mask: torch.Tensor | None = None, all_audio: bool = False) -> torch.Tensor:
        """Hidden states (tokens, hidden) of one flat step.

        audio_mask: (tokens,) bool, True where the position is an audio frame; None derives it from
        the placeholder tokens in input_ids (what the reference does). audio_codes: (audio positions,
        num_codebooks), the frames of the True positions in order; input_ids there are not read.
        all_audio: every position is an audio frame (no mask read: what a CUDA graph of decode steps runs).
        """
        return self.model(input_ids, positions, audio_codes, audio_mask, all_audio)

    def placeholder_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.placeholder_mask(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Audio logits (rows, num_codebooks, codebook_size)."""
        return self.audio_lm_head(hidden).view(-1, self.num_codebooks, self.codebook_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((name, t) for name, t in weights if name not in IGNORED_WEIGHTS)
