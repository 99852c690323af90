"""EngineArgs: the user's settings (vLLM's names) turned into the engine's frozen configs."""
from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import torch

from pagedllm.config import (
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    QUANTIZATION_METHODS,
    QUANTIZE_AT_LOAD,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    resolve_dtype,
)
from pagedllm.speculative_config import SpeculativeConfig
from pagedllm.errors import UnsupportedModelError
from pagedllm.model_executor.moe import num_experts
from pagedllm.model_executor.quant import checkpoint_quant
from pagedllm.structured_output_limits import StructuredOutputLimits
from pagedllm.model_executor.model_files import has_tokenizer, load_hf_config, resolve_model_path
from pagedllm.pooler_config import RUNNERS, TASKS, apply_hf_overrides, parse_pooler_config, pooler_config, resolve_runner
from pagedllm.utils import gib_to_bytes, parse_size

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Flag:
    """How one EngineArgs field is given on a command line: its help, the names it may take (a callable, read
    from the registry it names when a parser is built), extra spellings (vLLM's short ones), how a value is
    read (default: from the field's type), and its group (SERVER_ONLY: only `serve` and `plan` have it)."""

    help: str
    choices: Callable[[], Iterable[str]] | None = None
    aliases: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None
    group: str = "engine"
    metavar: str | None = None


def flag(default: Any, help: str, **how: Any) -> Any:
    """An EngineArgs field and its flag: the default is written once, for `LLM(...)` and the command line."""
    return field(default=default, metadata={"flag": Flag(help, **how)})


def _read_max_model_len(value: str) -> int | str:
    return "auto" if value == "auto" else int(value)


def _device(value: str) -> str:
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: use auto, cpu, cuda or cuda:N")


def _dtypes() -> tuple[str, ...]:
    return ("auto", *DTYPES)


def _attention_backends() -> tuple[str, ...]:
    from pagedllm.model_executor.attention import ATTENTION_BACKENDS

    return ATTENTION_BACKENDS


SERVER_COMPILE_TIMEOUT_S = 10.0  # serve's (and plan's) structured-output compile deadline when none is given
_LIMITS = StructuredOutputLimits()
SERVER_ONLY = "engine, for serve and plan"  # a group only the commands that serve (or plan a server) have
_STRUCTURED = "structured outputs: what one constraint may be and cost (a 400 names the limit)"


@dataclass
class EngineArgs:
    """The engine's settings, vLLM's names: `LLM(**kwargs)`, and every command's engine flags (add_engine_args).
    A field and its flag are one entry: its default, help and choices are written here and nowhere else."""

    model: str | None = flag(None, "HF model folder, config.json (with --load-format dummy) or hub name in the "
                             "local HF cache; default: the built-in demo model")
    tokenizer: str | None = flag(None, "tokenizer folder or hub name (default: the model's)")
    revision: str | None = flag(None, "hub revision of the model in the local HF cache")
    runner: str = flag("auto", "generate: text (or speech) generation; pooling: embeddings, classification and "
                       "scores (/v1/embeddings, /v1/score, /v1/rerank); auto: pooling for *ForSequenceClassification, "
                       "bare *Model and sentence-transformers checkpoints, else generate", choices=lambda: RUNNERS)
    task: str | None = flag(None, "vLLM's older switch: embed (or embedding), classify, score (a single-label "
                            "classifier's relevance, or an embedding model's cosine similarity) run the pooling runner; "
                            "generate the generate runner", choices=lambda: TASKS)
    pooler_config: str | dict | None = flag(None, "JSON: how the pooling runner pools, e.g. '{\"pooling_type\": "
                                            "\"MEAN\", \"normalize\": true}' (pooling_type LAST, MEAN or CLS; "
                                            "normalize; use_activation); default: the checkpoint's sentence-"
                                            "transformers modules, else last-token", parse=str)
    hf_overrides: str | dict | None = flag(None, "JSON set on the model's config.json as loaded, e.g. Qwen3-Reranker's "
                                           "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                                           "\"classifier_from_token\": [\"no\", \"yes\"], "
                                           "\"is_original_qwen3_reranker\": true}'", parse=str)
    dtype: str = flag("auto", "weights' and activations' dtype; auto: the checkpoint's (float16 becomes bfloat16 "
                      "on a CPU)", choices=_dtypes)
    seed: int = flag(0, "seed of the random weights (--load-format dummy) and of unseeded sampling")
    max_model_len: int | str | None = flag(None, "context length (prompt + output) in tokens; default: the "
                                           "model's; auto: the longest that fits in memory", parse=_read_max_model_len)
    block_size: int = flag(16, "tokens per KV cache block (a power of two up to 256)")
    max_num_seqs: int = flag(256, "sequences running at once")
    max_logprobs: int = flag(20, "most logprobs (and prompt_logprobs) a request may ask for; -1: up to the "
                                 "vocabulary size")
    max_num_batched_tokens: int | None = flag(None, "tokens one step computes (prefill chunks and decodes); "
                                              "default 2048")
    gpu_memory_utilization: float = flag(0.9, "fraction of device memory the engine may take (on CPU: of host "
                                         "memory)")
    kv_cache_memory: int | str | None = flag(None, "KV cache size, e.g. 4GiB (overrides the utilization)",
                                             parse=str)
    num_gpu_blocks_override: int | None = flag(None, "KV cache blocks, whatever memory says")
    kv_cache_dtype: str = flag("auto", "storage dtype of the KV cache: auto = the model dtype, fp8 = fp8_e4m3 "
                               "(half a 16-bit cache; per-tensor k/v scales from the checkpoint, else 1.0)",
                               choices=lambda: KV_CACHE_DTYPES)
    enable_prefix_caching: bool = flag(True, "reuse the KV cache of prompts' shared prefixes (full blocks)")
    enforce_eager: bool = flag(False, "no CUDA graphs: every step's kernels are launched one by one (saves the "
                               "graph pool's memory and the capture time at start; decode is slower)")
    cuda_graph_sizes: list[int] | None = flag(None, "decode batch sizes captured in CUDA graphs at start (a decode "
                                              "step of n sequences replays the smallest >= n); default 1 2 4 8 16 "
                                              "24 ... up to --max-num-seqs", metavar="N")
    async_output_proc: bool | None = flag(None, "make each step's outputs (detokenization, stop strings) while the "
                                          "next step runs on the device; default: on with CUDA, off on a CPU "
                                          "(nothing to overlap: its steps run on the host)")
    disable_async_output_proc: bool = flag(False, "vLLM's spelling of --no-async-output-proc")
    attention_backend: str = flag("auto", "how attention is computed: torch (PyTorch ops, any device), cpu "
                                  "(native CPU kernels), triton (CUDA kernels reading the paged cache in place); "
                                  "auto: triton on CUDA, cpu on a CPU, else torch", choices=_attention_backends)
    batch_invariant: bool | None = flag(None, "a request's logits do not depend on the other requests in its "
                                        "batch, so a seeded request samples the same tokens (or audio) alone or "
                                        "beside any others; every Linear multiplies in fixed 16-row tiles and "
                                        "attention runs per query (slower). Default: VLLM_BATCH_INVARIANT=1 in the "
                                        "environment turns it on")
    tensor_parallel_size: int = flag(1, "split the model across N ranks (devices; processes on a CPU): attention "
                                     "heads, MLP and vocabulary sharded Megatron-style, one all-reduce per "
                                     "attention and per MLP (torch.distributed: NCCL on CUDA, gloo on a CPU). "
                                     "Refused, with the sizes that work, when it does not divide the model's heads",
                                     aliases=("-tp",))
    distributed_executor_backend: str | None = flag(None, "what starts the other ranks: mp (default) local "
                                                    "processes; ray actors placed on a running Ray cluster "
                                                    "(several machines: docs/distributed.md)",
                                                    choices=lambda: DISTRIBUTED_EXECUTOR_BACKENDS)
    load_format: str = flag("auto", "auto or safetensors: the checkpoint's weights; dummy: random weights of the "
                            "config's shapes", choices=lambda: LOAD_FORMATS)
    device: str = flag("auto", "auto (cuda when there is one), cpu, cuda or cuda:N", parse=_device)
    quantization: str | None = flag(None, "int8 or fp8: weight-only int8 / fp8 (e4m3) decoder Linears "
                                    "(per-output-channel scales), quantized at load; embeddings and LM head stay in "
                                    "--dtype. A quantized checkpoint (FP8, NVFP4, MXFP4, GPTQ, AWQ, "
                                    "compressed-tensors: docs/quantization.md) loads as stored: none needed, or its "
                                    "quant_method. plan: int4 / nvfp4 size a checkpoint stored so",
                                    choices=lambda: QUANTIZATION_METHODS, aliases=("-q",))
    cpu_offload_gb: float = flag(0.0, "GiB of weights (whole decoder layers, the last first) kept in host memory "
                                 "and copied to the GPU layer by layer; CUDA only")
    swap_space: float = flag(0.0, "GiB of host memory for the KV blocks of preempted requests, swapped out and "
                             "back in instead of recomputed. vLLM's default is 4 (and its V1 engine ignores the "
                             "flag); pagedllm's is 0: no swap space, preempted requests recompute")
    preemption_mode: str | None = flag(None, "force swap (needs --swap-space) or recompute preemption; default: "
                                       "swap when there is swap space and the request has computed at least one "
                                       "block, else recompute", choices=lambda: PREEMPTION_MODES)
    scheduling_policy: str = flag("fcfs", "fcfs: first come first served, a request's priority other than 0 is "
                                  "refused (400); priority: requests' priority field (lower first) orders "
                                  "scheduling and preemption", choices=lambda: SCHEDULING_POLICIES)
    speculative_config: str | dict | None = flag(None, "JSON, vLLM's keys: speculative decoding, e.g. '{\"method\": "
                                                 "\"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' "
                                                 "(ngram: drafts from earlier spans of the prompt and output); "
                                                 "disable_by_batch_size caps the batch that speculates, and a rule "
                                                 "from measured step times and acceptance turns it off when it does "
                                                 "not pay (\"adaptive\": false keeps it on): docs/speculative_decoding.md",
                                                 parse=str)
    repetition_aware_sampling: bool = flag(True, "audio models: repetition-aware sampling as the checkpoint's "
                                           "generation_config.json sets it (ras_win_len); off: never (RAS redraws "
                                           "repeated codes at random, even for greedy requests)")
    structured_outputs_max_bytes: int = flag(_LIMITS.max_spec_bytes, "bytes of a JSON schema's text, a regex, a "
                                             "grammar or a choice list", group=_STRUCTURED)
    structured_outputs_max_properties: int = flag(_LIMITS.max_properties, "object properties in a whole JSON "
                                                  "schema", group=_STRUCTURED)
    structured_outputs_max_alternatives: int = flag(_LIMITS.max_alternatives, "members of one anyOf / oneOf / "
                                                    "enum, strings of one choice", group=_STRUCTURED)
    structured_outputs_max_depth: int = flag(_LIMITS.max_depth, "nesting of a JSON schema's objects, arrays and "
                                             "combinators", group=_STRUCTURED)
    structured_outputs_compile_timeout: float | None = flag(
        None, f"seconds one constraint may take to compile, in a worker process that is then killed (400); 0: "
              f"compile in the engine's process with no deadline. Default: {SERVER_COMPILE_TIMEOUT_S:g} for serve "
              f"(and plan), 0 for generate and LLM(...) (the caller's own input)", group=_STRUCTURED)
    structured_outputs_compile_memory: int | str = flag(_LIMITS.compile_memory_bytes, "memory the compile worker "
                                                        "may take beyond its start (e.g. 2GiB)", parse=str,
                                                        group=_STRUCTURED)
    trust_request_chat_template: bool = flag(False, "allow a chat_template in requests (vLLM's flag); each is "
                                             "rendered in a worker process (planned in the memory plan) under "
                                             "--request-chat-template-timeout and a 1 GiB cap. Off: such requests "
                                             "get 400", group=SERVER_ONLY)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        if self.model is None:
            from pagedllm.demo import demo_model_path

            self.model = str(demo_model_path())
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}.")
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda'; got {device!r}.")
        path = resolve_model_path(self.model, self.revision)
        if path.is_file() and self.load_format != "dummy":
            raise ValueError(f"{path} is a config file, not a model folder: pass load_format='dummy' to run "
                             f"its shape with random weights.")
        hf_config = load_hf_config(path)
        apply_hf_overrides(hf_config, self.hf_overrides)
        self._verify_quantization(hf_config)
        cpu_offload_bytes = self._cpu_offload_bytes(device)
        from pagedllm.model_executor.models.registry import get_model_class

        architecture, model_cls = get_model_class(hf_config)
        parallel = self._parallel_config(hf_config, model_cls)
        checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = getattr(torch, checkpoint_dtype, None)
        dtype = resolve_dtype(self.dtype, checkpoint_dtype, device)
        max_model_len = self._max_model_len(hf_config)
        tokenizer = self.tokenizer or (str(path) if has_tokenizer(path) else None)
        pooler = self._pooler(architecture, hf_config, path, tokenizer)
        model_config = ModelConfig(
            model=self.model, path=path, hf_config=hf_config, architecture=architecture, dtype=dtype,
            max_model_len=max_model_len, max_model_len_auto=self.max_model_len in ("auto", -1),
            load_format=self.load_format, seed=self.seed,
            tokenizer=tokenizer, quantization=self._quantize_at_load(hf_config), cpu_offload_bytes=cpu_offload_bytes,
            repetition_aware_sampling=self.repetition_aware_sampling,
            max_logprobs=self._max_logprobs(hf_config.vocab_size), pooler=pooler,
        )
        cache = CacheConfig(
            block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            kv_cache_memory_bytes=parse_size(self.kv_cache_memory), cache_dtype=self.kv_cache_dtype,
            enable_prefix_caching=self.enable_prefix_caching if pooler is None else False,
            swap_space_bytes=self._swap_space_bytes(),
        )
        spec = self._speculative(model_cls, pooler)
        batched = self.max_num_batched_tokens or 2048
        scheduler = SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched,
                                    preemption_mode=self.preemption_mode, policy=self.scheduling_policy)
        return EngineConfig(model=model_config, cache=cache, scheduler=scheduler, device=device,
                            enforce_eager=self.enforce_eager, attention_backend=self._attention_backend(),
                            cuda_graph_sizes=None if self.cuda_graph_sizes is None else tuple(self.cuda_graph_sizes),
                            async_output_proc=self._async_output_proc(device),
                            batch_invariant=self._batch_invariant(), parallel=parallel,
                            structured_outputs=self._structured_output_limits(),
                            request_template_worker=self.trust_request_chat_template,
                            speculative=spec, draft_model=self._draft_model(spec, model_config, parallel, cache))

    def _speculative(self, model_cls, pooler) -> SpeculativeConfig | None:
        spec = SpeculativeConfig.parse(self.speculative_config)
        if spec is None:
            return None
        if pooler is not None:
            raise ValueError("--speculative-config applies to generation: the pooling runner generates nothing.")
        if getattr(model_cls, "generates_audio", False):
            raise ValueError(f"--speculative-config is not supported for {model_cls.__name__}: its positions are "
                             f"audio frames of several codebooks, which text drafts do not predict.")
        return spec

    def _draft_model(self, spec: SpeculativeConfig | None, target: ModelConfig, parallel: ParallelConfig,
                     cache: CacheConfig) -> ModelConfig | None:
        """The draft model's config (method draft_model): its own folder, the target's dtype, context and load
        format (dummy weights for a dummy target); refused where it cannot follow the target."""
        if spec is None or spec.method != "draft_model":
            return None
        if parallel.tensor_parallel_size > 1:
            raise ValueError("speculative method draft_model runs the draft on one rank: it is not supported with "
                             "--tensor-parallel-size > 1 yet (the ngram method is).")
        if cache.swap_space_bytes:
            raise ValueError("speculative method draft_model does not support --swap-space yet (the draft's K/V "
                             "would have to move with the target's); drop --swap-space: preemption recomputes.")
        path = resolve_model_path(spec.model)
        hf_config = load_hf_config(path)
        from pagedllm.kv_layout import KVCacheLayout
        from pagedllm.model_executor.models.registry import get_model_class

        architecture, _ = get_model_class(hf_config)
        if hf_config.vocab_size > target.vocab_size:  # (smaller: the same tokenizer, embeddings padded less)
            raise ValueError(f"the draft model {spec.model} has a vocabulary of {hf_config.vocab_size} tokens, more "
                             f"than the target's {target.vocab_size}: a draft must share the target's tokenizer.")
        if KVCacheLayout.of_config(hf_config).has_windows or target.kv_layout.has_windows:
            raise ValueError(f"speculative method draft_model needs full-attention models: the draft ({spec.model}) "
                             f"shares the target's block tables, one per request, and sliding-window layers keep "
                             f"tables of their own.")
        if hf_config.max_position_embeddings < target.max_model_len:
            raise ValueError(f"the draft model {spec.model} knows {hf_config.max_position_embeddings} positions, fewer "
                             f"than max_model_len {target.max_model_len}: lower --max-model-len.")
        load_format = "dummy" if target.load_format == "dummy" or path.is_file() else "auto"
        return ModelConfig(model=spec.model, path=path, hf_config=hf_config, architecture=architecture,
                           dtype=target.dtype, max_model_len=target.max_model_len, load_format=load_format,
                           seed=target.seed + 1, tokenizer=target.tokenizer, max_logprobs=target.max_logprobs)

    def _pooler(self, architecture: str, hf_config, path, tokenizer):
        """The pooling runner's PoolerConfig, or None for the generate runner (--runner, --task)."""
        task = resolve_runner(self.runner, self.task, architecture, hf_config, path)
        if task is None:
            if self.pooler_config is not None:
                raise ValueError("--pooler-config configures the pooling runner, and this model runs the generate "
                                 "runner: add --runner pooling, or drop --pooler-config.")
            return None
        if self.tensor_parallel_size > 1:
            raise UnsupportedModelError(f"--tensor-parallel-size {self.tensor_parallel_size}: the pooling runner "
                                        f"runs on one device for now.")
        config = pooler_config(task, architecture, hf_config, path, parse_pooler_config(self.pooler_config),
                               tokenizer)
        if self.enable_prefix_caching:
            logger.info("pooling runner (%s); prefix caching off: a pooled prompt needs every token's state",
                        config.describe())
        return config

    def _max_logprobs(self, vocab_size: int) -> int:
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the vocabulary size) or >= 0, got {self.max_logprobs}.")
        return vocab_size if self.max_logprobs == -1 else min(self.max_logprobs, vocab_size)

    def _structured_output_limits(self) -> StructuredOutputLimits:
        return StructuredOutputLimits(
            max_spec_bytes=self.structured_outputs_max_bytes, max_properties=self.structured_outputs_max_properties,
            max_alternatives=self.structured_outputs_max_alternatives, max_depth=self.structured_outputs_max_depth,
            compile_timeout_s=self.structured_outputs_compile_timeout or None,  # 0: in this process
            compile_memory_bytes=parse_size(self.structured_outputs_compile_memory))

    def _async_output_proc(self, device: str) -> bool:
        if self.disable_async_output_proc:
            if self.async_output_proc:
                raise ValueError("async_output_proc=True and disable_async_output_proc=True contradict each other.")
            return False
        return device.startswith("cuda") if self.async_output_proc is None else bool(self.async_output_proc)

    def _parallel_config(self, hf_config, model_cls) -> ParallelConfig:
        from pagedllm.distributed.sharding import verify_tensor_parallel_size

        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool):
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}.")
        if tp > 1:
            if not getattr(model_cls, "supports_tensor_parallel", False):
                raise UnsupportedModelError(f"--tensor-parallel-size {tp}: {model_cls.__name__} runs on one device "
                                            f"only for now (Llama, Mistral, Qwen2 and Qwen3 can be split).")
            verify_tensor_parallel_size(hf_config, tp)
        timeout = os.environ.get("PAGEDLLM_WORKER_TIMEOUT_S", "120")
        try:
            timeout_s = float(timeout)
        except ValueError:
            raise ValueError(f"PAGEDLLM_WORKER_TIMEOUT_S must be a number of seconds, got {timeout!r}.") from None
        return ParallelConfig(tensor_parallel_size=tp, worker_timeout_s=timeout_s,
                              distributed_executor_backend=self.distributed_executor_backend or "mp")

    def _batch_invariant(self) -> bool:
        if self.batch_invariant is not None:
            return bool(self.batch_invariant)
        from pagedllm.model_executor.batch_invariant import ENV_VAR

        value = os.environ.get(ENV_VAR, "0")
        if value not in ("0", "1"):
            raise ValueError(f"{ENV_VAR} must be 0 or 1, got {value!r}.")
        return value == "1"

    def _attention_backend(self) -> str:
        from pagedllm.model_executor.attention import ATTENTION_BACKENDS

        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                             f"got {self.attention_backend!r}.")
        return self.attention_backend

    def _verify_quantization(self, hf_config) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None (off); "
                             f"got {self.quantization!r}.")
        stored = checkpoint_quant(hf_config)  # (raises for a format pagedllm does not load)
        if stored is not None:
            if self.quantization not in (None, stored.method):
                raise ValueError(f"--quantization {self.quantization}: this checkpoint is already quantized "
                                 f"({stored.method}: {stored.describe()}) and loads as stored: drop --quantization "
                                 f"(or name its quant_method, {stored.method}).")
            if self.tensor_parallel_size > 1:
                raise UnsupportedModelError(f"tensor parallelism over a quantized checkpoint ({stored.describe()}) "
                                            f"is not supported yet: serve it with --tensor-parallel-size 1.")
            return
        if self.quantization is not None and self.quantization not in QUANTIZE_AT_LOAD:
            raise ValueError(
                f"--quantization {self.quantization} names a checkpoint's format, and this checkpoint is not "
                f"quantized. pagedllm quantizes a 16/32-bit checkpoint at load to {' or '.join(QUANTIZE_AT_LOAD)}; "
                f"int4 and nvfp4 weights come from checkpoints stored so (GPTQ, AWQ, compressed-tensors, ModelOpt), "
                f"which `pagedllm plan --quantization {self.quantization}` sizes.")
        if self.quantization is not None and num_experts(hf_config):
            raise UnsupportedModelError(
                f"--quantization {self.quantization} quantizes dense Linear layers; this model's experts (a mixture "
                f"of experts) cannot be quantized at load yet: serve it in bfloat16, or from a quantized "
                f"checkpoint (gpt-oss' MXFP4 experts load as shipped).")

    def _quantize_at_load(self, hf_config) -> str | None:
        """What the loader quantizes the checkpoint to (None: nothing; a quantized checkpoint loads as stored)."""
        return None if checkpoint_quant(hf_config) is not None else self.quantization

    def _cpu_offload_bytes(self, device: str) -> int:
        """--cpu-offload-gb in bytes; refused where there is no accelerator memory to relieve."""
        if not isinstance(self.cpu_offload_gb, (int, float)) or self.cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0, got {self.cpu_offload_gb!r}.")
        if self.cpu_offload_gb and device == "cpu":
            raise ValueError(
                f"--cpu-offload-gb {self.cpu_offload_gb:g} has nothing to do on a CPU-only engine (device cpu): "
                f"offloading moves weights from accelerator memory to host memory, and here the weights already "
                f"live in host memory. Remove --cpu-offload-gb; to make the weights smaller, use "
                f"--quantization int8 (or --dtype bfloat16).")
        return gib_to_bytes(self.cpu_offload_gb)

    def _swap_space_bytes(self) -> int:
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}.")
        return gib_to_bytes(self.swap_space)

    def _max_model_len(self, hf_config) -> int:
        derived = getattr(hf_config, "max_position_embeddings", None)
        if derived is None:
            raise UnsupportedModelError("config.json has no max_position_embeddings; pass max_model_len.")
        if self.max_model_len is None or self.max_model_len in ("auto", -1):
            return derived
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}.")
        if self.max_model_len > derived:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's max_position_embeddings "
                f"({derived}); positions past it were never trained. Use max_model_len <= {derived}."
            )
        return self.max_model_len


# -- the command line, made from the table ---------------------------------------------------------------
def engine_flags(server: bool = True) -> list[tuple[str, Any, Flag]]:
    """(field name, default, Flag) of each engine flag, in the table's order; without the `server` group for
    commands that serve nothing (generate, the offline benches)."""
    return [(f.name, None if f.default is MISSING else f.default, f.metadata["flag"]) for f in fields(EngineArgs)
            if server or f.metadata["flag"].group != SERVER_ONLY]


def _type_name(field_name: str) -> str:
    kind = EngineArgs.__dataclass_fields__[field_name].type  # a string under `from __future__ import annotations`
    return kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser, server: bool = False) -> None:
    """Every engine flag, from the table: the field's default, its help and choices; a bool field that is off
    is a switch, one that is on (or unset) a --flag / --no-flag pair; a list field takes one or more values."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, default, how in engine_flags(server):
        group = groups.get(how.group) or groups.setdefault(how.group, parser.add_argument_group(how.group))
        kind = _type_name(name)
        options: dict[str, Any] = {"default": default, "help": how.help, "dest": name}
        if kind.startswith("bool"):  # vLLM's --enforce-eager; --no-enable-prefix-caching for one that is on
            options["action"] = "store_true" if default is False else argparse.BooleanOptionalAction
        else:
            options["type"] = how.parse or (int if kind.startswith(("int", "list[int]")) else
                                            float if kind.startswith("float") else str)
            if kind.startswith("list["):
                options["nargs"] = "+"
            if how.choices is not None:
                options["choices"] = list(how.choices())
            if how.metavar is not None:
                options["metavar"] = how.metavar
        group.add_argument(flag_name(name), *how.aliases, **options)


def engine_args_from(ns: argparse.Namespace, server: bool = False) -> EngineArgs:
    """The EngineArgs a parsed command line names; `server`: serve's (and plan's) defaults where the table
    leaves the choice to the entry point."""
    args = EngineArgs(**{k: v for k, v in vars(ns).items() if k in EngineArgs.field_names()})
    if server and args.structured_outputs_compile_timeout is None:
        args.structured_outputs_compile_timeout = SERVER_COMPILE_TIMEOUT_S
    return args
