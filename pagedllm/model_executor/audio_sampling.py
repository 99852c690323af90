"""Multi-codebook audio generation under a delay pattern: Higgs Audio v2's rules, per request.

A generation step of an audio model yields logits (num_codebooks, codebook_size) per request. Before
sampling, the reference (transformers' HiggsAudioV2DelayPatternLogitsProcessor) forces some codebooks
to a single id:

- stream bos: codebook k (delay k + 1) is forced to `stream_bos_id` for the first steps after the
  audio-bos token: all codebooks at the first step, then codebook k for k more steps. Codebook k thus
  lags codebook 0 by k frames (the delay pattern).
- stream eos: once any codebook emits `stream_eos_id`, the next placeholder token is the delay token,
  and each step whose preceding token is the delay token forces one more codebook (0, 1, ...) to
  stream eos, until every codebook emits it: that frame ends audio generation.

Each frame is fed back at the position of a placeholder token (`audio_token_id`, or
`audio_delay_token_id` once eos has started), whose embedding is the sum of its codes' embeddings.

Everything here is per request (an AudioGenerationState each, own seeded generator), so a request's
codes do not depend on what else is in the batch. Sampling reuses the text sampler's top-k/top-p
masking and inverse-CDF draw, applied per codebook row.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedllm.errors import UnsupportedSamplingParamsError
from pagedllm.model_executor.sampler import _top_k_top_p, sample_from_probs
from pagedllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class DelayPatternSpec:
    """The ids and shape a delay-pattern audio model generates with (read from its config)."""

    num_codebooks: int
    codebook_size: int  # ids per codebook, stream bos/eos included
    stream_bos_id: int  # per-codebook id that opens a stream
    stream_eos_id: int  # per-codebook id that closes it
    audio_bos_token_id: int  # text token after which audio frames follow
    audio_token_id: int  # placeholder of a frame
    audio_delay_token_id: int  # placeholder of a frame once stream eos has started
    eos_token_id: int | None  # token that follows the all-eos frame (ends the request)

    @classmethod
    def from_hf_config(cls, cfg) -> DelayPatternSpec:
        eos = getattr(cfg, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return cls(
            num_codebooks=cfg.num_codebooks, codebook_size=cfg.codebook_size,
            stream_bos_id=cfg.audio_stream_bos_id, stream_eos_id=cfg.audio_stream_eos_id,
            audio_bos_token_id=cfg.audio_bos_token_id, audio_token_id=cfg.audio_token_id,
            audio_delay_token_id=cfg.audio_delay_token_id, eos_token_id=eos,
        )

    @property
    def delays(self) -> list[int]:
        """The reference's delay pattern: codebook k has delay k + 1."""
        return list(range(1, self.num_codebooks + 1))

    @property
    def placeholder_token_ids(self) -> tuple[int, int]:
        """Token ids whose positions carry a frame of codes (the audio path of the model)."""
        return self.audio_token_id, self.audio_delay_token_id


@dataclass(frozen=True)
class RepetitionAwareSampling:
    """RAS (the reference's `ras_win_len` / `ras_win_max_num_repeat` generation-config fields).

    A codebook whose sampled code already occurs `max_repeat` times among the last `window` frames
    (stream bos/eos not counted) is redrawn from the raw logits' softmax: no delay-pattern masks, no
    temperature, top-k or top-p, and a random draw even for greedy requests, as the reference does.
    The converted 3B checkpoint's generation_config.json sets window 7, max_repeat 2.
    """

    window: int
    max_repeat: int

    @classmethod
    def from_generation_config(cls, gen: dict) -> RepetitionAwareSampling | None:
        window, repeat = gen.get("ras_win_len"), gen.get("ras_win_max_num_repeat")
        return None if window is None or repeat is None else cls(window, repeat)


@dataclass
class AudioGenerationState:
    """One request's audio-generation progress: the reference processor's counters, and its frames.

    `bos_countdown[k] >= 0`: codebook k is forced to stream bos this step (then it counts down).
    `eos_countdown[k] <= 0`: codebook k is forced to stream eos; it counts down at every step whose
    preceding token is the delay token. Build it with `from_prompt`, advance it with
    `sample_audio_steps`.
    """

    spec: DelayPatternSpec
    bos_countdown: list[int]
    eos_countdown: list[int]
    last_token_id: int  # the sequence's last token: the prompt's, then each placeholder appended
    prompt_tail: list[list[int]] = field(default_factory=list)  # last prompt frames, for RAS
    frames: list[list[int]] = field(default_factory=list)  # generated codes, delay pattern included
    ras: RepetitionAwareSampling | None = None
    seed: int | None = None
    generator: torch.Generator | None = None  # made from `seed` on the logits' device when first needed
    finished: bool = False  # the all-stream-eos frame has been generated

    @classmethod
    def from_prompt(
        cls,
        spec: DelayPatternSpec,
        prompt_token_ids: Sequence[int],
        prompt_audio_codes: torch.Tensor | Sequence[Sequence[int]] | None = None,
        ras: RepetitionAwareSampling | None = None,
        seed: int | None = None,
    ) -> AudioGenerationState:
        """The state before the first audio step, from the prompt as the reference reads it.

        Only the last `num_codebooks` prompt tokens matter: the first audio-bos token among them sets
        the bos countdown (none: every codebook is forced to stream bos at the first step only), the
        first delay token among them the eos countdown. `prompt_audio_codes` (frames, num_codebooks)
        are the prompt's audio spans; only their tail is kept, for RAS.
        """
        if not prompt_token_ids:
            raise ValueError("an audio generation needs a prompt of at least one token")
        delays = spec.delays
        window = list(prompt_token_ids[-spec.num_codebooks:])
        bos = _countdown_from_window(window, spec.audio_bos_token_id, delays, missing=[0] * len(delays))
        eos = _countdown_from_window(window, spec.audio_delay_token_id, delays, missing=list(delays))
        tail: list[list[int]] = []
        if prompt_audio_codes is not None and ras is not None:
            tail = [list(map(int, f)) for f in _as_rows(prompt_audio_codes)[-ras.window:]]
        return cls(spec, bos, eos, int(window[-1]), tail, ras=ras, seed=seed)

    def generator_for(self, device: torch.device, shared: torch.Generator) -> torch.Generator:
        """The request's own generator when it is seeded (batch-independent draws), else `shared`."""
        if self.seed is None:
            return shared
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator


def _countdown_from_window(window: list[int], token_id: int, delays: list[int], missing: list[int]) -> list[int]:
    """delays - (K - i) for the first `token_id` at index i of the last-K-tokens window."""
    if token_id not in window:
        return missing
    steps_after = len(delays) - window.index(token_id)
    return [d - steps_after for d in delays]


def _as_rows(codes: torch.Tensor | Sequence[Sequence[int]]) -> list:
    return codes.tolist() if isinstance(codes, torch.Tensor) else list(codes)


@dataclass(frozen=True)
class AudioStep:
    """What one step produced for a request: the frame, the token to append, whether audio ended."""

    codes: list[int]  # (num_codebooks,) the frame, stream bos/eos included
    token_id: int  # next token of the sequence: audio_token_id, audio_delay_token_id or eos_token_id
    finished: bool  # every codebook emitted stream eos


@dataclass(frozen=True)
class DelayPatternMasks:
    """Which codebooks are forced this step, and the counters after it (computed, not yet applied)."""

    force_bos: list[bool]
    force_eos: list[bool]
    next_bos_countdown: list[int]
    next_eos_countdown: list[int]


def delay_pattern_masks(state: AudioGenerationState) -> DelayPatternMasks:
    """This step's masks for one request, exactly as the reference processor's call computes them."""
    force_bos = [c >= 0 for c in state.bos_countdown]
    next_bos = [c - 1 if f else c for c, f in zip(state.bos_countdown, force_bos)]
    eos = state.eos_countdown
    if state.last_token_id == state.spec.audio_delay_token_id:
        eos = [c - 1 for c in eos]
    return DelayPatternMasks(force_bos, [c <= 0 for c in eos], next_bos, eos)


def apply_delay_pattern(
    logits: torch.Tensor, force_bos: torch.Tensor, force_eos: torch.Tensor, spec: DelayPatternSpec
) -> torch.Tensor:
    """-inf everywhere but stream bos (eos) in forced rows. logits (..., K, C); masks (..., K) bool.

    The bos mask is applied first, then the eos mask, so a row forced both ways is all -inf (the
    reference's argmax then picks id 0).
    """
    ids = torch.arange(spec.codebook_size, device=logits.device)
    logits = logits.masked_fill(force_bos.unsqueeze(-1) & (ids != spec.stream_bos_id), _NEG_INF)
    return logits.masked_fill(force_eos.unsqueeze(-1) & (ids != spec.stream_eos_id), _NEG_INF)


def verify_audio_sampling_params(params: SamplingParams) -> None:
    """Refuse, by name, what audio generation cannot honour (never silently ignore it): the logits
    processors the reference refuses for codebook logits, and the text-only settings (logprobs of a
    frame, stops on placeholder tokens or text, min_tokens)."""
    unsupported = {
        "min_p": params.min_p != 0.0, "presence_penalty": params.presence_penalty != 0.0,
        "frequency_penalty": params.frequency_penalty != 0.0, "repetition_penalty": params.repetition_penalty != 1.0,
        "logprobs": params.logprobs is not None, "prompt_logprobs": params.prompt_logprobs is not None,
        "stop": bool(params.stop), "stop_token_ids": bool(params.stop_token_ids), "min_tokens": params.min_tokens > 0,
        "logit_bias": bool(params.logit_bias), "guided_decoding": params.guided_decoding is not None,
    }
    bad = [name for name, is_set in unsupported.items() if is_set]
    if bad:
        raise UnsupportedSamplingParamsError(
            f"{', '.join(bad)} not supported for audio codes: use temperature, top_k, top_p, seed, n, max_tokens "
            f"(frames) and ignore_eos (no stream eos unless the delay pattern forces it).")


def sample_audio_steps(
    states: Sequence[AudioGenerationState],
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generator: torch.Generator,
) -> list[AudioStep]:
    """One audio step for a batch of requests: masks, per-codebook sampling, RAS, next token.

    logits: (B, num_codebooks, codebook_size), row b for states[b]. `generator` serves unseeded
    requests; seeded ones draw from their own. Advances every state (counters, frames, finished).
    """
    if not states:
        return []
    if any(s.finished for s in states):
        raise ValueError("a request whose audio has ended (all codebooks at stream eos) cannot take another step")
    spec = states[0].spec
    raw = logits.float()
    device = raw.device
    masks = [delay_pattern_masks(s) for s in states]
    force_bos = torch.tensor([m.force_bos for m in masks], device=device)
    force_eos = torch.tensor([m.force_eos for m in masks], device=device)
    if any(p.ignore_eos for p in params):
        raw = _suppress_stream_eos(raw, [p.ignore_eos for p in params], force_eos, spec)
    scores = apply_delay_pattern(raw, force_bos, force_eos, spec)
    codes = _sample_codes(scores, states, params, generator)  # (B, K)
    codes = _repetition_aware_resample(codes, raw, states, generator)
    return [_advance(s, m, c) for s, m, c in zip(states, masks, codes.tolist())]


def _suppress_stream_eos(raw: torch.Tensor, ignore_eos: list[bool], force_eos: torch.Tensor,
                         spec: DelayPatternSpec) -> torch.Tensor:
    """ignore_eos: no codebook of those requests may pick stream eos (nor RAS redraw it) unless the
    delay pattern forces it, so audio runs to max_tokens (benchmarks)."""
    rows = torch.tensor(ignore_eos, device=raw.device)[:, None] & ~force_eos  # (B, K)
    raw = raw.clone()
    raw[..., spec.stream_eos_id] = raw[..., spec.stream_eos_id].masked_fill(rows, _NEG_INF)
    return raw


def _sample_codes(scores: torch.Tensor, states, params, generator: torch.Generator) -> torch.Tensor:
    """Greedy argmax, or temperature -> top-k -> top-p -> draw, per codebook row (the reference's order)."""
    b, k, c = scores.shape
    rows = scores.reshape(b * k, c)
    greedy = [p.greedy for p in params]
    codes = rows.argmax(dim=-1)
    if not all(greedy):
        sampled_reqs = [i for i, g in enumerate(greedy) if not g]
        sampled = _draw(rows.view(b, k, c)[sampled_reqs], [states[i] for i in sampled_reqs],
                        [params[i] for i in sampled_reqs], generator)
        codes = codes.view(b, k)
        codes[sampled_reqs] = sampled
    return codes.view(b, k)


def _draw(scores: torch.Tensor, states, params, generator: torch.Generator) -> torch.Tensor:
    """Sample (n, K) codes from (n, K, C) scores, one uniform number per codebook from each request."""
    n, k, c = scores.shape
    device = scores.device
    temperature = torch.tensor([p.temperature for p in params], device=device).repeat_interleave(k)
    rows = scores.reshape(n * k, c) / temperature[:, None]
    top_k = [p.top_k for p in params for _ in range(k)]
    top_p = [p.top_p for p in params for _ in range(k)]
    if any(t > 0 for t in top_k) or any(t < 1.0 for t in top_p):
        rows = _top_k_top_p(rows, torch.tensor(top_k, device=device), torch.tensor(top_p, device=device)[:, None])
    uniform = torch.cat([_uniform(s, k, device, generator) for s in states])
    # A row forced to both stream bos and eos has no finite logit: the reference's argmax gives id 0
    # there (its sampling would fail), so we give 0 too.
    dead = ~torch.isfinite(rows).any(dim=-1, keepdim=True)
    codes = sample_from_probs(torch.softmax(rows.masked_fill(dead, 0.0), dim=-1), uniform)
    return codes.masked_fill(dead.squeeze(-1), 0).view(n, k)


def _uniform(state: AudioGenerationState, count: int, device: torch.device, shared: torch.Generator) -> torch.Tensor:
    return torch.rand(count, dtype=torch.float64, device=device, generator=state.generator_for(device, shared))


def _repetition_aware_resample(codes: torch.Tensor, raw: torch.Tensor, states, generator: torch.Generator):
    """Redraw, from the raw logits, codebooks that repeat too often in the recent frames (RAS)."""
    for b, state in enumerate(states):
        ras = state.ras
        recent = (state.prompt_tail + state.frames)[-ras.window:] if ras is not None else []
        if not recent:
            continue
        window = torch.tensor(recent, device=codes.device)  # (frames, K)
        spec = state.spec
        counted = (window != spec.stream_bos_id) & (window != spec.stream_eos_id)
        repeats = ((window == codes[b]) & counted).sum(dim=0)
        redraw = torch.nonzero(repeats >= ras.max_repeat).flatten()
        if len(redraw):
            probs = torch.softmax(raw[b, redraw], dim=-1)
            codes[b, redraw] = sample_from_probs(probs, _uniform(state, len(redraw), codes.device, generator))
    return codes


def commit_frame(state: AudioGenerationState, codes: list[int]) -> AudioStep:
    """Advance `state` by a frame sampled elsewhere (a tensor-parallel worker mirroring rank 0's draw)."""
    return _advance(state, delay_pattern_masks(state), codes)


def _advance(state: AudioGenerationState, masks: DelayPatternMasks, codes: list[int]) -> AudioStep:
    """Commit one frame to the state and pick the next placeholder as the reference's `_sample` does."""
    spec = state.spec
    any_eos = any(c == spec.stream_eos_id for c in codes)
    all_eos = all(c == spec.stream_eos_id for c in codes)
    token = spec.audio_token_id
    if any_eos or state.last_token_id == spec.audio_delay_token_id:
        token = spec.audio_delay_token_id
    if all_eos and spec.eos_token_id is not None:
        token = spec.eos_token_id
    state.bos_countdown, state.eos_countdown = masks.next_bos_countdown, masks.next_eos_countdown
    state.frames.append(codes)
    state.last_token_id = token
    state.finished = all_eos
    return AudioStep(codes, token, all_eos)


# -- the delay pattern on whole code arrays ------------------------------------------------------

def build_delay_pattern(codes: torch.Tensor, spec: DelayPatternSpec) -> torch.Tensor:
    """Codes (frames, K) of a prompt's audio span -> the (frames + K + 1, K) frames the model reads.

    As the reference processor does: a stream-bos frame before and a stream-eos frame after, then
    codebook k shifted down by k frames (stream bos above, stream eos below).
    """
    n, k = codes.shape
    out = torch.empty((n + k + 1, k), dtype=codes.dtype, device=codes.device)
    for i in range(k):
        out[: i + 1, i] = spec.stream_bos_id
        out[i + 1: i + 1 + n, i] = codes[:, i]
        out[i + 1 + n:, i] = spec.stream_eos_id
    return out


def audio_placeholder_ids(num_frames: int, spec: DelayPatternSpec) -> list[int]:
    """The prompt tokens standing for `num_frames` delayed frames: audio tokens, then K - 1 delay tokens."""
    delayed = spec.num_codebooks - 1
    return [spec.audio_token_id] * (num_frames - delayed) + [spec.audio_delay_token_id] * delayed


def revert_delay_pattern(codes: torch.Tensor) -> torch.Tensor:
    """(T, K) delayed frames -> (T - K + 1, K): codebook k's column read from frame k on."""
    t, k = codes.shape
    return torch.stack([codes[i: t - k + 1 + i, i] for i in range(k)], dim=1)


def extract_audio_codes(frames: torch.Tensor, spec: DelayPatternSpec) -> torch.Tensor:
    """Generated frames (delay pattern, stream bos/eos) -> the codes an audio decoder takes (n, K).

    As the reference processor's batch_decode: start at the last all-bos frame, stop before the
    first all-eos frame after it, revert the delay pattern, clip ids to [0, stream_bos_id - 1].
    Where no frame is all bos (the processor would fail), the frames are read from the first.
    """
    frames = torch.as_tensor(frames)
    k = spec.num_codebooks
    all_bos = torch.nonzero((frames == spec.stream_bos_id).all(-1)).flatten()
    body = frames[int(all_bos[-1]) + 1:] if len(all_bos) else frames
    all_eos = torch.nonzero((body == spec.stream_eos_id).all(-1)).flatten()
    body = body[: int(all_eos[0])] if len(all_eos) else body
    if body.shape[0] < k:
        return body.new_empty((0, k))
    return revert_delay_pattern(body).clip(0, spec.stream_bos_id - 1)
