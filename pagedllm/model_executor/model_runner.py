"""ModelRunner: turns a scheduled step into tensors, runs the model once, and samples."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pagedllm.config import EngineConfig, graph_batch_sizes
from pagedllm.distributed.parallel_state import tp_group
from pagedllm.distributed.sharding import ShardLayout
from pagedllm.step_input import StepInput
from pagedllm.memory.profiler import measure_peak_bytes
from pagedllm.model_executor.attention import (
    AttentionShape,
    bind_kv_cache,
    forward_context,
    kv_cache_shape,
    select_attention_backends,
)
from pagedllm.model_executor.audio_runner import (
    audio_forward_inputs,
    decode_frames,
    profile_audio_inputs,
    profile_audio_sampling,
    sample_audio,
)
from pagedllm.model_executor.batch_invariant import make_linears_batch_invariant
from pagedllm.model_executor.cuda_graphs import (
    CudaGraphCapture,
    DecodeGraphs,
    EagerReplay,
)
from pagedllm.model_executor.kv_quant import is_fp8
from pagedllm.model_executor.loader import load_model
from pagedllm.model_executor.pooler import Pooler
from pagedllm.model_executor.request_state import RunnerRequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.model_executor.sampler import PendingRows, SampledRow, Sampler
from pagedllm.model_executor.step_buffers import StepBuffers
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.proposer import make_proposer
from pagedllm.spec_decode.verify import ACCEPT_SEED_SALT, VerifyGroup, greedy_chain, positions, sampled_chain
from pagedllm.structured_output import apply_grammar_bitmask
from pagedllm.utils import cdiv, phase

logger = logging.getLogger(__name__)


@dataclass
class PromptLogprobsChunk:
    """Logprobs of prompt tokens first_position .. first_position + len - 1 (each given its prefix)."""

    first_position: int
    token_logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, SampledRow] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # pooling requests done this step: their outputs
    # Speculative decoding: each request's drafts for its next step (the proposer's, after this step's tokens)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class RunnerFacts:
    """What the engine's memory plan and request handling need to know of a loaded runner (plain data)."""

    device: str
    weight_bytes: int  # parameters (shared ones once) and packed weights
    offloaded_weight_bytes: int  # the part of weight_bytes kept in host memory by --cpu-offload-gb
    offload_slot_bytes: int  # device memory the offloaded layers pass through
    graph_sizes: tuple[int, ...]  # decode batch sizes replayed from CUDA graphs (empty: none, or a CPU's twin)
    audio_spec: Any = None  # a multi-codebook audio model's AudioSpec; None for a text model
    draft_weight_bytes: int = 0  # speculative decoding's draft model (0: none)


class PendingOutput:
    """A launched step's results: result() waits for the sampled rows, gives each request its token and
    computes the prompt logprobs asked for."""

    def __init__(self, requests: list[RunnerRequest], sampled: PendingRows | None, prompt_spans: list,
                 pooled: dict[str, torch.Tensor] | None = None, propose=None) -> None:
        self._requests, self._sampled, self._prompt_spans = requests, sampled, prompt_spans
        self._pooled = pooled or {}
        self._propose = propose  # speculative decoding: requests -> their drafts for the next step
        self._output: ModelRunnerOutput | None = None

    @torch.inference_mode()
    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            out = ModelRunnerOutput(pooled=self._pooled)
            if self._sampled is not None:
                for req, row in zip(self._requests, self._sampled.rows()):
                    out.sampled[req.request_id] = row
                    for token in row.token_ids:
                        req.append_token(token)
                if self._propose is not None:
                    out.spec_token_ids = self._propose(self._requests)
            for req, first, compute, hidden in self._prompt_spans:
                out.prompt_logprobs[req.request_id] = compute(req, first, hidden)
            self._output = out
        return self._output


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        m = config.model  # the attention backend is chosen (or refused) before any weight is loaded
        self.tp = tp_group()
        self.shards = ShardLayout.of(m.hf_config)  # this rank's heads (all of them without tensor parallelism)
        self.kv_layout = m.kv_layout  # which layers share a block table (kv_layout.py)
        # One backend per KV group: each builds its group's step metadata (in its own persistent buffers).
        self.attn_backends = select_attention_backends(config.attention_backend, AttentionShape(
            self.device, self.shards.heads, self.shards.kv_heads, m.head_dim, m.dtype, config.kv_cache_dtype),
            config.batch_invariant, len(self.kv_layout.groups))
        self.attn_backend = self.attn_backends[0]
        self.loaded = load_model(config.model, self.device)
        self.model = self.loaded.model
        # The pooling runner's (embeddings, classifiers): requests pooled at their prompt's end, nothing sampled.
        self.pooler = None if m.pooler is None else Pooler(m.pooler, getattr(self.model, "score", None))
        if config.batch_invariant:
            make_linears_batch_invariant(self.model)
        s = config.scheduler
        max_tokens = max(s.max_num_batched_tokens, s.max_num_seqs)
        for backend in self.attn_backends:
            backend.allocate_buffers(max_tokens, s.max_num_seqs, cdiv(m.max_model_len, self.block_size), self.device)
        self.sampler = Sampler(self.device, config.model.seed, s.max_num_seqs)
        self.proposer = make_proposer(config, self)  # None: no speculative decoding
        self.draft = self.proposer if hasattr(self.proposer, "follow") else None  # a draft model, run every step
        # Multi-codebook audio models: frames in and out (audio_runner); None for text models.
        self.audio_spec = self.model.audio_spec
        # The step's token ids (and a graphed audio decode's frames) in persistent device buffers.
        inputs = {"input_ids": (max_tokens, torch.long)}
        if self.audio_spec is not None:
            inputs["audio_codes"] = (s.max_num_seqs * self.audio_spec.num_codebooks, torch.long)
        self.inputs = StepBuffers(inputs, self.device)
        self.graphs = self._decode_graphs()  # None: every step runs eagerly
        self.null_block: int | None = None  # the KV block padded graph rows write to (one past the pool)
        self.profiled_graph_bytes: int | None = None  # a decode step's peak at the largest graph size (CUDA)
        self.kv_cache: torch.Tensor | None = None
        self.requests: dict[str, RunnerRequest] = {}  # the runner's state of each request it has been sent
        self.swap_cache: torch.Tensor | None = None  # host copy of the layout for swapped-out blocks
        if is_fp8(config.kv_cache_dtype):
            self._log_kv_scales()

    # -- CUDA graphs ------------------------------------------------------------------------------
    def graphs_off_reason(self) -> str | None:
        """Why decode steps run eagerly (None: they replay CUDA graphs, or their CPU twin)."""
        if self.config.enforce_eager:
            return "--enforce-eager"
        if self.config.model.pooler is not None:
            return "the pooling runner has no decode steps"
        if not self.attn_backend.supports_graphs:
            return f"the {self.attn_backend.name} attention backend builds its inputs on the host each step"
        if self.loaded.offloads:
            return "--cpu-offload-gb copies layers in on a side stream"
        if self.config.draft_model is not None:
            return "the speculative draft model runs beside every step"
        return None

    def _decode_graphs(self) -> DecodeGraphs | None:
        reason = self.graphs_off_reason()
        if reason is not None:
            if self.device.type == "cuda":
                logger.info("CUDA graphs off (%s): every step is launched kernel by kernel", reason)
            return None
        sizes = graph_batch_sizes(self.config.scheduler.max_num_seqs, self.config.cuda_graph_sizes)
        capture = CudaGraphCapture(self.device) if self.device.type == "cuda" else EagerReplay()
        return DecodeGraphs(sizes, capture, self._graph_step, self._fill_padding)

    def _graph_step(self, batch_size: int):
        """What the graph of `batch_size` one-token sequences records: the model's forward over the
        persistent inputs (logits and sampling stay outside: they differ by request)."""
        metas = [backend.graph_metadata(batch_size, self.block_size) for backend in self.attn_backends]
        ids = self.inputs.device["input_ids"][:batch_size]
        extra = {}
        if self.audio_spec is not None:  # frames in: every row of a graphed audio decode is audio
            k = self.audio_spec.num_codebooks
            extra = {"audio_codes": self.inputs.device["audio_codes"][:batch_size * k].view(batch_size, k),
                     "all_audio": True}

        def forward() -> torch.Tensor:
            with forward_context(metas):
                return self.model(ids, metas[0].positions, **extra)

        return forward

    def _fill_padding(self, batch_size: int) -> None:
        """The persistent inputs of a step of padding rows only (captures run it: their K/V go to the null block)."""
        self._fill_graph_inputs(batch_size, [], [], [], [])

    def _fill_graph_inputs(self, batch_size: int, starts: list[int], tables: list[list[list[int]]],
                           input_ids: list[int], frames: list) -> None:
        pad = batch_size - len(starts)
        for g, backend in enumerate(self.attn_backends):
            backend.build_metadata(starts + [0] * pad, [1] * batch_size,
                                   [t[g] for t in tables] + [[self.null_block]] * pad, self.block_size, self.device)
        inputs = {"input_ids": torch.tensor(input_ids + [0] * pad, dtype=torch.long)}
        if self.audio_spec is not None:
            k = self.audio_spec.num_codebooks
            inputs["audio_codes"] = torch.tensor([list(f) for f in frames] + [[0] * k] * pad,
                                                 dtype=torch.long).view(-1)
        self.inputs.load_all(inputs)

    def capture_graphs(self) -> None:
        """Capture every decode size now (on a GPU; the CPU twin captures each size when first used).
        Needs the KV cache: graphs record its addresses."""
        if self.graphs is None or self.graphs.capturer.lazy:
            return
        with torch.inference_mode():
            self.graphs.capture_all(self.device)
        g = self.graphs
        logger.info("CUDA graphs: %d decode batch sizes (%s) captured in %.1f s; graph pool %.1f MiB", len(g.sizes),
                    _sizes_text(g.sizes), g.capture_seconds, (g.pool_bytes or 0) / 2**20)

    def _graph_batch_size(self, step: StepInput, reqs: list[RunnerRequest]) -> int | None:
        """The graph size a step replays, or None (a prefill or mixed step, one too large, graphs off)."""
        if self.graphs is None or any(s.num_new_tokens != 1 for s in step.scheduled):
            return None
        return self.graphs.batch_size_for(len(step.scheduled))

    def _log_kv_scales(self) -> None:
        scales = {(a.k_scale, a.v_scale) for a in self.model.attention_layers()}
        source = "1.0 (the checkpoint has no k_scale/v_scale)" if scales == {(1.0, 1.0)} else "from the checkpoint"
        logger.info("KV cache stored as %s, per-layer k/v scales %s", self.config.kv_cache_dtype, source)

    def facts(self) -> RunnerFacts:
        graphs = self.graphs if self.graphs is not None and self.device.type == "cuda" else None
        return RunnerFacts(str(self.device), self.weight_bytes, self.offloaded_weight_bytes, self.offload_slot_bytes,
                           graphs.sizes if graphs is not None else (), self.audio_spec,
                           self.draft.weight_bytes if self.draft is not None else 0)

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights: parameters (shared ones once) plus those packed for the CPU kernels or oneDNN."""
        return self.loaded.weight_bytes

    @property
    def offloaded_weight_bytes(self) -> int:
        """The part of weight_bytes kept in host memory by --cpu-offload-gb."""
        return sum(offload.num_bytes for offload in self.loaded.offloads)

    @property
    def offload_slot_bytes(self) -> int:
        """Device memory the offloaded layers pass through (--cpu-offload-gb)."""
        offloader = self.loaded.offloader
        return 0 if offloader is None else offloader.slot_bytes

    def allocate_kv_cache(self, num_blocks: int, config: EngineConfig | None = None) -> None:
        """One tensor for every layer's K and V (kv_cache_shape); each attention layer gets views of its slice.
        With CUDA graphs, one block more: the null block padded rows write to (the block manager's pool is
        blocks 0 .. num_blocks - 1). `config`: the engine's, as the memory plan settled it (max_model_len auto),
        which this runner runs with from now on; None keeps the one it was built with (the profile run's)."""
        if config is not None:
            self.config = replace(config, device=self.config.device)  # a worker keeps its rank's device
        m = self.config.model
        self.null_block = num_blocks if self.graphs is not None else None
        total = num_blocks + (self.graphs is not None)
        shape = kv_cache_shape(self.kv_layout.num_slots, self.shards.kv_heads, total * self.block_size, m.head_dim)
        # Zeros, not empty: padded key positions (and a window group's NULL_BLOCK, read below its window) are
        # multiplied by 0 attention, and 0 * NaN is NaN.
        self.kv_cache = torch.zeros(shape, dtype=self.config.kv_cache_dtype, device=self.device)
        bind_kv_cache(self.model.attention_layers(), self.kv_cache, self.kv_layout)
        if self.draft is not None:  # the draft's K/V of the same blocks
            self.draft.allocate_kv_cache(total)

    def kv_cache_blocks(self) -> int:
        """Blocks the KV cache holds (without the CUDA graphs' null block); 0 when not allocated."""
        if self.kv_cache is None:
            return 0
        return self.kv_cache.shape[3] // self.block_size - (self.null_block is not None)

    # -- swap space ---------------------------------------------------------------------------------
    def _block_view(self, cache: torch.Tensor) -> torch.Tensor:
        """A KV tensor as raw bytes, (layers, 2, kv_heads, blocks, bytes of one block of one head): one
        copy kernel for every cache dtype (fp8 has no index_copy_ of its own)."""
        layers, kv, heads, slots = cache.shape[:4]
        return cache.view(torch.uint8).view(layers, kv, heads, slots // self.block_size, -1)

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block, every layer's K and V, as the device KV cache is allocated (its dtype
        and layout, whatever --kv-cache-dtype made them)."""
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is not allocated yet")
        layers, kv, heads, _, block = self._block_view(self.kv_cache).shape
        return layers * kv * heads * block

    def allocate_swap_space(self, num_blocks: int) -> None:
        """Host memory for `num_blocks` swapped-out blocks, in the device cache's per-layer layout and
        dtype; pinned on CUDA so the copies run at full PCIe speed."""
        if num_blocks < 1:
            self.swap_cache = None
            return
        shape = (*self.kv_cache.shape[:3], num_blocks * self.block_size, self.kv_cache.shape[4])
        # Empty, not zeros: a host block is read only after a swap-out wrote all of it (whole blocks move), and
        # untouched pages cost neither the start (4 GiB of zeros took seconds) nor memory until they are used.
        self.swap_cache = torch.empty(shape, dtype=self.kv_cache.dtype, device="cpu",
                                      pin_memory=self.device.type == "cuda")

    @torch.inference_mode()
    def swap_blocks(self, step: StepInput) -> None:
        """The step's block copies, every layer's K and V in one gather and one scatter per direction.
        Swap-outs run first: this step's forward (or swap-ins) may write the device blocks they free."""
        if step.blocks_to_swap_out:
            src, dst = self._copy_ids(step.blocks_to_swap_out)
            host, dev = self._block_view(self.swap_cache), self._block_view(self.kv_cache)
            host.index_copy_(3, dst, dev.index_select(3, src.to(self.device)).cpu())
        if step.blocks_to_swap_in:
            src, dst = self._copy_ids(step.blocks_to_swap_in)
            host, dev = self._block_view(self.swap_cache), self._block_view(self.kv_cache)
            dev.index_copy_(3, dst.to(self.device), host.index_select(3, src).to(self.device))

    @staticmethod
    def _copy_ids(copies: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        src, dst = zip(*copies)
        return torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)

    def update_states(self, step: StepInput) -> None:
        """Drop the state of requests finished since the last step; make it for those new to the runner."""
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in step.new_requests:
            self.requests[new.request_id] = RunnerRequest.from_new(new)

    def execute(self, step: StepInput) -> ModelRunnerOutput:
        """Run the step and wait for its results."""
        return self.execute_async(step).result()

    @torch.inference_mode()
    def execute_async(self, step: StepInput) -> PendingOutput:
        """Launch the step: the forward and the sampling are queued on the device and the copy of the sampled
        rows to the host started. The returned PendingOutput's result() waits for them; it must be called
        before the next step is launched (that step's inputs are this one's tokens)."""
        self.update_states(step)
        self.swap_blocks(step)  # before the forward, which may write blocks swapped out this step
        if not step.scheduled:
            return PendingOutput([], None, [])
        reqs = [self.requests[s.request_id] for s in step.scheduled]
        starts, lengths, tables, input_ids = [], [], [], []
        for s, req in zip(step.scheduled, reqs):
            c = s.num_computed_tokens
            starts.append(c)
            lengths.append(s.num_new_tokens)
            tables.append(s.block_tables)
            input_ids.extend(req.all_token_ids[c:c + s.num_new_tokens - len(s.spec_token_ids)])
            input_ids.extend(s.spec_token_ids)  # drafts: checked by this forward
        with phase("forward"):
            hidden = self._forward(step, reqs, starts, lengths, tables, input_ids)  # (tokens, hidden)
        if self.draft is not None:
            with phase("draft"):
                self.draft.follow(starts, lengths, [t[0] for t in tables], input_ids)
        if self.pooler is not None:
            with phase("pool"):
                return PendingOutput([], None, [], self._pool(step, reqs, starts, lengths, hidden))
        with phase("sample"):
            return self._launch_sampling(step, reqs, starts, lengths, hidden)

    def _pool(self, step: StepInput, reqs: list[RunnerRequest], starts: list[int], lengths: list[int],
              hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each request's states into its pool; the outputs of those whose prompt ended this step."""
        done, pooled, offset = [], [], 0
        for s, req, c, n in zip(step.scheduled, reqs, starts, lengths):
            rows = hidden[offset:offset + n]
            self.pooler.add(req.pooling, c, rows)
            if s.samples:
                done.append(req)
                pooled.append(self.pooler.pooled(req.pooling, rows[-1]))
            offset += n
        if not done:
            return {}
        outputs = self.pooler.outputs(torch.stack(pooled), [req.pooling_params for req in done])
        return {req.request_id: out for req, out in zip(done, outputs)}

    def _launch_sampling(self, step: StepInput, reqs: list[RunnerRequest], starts: list[int], lengths: list[int],
                         hidden: torch.Tensor) -> PendingOutput:
        # Rows whose logits we need: each sampling request's last token (and its drafts'), then prompt-logprob rows.
        sample_rows, sample_reqs, row_views, groups, prompt_spans = [], [], [], [], []
        offset = 0
        for s, req, c, n in zip(step.scheduled, reqs, starts, lengths):
            if s.samples:
                k = len(s.spec_token_ids)
                groups.append(VerifyGroup(req, len(sample_rows), s.spec_token_ids))
                sample_rows.extend(range(offset + n - k - 1, offset + n))
                sample_reqs.append(req)
                row_views.extend(positions(req, s.spec_token_ids))
            if req.wants_prompt_logprobs and c < req.num_prompt_tokens - 1:
                end = min(c + n, req.num_prompt_tokens - 1)  # positions that predict a prompt token
                prompt_spans.append((req, c, hidden[offset:offset + end - c]))
            offset += n
        sampled = None
        if sample_rows:
            rows = hidden if len(sample_rows) == len(hidden) else hidden[torch.tensor(sample_rows, device=self.device)]
            logits = self.compute_logits(rows, self.audio_spec is None and self.sampler.reads_any_layout(sample_reqs))
            if logits is None:  # a tensor-parallel worker: rank 0 samples
                return PendingOutput(sample_reqs, None, [(req, first, self._prompt_logprobs, h)
                                                         for req, first, h in prompt_spans])
            if step.grammar_bitmask is not None:  # structured outputs: the engine filled it for these rows
                apply_grammar_bitmask(logits, step.grammar_bitmask)
            if self.audio_spec is not None:
                sampled = PendingRows.ready(self._sample_audio(logits, sample_reqs))
            elif len(row_views) > len(groups):  # some request checks drafts
                sampled = PendingRows.ready(self._verify(logits, groups, row_views))
            else:
                sampled = self.sampler.sample(logits, sample_reqs)
        propose = None
        if self.proposer is not None:
            step_tables = {s.request_id: s.block_tables[0] for s in step.scheduled}
            propose = lambda requests: self.proposer.propose(requests, step_tables,  # noqa: E731
                                                             step.num_drafts_wanted)
        return PendingOutput(sample_reqs, sampled, [(req, first, self._prompt_logprobs, h)
                                                    for req, first, h in prompt_spans], propose=propose)

    def _verify(self, logits: torch.Tensor, groups: list[VerifyGroup], views: list) -> list[SampledRow]:
        """Each request's tokens of a step that checks drafts (spec_decode/verify.py): the kept drafts (as the
        returned row's `accepted`) and the token the target chose after them."""
        pending = self.sampler.sample(logits, views)  # greedy rows' choices; rows without drafts: their draws
        sampled = [g for g in groups if g.drafts and not g.request.sampling_params.greedy]
        if sampled:
            index = [g.first_row + j for g in sampled for j in range(g.num_rows)]
            sub = [views[i] for i in index]
            probs = self.sampler.probs(logits[torch.tensor(index, device=logits.device)], sub)
            accept_u, draw_u = self.sampler.uniforms(sub, ACCEPT_SEED_SALT), self.sampler.uniforms(sub)
        rows, out, at = pending.rows(), [], 0
        for g in groups:
            if not g.drafts:
                out.append(rows[g.first_row])
                continue
            span = slice(g.first_row, g.first_row + g.num_rows)
            if g.request.sampling_params.greedy:
                chain = greedy_chain(g.drafts, [r.token_id for r in rows[span]])
            else:
                mine = slice(at, at + g.num_rows)
                q = g.request.draft_probs  # the draft model's distributions (None: n-gram drafts, certain)
                chain = sampled_chain(probs[mine], g.drafts, accept_u[mine], draw_u[mine],
                                      None if q is None else q[:len(g.drafts)])
                at += g.num_rows
            if g.request.sampling_params.logprobs is not None:
                chain_rows = self.sampler.logprob_rows(logits[g.first_row:g.first_row + len(chain)], chain,
                                                       views[g.first_row:g.first_row + len(chain)])
            else:
                chain_rows = [SampledRow(t) for t in chain]
            last = chain_rows[-1]
            last.accepted = chain_rows[:-1]
            out.append(last)
        return out

    def compute_logits(self, hidden: torch.Tensor, vocab_major: bool = False) -> torch.Tensor | None:
        """The model's logits of `hidden`'s rows. Under tensor parallelism each rank computes its vocabulary
        rows and rank 0 gathers them (the others get None); `vocab_major` then does not apply."""
        if self.tp.size == 1:
            return self.model.compute_logits(hidden, vocab_major=True) if vocab_major else \
                self.model.compute_logits(hidden)
        if not self.model.logits_split_by_vocab:  # a replicated head: rank 0's are whole
            logits = self.model.compute_logits(hidden)
            return logits if self.tp.is_driver else None
        logits = self.tp.gather_last_dim(self.model.compute_logits(hidden))
        return None if logits is None else logits[..., :self.config.model.vocab_size]

    def _forward(self, step: StepInput, reqs: list[RunnerRequest], starts: list[int], lengths: list[int],
                 tables: list[list[list[int]]], input_ids: list[int]) -> torch.Tensor:
        """The model's hidden states of the step's tokens: a decode step replays its CUDA graph (its rows
        past len(reqs) are padding), any other runs eagerly."""
        batch_size = self._graph_batch_size(step, reqs)
        frames = None
        if batch_size is not None and self.audio_spec is not None:
            frames = decode_frames(reqs, starts)  # None where some row is text: that step runs eagerly
            batch_size = None if frames is None else batch_size
        if batch_size is not None:
            graph = self.graphs.get(batch_size)  # (the CPU twin captures here, on first use)
            self._fill_graph_inputs(batch_size, starts, tables, input_ids, frames or [])
            graph.replay()
            return graph.output[:len(reqs)]
        metas = [backend.build_metadata(starts, lengths, [t[g] for t in tables], self.block_size, self.device)
                 for g, backend in enumerate(self.attn_backends)]
        ids = self.inputs.load_all({"input_ids": torch.tensor(input_ids, dtype=torch.long)})["input_ids"]
        audio = {} if self.audio_spec is None else audio_forward_inputs(
            reqs, starts, lengths, self.audio_spec.num_codebooks, self.device)
        with forward_context(metas):
            return self.model(ids, metas[0].positions, **audio)

    def _sample_audio(self, logits: torch.Tensor, requests: list[RunnerRequest]) -> list[SampledRow]:
        """Audio frames; unseeded requests draw from the engine's seeded generator, as text ones do."""
        return sample_audio(logits, requests, self.sampler.generator)

    def _prompt_logprobs(self, req, first: int, hidden: torch.Tensor) -> PromptLogprobsChunk | None:
        logits = self.compute_logits(hidden)
        if logits is None:  # a tensor-parallel worker
            return None
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(req.prompt_token_ids[first + 1:first + 1 + len(hidden)], device=self.device)
        chosen = logprobs.gather(1, targets[:, None])
        ranks = (logprobs > chosen).sum(-1) + 1
        n = req.sampling_params.prompt_logprobs
        top_lp, top_ids = logprobs.topk(n, dim=-1) if n else (torch.empty(len(hidden), 0),) * 2
        return PromptLogprobsChunk(first + 1, chosen.squeeze(1).tolist(), ranks.tolist(),
                                   top_ids.long().tolist(), top_lp.tolist())

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_num_seqs: int, max_model_len: int) -> int | None:
        """Measure the activation peak of the heaviest step: `num_tokens` prompt tokens in one forward,
        then logits and sampling for up to `max_num_seqs` rows. None where it can't be measured."""
        lengths, left = [], num_tokens
        while left > 0 and len(lengths) < max_num_seqs:
            lengths.append(min(left, max_model_len))
            left -= lengths[-1]
        tables, next_block = [], 0
        for n in lengths:
            count = cdiv(n, self.block_size)
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        self.allocate_kv_cache(next_block)  # scratch cache, outside the measurement
        rows = min(max_num_seqs, sum(lengths))
        fake = [RunnerRequest(f"profile-{i}", [0], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=1),
                              all_token_ids=[0]) for i in range(rows)]
        ids = torch.randint(0, self.config.model.vocab_size, (sum(lengths),), device=self.device)
        spec = self.audio_spec
        audio = {} if spec is None else profile_audio_inputs(sum(lengths), spec, self.device)

        def step() -> None:
            metas = [backend.build_metadata([0] * len(lengths), lengths, tables, self.block_size, self.device)
                     for backend in self.attn_backends]  # (every group writes the scratch blocks: they are scratch)
            with forward_context(metas):
                hidden = self.model(ids, metas[0].positions, **audio)
            if self.pooler is not None:  # a pooling step's end: every row pooled
                self.pooler.outputs(hidden[:rows], [PoolingParams(self.pooler.config.task)] * rows)
                return
            logits = self.compute_logits(hidden[:rows])
            if logits is None:  # a tensor-parallel worker: rank 0 samples
                return
            if spec is None:
                self.sampler(logits, fake)
            else:
                profile_audio_sampling(logits, spec, torch.Generator(self.device))  # not the engine's draws

        def decode_step(n: int) -> None:
            """`n` one-token sequences: loads the kernels decode steps of that size use (cuBLAS picks them by
            row count), outside the measured peak, so that the runtime overhead measured next has them."""
            metas = [backend.build_metadata([0] * n, [1] * n, [[0]] * n, self.block_size, self.device)
                     for backend in self.attn_backends]
            with forward_context(metas):
                hidden = self.model(ids[:n], metas[0].positions, **({} if spec is None else
                                    profile_audio_inputs(n, spec, self.device)))
            logits = self.compute_logits(hidden)
            if spec is None and logits is not None:
                self.sampler(logits, fake[:n])

        # Every power of two up to `rows` on a GPU (kernels load lazily there); one size on a CPU.
        decode_sizes = sorted({rows, *(1 << k for k in range(rows.bit_length()) if 1 << k < rows)}) \
            if self.device.type == "cuda" else [rows]
        if self.pooler is not None:
            decode_sizes = []  # (a pooling runner never decodes)
        try:
            peak = measure_peak_bytes(step, self.device)
            for n in decode_sizes:
                decode_step(n)
            if self.graphs is not None and self.device.type == "cuda":
                # What the CUDA graphs will keep: a decode forward of the largest size, as they record it.
                self._fill_padding(self.graphs.max_batch_size)
                self.profiled_graph_bytes = measure_peak_bytes(self._graph_step(self.graphs.max_batch_size),
                                                               self.device)
            return peak
        finally:
            self.release_kv_cache()

    def release_kv_cache(self) -> None:
        self.null_block = None
        self.kv_cache = None
        bind_kv_cache(self.model.attention_layers(), None, self.kv_layout)
        if self.draft is not None:
            self.draft.release_kv_cache()


def _sizes_text(sizes: tuple[int, ...]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{', '.join(map(str, sizes[:4]))}, ..., {sizes[-1]}"
