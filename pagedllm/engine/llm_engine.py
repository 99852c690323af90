"""LLMEngine: add requests, step (schedule -> execute -> update), collect outputs."""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.audio_inputs import AudioGeneration
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.kv_cache_manager import KVCacheManager, PrefixCacheStats, SwapStats
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request import RequestStatus
from pagedllm.engine.scheduler import PreemptionStats, Scheduler
from pagedllm.engine.stats import EngineStats, KVCacheUsage, RequestBlocks
from pagedllm.errors import KVCacheMemoryError
from pagedllm.memory.device import DeviceMemory, device_memory, host_memory
from pagedllm.memory.facts import device_facts, measured_model_facts, settings_from, with_measured_offload_cost
from pagedllm.memory.model_size import estimate_activation_bytes
from pagedllm.memory.plan import ComponentMemory, MemoryPlan, kv_allocation_failure
from pagedllm.memory.profiler import runtime_overhead_bytes
from pagedllm.executor import Executor, make_executor
from pagedllm.model_executor.model_runner import ModelRunnerOutput
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.policy import SpecDecodeStats, SpeculationPolicy
from pagedllm.structured_output import GrammarCompiler, StructuredOutputManager
from pagedllm.utils import phase

logger = logging.getLogger(__name__)

class PlannedComponent(Protocol):
    """A model beside the engine's own on its device (a speech model's audio tokenizer), loaded at start-up after
    the engine has measured itself (weights, activation peak, runtime overhead: none of them include it) and
    before the KV cache is sized from the plan (its memory is taken from the KV cache's budget). The plan shows
    each of its parts on its own line."""

    def load(self, config: EngineConfig, plan: MemoryPlan) -> list[ComponentMemory]:
        """Load it; the memory to plan for it, given the engine's plan without it."""


class LLMEngine:
    """Start-up, in phases: load the model (the executor's runners), profile and plan the memory, load the
    planned components, allocate the KV cache, capture CUDA graphs, allocate the swap space."""

    def __init__(self, config: EngineConfig, tokenizer=None, components: Sequence[PlannedComponent] = ()) -> None:
        self.tokenizer = tokenizer
        self.components = tuple(components)
        at_start = device_memory(config.device)  # what others use, measured before we load anything
        tp = config.parallel.tensor_parallel_size
        if tp > 1 and at_start.device == "cpu":  # every rank's weights and KV cache are in this one memory
            at_start = replace(at_start, total_bytes=at_start.total_bytes // tp,
                               used_by_others_bytes=at_start.used_by_others_bytes // tp)
        if at_start.unified and config.model.cpu_offload_bytes:
            raise ValueError(
                f"--cpu-offload-gb has nothing to do on {at_start.name or 'this GPU'}: its memory is unified with "
                f"the host's, so offloaded weights would stay in the same memory. Remove --cpu-offload-gb; to make "
                f"the weights smaller, use --quantization int8.")
        self.executor: Executor = make_executor(config)
        # Dropping the last reference to the engine stops its workers and leaves the process group, so the
        # next engine in this process can start (LLM.shutdown() or a `with` block does it at a known point).
        self.structured_outputs = StructuredOutputManager(tokenizer, config.model.vocab_size, config.structured_outputs)
        self._finalizer = weakref.finalize(self, _shut_down, self.executor, self.structured_outputs)
        try:
            self._set_up(config, at_start)
        except BaseException:
            self.shutdown()
            raise

    def _set_up(self, config: EngineConfig, at_start: DeviceMemory) -> None:
        self.memory_plan = self._plan_components(config, self._plan_memory(config, at_start))
        self.memory_plan.check()
        if config.model.max_model_len_auto:
            config = replace(config, model=replace(config.model, max_model_len=self.memory_plan.max_model_len))
            logger.info("max_model_len auto: %d tokens fit", config.model.max_model_len)
        self.config = config  # the runners run with it from the allocation on
        logger.info("memory plan:\n%s", self.memory_plan.table())
        self._allocate_kv_cache()
        self._capture_graphs()
        self.num_swap_blocks = self._allocate_swap_space(config.cache.swap_space_bytes)
        self.kv_cache = KVCacheManager(self.memory_plan.num_blocks, config.cache.block_size,
                                       enable_caching=config.cache.enable_prefix_caching,
                                       num_swap_blocks=self.num_swap_blocks, layout=config.model.kv_layout)
        # Speculative decoding's per-step rule (None: no speculation)
        self.speculation = None if config.speculative is None else SpeculationPolicy(config.speculative)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.speculation)
        # Audio models (None for text ones): how prompts carry audio and requests sample frames.
        self.audio = AudioGeneration.for_model(self.runner_facts.audio_spec, config.model.path,
                                               config.model.repetition_aware_sampling)
        self.inputs = InputProcessor(config, self.tokenizer, self.audio, self.structured_outputs)
        self.outputs = OutputProcessor(self.tokenizer, self.audio, self.scheduler.finish_request)
        self._ids = itertools.count()
        self.last_step_num_requests = 0
        self._deferred: ModelRunnerOutput | None = None  # a step whose outputs are made during the next one

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (nothing to do on one device); safe to
        call twice. The engine is unusable after."""
        self._finalizer()

    # -- set-up -----------------------------------------------------------------------------
    def _plan_memory(self, config: EngineConfig, at_start: DeviceMemory) -> MemoryPlan:
        """The plan from measured numbers: weights after load, overhead, a profiled activation peak."""
        settings = settings_from(config)
        if config.model.max_model_len_auto:
            settings = replace(settings, max_model_len=None)
        facts = self.runner_facts = self.executor.runner_facts()
        device = torch.device(facts.device)
        settings = replace(settings, cuda_graph_sizes=facts.graph_sizes)  # what the runner really captures
        if facts.draft_weight_bytes:  # a speculative draft model, as loaded
            settings = replace(settings, draft_weight_bytes=facts.draft_weight_bytes)
        weights = facts.weight_bytes
        # On a CPU before the profile run (whose freed heap the resident set keeps); on a GPU after it, with
        # the kernels its steps loaded and the workspaces they made.
        resident_weights = weights - facts.offloaded_weight_bytes + facts.offload_slot_bytes
        overhead = runtime_overhead_bytes(device, resident_weights, at_start) if device.type == "cpu" else None
        sized_by_user = config.cache.kv_cache_memory_bytes is not None or config.cache.num_gpu_blocks_override
        activation, graph_bytes, source = None, None, "measured"
        if not sized_by_user:
            peaks = self.executor.profile_run(settings.max_num_batched_tokens, settings.max_num_seqs,
                                              config.model.max_model_len)
            activation, graph_bytes = peaks.activation_bytes, peaks.graph_bytes
        if overhead is None:
            overhead = runtime_overhead_bytes(device, resident_weights, at_start)
        if activation is None:
            source = "estimated (KV cache sized by the user)" if sized_by_user else "estimated"
            activation = estimate_activation_bytes(config.model.hf_config, settings.dtype,
                                                   settings.max_num_batched_tokens, settings.max_num_seqs)
        model_facts = measured_model_facts(config.model.hf_config, config.model.model_max_len, settings, weights,
                                           activation, overhead, source, device.type, graph_bytes)
        host = host_memory() if device.type != "cpu" else None  # where a GPU's swap space goes
        # Tensor parallelism: the plan holds on every rank if it is made for the rank with the least memory.
        planned_for = self.executor.plan_device_memory(at_start)
        return with_measured_offload_cost(MemoryPlan(settings, device_facts(planned_for, host=host), model_facts))

    def _plan_components(self, config: EngineConfig, plan: MemoryPlan) -> MemoryPlan:
        """Load each planned component; the plan with their memory."""
        for component in self.components:
            parts = component.load(config, plan)
            for part in parts:
                logger.info("%s: weights %d bytes, peak %d bytes (%s)", part.name, part.weight_bytes,
                            part.activation_bytes, part.source)
            plan = replace(plan, components=plan.components + tuple(parts))
        return plan

    def _allocate_kv_cache(self) -> None:
        """The planned KV cache; a failed allocation (memory taken since it was measured) is a KVCacheMemoryError."""
        plan = self.memory_plan
        try:
            self.executor.allocate_kv_cache(plan.num_blocks, self.config)
        except torch.OutOfMemoryError as e:
            self.executor.release_kv_cache()
            raise KVCacheMemoryError(kv_allocation_failure(plan, str(e).splitlines()[0])) from None

    def _capture_graphs(self) -> None:
        """CUDA graphs of decode steps, after the KV cache (they record its addresses); what they took is
        compared with what the plan set aside for them."""
        pool_bytes, planned = self.executor.capture_graphs(), self.memory_plan.graph_pool_bytes
        if pool_bytes is None or not planned:
            return
        if pool_bytes > planned:
            logger.warning("the CUDA graphs took %.1f MiB, more than the %.1f MiB the memory plan set aside: lower "
                           "--gpu-memory-utilization if other processes need the difference, or pass --enforce-eager",
                           pool_bytes / 2**20, planned / 2**20)

    def _allocate_swap_space(self, swap_space_bytes: int) -> int:
        """Host blocks for --swap-space, sized by the bytes per block of the KV cache as allocated (its
        dtype, e.g. fp8, and layout), not by the model dtype. Returns how many."""
        if not swap_space_bytes:
            return 0
        block_bytes = self.executor.kv_block_bytes()
        num_blocks = swap_space_bytes // block_bytes
        if num_blocks < 1:  # the plan refuses this first; here in case the two ever disagree
            raise ValueError(f"--swap-space ({swap_space_bytes} bytes) is smaller than one KV block ({block_bytes} "
                             f"bytes)")
        self.executor.allocate_swap_space(num_blocks)
        logger.info("swap space: %d blocks x %d bytes in host memory", num_blocks, block_bytes)
        return num_blocks

    # -- requests -----------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> set[int]:
        return self.inputs.eos_token_ids

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A string, {"prompt": str}, {"prompt_token_ids": [...]} or a list of ids -> (text, ids)."""
        return self.inputs.tokenize_prompt(prompt)

    def apply_chat_template(self, messages: list[dict], chat_template: str | None = None,
                            add_generation_prompt: bool = True, tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """Render a conversation (and the tools it may call) with the model's (or the given) chat template ->
        (text, token ids). `template_kwargs`: more variables for the template (`enable_thinking`)."""
        return self.inputs.apply_chat_template(messages, chat_template, add_generation_prompt, tools, template_kwargs)

    def check_priority(self, priority: int) -> None:
        """Refused unless the scheduling policy is `priority` (InputProcessor.check_priority)."""
        self.inputs.check_priority(priority)

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | PoolingParams | None = None, stream: bool = False,
                    strict_length: bool = False, priority: int = 0) -> str:
        """Queue a prompt: to generate from (SamplingParams), or to pool (PoolingParams, the pooling runner's). With
        `strict_length`, prompt + max_tokens over max_model_len is an error
        (the server's rule) instead of generation ending at max_model_len (the offline rule).
        `priority` (vLLM's: lower is more important) decides who is preempted first when blocks run out."""
        params = params or (SamplingParams() if self.config.model.pooler is None else
                            PoolingParams(self.config.model.pooler.task))
        self.inputs.check_priority(priority)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs:
            raise ValueError(f"request id {request_id!r} is already in use")
        new = self.inputs.process(request_id, prompt, params, strict_length, priority)
        self.outputs.add(request_id, new.prompt, new.prompt_token_ids, params, new.requests, stream)
        for req in new.requests:
            self.scheduler.add_request(req)
        return request_id

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiler (made at the first constraint; usable from any thread)."""
        return self.structured_outputs.compiler

    def abort_request(self, request_id: str) -> None:
        for req in self.outputs.abort(request_id):
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._deferred is not None

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step. Returns outputs of groups that finished (or changed, when streaming).

        With async output processing (config.async_output_proc, on by default on CUDA) a step's outputs
        (detokenization, stop strings, logprob dicts) are made while the next step runs on the device, and
        returned by that next step: a request a stop string ends has one more token computed, and dropped."""
        with phase("schedule"):
            plan = self.scheduler.schedule()
            step_input = None if plan.is_empty else self.scheduler.runner_input(plan)
            if step_input is not None and self.structured_outputs.started:  # the allowed tokens of sampling rows
                step_input.grammar_bitmask = self._grammar_bitmask(plan)
            if step_input is not None and self.speculation is not None:
                step_input.num_drafts_wanted = self.speculation.drafts_wanted()
        self.last_step_num_requests = len(plan.scheduled)
        started = time.perf_counter()
        with phase("launch"):
            pending = None if step_input is None else self.executor.execute_model(step_input)
        outputs = []
        if self._deferred is not None:  # the host's work on the last step, while the device runs this one
            with phase("outputs"):
                outputs, self._deferred = self.outputs.process(self._deferred), None
        if pending is None:
            return outputs
        with phase("wait"):
            result = self.outputs.drop_ended(pending.result())
        if self.speculation is not None:
            self.speculation.record_step(plan.num_tokens, time.perf_counter() - started)
        with phase("update"):
            self.scheduler.update(plan, {rid: row.token_ids for rid, row in result.sampled.items()},
                                  {rid: (row.frame, row.audio_finished) for rid, row in result.sampled.items()
                                   if row.frame is not None}, result.spec_token_ids)
        if self.config.async_output_proc:
            self._deferred = result
            return outputs
        with phase("outputs"):
            return outputs + self.outputs.process(result)

    def _grammar_bitmask(self, plan):
        """Structured outputs' bitmask for the step's sampling rows (with drafts: a row per draft and one more)."""
        sampling = [s for s in plan.scheduled if s.samples]
        return self.structured_outputs.bitmask([s.request for s in sampling], [s.spec_token_ids for s in sampling])

    @property
    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's counters (None without --speculative-config)."""
        return None if self.speculation is None else self.speculation.stats

    def local_model(self):
        """This process's model (rank 0's shard under tensor parallelism): what `bench roofline` times layer by
        layer. Serving never needs it."""
        return self.executor.local_model()

    def stats(self, with_requests: bool = False) -> EngineStats:
        """What the engine holds now (call it on the engine's thread: AsyncLLMEngine.call); `with_requests`: each
        request's blocks too (/v1/memory)."""
        pool, kv = self.kv_cache.pool, self.kv_cache
        requests = ()
        if with_requests:  # (not on /metrics' path, which takes a snapshot every step)
            running = {r.request_id: r for r in self.scheduler.running}
            requests = tuple(RequestBlocks(rid, kv.num_blocks_held(rid),
                                           running[rid].num_computed_tokens if rid in running else 0)
                             for rid in kv.tables)
        grammars = self.structured_outputs
        return EngineStats(
            memory_plan=self.memory_plan, num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), num_swapped=len(self.scheduler.swapped),
            kv_cache=KVCacheUsage(kv.block_size, pool.num_blocks, pool.num_used_blocks, pool.num_free_blocks,
                                  pool.num_cached_blocks, pool.usage),
            swap_blocks_total=self.num_swap_blocks, swap_blocks_used=kv.num_swapped_blocks, swap_usage=kv.swap_usage,
            preemptions=replace(self.scheduler.preemption_stats), swaps=replace(kv.swap_stats),
            prefix_cache=replace(kv.prefix_cache_stats),
            structured_output_cache_bytes=grammars.compiler.cache_bytes if grammars.started else 0,
            requests=requests)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix cache queries and hits so far, in tokens."""
        return self.kv_cache.prefix_cache_stats

    @property
    def preemption_stats(self) -> PreemptionStats:
        """Preemptions so far by kind (swap, recompute) and the computed tokens recompute dropped."""
        return self.scheduler.preemption_stats

    @property
    def swap_stats(self) -> SwapStats:
        """Blocks swapped out to and in from the host pool so far."""
        return self.kv_cache.swap_stats

    def check_integrity(self) -> None:
        """No block leaked or double-owned in the device pool or the host (swap) pool."""
        self.kv_cache.check_integrity()


def _shut_down(executor: Executor, structured_outputs: StructuredOutputManager) -> None:
    """An engine's end (its finalizer: it must not hold the engine): the workers, then the grammar worker."""
    try:
        executor.shutdown()
    finally:
        structured_outputs.shutdown()
