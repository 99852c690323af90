"""The memory plan: where every byte goes, how many KV blocks fit, and when nothing fits, why and
what would. Pure arithmetic over numbers it is given (measured by the engine, or read from files
by `pagedllm plan`), so both uses share this code and it is tested without a device."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from pagedllm.config import PLANNED_CHECKPOINT_FORMATS, QUANTIZE_AT_LOAD, resolve_kv_cache_dtype

# Where checkpoints stored in a format --quantization can only plan come from.
PLANNED_CHECKPOINT_SOURCES = {"int4": "GPTQ, AWQ or compressed-tensors W4A16, as `*-AWQ` / `*-GPTQ-Int4` repos ship",
                              "nvfp4": "ModelOpt or compressed-tensors NVFP4, as `nvidia/*-FP4` repos ship"}
from pagedllm.errors import KVCacheMemoryError
from pagedllm.kv_layout import KVCacheLayout
from pagedllm.model_executor.offload import device_slots, num_offloaded_layers
from pagedllm.utils import cdiv, gib_to_bytes

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
# vLLM's limits on --swap-space as a share of the host's total memory: refused above 70%, warned about
# above 40%. pagedllm refuses the same, and never proposes more than 40%.
SWAP_HOST_LIMIT, SWAP_HOST_ADVISED = 0.7, 0.4
# Host-to-device bandwidth a plan for a described (not measured) GPU prices --cpu-offload-gb at: what a
# PCIe 4.0 x16 link sustains for pinned copies. Said to be assumed wherever it is used.
ASSUMED_H2D_BYTES_PER_S = 25e9
DROP_CACHES = "sync; echo 3 > /proc/sys/vm/drop_caches"
UNIFIED_NO_OFFLOAD = ("on unified memory the GPU's memory is the host's: --cpu-offload-gb and --swap-space would move "
                      "nothing out of it")


def fmt_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{sign}{int(n)} B"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PlanSettings:
    """What the user controls (engine flags)."""

    dtype: torch.dtype
    max_model_len: int | None  # None: "auto", the largest that fits
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype; "auto" follows dtype
    quantization: str | None = None  # --quantization int8: the decoder Linears' weights in int8
    cpu_offload_bytes: int = 0  # --cpu-offload-gb, in bytes: whole decoder layers kept in host memory
    swap_space_bytes: int = 0  # --swap-space, in bytes: host memory for the KV blocks of preempted requests
    cuda_graph_sizes: tuple[int, ...] = ()  # decode batch sizes captured in CUDA graphs (): none, --enforce-eager
    # Worker processes beside the engine, (what they do, the host memory each may hold): started when first
    # needed, each capped (isolated_worker.py); part of this plan where the device shares the host's memory.
    worker_processes: tuple[tuple[str, int], ...] = ()
    pooling: bool = False  # the pooling runner: requests end with their prompt, nothing decodes
    # --speculative-config: drafts a request checks per step (0: none) and how they are made
    num_speculative_tokens: int = 0
    speculative_method: str = ""
    speculative_max_batch: int | None = None  # disable_by_batch_size: larger steps check no drafts
    # speculative method draft_model: the draft's weights, and its K/V values per token (in the KV cache's dtype,
    # beside the target's in every block)
    draft_model: str = ""
    draft_weight_bytes: int = 0
    draft_kv_values_per_token: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype the KV cache is stored in."""
        return resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype)


@dataclass(frozen=True)
class DeviceFacts:
    device: str  # "cpu" | "cuda"
    total_bytes: int
    used_by_others_bytes: int
    unified: bool = False
    name: str = ""
    source: str = "measured"  # or "given" (plan flags)
    # The host's memory, where the swap space goes on a discrete GPU (None: not measured; on CPU the
    # device is the host).
    host_total_bytes: int | None = None
    host_used_bytes: int | None = None
    # Reclaimable page cache in the device's memory (CPU, unified memory): counted as available, since
    # the kernel hands it back as the engine allocates; used_by_others_bytes is what is really held.
    page_cache_bytes: int = 0
    # Pinned host-to-device copy bandwidth (bytes/s), what --cpu-offload-gb costs per step; None: not measured.
    h2d_bytes_per_s: float | None = None

    @property
    def shares_host_memory(self) -> bool:
        """The device's memory is the host's RAM (CPU, unified memory): page cache lives in it."""
        return self.device == "cpu" or self.unified


NO_SPECULATION = "without --speculative-config"  # the fix that turns speculative decoding off


@dataclass(frozen=True)
class ModelFacts:
    """How the model's memory depends on the settings. Functions, so levers can be re-planned."""

    model_max_len: int
    weight_bytes: Callable[[PlanSettings], int]
    activation_bytes: Callable[[PlanSettings], int]
    overhead_bytes: Callable[[PlanSettings], int]
    kv_bytes_per_token: Callable[[PlanSettings], int]
    layer_weight_bytes: Callable[[PlanSettings], int] | None = None  # one decoder layer (None: no offload)
    num_layers: int = 0
    weights_source: str = "config shapes"
    activation_source: str = "estimated"
    overhead_source: str = "estimated"
    # The CUDA graph pool: the activations of a decode step of the largest captured size, kept by the
    # graphs (the smaller ones share it) plus the null block padded rows write to. None: no graphs.
    graph_pool_bytes: Callable[[PlanSettings], int] | None = None
    graph_pool_source: str = "estimated"
    vocab_size: int = 0  # the logits' width: the structured outputs' token bitmask has a bit per token
    experts: str = ""  # a mixture of experts: what the weights hold of them ("every expert: ..."); "": dense
    stored_format: str = ""  # a quantized checkpoint's formats, as the weights are held ("mxfp4 experts"); "": none
    # Of weight_bytes: a CPU engine's second copy of a tied LM head (oneDNN's layout beside the embedding's table).
    head_copy_bytes: Callable[[PlanSettings], int] | None = None
    # Which layers share a block table (kv_layout.py); None or one without windows: every layer's K/V of a
    # token stays while its sequence does.
    kv_layout: KVCacheLayout | None = None


@dataclass(frozen=True)
class ComponentMemory:
    """A model beside the LLM on the same device (the audio tokenizer of a speech model): its weights
    and the peak of its largest call, both outside the KV cache. Its own line in the plan."""

    name: str
    weight_bytes: int
    activation_bytes: int
    source: str = "config shapes"  # or "measured"
    detail: str = ""

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes


@dataclass(frozen=True)
class Fix:
    flag: str
    value: str
    effect: str
    extra_step_ms: float | None = None  # --cpu-offload-gb: the copies each forward waits for
    plan: MemoryPlan | None = field(default=None, repr=False, compare=False)  # the plan with the fix (the picture's)

    @property
    def command(self) -> str:
        return f"{self.flag} {self.value}" if self.value else self.flag  # a switch (--enforce-eager) has no value


@dataclass(frozen=True)
class MemoryPlan:
    settings: PlanSettings
    device: DeviceFacts
    model: ModelFacts = None  # type: ignore[assignment]
    components: tuple[ComponentMemory, ...] = ()  # models beside the LLM (an audio tokenizer)

    # -- the arithmetic -------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        """Weights in device memory: all of them, less the layers offloaded to host memory, plus the
        device slots those pass through (two layers: one computing, the next one's copy arriving; on
        unified memory, offloading saves nothing)."""
        total = self.model.weight_bytes(self.settings)
        if not self.offloaded_layers:
            return total
        saved = 0 if self.device.unified else self.offloaded_weight_bytes
        return total - saved + device_slots(self.offloaded_layers) * self.model.layer_weight_bytes(self.settings)

    @property
    def offloaded_layers(self) -> int:
        if self.model.layer_weight_bytes is None:
            return 0
        return num_offloaded_layers(self.settings.cpu_offload_bytes, self.model.layer_weight_bytes(self.settings),
                                    self.model.num_layers)

    @property
    def offloaded_weight_bytes(self) -> int:
        """Weights --cpu-offload-gb keeps in host memory."""
        if not self.offloaded_layers:
            return 0
        return self.offloaded_layers * self.model.layer_weight_bytes(self.settings)

    @property
    def offload_step_ms(self) -> float | None:
        """What --cpu-offload-gb adds to each forward: copying the offloaded layers from host memory at the
        measured host-to-device bandwidth (or the assumed one, on a described device). The copies overlap
        the layers' compute, so a step takes about max(this, its compute)."""
        if not self.offloaded_weight_bytes:
            return None
        return self.offloaded_weight_bytes / self.h2d_bytes_per_s * 1000

    @property
    def h2d_bytes_per_s(self) -> float:
        return self.device.h2d_bytes_per_s or ASSUMED_H2D_BYTES_PER_S

    @property
    def activation_bytes(self) -> int:
        return self.model.activation_bytes(self.settings)

    @property
    def overhead_bytes(self) -> int:
        return self.model.overhead_bytes(self.settings)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(self.settings) + self.draft_kv_bytes_per_token

    @property
    def draft_kv_bytes_per_token(self) -> int:
        """A draft model's K/V of one token (0: none), held in the same blocks as the target's."""
        return self.settings.draft_kv_values_per_token * self.settings.kv_dtype.itemsize

    @property
    def windows(self) -> KVCacheLayout | None:
        """The model's KV layout where sliding-window layers drop blocks below their window (None otherwise)."""
        layout = self.model.kv_layout
        return layout if layout is not None and layout.has_windows else None

    @property
    def block_bytes(self) -> int:
        """One pool block: block_size tokens of every layer, or with windows, of one layer per group's slot."""
        if self.windows is None:
            return self.kv_bytes_per_token * self.settings.block_size
        return self.kv_bytes_per_token * self.windows.num_slots // self.model.num_layers * self.settings.block_size

    def blocks_as_tokens(self, blocks: int) -> int:
        """Tokens whose every layer's K/V `blocks` pool blocks hold."""
        if self.windows is None:
            return blocks * self.settings.block_size
        return blocks * self.block_bytes // self.kv_bytes_per_token

    def sequence_blocks(self, num_tokens: int, num_new_tokens: int = 1) -> int:
        """The most pool blocks one sequence holds on its way to `num_tokens` tokens, computing up to
        `num_new_tokens` a step."""
        if self.windows is None:
            return cdiv(num_tokens, self.settings.block_size)
        return self.windows.blocks_per_sequence(num_tokens, self.settings.block_size, num_new_tokens)

    @property
    def seq_blocks(self) -> int:
        """Blocks one max_model_len sequence needs at its peak (with windows: while a prompt chunk of
        max_num_batched_tokens runs, every block of the chunk is held), with the null block window tables point to."""
        n = max(self.max_model_len, 1)
        if self.windows is None:
            return self.sequence_blocks(n)
        return self.sequence_blocks(n, min(n, self.settings.max_num_batched_tokens)) + self.windows.reserved_blocks

    def tokens_held(self, blocks: int) -> int:
        """The longest sequence `blocks` pool blocks hold (at its peak, with the null block)."""
        if self.windows is None:
            return blocks * self.settings.block_size
        chunk = self.settings.max_num_batched_tokens
        lo, hi = 0, self.model.model_max_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            fits = self.sequence_blocks(mid, min(mid, chunk)) + self.windows.reserved_blocks <= blocks
            lo, hi = (mid, hi) if fits else (lo, mid - 1)
        return lo

    @property
    def budget_bytes(self) -> int:
        return int(self.device.total_bytes * self.settings.gpu_memory_utilization)

    @property
    def graph_pool_bytes(self) -> int:
        """Device memory CUDA graphs keep (0: none captured; --cpu-offload-gb turns them off)."""
        s, fn = self.settings, self.model.graph_pool_bytes
        if not s.cuda_graph_sizes or s.cpu_offload_bytes or fn is None:
            return 0
        return fn(s) + self.block_bytes

    @property
    def bitmask_bytes(self) -> int:
        """Structured outputs' token bitmask for a step with every sequence constrained: a 32-bit word per 32
        tokens per row, filled on the host and copied to the device (both in this memory when they share it)."""
        row = -(-self.model.vocab_size // 32) * 4
        return self.settings.max_num_seqs * row * (2 if self.device.shares_host_memory else 1)

    @property
    def worker_bytes(self) -> int:
        """The worker processes' host memory (grammar compiles, request templates), where it is this memory."""
        if not self.device.shares_host_memory:
            return 0
        return sum(size for _, size in self.settings.worker_processes)

    @property
    def spec_decode_rows(self) -> int:
        """Speculative decoding: the logits rows a step has beyond one per sequence (each checked draft has one),
        up to the step's token budget (and of at most disable_by_batch_size sequences)."""
        s = self.settings
        if not s.num_speculative_tokens:
            return 0
        checking = min(s.max_num_seqs, s.speculative_max_batch or s.max_num_seqs)  # sequences that may check drafts
        return max(0, min(s.max_num_seqs + checking * s.num_speculative_tokens, s.max_num_batched_tokens)
                   - min(s.max_num_seqs, s.max_num_batched_tokens))

    @property
    def spec_decode_bytes(self) -> int:
        """Those rows' logits (model dtype), the sampler's float32 copy and the checked rows' probabilities (float32):
        what a step that checks drafts holds beyond the activation peak measured with one row per sequence. The
        n-gram proposer has no weights and no KV cache of its own."""
        return self.spec_decode_rows * self.model.vocab_size * (self.settings.dtype.itemsize + 8)

    @property
    def non_kv_bytes(self) -> int:
        return (self.weight_bytes + self.activation_bytes + self.overhead_bytes + self.component_bytes
                + self.graph_pool_bytes + self.bitmask_bytes + self.worker_bytes + self.spec_decode_bytes
                + self.settings.draft_weight_bytes)

    @property
    def component_bytes(self) -> int:
        return sum(c.total_bytes for c in self.components)

    @property
    def kv_budget_bytes(self) -> int:
        """What is left for the KV cache: the budget minus others' use and everything else of ours."""
        if self.settings.kv_cache_memory_bytes is not None:
            return self.settings.kv_cache_memory_bytes
        return self.budget_bytes - self.device.used_by_others_bytes - self.non_kv_bytes - self.shared_swap_bytes

    @property
    def blocks_that_fit(self) -> int:
        if self.settings.num_gpu_blocks_override is not None:
            return self.settings.num_gpu_blocks_override
        return max(0, self.kv_budget_bytes // self.block_bytes)

    @property
    def max_model_len_fit(self) -> int:
        """The longest sequence the KV cache can hold, capped by the model's limit."""
        return min(self.model.model_max_len, self.tokens_held(self.blocks_that_fit))

    @property
    def max_model_len(self) -> int:
        if self.settings.max_model_len is None:
            return max(self.max_model_len_fit, 0)
        return self.settings.max_model_len

    @property
    def seq_bytes(self) -> int:
        """KV bytes one max_model_len sequence needs (whole blocks)."""
        return self.seq_blocks * self.block_bytes

    @property
    def max_useful_blocks(self) -> int:
        """max_num_seqs sequences of max_model_len: more blocks could never be used at once (with windows: as
        they decode, plus one's last prompt chunk and the null block)."""
        s = self.settings
        if s.pooling:  # prompts only, chunked: at most one is part-computed across steps, beside one step's batch
            batch = self.sequence_blocks(s.max_num_batched_tokens) + min(s.max_num_seqs, s.max_num_batched_tokens)
            return self.seq_blocks + batch
        decoding = self.sequence_blocks(max(self.max_model_len, 1))
        return (s.max_num_seqs - 1) * decoding + self.seq_blocks

    @property
    def num_blocks(self) -> int:
        if self.settings.num_gpu_blocks_override is not None:
            return self.settings.num_gpu_blocks_override
        return min(self.blocks_that_fit, self.max_useful_blocks)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def max_tokens_in_cache(self) -> int:
        """Tokens of every layer's K/V the cache holds."""
        return self.blocks_as_tokens(self.num_blocks)

    @property
    def max_concurrency(self) -> float:
        """Sequences of max_model_len the cache holds at once, as they decode (windowed layers hold their
        window's blocks only)."""
        if not self.max_model_len:
            return 0.0
        if self.windows is None:
            return self.max_tokens_in_cache / self.max_model_len
        return max(0, self.num_blocks - self.windows.reserved_blocks) / self.sequence_blocks(self.max_model_len)

    @property
    def full_attention_concurrency(self) -> float:
        """What max_concurrency would be if every layer kept every token (a full-attention count)."""
        return self.max_tokens_in_cache / self.max_model_len if self.max_model_len else 0.0

    # -- swap space (--swap-space) ---------------------------------------------------------------
    @property
    def swap_shares_device_memory(self) -> bool:
        """On CPU (and unified memory) the swap pool and the KV cache are the same RAM: the swap space is
        counted in the engine's budget, before the KV cache, so both never take more than the budget."""
        return self.device.device == "cpu" or self.device.unified

    @property
    def num_swap_blocks(self) -> int:
        return self.settings.swap_space_bytes // self.block_bytes if self.block_bytes > 0 else 0

    @property
    def swap_bytes(self) -> int:
        """The host KV tensor the engine allocates: whole blocks of the device cache's layout and dtype."""
        return self.num_swap_blocks * self.block_bytes

    @property
    def swap_tokens(self) -> int:
        """Tokens of preempted requests the swap space holds."""
        return self.blocks_as_tokens(self.num_swap_blocks)

    @property
    def shared_swap_bytes(self) -> int:
        return self.swap_bytes if self.swap_shares_device_memory else 0

    @property
    def host_free_bytes(self) -> int | None:
        """Host memory left for the swap space of a discrete GPU: what other processes leave, less the
        weights --cpu-offload-gb keeps there. None where the host was not measured."""
        d = self.device
        if d.host_total_bytes is None or d.host_used_bytes is None:
            return None
        return d.host_total_bytes - d.host_used_bytes - self.offloaded_weight_bytes

    def host_swap_limit(self, share: float = SWAP_HOST_LIMIT) -> int | None:
        """The most swap space the host allows: free host memory, and at most `share` of its total."""
        free = self.host_free_bytes
        return None if free is None else min(free, int(self.device.host_total_bytes * share))

    @property
    def swap_fits(self) -> bool:
        if not self.settings.swap_space_bytes:
            return True
        if self.num_swap_blocks < 1:
            return False
        limit = None if self.swap_shares_device_memory else self.host_swap_limit()
        return limit is None or self.swap_bytes <= limit

    # -- verdict --------------------------------------------------------------------------------
    @property
    def fits(self) -> bool:
        return self.kv_fits and self.swap_fits

    @property
    def kv_fits(self) -> bool:
        """Everything but the swap space fits: one max_model_len sequence in the KV cache, in memory."""
        if self.max_model_len < 1 or self.blocks_that_fit < 1:
            return False
        explicit = self.settings.kv_cache_memory_bytes
        if explicit is not None:
            needed = self.device.used_by_others_bytes + self.non_kv_bytes + explicit + self.shared_swap_bytes
            if needed > self.device.total_bytes:
                return False
        return self.num_blocks >= self.seq_blocks

    # -- diagnosis ------------------------------------------------------------------------------
    @property
    def cause(self) -> str | None:
        if self.fits:
            return None
        if self.kv_fits:
            return self._swap_cause()
        s, d = self.settings, self.device
        mem = f"{fmt_bytes(d.total_bytes)}{' unified' if d.unified else ''} memory"
        if s.num_gpu_blocks_override is not None:
            return (f"num_gpu_blocks_override={s.num_gpu_blocks_override} blocks hold "
                    f"{self.tokens_held(s.num_gpu_blocks_override)} tokens, fewer than one sequence of "
                    f"max_model_len {self.max_model_len}.")
        if s.kv_cache_memory_bytes is not None:
            if self.tokens_held(self.blocks_that_fit) < self.max_model_len:
                return (f"--kv-cache-memory {fmt_bytes(s.kv_cache_memory_bytes)} holds "
                        f"{self.tokens_held(self.blocks_that_fit)} tokens, fewer than one sequence of "
                        f"max_model_len {self.max_model_len} ({fmt_bytes(self.seq_bytes)}).")
            return (f"--kv-cache-memory {fmt_bytes(s.kv_cache_memory_bytes)} plus the weights, activations and "
                    f"overhead ({fmt_bytes(self.non_kv_bytes)}) and other processes' "
                    f"{fmt_bytes(d.used_by_others_bytes)} exceed the {mem}.")
        budget, others = self.budget_bytes, d.used_by_others_bytes
        mem += self._page_cache_aside()
        if others >= budget:
            return (f"other processes and the OS already use {fmt_bytes(others)} of the {mem}; the engine's "
                    f"budget of {fmt_bytes(budget)} (gpu_memory_utilization {s.gpu_memory_utilization:g}) "
                    f"cannot be met.")
        left = budget - others
        if left < self.weight_bytes:
            return (f"other processes and the OS already use {fmt_bytes(others)} of the {mem}, leaving "
                    f"{fmt_bytes(left)} of the engine's budget of {fmt_bytes(budget)}: less than the model's "
                    f"weights ({fmt_bytes(self.weight_bytes)}).")
        if self.kv_budget_bytes < self.block_bytes:
            swap = f", the swap space ({fmt_bytes(self.shared_swap_bytes)})" if self.shared_swap_bytes else ""
            graphs = f", the CUDA graphs ({fmt_bytes(self.graph_pool_bytes)})" if self.graph_pool_bytes else ""
            graphs += (f", speculative decoding's logits rows ({fmt_bytes(self.spec_decode_bytes)})"
                       if self.spec_decode_bytes else "")
            graphs += (f", the draft model ({fmt_bytes(self.settings.draft_weight_bytes)})"
                       if self.settings.draft_weight_bytes else "")
            return (f"after other processes ({fmt_bytes(others)}) and the weights ({fmt_bytes(self.weight_bytes)}), "
                    f"the activation peak ({fmt_bytes(self.activation_bytes)}){swap}{graphs}{self._components_text()} "
                    f"and runtime overhead "
                    f"({fmt_bytes(self.overhead_bytes)}) leave {fmt_bytes(self.kv_budget_bytes)} of the "
                    f"{fmt_bytes(budget)} budget for the KV cache: not one block ({fmt_bytes(self.block_bytes)}).")
        graphs = (f"; the CUDA graphs of decode steps take {fmt_bytes(self.graph_pool_bytes)} of the budget"
                  if self.graph_pool_bytes else "")
        graphs += (f"; speculative decoding's logits rows take {fmt_bytes(self.spec_decode_bytes)}"
                   if self.spec_decode_bytes else "")
        return (f"the KV cache gets {fmt_bytes(self.kv_budget_bytes)}, enough for "
                f"{self.tokens_held(self.blocks_that_fit)} tokens, but one sequence of max_model_len "
                f"{self.max_model_len} needs {fmt_bytes(self.seq_bytes)} "
                f"({fmt_bytes(self.kv_bytes_per_token)} per token){graphs}.")

    def _page_cache_aside(self) -> str:
        """Said beside what others hold: the page cache is not part of it."""
        cache = self.device.page_cache_bytes
        return f" (besides {fmt_bytes(cache)} of page cache, counted as free: the kernel reclaims it)" if cache else ""

    @property
    def page_cache_reclaimed_bytes(self) -> int:
        """Page cache the kernel must give back for the engine to start: what the engine will hold beyond
        the memory that is free now (not others', not page cache)."""
        d = self.device
        if not d.page_cache_bytes or not self.fits:
            return 0
        engine = self.non_kv_bytes + self.kv_cache_bytes + self.shared_swap_bytes
        return max(0, min(d.page_cache_bytes, d.used_by_others_bytes + d.page_cache_bytes + engine - d.total_bytes))

    def _swap_cause(self) -> str:
        s = self.settings
        if self.num_swap_blocks < 1:
            return (f"--swap-space {fmt_bytes(s.swap_space_bytes)} is smaller than one KV block "
                    f"({fmt_bytes(self.block_bytes)}).")
        d = self.device
        offload = (f" and the {fmt_bytes(self.offloaded_weight_bytes)} of weights --cpu-offload-gb keeps there"
                   if self.offloaded_weight_bytes else "")
        return (f"--swap-space {fmt_bytes(self.swap_bytes)} is host memory, but other processes use "
                f"{fmt_bytes(d.host_used_bytes)} of the host's {fmt_bytes(d.host_total_bytes)}{offload}, and at most "
                f"{SWAP_HOST_LIMIT:.0%} of it may be swap space (vLLM's limit): {fmt_bytes(self.host_swap_limit())}.")

    def with_settings(self, **changes) -> "MemoryPlan":
        return replace(self, settings=replace(self.settings, **changes))

    def fixes(self) -> list[Fix]:
        """Each lever pagedllm implements, computed and verified by re-planning with it alone."""
        if self.fits:
            return []
        s = self.settings
        candidates: list[tuple[str, str, MemoryPlan]] = []
        # The longest max_model_len that fits.
        fit_len = self.max_model_len_fit
        if 0 < fit_len < self.max_model_len:
            candidates.append(("--max-model-len", str(fit_len), self.with_settings(max_model_len=fit_len)))
        # The smallest utilization that fits (only meaningful when the budget decides).
        if s.kv_cache_memory_bytes is None and s.num_gpu_blocks_override is None:
            needed = self.device.used_by_others_bytes + self.non_kv_bytes + self.seq_bytes
            util = cdiv(needed * 100, self.device.total_bytes) / 100
            if util <= 1.0:
                util_plan = self.with_settings(gpu_memory_utilization=util)
                while not util_plan.fits and util < 1.0:  # rounding of the budget
                    util = round(util + 0.01, 2)
                    util_plan = self.with_settings(gpu_memory_utilization=util)
                candidates.append(("--gpu-memory-utilization", f"{util:g}", util_plan))
            # Half-size weights and cache.
            if s.dtype == torch.float32:
                candidates.append(("--dtype", "bfloat16", self.with_settings(dtype=torch.bfloat16)))
            # A smaller per-step token budget lowers the activation peak.
            lo, hi = 1, s.max_num_batched_tokens - 1
            if hi >= lo and self.with_settings(max_num_batched_tokens=lo).fits:
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if self.with_settings(max_num_batched_tokens=mid).fits else (lo, mid - 1)
                candidates.append(("--max-num-batched-tokens", str(lo), self.with_settings(max_num_batched_tokens=lo)))
        if s.num_gpu_blocks_override is None and s.kv_dtype.itemsize > 1:
            candidates.append(("--kv-cache-dtype", "fp8", self.with_settings(kv_cache_dtype="fp8")))
        if s.quantization is None and not self.model.stored_format:
            # Quantized at load (dense models), then the checkpoints stored smaller (their own download).
            formats = PLANNED_CHECKPOINT_FORMATS if self.model.experts \
                else QUANTIZE_AT_LOAD + PLANNED_CHECKPOINT_FORMATS
            candidates += [("--quantization", q, self.with_settings(quantization=q)) for q in formats]
        offload = self._cpu_offload_fix()
        if offload is not None:
            candidates.append(offload)
        if s.kv_cache_memory_bytes is not None:
            want = self.seq_bytes
            candidates.append(("--kv-cache-memory", str(want), self.with_settings(kv_cache_memory_bytes=want)))
        if s.num_gpu_blocks_override is not None:
            blocks = cdiv(self.max_model_len, s.block_size)
            candidates.append(("--num-gpu-blocks-override", str(blocks),
                               self.with_settings(num_gpu_blocks_override=blocks)))
        swap = self._smaller_swap_fix()
        if swap is not None:
            candidates.append(swap)
        if self.graph_pool_bytes:
            candidates.append(("--enforce-eager", "", self.with_settings(cuda_graph_sizes=())))
        if self.spec_decode_bytes:
            candidates.append((NO_SPECULATION, "", self.with_settings(
                num_speculative_tokens=0, draft_weight_bytes=0, draft_kv_values_per_token=0)))
        return [Fix(flag, value, self._effect_of(flag, p), p.offload_step_ms if flag == "--cpu-offload-gb" else None,
                    p) for flag, value, p in candidates if p.fits]

    def _smaller_swap_fix(self) -> tuple[str, str, MemoryPlan] | None:
        """The largest --swap-space (to 0.01 GiB, 0 = none) below the current one at which the plan fits."""
        current = self.settings.swap_space_bytes
        if not current:
            return None

        def plan_at(hundredths: int) -> MemoryPlan:
            return self.with_settings(swap_space_bytes=gib_to_bytes(hundredths / 100))

        lo, hi = 0, cdiv(current * 100, GiB) - 1
        if hi < 0 or not plan_at(0).fits:
            return None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if plan_at(mid).fits else (lo, mid - 1)
        return "--swap-space", f"{lo / 100:.2f}", plan_at(lo)

    def preemption_fixes(self) -> list[Fix]:
        """Levers for a plan that fits but whose KV cache cannot hold max_num_seqs sequences of
        max_model_len at once, so requests will be preempted: swap space as large as that shortfall
        (capped by free host memory and by 40% of the host's total) keeps preempted requests' K/V in
        host memory instead of recomputing it. Verified by re-planning with it. Never offered for a plan
        that does not fit (it makes no model start), nor where the swap space would be the KV cache's
        own memory (CPU, unified memory: the same bytes serve better as KV cache), nor where host memory
        was not measured."""
        limit = self.host_swap_limit(SWAP_HOST_ADVISED)
        if not self.fits or self.swap_shares_device_memory or limit is None:
            return []
        short = self.max_useful_blocks - self.num_blocks - self.num_swap_blocks
        if short <= 0:
            return []
        want = cdiv((self.swap_bytes + short * self.block_bytes) * 100, GiB)  # hundredths of a GiB
        gib = min(want, limit * 100 // GiB) / 100
        fixed = self.with_settings(swap_space_bytes=gib_to_bytes(gib))
        if not fixed.fits or fixed.num_swap_blocks <= self.num_swap_blocks:
            return []
        return [Fix("--swap-space", f"{gib:.2f}", fixed.swap_effect(self))]

    def swap_effect(self, before: MemoryPlan) -> str:
        """What this plan's swap space adds over `before`'s."""
        return (f"+{self.swap_tokens - before.swap_tokens} tokens of preempted requests kept in host memory "
                f"(swap space {fmt_bytes(self.swap_bytes)} = {self.num_swap_blocks} blocks) instead of recomputed; "
                f"the KV cache itself still holds {self.max_concurrency:.1f} sequences of max_model_len "
                f"{self.max_model_len}")

    def _effect_of(self, flag: str, fixed: MemoryPlan) -> str:
        if flag == "--swap-space":
            return f"{fixed.effect()}; swap space {fmt_bytes(fixed.swap_bytes)} = {fixed.swap_tokens} tokens"
        if flag in ("--quantization", "--cpu-offload-gb"):
            text = (f"{fixed.effect()}; weights in device memory {fmt_bytes(self.weight_bytes)} -> "
                    f"{fmt_bytes(fixed.weight_bytes)} ({fmt_bytes(self.weight_bytes - fixed.weight_bytes)} saved)")
            if fixed.settings.quantization in PLANNED_CHECKPOINT_FORMATS:
                text += (f"; from a checkpoint of this model stored in {fixed.settings.quantization} "
                         f"({PLANNED_CHECKPOINT_SOURCES[fixed.settings.quantization]}), which loads as stored: "
                         f"pagedllm does not make {fixed.settings.quantization} at load")
            return text + (f"; {fixed.offload_cost()}" if flag == "--cpu-offload-gb" else "")
        if flag == NO_SPECULATION:
            draft = (f", the draft model's {fmt_bytes(self.settings.draft_weight_bytes)} of weights and its K/V"
                     if self.settings.draft_weight_bytes else "")
            return (f"{fixed.effect()}; frees the {fmt_bytes(self.spec_decode_bytes)} of drafts' logits rows{draft}, "
                    f"and decoding runs one token per step")
        if flag == "--enforce-eager":
            return (f"{fixed.effect()}; frees the CUDA graph pool ({fmt_bytes(self.graph_pool_bytes)}), and decode "
                    f"steps are launched kernel by kernel (slower)")
        return fixed.effect(self if flag == "--kv-cache-dtype" else None)

    def _cpu_offload_fix(self) -> tuple[str, str, MemoryPlan] | None:
        """The smallest --cpu-offload-gb (in whole layers) that fits; only a discrete CUDA device gains.
        Offloading as many layers as there are device slots saves nothing: each passes through one."""
        if self.device.device != "cuda" or self.device.unified or self.model.layer_weight_bytes is None:
            return None
        layer = self.model.layer_weight_bytes(self.settings)
        for n in range(max(self.offloaded_layers + 1, device_slots(self.model.num_layers) + 1),
                       self.model.num_layers + 1):
            gib = cdiv(n * layer * 100, GiB) / 100
            plan = self.with_settings(cpu_offload_bytes=gib_to_bytes(gib))
            if plan.fits:
                return "--cpu-offload-gb", f"{gib:.2f}", plan
        return None

    def offload_cost(self) -> str:
        """What the offloaded layers cost each step, in words."""
        measured = self.device.h2d_bytes_per_s is not None
        rate = f"{self.h2d_bytes_per_s / 1e9:.1f} GB/s"
        rate += " host-to-device, measured" if measured else " (PCIe 4.0 x16, assumed: not measured here)"
        return (f"each step copies {fmt_bytes(self.offloaded_weight_bytes)} from host memory: "
                f"+{self.offload_step_ms:.0f} ms per step at {rate}")

    def effect(self, before: MemoryPlan | None = None) -> str:
        """What this plan's KV cache holds; with `before`, also the tokens gained over it."""
        text = (f"KV cache {fmt_bytes(self.kv_cache_bytes)} = {self.max_tokens_in_cache} tokens, "
                f"{self.max_concurrency:.1f} sequences of max_model_len {self.max_model_len} at once")
        if before is None:
            return text
        return (f"{text} (+{self.max_tokens_in_cache - before.max_tokens_in_cache} tokens over the "
                f"{_dtype_name(before.settings.kv_dtype)} cache)")

    def check(self) -> None:
        """Raise KVCacheMemoryError (with breakdown, cause and fixes) unless the plan fits."""
        if self.fits:
            return
        if self.kv_fits:
            head = "Not enough memory for the swap space"
        elif self.kv_budget_bytes < self.block_bytes and self.settings.num_gpu_blocks_override is None:
            head = "No available memory for the cache blocks"
        else:
            head = (f"The model's max seq len ({self.max_model_len}) is larger than the maximum number of "
                    f"tokens that can be stored in KV cache ({self.tokens_held(self.blocks_that_fit)})")
        raise KVCacheMemoryError(f"{head}: {self.cause}\n{self.table()}")

    # -- presentation ---------------------------------------------------------------------------
    def _weights_row(self) -> tuple[str, str, str]:
        s = self.settings
        stored = f", {self.model.stored_format}" if self.model.stored_format else ""
        linears = f", {s.quantization} decoder linears" if s.quantization in QUANTIZE_AT_LOAD else ""
        planned = f", as an {s.quantization} checkpoint" if s.quantization in PLANNED_CHECKPOINT_FORMATS else ""
        label = f"model weights ({_dtype_name(s.dtype)}{linears}{planned}{stored})"
        note = self.model.weights_source + (f"; {self.model.experts}" if self.model.experts else "")
        copy = self.model.head_copy_bytes(s) if self.model.head_copy_bytes else 0
        if copy:
            note += f"; the tied LM head twice (oneDNN's packed copy, {fmt_bytes(copy)}, beside the embedding)"
        if self.offloaded_layers:
            slots = device_slots(self.offloaded_layers)
            note += (f"; {self.offloaded_layers} of {self.model.num_layers} layers "
                     f"({fmt_bytes(self.offloaded_weight_bytes)}) in host memory, through {slots} device "
                     f"slot{'s' if slots > 1 else ''}")
            if self.device.unified:
                note += ": saves nothing on unified memory"
        return label, fmt_bytes(self.weight_bytes), note

    def table(self) -> str:
        s, d, m = self.settings, self.device, self.model
        kind = "unified memory" if d.unified else f"{d.device} memory"
        rows = [
            (f"{kind} total" + (f" ({d.name})" if d.name else ""), fmt_bytes(d.total_bytes), d.source),
            (f"budget (gpu_memory_utilization {s.gpu_memory_utilization:g})", fmt_bytes(self.budget_bytes), ""),
            ("used by other processes and the OS", fmt_bytes(d.used_by_others_bytes), d.source),
            *self._page_cache_rows(),
            self._weights_row(),
            (f"activation peak ({s.max_num_batched_tokens} tokens/step)", fmt_bytes(self.activation_bytes),
             m.activation_source),
            self._overhead_row(),
            *self._graph_rows(),
            *self._bitmask_rows(),
            *self._spec_decode_plan_rows(),
            *self._worker_rows(),
            *self._component_rows(),
            ("left for the KV cache", fmt_bytes(self.kv_budget_bytes),
             "--kv-cache-memory" if s.kv_cache_memory_bytes is not None else ""),
            (f"KV cache per token ({_dtype_name(s.kv_dtype)})", fmt_bytes(self.kv_bytes_per_token),
             f"tp={s.tensor_parallel_size}" if s.tensor_parallel_size > 1 else ""),
            (f"one sequence of max_model_len {self.max_model_len}", fmt_bytes(self.seq_bytes), ""),
            ("KV cache allocated", f"{fmt_bytes(self.kv_cache_bytes)} = {self.num_blocks} blocks x "
             f"{s.block_size} tokens", self._kv_cap_note
             if self.num_blocks == self.max_useful_blocks < self.blocks_that_fit else ""),
            ("holds", f"{self.max_tokens_in_cache} tokens = {self.full_attention_concurrency:.1f} x max_model_len",
             "of every layer's K/V" if self.windows is not None else ""),
            *self._window_rows(),
        ]
        if s.swap_space_bytes:
            rows.append(self._swap_row())
        width = max(len(r[0]) for r in rows)
        vwidth = max(len(r[1]) for r in rows)
        lines = [f"  {k:<{width}}  {v:>{vwidth}}  {note}".rstrip() for k, v, note in rows]
        if not self.fits:
            lines.append(f"  cause: {self.cause}")
            fixes = self.fixes()
            if fixes:
                lines.append("  fixes (each alone makes the plan fit):")
                lines += [f"    {f.command}: {f.effect}" for f in fixes]
            util_fix = any(f.flag == "--gpu-memory-utilization" for f in fixes)
            if (not util_fix and not self.kv_fits and s.kv_cache_memory_bytes is None
                    and s.num_gpu_blocks_override is None):
                lines.append(f"  no gpu_memory_utilization can fit it: {fmt_bytes(d.used_by_others_bytes)} of the "
                             f"{fmt_bytes(d.total_bytes)} is used elsewhere; free memory there first.")
            if d.unified:
                lines.append(f"  {UNIFIED_NO_OFFLOAD}: not offered.")
        else:
            lines += self._page_cache_lines() + self._preemption_lines()
        return "\n".join(lines)

    @property
    def _kv_cap_note(self) -> str:
        if self.settings.pooling:
            return "capped: pooling, prompts only (one max_model_len prompt + one step's batch)"
        return "capped at max_num_seqs x max_model_len"

    def _page_cache_rows(self) -> list[tuple[str, str, str]]:
        d = self.device
        if not (d.unified or (d.shares_host_memory and d.page_cache_bytes)):
            return []
        return [("page cache (reclaimable)", fmt_bytes(d.page_cache_bytes),
                 f"{d.source}; counted as free (the kernel reclaims it)")]

    def _page_cache_lines(self) -> list[str]:
        reclaimed = self.page_cache_reclaimed_bytes
        if not reclaimed:
            return []
        return [f"  page cache: starting takes {fmt_bytes(reclaimed)} of the {fmt_bytes(self.device.page_cache_bytes)} "
                f"page cache back (the kernel reclaims it as the engine allocates; to free it now, as root: "
                f"`{DROP_CACHES}`)."]

    def _overhead_row(self) -> tuple[str, str, str]:
        d, m = self.device, self.model
        if d.device != "cuda":
            return "runtime overhead", fmt_bytes(self.overhead_bytes), m.overhead_source
        what = "CUDA context, libraries" + (", process memory" if d.unified else "")
        note = m.overhead_source if m.overhead_source == "measured" else f"{m.overhead_source} (the engine measures it)"
        return f"runtime overhead ({what})", fmt_bytes(self.overhead_bytes), note

    def _graph_rows(self) -> list[tuple[str, str, str]]:
        sizes = self.settings.cuda_graph_sizes
        if not self.graph_pool_bytes:
            return []
        return [(f"CUDA graphs ({len(sizes)} decode sizes, up to {sizes[-1]} rows)", fmt_bytes(self.graph_pool_bytes),
                 f"{self.model.graph_pool_source}; --enforce-eager: none")]

    def _bitmask_rows(self) -> list[tuple[str, str, str]]:
        if not self.bitmask_bytes:
            return []
        from pagedllm.structured_output import grammar_cache_limit_bytes

        return [(f"structured outputs bitmask ({self.settings.max_num_seqs} rows)", fmt_bytes(self.bitmask_bytes),
                 f"compiled grammars: host memory, up to {fmt_bytes(grammar_cache_limit_bytes())} "
                 "(VLLM_XGRAMMAR_CACHE_MB)")]

    def _spec_decode_plan_rows(self) -> list[tuple[str, str, str]]:
        s = self.settings
        if not s.num_speculative_tokens:
            return []
        rows = [(f"speculative decoding ({s.speculative_method}, {s.num_speculative_tokens} drafts): "
                 f"{self.spec_decode_rows} more logits rows", fmt_bytes(self.spec_decode_bytes),
                 "estimated" + ("" if s.draft_model else "; no draft weights or draft KV cache (n-gram drafts)"))]
        if s.draft_model:
            rows += [(f"draft model weights ({s.draft_model})", fmt_bytes(s.draft_weight_bytes), ""),
                     ("draft KV cache per token", fmt_bytes(self.draft_kv_bytes_per_token),
                      "in every block beside the target's: part of the KV cache per token below")]
        return rows

    def _worker_rows(self) -> list[tuple[str, str, str]]:
        workers = self.settings.worker_processes
        if not workers:
            return []
        total = sum(size for _, size in workers)
        where = "" if self.device.shares_host_memory else "; host memory, not this device's"
        return [(f"worker processes ({', '.join(name for name, _ in workers)})", fmt_bytes(total),
                 f"at most: each its start and its cap (compiles: --structured-outputs-compile-memory, "
                 f"templates: 1 GiB){where}")]

    def _window_rows(self) -> list[tuple[str, str, str]]:
        """A windowed model's KV groups, and the sequences they hold over a full-attention count."""
        w = self.windows
        if w is None:
            return []
        full_blocks = cdiv(self.max_model_len, self.settings.block_size) * len(w.groups)
        return [("KV groups", w.describe(), "windowed layers keep their window's blocks only"),
                ("sequences of max_model_len at once", f"{self.max_concurrency:.1f}",
                 f"{self.full_attention_concurrency:.1f} if every layer kept every token: each holds "
                 f"{self.sequence_blocks(self.max_model_len)} blocks as it decodes, not {full_blocks} "
                 f"({full_blocks / self.sequence_blocks(self.max_model_len):.2f}x as many fit); 1 null block")]

    def _component_rows(self) -> list[tuple[str, str, str]]:
        return [(f"{c.name} ({c.detail})" if c.detail else c.name, fmt_bytes(c.total_bytes),
                 f"weights {fmt_bytes(c.weight_bytes)} + peak {fmt_bytes(c.activation_bytes)}; {c.source}")
                for c in self.components]

    def _components_text(self) -> str:
        return "".join(f", the {c.name} ({fmt_bytes(c.total_bytes)})" for c in self.components)

    def _swap_row(self) -> tuple[str, str, str]:
        if self.swap_shares_device_memory:
            note = "the same RAM as the KV cache: taken from the budget before it"
        elif self.host_free_bytes is None:
            note = "host memory (not measured)"
        else:
            note = f"host memory, {fmt_bytes(self.host_free_bytes)} free"
        size = f"{fmt_bytes(self.swap_bytes)} = {self.num_swap_blocks} blocks = {self.swap_tokens} tokens"
        return "swap space (--swap-space)", size, note

    def _preemption_lines(self) -> list[str]:
        fixes = self.preemption_fixes()
        s = self.settings
        head = (f"  preemption: the KV cache holds {self.max_concurrency:.1f} of max_num_seqs {s.max_num_seqs} "
                f"sequences of max_model_len {self.max_model_len}; past that, requests are preempted and recompute.")
        if not fixes:
            short = self.max_useful_blocks > self.num_blocks + self.num_swap_blocks
            if self.device.unified and short and self.settings.num_gpu_blocks_override is None:
                return [head, f"  {UNIFIED_NO_OFFLOAD}: not offered."]
            return []
        return [head, "  fixes (keep preempted requests' K/V):"] + [f"    {f.command}: {f.effect}" for f in fixes]

    def to_json(self) -> dict:
        return {
            "fits": self.fits,
            "device": self.device.device,
            "unified_memory": self.device.unified,
            "device_total_bytes": self.device.total_bytes,
            "device_used_bytes": self.device.used_by_others_bytes,
            "page_cache_bytes": self.device.page_cache_bytes,
            "page_cache_reclaimed_bytes": self.page_cache_reclaimed_bytes,
            "budget_bytes": self.budget_bytes,
            "gpu_memory_utilization": self.settings.gpu_memory_utilization,
            "dtype": str(self.settings.dtype).removeprefix("torch."),
            "weights_bytes": self.weight_bytes,
            "quantization": self.settings.quantization,
            "cpu_offload_bytes": self.settings.cpu_offload_bytes,
            "offloaded_layers": self.offloaded_layers,
            "offloaded_weight_bytes": self.offloaded_weight_bytes,
            "offload_step_ms": self.offload_step_ms,
            "h2d_bytes_per_s": self.device.h2d_bytes_per_s,
            "activation_peak_bytes": self.activation_bytes,
            "overhead_bytes": self.overhead_bytes,
            "cuda_graph_sizes": list(self.settings.cuda_graph_sizes),
            "cuda_graph_pool_bytes": self.graph_pool_bytes,
            "structured_output_bitmask_bytes": self.bitmask_bytes,
            "spec_decode_bytes": self.spec_decode_bytes,
            "draft_weight_bytes": self.settings.draft_weight_bytes,
            "draft_kv_bytes_per_token": self.draft_kv_bytes_per_token,
            "worker_processes": [{"name": name, "host_bytes": size} for name, size in self.settings.worker_processes],
            "worker_process_bytes": self.worker_bytes,
            "components": [{"name": c.name, "weight_bytes": c.weight_bytes, "activation_peak_bytes": c.activation_bytes,
                            "source": c.source, "detail": c.detail} for c in self.components],
            "kv_cache_budget_bytes": self.kv_budget_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_cache_dtype": _dtype_name(self.settings.kv_dtype),
            "block_size": self.settings.block_size,
            "num_blocks": self.num_blocks,
            "max_model_len": self.max_model_len,
            "max_model_len_fit": self.max_model_len_fit,
            "max_concurrency": round(self.max_concurrency, 3),
            "max_concurrency_full_attention": round(self.full_attention_concurrency, 3),
            "kv_groups": None if self.windows is None else self.windows.describe(),
            "max_num_batched_tokens": self.settings.max_num_batched_tokens,
            "pooling": self.settings.pooling,
            "tensor_parallel_size": self.settings.tensor_parallel_size,
            "sources": {"weights": self.model.weights_source, "activation": self.model.activation_source,
                        "overhead": self.model.overhead_source, "device": self.device.source,
                        "cuda_graphs": self.model.graph_pool_source},
            "cause": self.cause,
            "fixes": [{"flag": f.flag, "value": f.value, "effect": f.effect}
                      | ({"extra_step_ms": f.extra_step_ms} if f.extra_step_ms is not None else {})
                      for f in self.fixes()],
            "swap_space_bytes": self.settings.swap_space_bytes,
            "swap_bytes": self.swap_bytes,
            "num_swap_blocks": self.num_swap_blocks,
            "swap_tokens": self.swap_tokens,
            "host_free_bytes": self.host_free_bytes,
            "preemption_fixes": [{"flag": f.flag, "value": f.value, "effect": f.effect}
                                 for f in self.preemption_fixes()],
        }


def kv_allocation_failure(plan: MemoryPlan, error: str) -> str:
    """Why allocating a KV cache the plan had room for failed, and what to do: memory was taken between
    the measurement and the allocation (on unified memory: page cache the kernel did not give back)."""
    d = plan.device
    head = (f"No available memory for the cache blocks: allocating the planned KV cache "
            f"({fmt_bytes(plan.kv_cache_bytes)} = {plan.num_blocks} blocks) failed ({error}) although the plan left "
            f"room for it")
    if d.shares_host_memory and d.page_cache_bytes:
        cause = (f"the plan counted {fmt_bytes(d.page_cache_bytes)} of page cache as free, and the kernel did not "
                 f"give enough of it back")
        fix = (f"free the page cache first (as root: `{DROP_CACHES}`), or lower --gpu-memory-utilization below "
               f"{plan.settings.gpu_memory_utilization:g}")
    else:
        cause = (f"another process took memory after the engine measured {fmt_bytes(d.used_by_others_bytes)} "
                 f"in use by others")
        fix = f"start when that memory is free, or lower --gpu-memory-utilization below {plan.settings.gpu_memory_utilization:g}"
    return f"{head}: {cause}.\n  fix: {fix}.\n{plan.table()}"
