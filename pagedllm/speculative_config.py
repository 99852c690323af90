"""--speculative-config, as vLLM spells it: a JSON object (or LLM(speculative_config={...}))."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

# Methods pagedllm runs, by vLLM's names. "ngram": prompt lookup (no model); "draft_model": a small model
# of the same vocabulary, in the same engine; "eagle3" / "mtp": draft heads on the target's hidden states (not yet).
SPECULATIVE_METHODS = ("ngram", "draft_model")
NOT_YET = ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "suffix")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are made and how many. `disable_by_batch_size`: vLLM's cap, a step with more running requests
    than this never speculates; whether a smaller step speculates is decided each step from measured step times
    and acceptance (policy.SpeculationPolicy) unless `adaptive` is false."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    model: str | None = None  # draft_model: the draft's folder or hub name (in the local HF cache)
    draft_tensor_parallel_size: int | None = None  # draft_model: 1 (the draft runs on one rank)
    prompt_lookup_min: int | None = None  # ngram: shortest suffix matched (default: prompt_lookup_max)
    prompt_lookup_max: int | None = None  # ngram: longest suffix matched (default: prompt_lookup_min, else 5)
    disable_by_batch_size: int | None = None
    adaptive: bool = True  # the per-step rule (policy.py); false: speculate whenever there is a draft

    def __post_init__(self) -> None:
        if self.method in NOT_YET:
            raise ValueError(f"speculative method {self.method!r} is not implemented yet; pagedllm runs "
                             f"{', '.join(SPECULATIVE_METHODS)}.")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}; got "
                             f"{self.method!r}.")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: method draft_model needs \"model\" (the draft's folder), and only "
                             "it takes one.")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(f"draft_tensor_parallel_size must be 1 (the draft runs on one rank); got "
                             f"{self.draft_tensor_parallel_size!r}.")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]; got {k!r}.")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}.")
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi}).")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"disable_by_batch_size must be an integer >= 1; got {b!r}.")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A JSON string or a dict (vLLM's keys); None stays None. Unknown keys are refused, never ignored."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config must be a JSON object, e.g. '{{\"method\": \"ngram\", "
                                 f"\"num_speculative_tokens\": 3}}': {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object; got {type(value).__name__}.")
        if "method" not in value and value.get("model") is not None:  # vLLM: a model alone is a draft model
            value = {**value, "method": "draft_model"}
        if value.get("method") in NOT_YET:
            raise ValueError(f"speculative method {value['method']!r} is not implemented yet; pagedllm runs "
                             f"{', '.join(SPECULATIVE_METHODS)}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config keys {unknown} are not supported; known: {sorted(known)}.")
        return cls(**value)
