"""The memory plan: where every byte goes, how many KV blocks fit, and when nothing fits, why and
what would. Pure arithmetic over numbers it is given (measured by the engine, or read from files
by `pagedllm plan`), so both uses share this code and it is tested without a device."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pagedllm.errors import KVCacheMemoryError
from pagedllm.utils import cdiv

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def fmt_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{sign}{int(n)} B"


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

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")


@dataclass(frozen=True)
class DeviceFacts:
    device: str  # "cpu" | "cuda"
    total_bytes: int
    used_by_others_bytes: int
    unified: bool = False
    name: str = ""
    source: str = "measured"  # or "given" (plan flags)


@dataclass(frozen=True)
class ModelFacts:
    """How the model's memory depends on the settings. Functions, so levers can be re-planned."""

    model_max_len: int
    weight_bytes: Callable[[PlanSettings], int]
    activation_bytes: Callable[[PlanSettings], int]
    overhead_bytes: Callable[[PlanSettings], int]
    kv_bytes_per_token: Callable[[PlanSettings], int]
    weights_source: str = "config shapes"
    activation_source: str = "estimated"
    overhead_source: str = "estimated"


@dataclass(frozen=True)
class Fix:
    flag: str
    value: str
    effect: str


@dataclass(frozen=True)
class MemoryPlan:
    settings: PlanSettings
    device: DeviceFacts
    model: ModelFacts = None  # type: ignore[assignment]

    # -- the arithmetic -------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes(self.settings)

    @property
    def activation_bytes(self) -> int:
        return self.model.activation_bytes(self.settings)

    @property
    def overhead_bytes(self) -> int:
        return self.model.overhead_bytes(self.settings)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(self.settings)

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.settings.block_size

    @property
    def budget_bytes(self) -> int:
        return int(self.device.total_bytes * self.settings.gpu_memory_utilization)

    @property
    def non_kv_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.overhead_bytes

    @property
    def kv_budget_bytes(self) -> int:
        """What is left for the KV cache: the budget minus others' use and everything else of ours."""
        if self.settings.kv_cache_memory_bytes is not None:
            return self.settings.kv_cache_memory_bytes
        return self.budget_bytes - self.device.used_by_others_bytes - self.non_kv_bytes

    @property
    def blocks_that_fit(self) -> int:
        if self.settings.num_gpu_blocks_override is not None:
            return self.settings.num_gpu_blocks_override
        return max(0, self.kv_budget_bytes // self.block_bytes)

    @property
    def max_model_len_fit(self) -> int:
        """The longest sequence the KV cache can hold, capped by the model's limit."""
        return min(self.model.model_max_len, self.blocks_that_fit * self.settings.block_size)

    @property
    def max_model_len(self) -> int:
        if self.settings.max_model_len is None:
            return max(self.max_model_len_fit, 0)
        return self.settings.max_model_len

    @property
    def seq_bytes(self) -> int:
        """KV bytes one max_model_len sequence needs (whole blocks)."""
        return cdiv(self.max_model_len, self.settings.block_size) * self.block_bytes

    @property
    def max_useful_blocks(self) -> int:
        """max_num_seqs sequences of max_model_len: more blocks could never be used at once."""
        return self.settings.max_num_seqs * cdiv(max(self.max_model_len, 1), self.settings.block_size)

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
        return self.num_blocks * self.settings.block_size

    @property
    def max_concurrency(self) -> float:
        return self.max_tokens_in_cache / self.max_model_len if self.max_model_len else 0.0

    @property
    def fits(self) -> bool:
        if self.max_model_len < 1 or self.blocks_that_fit < 1:
            return False
        explicit = self.settings.kv_cache_memory_bytes
        if explicit is not None:
            needed = self.device.used_by_others_bytes + self.non_kv_bytes + explicit
            if needed > self.device.total_bytes:
                return False
        return self.max_tokens_in_cache >= self.max_model_len

    # -- diagnosis ------------------------------------------------------------------------------
    @property
    def cause(self) -> str | None:
        if self.fits:
            return None
        s, d = self.settings, self.device
        mem = f"{fmt_bytes(d.total_bytes)}{' unified' if d.unified else ''} memory"
        if s.num_gpu_blocks_override is not None:
            return (f"num_gpu_blocks_override={s.num_gpu_blocks_override} blocks hold "
                    f"{s.num_gpu_blocks_override * s.block_size} tokens, fewer than one sequence of "
                    f"max_model_len {self.max_model_len}.")
        if s.kv_cache_memory_bytes is not None:
            if self.blocks_that_fit * s.block_size < self.max_model_len:
                return (f"--kv-cache-memory {fmt_bytes(s.kv_cache_memory_bytes)} holds "
                        f"{self.blocks_that_fit * s.block_size} tokens, fewer than one sequence of "
                        f"max_model_len {self.max_model_len} ({fmt_bytes(self.seq_bytes)}).")
            return (f"--kv-cache-memory {fmt_bytes(s.kv_cache_memory_bytes)} plus the weights, activations and "
                    f"overhead ({fmt_bytes(self.non_kv_bytes)}) and other processes' "
                    f"{fmt_bytes(d.used_by_others_bytes)} exceed the {mem}.")
        budget, others = self.budget_bytes, d.used_by_others_bytes
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
            return (f"after other processes ({fmt_bytes(others)}) and the weights ({fmt_bytes(self.weight_bytes)}), "
                    f"the activation peak ({fmt_bytes(self.activation_bytes)}) and runtime overhead "
                    f"({fmt_bytes(self.overhead_bytes)}) leave {fmt_bytes(self.kv_budget_bytes)} of the "
                    f"{fmt_bytes(budget)} budget for the KV cache: not one block ({fmt_bytes(self.block_bytes)}).")
        return (f"the KV cache gets {fmt_bytes(self.kv_budget_bytes)}, enough for "
                f"{self.blocks_that_fit * s.block_size} tokens, but one sequence of max_model_len "
                f"{self.max_model_len} needs {fmt_bytes(self.seq_bytes)} "
                f"({fmt_bytes(self.kv_bytes_per_token)} per token).")

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
        if s.kv_cache_memory_bytes is not None:
            want = self.seq_bytes
            candidates.append(("--kv-cache-memory", str(want), self.with_settings(kv_cache_memory_bytes=want)))
        if s.num_gpu_blocks_override is not None:
            blocks = cdiv(self.max_model_len, s.block_size)
            candidates.append(("--num-gpu-blocks-override", str(blocks),
                               self.with_settings(num_gpu_blocks_override=blocks)))
        return [Fix(flag, value, p.effect()) for flag, value, p in candidates if p.fits]

    def effect(self) -> str:
        return (f"KV cache {fmt_bytes(self.kv_cache_bytes)} = {self.max_tokens_in_cache} tokens, "
                f"{self.max_concurrency:.1f} sequences of max_model_len {self.max_model_len} at once")

    def check(self) -> None:
        """Raise KVCacheMemoryError (with breakdown, cause and fixes) unless the plan fits."""
        if self.fits:
            return
        if self.kv_budget_bytes < self.block_bytes and self.settings.num_gpu_blocks_override is None:
            head = "No available memory for the cache blocks"
        else:
            head = (f"The model's max seq len ({self.max_model_len}) is larger than the maximum number of "
                    f"tokens that can be stored in KV cache ({self.blocks_that_fit * self.settings.block_size})")
        raise KVCacheMemoryError(f"{head}: {self.cause}\n{self.table()}")

    # -- presentation ---------------------------------------------------------------------------
    def table(self) -> str:
        s, d, m = self.settings, self.device, self.model
        kind = "unified memory" if d.unified else f"{d.device} memory"
        rows = [
            (f"{kind} total" + (f" ({d.name})" if d.name else ""), fmt_bytes(d.total_bytes), d.source),
            (f"budget (gpu_memory_utilization {s.gpu_memory_utilization:g})", fmt_bytes(self.budget_bytes), ""),
            ("used by other processes and the OS", fmt_bytes(d.used_by_others_bytes), d.source),
            (f"model weights ({str(s.dtype).removeprefix('torch.')})", fmt_bytes(self.weight_bytes), m.weights_source),
            (f"activation peak ({s.max_num_batched_tokens} tokens/step)", fmt_bytes(self.activation_bytes),
             m.activation_source),
            ("runtime overhead", fmt_bytes(self.overhead_bytes), m.overhead_source),
            ("left for the KV cache", fmt_bytes(self.kv_budget_bytes),
             "--kv-cache-memory" if s.kv_cache_memory_bytes is not None else ""),
            ("KV cache per token", fmt_bytes(self.kv_bytes_per_token),
             f"tp={s.tensor_parallel_size}" if s.tensor_parallel_size > 1 else ""),
            (f"one sequence of max_model_len {self.max_model_len}", fmt_bytes(self.seq_bytes), ""),
            ("KV cache allocated", f"{fmt_bytes(self.kv_cache_bytes)} = {self.num_blocks} blocks x "
             f"{s.block_size} tokens", "capped at max_num_seqs x max_model_len"
             if self.num_blocks == self.max_useful_blocks < self.blocks_that_fit else ""),
            ("holds", f"{self.max_tokens_in_cache} tokens = {self.max_concurrency:.1f} x max_model_len", ""),
        ]
        width = max(len(r[0]) for r in rows)
        vwidth = max(len(r[1]) for r in rows)
        lines = [f"  {k:<{width}}  {v:>{vwidth}}  {note}".rstrip() for k, v, note in rows]
        if not self.fits:
            lines.append(f"  cause: {self.cause}")
            fixes = self.fixes()
            if fixes:
                lines.append("  fixes (each alone makes the plan fit):")
                lines += [f"    {f.flag} {f.value}: {f.effect}" for f in fixes]
            util_fix = any(f.flag == "--gpu-memory-utilization" for f in fixes)
            if not util_fix and s.kv_cache_memory_bytes is None and s.num_gpu_blocks_override is None:
                lines.append(f"  no gpu_memory_utilization can fit it: {fmt_bytes(d.used_by_others_bytes)} of the "
                             f"{fmt_bytes(d.total_bytes)} is used elsewhere; free memory there first.")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "fits": self.fits,
            "device": self.device.device,
            "unified_memory": self.device.unified,
            "device_total_bytes": self.device.total_bytes,
            "device_used_bytes": self.device.used_by_others_bytes,
            "budget_bytes": self.budget_bytes,
            "gpu_memory_utilization": self.settings.gpu_memory_utilization,
            "dtype": str(self.settings.dtype).removeprefix("torch."),
            "weights_bytes": self.weight_bytes,
            "activation_peak_bytes": self.activation_bytes,
            "overhead_bytes": self.overhead_bytes,
            "kv_cache_budget_bytes": self.kv_budget_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_size": self.settings.block_size,
            "num_blocks": self.num_blocks,
            "max_model_len": self.max_model_len,
            "max_model_len_fit": self.max_model_len_fit,
            "max_concurrency": round(self.max_concurrency, 3),
            "max_num_batched_tokens": self.settings.max_num_batched_tokens,
            "tensor_parallel_size": self.settings.tensor_parallel_size,
            "sources": {"weights": self.model.weights_source, "activation": self.model.activation_source,
                        "overhead": self.model.overhead_source, "device": self.device.source},
            "cause": self.cause,
            "fixes": [{"flag": f.flag, "value": f.value, "effect": f.effect} for f in self.fixes()],
        }
