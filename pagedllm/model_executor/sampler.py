"""Sampler: logits -> next tokens (+ logprobs), each row under its own request's parameters."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.model_executor.cpu_ops import fused_kernels
from pagedllm.model_executor.step_buffers import StepBuffers
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.model_executor.request_state import RunnerRequest as Request

_NEG_INF = float("-inf")


@dataclass
class SampledRow:
    token_id: int
    # Audio models: the frame sampled (delay pattern included), and whether every codebook has ended.
    frame: list[int] | None = None
    audio_finished: bool = False
    # (logprob of the chosen token, its rank, top-N ids, top-N logprobs) when logprobs were asked for
    logprob: float | None = None
    rank: int | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    # Speculative decoding: the drafts the target kept at this step, before token_id (each with its logprobs)
    accepted: list[SampledRow] | None = None

    @property
    def token_ids(self) -> list[int]:
        """The step's tokens for the request: the kept drafts, then the sampled token."""
        return [r.token_id for r in self.accepted or ()] + [self.token_id]


class PendingRows:
    """A step's sampled rows on their way to the host: the device-to-host copy is started when the
    sampler returns (asynchronous on CUDA, into page-locked memory), and waited for only in rows(), so
    the host can do other work (the previous step's outputs) while the GPU finishes this one."""

    def __init__(self, values: torch.Tensor | None, build, rows: list[SampledRow] | None = None) -> None:
        self._event = None
        if values is not None and values.device.type == "cuda":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            self._event = torch.cuda.current_stream().record_event()
            values = host
        self._values, self._build, self._rows = values, build, rows

    @classmethod
    def ready(cls, rows: list[SampledRow]) -> PendingRows:
        """Rows already on the host (an audio model's frames, sampled per request)."""
        return cls(None, None, rows)

    def rows(self) -> list[SampledRow]:
        if self._rows is None:
            if self._event is not None:
                self._event.synchronize()
            self._rows = self._build(self._values.tolist())
        return self._rows


def _token_rows(tokens: list[int]) -> list[SampledRow]:
    return [SampledRow(t) for t in tokens]


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


# Columns of a step's per-row parameters, copied to the device as one int64 tensor (floats bit-cast).
_FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INT_COLUMNS = ("greedy", "top_k", "seeded", "seed", "draw")


@dataclass
class SamplingBatch:
    """One step's sampling parameters: per-row tensors on the device (one host-to-device copy for
    all of them) and the host-side facts that choose which operations run at all."""

    params: list[SamplingParams]
    temperature: torch.Tensor  # (rows, 1) float32; 1 for greedy rows
    top_p: torch.Tensor  # (rows, 1) float32
    min_p: torch.Tensor  # (rows, 1) float32
    repetition_penalty: torch.Tensor  # (rows, 1) float32
    presence_penalty: torch.Tensor  # (rows, 1) float32
    frequency_penalty: torch.Tensor  # (rows, 1) float32
    greedy: torch.Tensor  # (rows,) bool
    top_k: torch.Tensor  # (rows,) int64, 0 = off
    seeded: torch.Tensor  # (rows,) bool
    seed: torch.Tensor  # (rows,) int64, the request's seed as 64 bits
    draw: torch.Tensor  # (rows,) int64: which of the request's draws this is (its output tokens so far)
    max_logprobs: int  # the most logprobs a row asks for; -1: none asked
    any_seeded: bool

    @classmethod
    def build(cls, requests: list[Request], device: torch.device, buffers: StepBuffers | None) -> SamplingBatch:
        params = [r.sampling_params for r in requests]
        floats = torch.tensor([(1.0 if p.greedy else p.temperature, p.top_p, p.min_p, p.repetition_penalty,
                                p.presence_penalty, p.frequency_penalty) for p in params], dtype=torch.float64)
        ints = torch.tensor([(p.greedy, max(p.top_k, 0), p.seed is not None, _seed_bits(p.seed), r.num_output_tokens)
                             for p, r in zip(params, requests)], dtype=torch.int64)
        packed = torch.cat([floats.view(torch.int64), ints], dim=1).view(-1)
        if buffers is not None and packed.numel() <= buffers.capacity("params"):
            packed = buffers.load_all({"params": packed})["params"]
        else:
            packed = packed.to(device)
        packed = packed.view(len(params), -1)
        f = packed[:, :len(_FLOAT_COLUMNS)].contiguous().view(torch.float64).float()
        i = packed[:, len(_FLOAT_COLUMNS):]
        return cls(params, *(f[:, c:c + 1] for c in range(len(_FLOAT_COLUMNS))),
                   greedy=i[:, 0].bool(), top_k=i[:, 1], seeded=i[:, 2].bool(), seed=i[:, 3], draw=i[:, 4],
                   max_logprobs=max((p.logprobs or 0) if p.logprobs is not None else -1 for p in params),
                   any_seeded=any(p.seed is not None for p in params))


class Sampler:
    """Greedy, temperature, top-k, top-p, min-p, penalties, min_tokens, seeds, logprobs: the whole
    batch in tensor ops, with the per-row parameters in one tensor (SamplingBatch) and one copy of
    the results to the host.

    Logprobs are those of the model's raw distribution (before temperature and penalties), as in
    vLLM's default. A seeded request's n-th draw is a hash of (seed, n) (seeded_uniform), so its
    tokens do not depend on the rest of the batch, nor on preemptions.
    """

    def __init__(self, device: torch.device, seed: int, max_num_seqs: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._float_buffer: torch.Tensor | None = None  # see _float_copy
        width = len(_FLOAT_COLUMNS) + len(_INT_COLUMNS)
        self.buffers = StepBuffers({"params": (max_num_seqs * width, torch.int64)}, device) \
            if max_num_seqs and device.type == "cuda" else None

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledRow]:
        return self.sample(logits, requests).rows()

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> PendingRows:
        """The batch's draws, launched; their one copy to the host started but not waited for."""
        params = [r.sampling_params for r in requests]
        bans = self._min_tokens_bans(requests)
        wants_logprobs = any(p.logprobs is not None for p in params)
        biased = any(p.logit_bias for p in params)
        if all(p.greedy for p in params) and not wants_logprobs and not bans and not biased \
                and not any(map(_has_penalty, params)):
            # Nothing changes the logits: the first maximum of the model's own, with no float32 copy.
            return PendingRows(argmax_rows(logits), _token_rows)

        batch = SamplingBatch.build(requests, logits.device, self.buffers)
        logits = self._float_copy(logits)  # (rows, vocab), ours to change in place
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs >= 0 else None
        logits = self._adjust(logits, requests, batch, bans)
        greedy_rows = [p.greedy for p in params]
        if all(greedy_rows):
            tokens = argmax_rows(logits)
        elif any(greedy_rows):
            greedy_tokens = argmax_rows(logits)  # before _sample reuses the logits in place
            tokens = torch.where(batch.greedy, greedy_tokens, self._sample(logits, batch, bans))
        else:
            tokens = self._sample(logits, batch, bans)
        if raw_logprobs is None:
            return PendingRows(tokens, _token_rows)
        return self._rows_with_logprobs(raw_logprobs, tokens, batch)

    def _adjust(self, logits: torch.Tensor, requests: list[Request], batch: SamplingBatch,
                bans: list[tuple[int, list[int]]]) -> torch.Tensor:
        """min_tokens' bans, logit_bias and the penalties, on float32 logits that are ours to change."""
        ban_index = _flat_index(bans, logits.device)
        if ban_index is not None:
            logits[ban_index] = _NEG_INF
        biased = [(i, p.logit_bias) for i, p in enumerate(batch.params) if p.logit_bias]
        if biased:  # OpenAI's logit_bias, every row's in one scatter
            rows, ids = _flat_index([(i, list(bias)) for i, bias in biased], logits.device)
            values = torch.tensor([b for _, bias in biased for b in bias.values()], dtype=logits.dtype)
            logits.index_put_((rows, ids), values.to(logits.device), accumulate=True)
        return self._apply_penalties(logits, requests, batch)

    def adjusted_logits(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """A float32 copy with min_tokens' bans, logit_bias and the penalties: a greedy row's choice is its argmax."""
        batch = SamplingBatch.build(requests, logits.device, None)
        return self._adjust(logits.float().clone(), requests, batch, self._min_tokens_bans(requests))

    def probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Each row's distribution as `sample` draws from it (bans, logit_bias, penalties, temperature, top-k,
        top-p, min-p): float32 (rows, vocab), rows summing to 1; a greedy row is one-hot at its choice.
        Speculative decoding's accept / reject rule needs the whole distribution, not one draw."""
        batch = SamplingBatch.build(requests, logits.device, None)
        logits = self._adjust(logits.float().clone(), requests, batch, self._min_tokens_bans(requests))
        greedy = argmax_rows(logits)
        logits = logits.div_(batch.temperature)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in batch.params):
            logits = _top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0.0 for p in batch.params):
            probs = probs.masked_fill(probs < batch.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        one_hot = torch.zeros_like(probs).scatter_(1, greedy[:, None], 1.0)
        return torch.where(batch.greedy[:, None], one_hot, probs)

    def uniforms(self, requests: list[Request], salt: int = 0) -> list[float]:
        """One uniform number per row, as `sample` draws them: the engine's generator's, or for a seeded row
        the hash of (its seed xor `salt`, its draw counter), so a seeded request's numbers do not depend on the
        batch."""
        batch = SamplingBatch.build(requests, self.device, None)
        uniform = torch.rand(len(requests), dtype=torch.float64, device=self.device, generator=self.generator)
        if batch.any_seeded:
            seeds = torch.tensor([_seed_bits((r.sampling_params.seed or 0) ^ salt) for r in requests],
                                 dtype=torch.int64, device=self.device)
            uniform = torch.where(batch.seeded, seeded_uniform(seeds, batch.draw), uniform)
        return uniform.tolist()

    def logprob_rows(self, logits: torch.Tensor, tokens: list[int], requests: list[Request]) -> list[SampledRow]:
        """Rows of chosen `tokens` with their logprobs (the model's raw distribution, as `sample` reports them)."""
        batch = SamplingBatch.build(requests, logits.device, None)
        raw = torch.log_softmax(logits.float(), dim=-1)
        chosen = torch.tensor(tokens, dtype=torch.long, device=logits.device)
        return self._rows_with_logprobs(raw, chosen, batch).rows()

    @staticmethod
    def reads_any_layout(requests: list[Request]) -> bool:
        """Whether this batch's logits may come vocab-major (the (rows, vocab) view of a (vocab, rows)
        array): true when every step is elementwise or a reduction along the vocabulary; sorting (top-k,
        top-p), softmaxes (min-p, logprobs) and penalties want rows contiguous."""
        for r in requests:
            p = r.sampling_params
            if p.logprobs is not None or p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 or _has_penalty(p) \
                    or p.guided_decoding is not None:  # (xgrammar's bitmask is applied to contiguous rows)
                return False
        return True

    def _float_copy(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits in float32, in a buffer kept from step to step and in the logits' own layout
        (row- or vocab-major: a transposing copy is slow). A batch's logits are tens of MB (128 rows x
        152k vocab = 78 MB), and on CPU a fresh array that size is mapped anew by malloc every step,
        its page faults costing as much as the copy."""
        rows, vocab = logits.shape
        buf = self._float_buffer
        if buf is None or buf.numel() < rows * vocab or buf.device != logits.device:
            buf = self._float_buffer = torch.empty(rows * vocab, dtype=torch.float32, device=logits.device)
        if _is_vocab_major(logits):
            return buf[: rows * vocab].view(vocab, rows).copy_(logits.T).T
        return buf[: rows * vocab].view(rows, vocab).copy_(logits)

    # -- logits processing -------------------------------------------------------------------
    @staticmethod
    def _min_tokens_bans(requests: list[Request]) -> list[tuple[int, list[int]]]:
        """(row, token ids) that min_tokens forbids this step: eos and stop tokens, before enough output."""
        bans = []
        for i, r in enumerate(requests):
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                banned = list(r.eos_token_ids | set(p.stop_token_ids))
                if banned:
                    bans.append((i, banned))
        return bans

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: list[Request], batch: SamplingBatch) -> torch.Tensor:
        if not any(map(_has_penalty, batch.params)):
            return logits
        rows, vocab = logits.shape
        device = logits.device
        # Every row's output and prompt tokens as one flat (row, token) index each: one copy to the device
        # and one scatter for the whole batch, however many requests.
        out_rows, out_ids = _flat_index([(i, r.output_token_ids) for i, r in enumerate(requests)], device,
                                        empty=True)
        out_counts = torch.zeros((rows, vocab), device=device)
        out_counts.index_put_((out_rows, out_ids), torch.ones(len(out_ids), device=device), accumulate=True)
        seen = out_counts > 0
        seen[_flat_index([(i, r.prompt_token_ids) for i, r in enumerate(requests)], device, empty=True)] = True
        rep, pres, freq = batch.repetition_penalty, batch.presence_penalty, batch.frequency_penalty
        # Repetition penalty (prompt and output tokens): shrink positive logits, grow negative ones. A token
        # masked out (-inf: a structured output's grammar, a ban) stays masked whatever the penalty, and an
        # extreme penalty (5e-324 is 0 in float32) saturates at the largest float instead of giving inf or nan:
        # a penalty can reorder the allowed tokens, never allow a masked one or empty the row.
        finite_max = torch.finfo(logits.dtype).max
        penalised = torch.where(logits > 0, logits / rep, logits * rep).nan_to_num_(
            nan=0.0, posinf=finite_max, neginf=-finite_max)
        logits = torch.where(seen & (logits > _NEG_INF), penalised, logits)
        # OpenAI presence / frequency penalties (output tokens only).
        logits = logits - freq * out_counts - pres * (out_counts > 0).float()
        return logits

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, bans: list[tuple[int, list[int]]]) -> torch.Tensor:
        params = batch.params
        if any(not p.greedy and p.temperature != 1.0 for p in params):
            logits = logits.div_(batch.temperature)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        candidates, mass_scale = None, None  # (rows, K) token ids, when every row samples among its top K
        num_candidates = _candidate_count(top_k, top_p, logits.shape[-1])
        if num_candidates:
            # torch.topk, then everything on (rows, K): sorting the whole vocabulary instead takes
            # ~20x longer (64 x 152k: 1.1 s against 58 ms for k = 50 on this CPU).
            values, ids = logits.topk(num_candidates, dim=-1)
            mass_scale = _nucleus_coverage(logits, values, top_k, batch.top_k, batch.top_p)
            if mass_scale is not None:
                logits, candidates = values, ids
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, batch.top_k, batch.top_p, mass_scale)
        if candidates is not None or any(p.min_p > 0.0 for p in params):
            probs = torch.softmax(logits, dim=-1)
            threshold = batch.min_p * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
            if candidates is not None:
                # Candidates back in vocabulary order: the inverse CDF then walks the kept tokens in the
                # same order as over the whole vocabulary, so a seeded row draws the same token whether
                # its batch took this path or the full one.
                candidates, order = candidates.sort(dim=-1)
                probs = probs.gather(1, order)
        else:
            # sample_from_probs needs only relative masses: exp(logit - max) in place, no softmax division.
            # exp is ~10-20x slower on -inf and on inputs whose result is subnormal, so logits more than
            # 80 below the max are raised to -80: a mass of 2e-35 each, far below what a draw resolves.
            # min_tokens' banned tokens then get exactly 0 again.
            row_max = _chunk_reduce(logits, torch.amax).amax(dim=-1, keepdim=True)
            probs = logits.sub_(row_max).clamp_(min=-80.0).exp_()
            ban_index = _flat_index(bans, probs.device)
            if ban_index is not None:
                probs[ban_index] = 0.0
        # Inverse-CDF sampling: one uniform number per row (cheaper on CPU than a noise value for every
        # vocabulary entry): the engine's generator's, or for a seeded row the hash of its seed and draw.
        uniform = torch.rand(len(params), dtype=torch.float64, device=logits.device, generator=self.generator)
        if batch.any_seeded:
            uniform = torch.where(batch.seeded, seeded_uniform(batch.seed, batch.draw), uniform)
        tokens = sample_from_probs(probs, uniform)
        return tokens if candidates is None else candidates.gather(1, tokens[:, None]).squeeze(1)

    # -- logprobs -----------------------------------------------------------------------------
    @staticmethod
    def _rows_with_logprobs(raw_logprobs: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> PendingRows:
        """Tokens, their logprobs and ranks, and each row's top-N, read back in one copy."""
        chosen = raw_logprobs.gather(1, tokens[:, None])  # (rows, 1)
        ranks = (raw_logprobs > chosen).sum(dim=-1, keepdim=True) + 1
        parts = [tokens[:, None].double(), chosen.double(), ranks.double()]
        n_top = batch.max_logprobs
        if n_top > 0:
            top_lp, top_ids = raw_logprobs.topk(n_top, dim=-1)
            parts += [top_ids.double(), top_lp.double()]  # ids < 2^53: exact in float64
        params = batch.params

        def build(host: list[list[float]]) -> list[SampledRow]:
            rows = []
            for values, p in zip(host, params):
                row = SampledRow(int(values[0]))
                if p.logprobs is not None:
                    n = p.logprobs
                    row.logprob, row.rank = values[1], int(values[2])
                    row.top_ids = [int(t) for t in values[3:3 + n]]
                    row.top_logprobs = values[3 + n_top:3 + n_top + n]
                rows.append(row)
            return rows

        return PendingRows(torch.cat(parts, dim=1), build)


_MASK64 = (1 << 64) - 1


def _seed_bits(seed: int | None) -> int:
    """A request's seed as a signed 64-bit value (any Python int: its low 64 bits)."""
    if seed is None:
        return 0
    bits = seed & _MASK64
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def _int64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


# splitmix64's constants (Steele, Lea, Flood 2014), as signed 64-bit values.
_GOLDEN, _MIX1, _MIX2 = _int64(0x9E3779B97F4A7C15), _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 values (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def seeded_uniform(seed: torch.Tensor, draw: torch.Tensor) -> torch.Tensor:
    """A uniform number in [0, 1) (float64, 53 random bits) for each (seed, draw) pair: splitmix64's
    output for the state seed + (draw + 1) * golden ratio, in int64 tensor ops (multiplications wrap
    modulo 2^64 on CPU and GPU alike). A counter-based generator: a seeded request's draws need no
    state kept between steps, and the whole batch's are a handful of element-wise ops."""
    x = seed + (draw + 1) * _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    return _shift_right(x, 11).double() * 2.0 ** -53


def _flat_index(row_tokens: list[tuple[int, list[int]]], device: torch.device,
                empty: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row ids, token ids) of (row, tokens) pairs as two index tensors, built on the host and copied
    once; None (or, with `empty`, two empty tensors) when there are none."""
    rows = [i for i, tokens in row_tokens for _ in tokens]
    if not rows and not empty:
        return None
    flat = torch.tensor([rows, [t for _, tokens in row_tokens for t in tokens]], dtype=torch.long)
    flat = flat.view(2, -1).to(device)
    return flat[0], flat[1]


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 mass_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus. Keeps at least one.

    mass_scale (rows, 1), for logits that are only a row's best candidates: the share of the row's
    whole probability mass those candidates hold (1 where top-k already renormalises to them), so
    a top-p without a top-k measures its nucleus against the whole vocabulary."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, vocab)  # (rows,)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    remove = rank >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, _NEG_INF)
    p = top_p  # (rows, 1)
    probs = torch.softmax(sorted_logits, dim=-1)
    if mass_scale is not None:
        probs = probs * mass_scale
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of strictly better tokens
    remove = remove | ((mass_before >= p) & (p < 1.0))  # p == 1: float cumsum may hit 1 early
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


_CHUNK = 1024
_CANDIDATE_TOP_K = 1024  # a top-k up to this, or a nucleus inside this many tokens, is sampled among torch.topk's candidates


def _candidate_count(top_k: list[int], top_p: list[float], vocab: int) -> int:
    """How many of each row's best tokens to draw from (0: the whole vocabulary is needed). Every row
    needs a top-k <= _CANDIDATE_TOP_K, or no top-k and a top-p < 1 (a nucleus that, as is usual for
    a trained model, fits in the _CANDIDATE_TOP_K best tokens: _nucleus_coverage checks)."""
    if not all(0 < k <= _CANDIDATE_TOP_K or (k <= 0 and p < 1.0) for k, p in zip(top_k, top_p)):
        return 0
    if all(k > 0 for k in top_k):
        return min(max(top_k), vocab)
    return min(_CANDIDATE_TOP_K, vocab)


def _nucleus_coverage(logits: torch.Tensor, best: torch.Tensor, top_k: list[int],
                      top_k_rows: torch.Tensor, top_p_rows: torch.Tensor) -> torch.Tensor | None:
    """(rows, 1) share of each row's probability mass held by its candidates `best` (the row's
    largest logits, sorted), 1 for rows whose top-k renormalises to them; None when some row's top-p
    nucleus reaches past them (then only the whole sorted vocabulary will do). top_k: the host's list
    (which rows have a top-k); top_k_rows (rows,), top_p_rows (rows, 1): the same on the device.

    Deciding between the two paths reads one flag back from the device: the only read besides the
    step's results, and only in batches with a top-p and no top-k."""
    scale = torch.ones(len(top_k), 1, dtype=logits.dtype, device=logits.device)
    if all(k > 0 for k in top_k) or best.shape[-1] == logits.shape[-1]:
        return scale  # top-k renormalises every row, or the candidates are the whole vocabulary
    row_max = best[:, :1]
    # exp(l - max) summed, inputs clamped at -80 as in _sample (exp is slow on -inf and subnormals).
    total = (logits - row_max).clamp_(min=-80.0).exp_().sum(dim=-1, keepdim=True)
    held = (best - row_max).exp_().sum(dim=-1, keepdim=True) / total
    nucleus = (top_k_rows <= 0)[:, None]
    if not bool(((held > top_p_rows) | ~nucleus).all()):
        return None
    return torch.where(nucleus, held, scale)


def _is_vocab_major(x: torch.Tensor) -> bool:
    """A (rows, vocab) tensor that is the transposed view of a contiguous (vocab, rows) array."""
    return x.shape[0] > 1 and x.stride() == (1, x.shape[0])


def _chunk_reduce(x: torch.Tensor, op) -> torch.Tensor:
    """op (torch.amax or torch.sum) over each 1024-wide chunk of every row of a (rows, vocab) tensor,
    row- or vocab-major, as (rows, chunks); the last chunk may be short. The reduction follows the
    memory layout: along a strided dimension PyTorch's CPU reductions run ~30x slower."""
    rows, vocab = x.shape
    full = vocab // _CHUNK
    if _is_vocab_major(x):
        xt = x.T  # (vocab, rows), contiguous
        parts = [op(xt[: full * _CHUNK].view(full, _CHUNK, rows), 1).T] if full else []
        if vocab % _CHUNK:
            parts.append(op(xt[full * _CHUNK:], 0, keepdim=True).T)
    else:
        parts = [op(x[:, : full * _CHUNK].reshape(rows, full, _CHUNK), -1)] if full else []
        if vocab % _CHUNK:
            parts.append(op(x[:, full * _CHUNK:], -1, keepdim=True))
    return torch.cat(parts, dim=1)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) (the first maximum of each row), for a (rows, vocab) tensor in either
    layout.

    PyTorch's CPU argmax is a scalar loop, ~2 ns per element (20 ms for 64 x 152k logits). Rows laid
    out contiguously go to cpu_kernels' one-pass argmax; otherwise amax, which is vectorised: the max
    of each 1024-wide chunk, the first chunk holding the row's max, then argmax inside that chunk alone.
    """
    rows, vocab = x.shape
    kernels = fused_kernels(x)
    if kernels is not None and x.stride(-1) == 1 and rows > 0:
        return kernels.argmax_rows(x)
    if vocab <= 4 * _CHUNK:
        return x.argmax(dim=-1)
    chunk = _chunk_reduce(x, torch.amax).argmax(dim=-1, keepdim=True)  # (rows, 1): the first chunk with the max
    index = chunk * _CHUNK + torch.arange(_CHUNK, device=x.device)[None, :]
    inside = x.gather(1, index.clamp(max=vocab - 1))
    inside = inside.masked_fill(index >= vocab, float("-inf"))  # past the end of a short last chunk
    return chunk.squeeze(1) * _CHUNK + inside.argmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row, given one uniform number in [0, 1) per row.

    Two levels, so there is no cumulative sum (nor any large temporary) over the whole vocabulary:
    pick a chunk of 1024 tokens by the chunks' masses, then a token inside it by a float64
    cumulative sum of just that chunk. Never returns a token of probability zero.
    """
    vocab = probs.shape[1]
    chunk_cdf = _chunk_reduce(probs, torch.sum).double().cumsum_(-1)  # (rows, chunks)
    total = chunk_cdf[:, -1:]
    target = uniform[:, None] * total
    last_chunk = (chunk_cdf < total).sum(-1, keepdim=True)  # the last chunk with any mass
    chunk = torch.minimum(torch.searchsorted(chunk_cdf, target, right=True), last_chunk)
    before = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp(min=0)), 0.0)
    index = chunk * _CHUNK + torch.arange(_CHUNK, device=probs.device)[None, :]  # (rows, 1024)
    inner = torch.where(index < vocab, probs.gather(1, index.clamp(max=vocab - 1)), 0.0).double().cumsum_(-1)
    last_token = (inner < inner[:, -1:]).sum(-1, keepdim=True)  # the last token with mass in the chunk
    token = torch.minimum(torch.searchsorted(inner, target - before, right=True), last_token)
    return (chunk * _CHUNK + token).squeeze(1)
