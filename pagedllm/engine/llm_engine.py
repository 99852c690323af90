"""LLMEngine: add requests, step (schedule -> execute -> update), collect outputs."""
from __future__ import annotations

import itertools
import logging
import weakref
from dataclasses import dataclass, replace

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.audio_inputs import AudioGeneration, AudioPrompt, refuse_audio
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.kv_cache_manager import KVCacheManager, PrefixCacheStats, SwapStats
from pagedllm.engine.request import FINISH_REASONS, Request, RequestStatus
from pagedllm.engine.scheduler import PreemptionStats, Scheduler
from pagedllm.errors import InvalidParameterError, InvalidPromptError, KVCacheMemoryError
from pagedllm.memory.device import DeviceMemory, device_memory, host_memory
from pagedllm.memory.facts import device_facts, measured_model_facts, settings_from, with_measured_offload_cost
from pagedllm.memory.model_size import estimate_activation_bytes
from pagedllm.memory.plan import MemoryPlan, kv_allocation_failure
from pagedllm.memory.profiler import runtime_overhead_bytes
from pagedllm.model_executor.audio_sampling import verify_audio_sampling_params
from pagedllm.model_executor.model_files import generation_eos_ids
from pagedllm.executor import Executor, make_executor
from pagedllm.model_executor.model_runner import ModelRunnerOutput
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import GrammarCompiler, StructuredOutputManager
from pagedllm.utils import phase

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


@dataclass
class _Sequence:
    """One of a prompt's n samples: the engine request plus its text so far."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None


@dataclass
class _Group:
    """What the user submitted under one request id: a prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    stream: bool = False

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None) -> None:
        self.tokenizer = tokenizer
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
        self.memory_plan = self._plan_memory(config, at_start)
        self.memory_plan.check()
        if config.model.max_model_len_auto:
            config = self._with_max_model_len(config, self.memory_plan.max_model_len)
            self.executor.set_max_model_len(config.model.max_model_len)
            logger.info("max_model_len auto: %d tokens fit", config.model.max_model_len)
        self.config = config
        logger.info("memory plan:\n%s", self.memory_plan.table())
        self._allocate_kv_cache()
        self._capture_graphs()
        self.num_swap_blocks = self._allocate_swap_space(config.cache.swap_space_bytes)
        self.kv_cache = KVCacheManager(self.memory_plan.num_blocks, config.cache.block_size,
                                       enable_caching=config.cache.enable_prefix_caching,
                                       num_swap_blocks=self.num_swap_blocks)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        self.eos_token_ids = self._eos_token_ids()
        # Audio models (None for text ones): how prompts carry audio and requests sample frames.
        self.audio = AudioGeneration.for_model(self.runner_facts.audio_spec, config.model.path,
                                               config.model.repetition_aware_sampling)
        self._groups: dict[str, _Group] = {}
        self._seq_of: dict[str, tuple[_Group, _Sequence]] = {}
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

    def _allocate_kv_cache(self) -> None:
        """The planned KV cache; a failed allocation (memory taken since it was measured) is a KVCacheMemoryError."""
        plan = self.memory_plan
        try:
            self.executor.allocate_kv_cache(plan.num_blocks)
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

    @staticmethod
    def _with_max_model_len(config: EngineConfig, max_model_len: int) -> EngineConfig:
        return replace(config, model=replace(config.model, max_model_len=max_model_len),
                       scheduler=replace(config.scheduler, max_model_len=max_model_len))

    def _eos_token_ids(self) -> set[int]:
        ids = generation_eos_ids(self.config.model.path)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        if not ids:
            eos = getattr(self.config.model.hf_config, "eos_token_id", None)
            ids = set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
        return ids

    # -- requests -----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A string, {"prompt": str}, {"prompt_token_ids": [...]} or a list of ids -> (text, ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidPromptError("a prompt dict needs a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidPromptError(
                    "this model has no tokenizer (its folder has no tokenizer files), so prompts must be "
                    "token ids: {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidPromptError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def apply_chat_template(self, messages: list[dict], chat_template: str | None = None,
                            add_generation_prompt: bool = True, tools: list[dict] | None = None
                            ) -> tuple[str, list[int]]:
        """Render a conversation (and the tools it may call) with the model's (or the given) chat template ->
        (text, token ids)."""
        if self.tokenizer is None:
            raise InvalidPromptError("chat needs a tokenizer with a chat template; this model has no tokenizer")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise InvalidPromptError("this model's tokenizer has no chat template; pass one (--chat-template)")
        text = self.tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, tools=tools)
        # The template already holds the special tokens (BOS): don't add them twice.
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def _cache_salt(prompt: PromptType) -> str | None:
        """A prompt dict's `cache_salt`: requests with different salts never share cached blocks."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidPromptError(f"cache_salt must be a non-empty string, got {salt!r}")
        return salt

    def _validate_prompt(self, ids: list[int]) -> None:
        max_len = self.config.model.max_model_len
        if not ids:
            raise InvalidPromptError("the prompt is empty: it must hold at least one token")
        if len(ids) >= max_len:
            raise InvalidPromptError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {max_len}: it must be at most "
                f"{max_len - 1} tokens to leave room for one generated token")
        vocab = self.config.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidPromptError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def check_priority(self, priority: int) -> None:
        """A request's priority counts only under --scheduling-policy priority (as vLLM): elsewhere anything but
        0 is refused, so no client can put itself first on a server whose operator did not ask for it."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise InvalidParameterError("priority", f"priority {priority} needs the engine started with "
                                                    f"--scheduling-policy priority (scheduling_policy='priority'); "
                                                    f"under {self.config.scheduler.policy} every request's is 0.")

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    stream: bool = False, strict_length: bool = False, priority: int = 0) -> str:
        """Queue a prompt. With `strict_length`, prompt + max_tokens over max_model_len is an error
        (the server's rule) instead of generation ending at max_model_len (the offline rule).
        `priority` (vLLM's: lower is more important) decides who is preempted first when blocks run out."""
        params = params or SamplingParams()
        self.check_priority(priority)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        audio_prompt = self._audio_prompt(prompt, ids, params)
        if audio_prompt is not None:
            ids = audio_prompt.token_ids  # its audio tokens expanded to one placeholder per frame
        self._validate_prompt(ids)
        cache_salt = self._cache_salt(prompt)
        max_len = self.config.model.max_model_len
        if strict_length and params.max_tokens is not None and len(ids) + params.max_tokens > max_len:
            raise InvalidPromptError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} for the "
                f"completion). Reduce the prompt or max_tokens to at most {max_len - len(ids)}.")
        vocab = self.config.model.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise InvalidParameterError(name, f"{name} must be at most the vocabulary size ({vocab}), got {value}.")
        bad_bias = [t for t in params.logit_bias or {} if t >= vocab]
        if bad_bias:
            raise InvalidParameterError("logit_bias", f"logit_bias token ids {bad_bias[:5]} are outside the vocabulary "
                                                      f"[0, {vocab})")
        if params.guided_decoding is not None:
            self.structured_outputs.compile(params.guided_decoding)  # an invalid constraint fails here, not in a step
        bad_stop = [t for t in params.stop_token_ids if t >= self.config.model.vocab_size]
        if bad_stop:
            raise InvalidParameterError("stop_token_ids", f"stop_token_ids {bad_stop} are outside the vocabulary "
                                                          f"[0, {self.config.model.vocab_size})")
        group = _Group(request_id, text, ids, [], [None] if params.prompt_logprobs is not None else None, stream)
        for j in range(params.n):
            child_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + j)
            # The n samples are queued one after another: the later ones hit the first one's prompt
            # blocks in the prefix cache, even when all are scheduled in the same step.
            req = Request(f"{request_id}" if params.n == 1 else f"{j}_{request_id}", ids, child_params,
                          self.eos_token_ids if audio_prompt is None else set(),  # audio ends by its codes
                          self.config.model.max_model_len, cache_salt=cache_salt, priority=priority,
                          **self._audio_request_args(audio_prompt, child_params))
            detok = None
            if self.tokenizer is not None and audio_prompt is None:  # audio outputs have no text
                detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                               params.spaces_between_special_tokens, params.stop,
                                               params.include_stop_str_in_output)
            seq = _Sequence(req, j, detok)
            group.sequences.append(seq)
            self._seq_of[req.request_id] = (group, seq)
        self._groups[request_id] = group
        for seq in group.sequences:
            self.scheduler.add_request(seq.request)
        return request_id

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiler (made at the first constraint; usable from any thread)."""
        return self.structured_outputs.compiler

    def _audio_prompt(self, prompt: PromptType, ids: list[int], params: SamplingParams) -> AudioPrompt | None:
        """An audio model's prompt with its audio checked and expanded; None for a text model."""
        if self.audio is None:
            refuse_audio(prompt)
            return None
        verify_audio_sampling_params(params)
        return self.audio.prompt(prompt, ids)

    def _audio_request_args(self, audio_prompt: AudioPrompt | None, params: SamplingParams) -> dict:
        if audio_prompt is None:
            return {}
        return {"prompt_frames": audio_prompt.frames, "audio_state": self.audio.new_state(audio_prompt, params.seed)}

    def abort_request(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.sequences:
            self.scheduler.finish_request(seq.request, RequestStatus.FINISHED_ABORTED)
            self._seq_of.pop(seq.request.request_id, None)

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
                step_input.grammar_bitmask = self.structured_outputs.bitmask(
                    [s.request for s in plan.scheduled if s.samples])
        self.last_step_num_requests = len(plan.scheduled)
        with phase("launch"):
            pending = None if step_input is None else self.executor.execute_model(step_input)
        outputs = []
        if self._deferred is not None:  # the host's work on the last step, while the device runs this one
            with phase("outputs"):
                outputs, self._deferred = self._emit(self._deferred), None
        if pending is None:
            return outputs
        with phase("wait"):
            result = self._drop_ended(pending.result())
        with phase("update"):
            self.scheduler.update(plan, {rid: row.token_id for rid, row in result.sampled.items()},
                                  {rid: (row.frame, row.audio_finished) for rid, row in result.sampled.items()
                                   if row.frame is not None})
        if self.config.async_output_proc:
            self._deferred = result
            return outputs
        with phase("outputs"):
            return outputs + self._emit(result)

    def _drop_ended(self, result: ModelRunnerOutput) -> ModelRunnerOutput:
        """Without the rows of requests that ended (a stop string, an abort) while their step ran."""
        def live(rid: str) -> bool:
            entry = self._seq_of.get(rid)
            return entry is not None and not entry[1].request.is_finished

        return ModelRunnerOutput({rid: row for rid, row in result.sampled.items() if live(rid)},
                                 {rid: c for rid, c in result.prompt_logprobs.items() if live(rid)})

    def _emit(self, result: ModelRunnerOutput) -> list[RequestOutput]:
        """The step's outputs: tokens detokenized, stop strings applied, finished groups let go."""
        outputs = []
        for group in self._process_outputs(result):
            if group.finished or group.stream:
                outputs.append(self._make_output(group))
            if group.finished:
                self._groups.pop(group.request_id, None)
                for seq in group.sequences:
                    self._seq_of.pop(seq.request.request_id, None)
        return outputs

    def _process_outputs(self, result: ModelRunnerOutput) -> list[_Group]:
        touched: dict[str, _Group] = {}
        for rid, chunk in result.prompt_logprobs.items():
            if rid in self._seq_of:  # (an abort since the step ran drops its rows)
                self._add_prompt_logprobs(self._seq_of[rid][0], chunk)
        for rid, row in result.sampled.items():
            if rid not in self._seq_of:
                continue
            group, seq = self._seq_of[rid]
            req = seq.request
            touched[group.request_id] = group
            if row.logprob is not None:
                entry = {row.token_id: Logprob(row.logprob, row.rank, self._decode_one(row.token_id))}
                for rank, (tid, lp) in enumerate(zip(row.top_ids, row.top_logprobs), start=1):
                    if tid not in entry:
                        entry[tid] = Logprob(lp, rank, self._decode_one(tid))
                req.output_logprobs.append(entry)
                req.cumulative_logprob += row.logprob
            if seq.detokenizer is None:
                continue
            stopped_by_token = req.status == RequestStatus.FINISHED_STOPPED and (
                row.token_id in req.eos_token_ids or row.token_id == req.stop_reason)
            if stopped_by_token and not req.sampling_params.include_stop_str_in_output:
                continue  # the EOS / stop token's own text is not part of the output
            _, stop = seq.detokenizer.add_token(row.token_id)
            if stop is None and req.is_finished:
                _, stop = seq.detokenizer.flush()
            if stop is not None:
                if not req.is_finished:
                    self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
                    req.stop_reason = stop
                elif req.status == RequestStatus.FINISHED_LENGTH:
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        return list(touched.values())

    def _add_prompt_logprobs(self, group: _Group, chunk) -> None:
        if group.prompt_logprobs is None:
            return
        # After a preemption the prompt is recomputed: keep only positions not yet recorded.
        skip = len(group.prompt_logprobs) - chunk.first_position
        if skip < 0:
            raise RuntimeError(f"prompt logprobs arrived out of order for request {group.request_id}")
        rows = list(zip(chunk.token_logprobs, chunk.ranks, chunk.top_ids, chunk.top_logprobs))[skip:]
        for lp, rank, ids, lps in rows:
            target = group.prompt_token_ids[len(group.prompt_logprobs)]
            entry = {target: Logprob(lp, rank, self._decode_one(target))}
            for r, (tid, tlp) in enumerate(zip(ids, lps), start=1):
                entry.setdefault(tid, Logprob(tlp, r, self._decode_one(tid)))
            group.prompt_logprobs.append(entry)

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _make_output(self, group: _Group) -> RequestOutput:
        outs = []
        for seq in group.sequences:
            req = seq.request
            want_lp = req.sampling_params.logprobs is not None
            outs.append(CompletionOutput(
                index=seq.index,
                text=seq.detokenizer.output_text if seq.detokenizer else "",
                token_ids=list(req.output_token_ids),
                cumulative_logprob=req.cumulative_logprob if want_lp else None,
                logprobs=list(req.output_logprobs) if want_lp else None,
                finish_reason=FINISH_REASONS.get(req.status),
                stop_reason=req.stop_reason,
                audio_codes=self.audio.output_codes(req.audio_frames) if req.generates_audio else None,
            ))
        reqs = [seq.request for seq in group.sequences]
        scheduled = [r.first_scheduled_time for r in reqs if r.first_scheduled_time is not None]
        metrics = {"arrival_time": min(r.arrival_time for r in reqs),
                   "first_scheduled_time": min(scheduled) if scheduled else None}
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                             group.prompt_logprobs, outs, group.finished, metrics)

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
