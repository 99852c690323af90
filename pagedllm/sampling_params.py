"""SamplingParams: how one request picks its tokens and when it stops (vLLM's fields and defaults)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pagedllm.errors import InvalidParameterError
from pagedllm.structured_output import GuidedDecodingParams

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings.

    Field names, meanings and defaults follow vLLM so user code ports unchanged.
    Invalid values raise ValueError naming the field, the value and what is allowed.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> added to its logit before sampling, clamped to [-100, 100] (OpenAI's range)
    logit_bias: dict[int, float] | None = None
    # structured output: a JSON schema, any JSON object, a regex, a choice or a grammar (xgrammar)
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.logit_bias:
            self.logit_bias = {t: min(max(float(b), -100.0), 100.0) for t, b in self.logit_bias.items()}
        if self.temperature < _GREEDY_EPS:
            # Greedy: the knobs that only shape a distribution have nothing to shape.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def _verify(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return InvalidParameterError(name, f"{name} must be {allowed}, got {getattr(self, name)!r}.")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise bad(name, "a finite number")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not self.temperature >= 0.0:
            raise bad("temperature", "a float >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "a float > 0 (1 means no penalty)")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None (up to max_model_len)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                "min_tokens", f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}."
            )
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "None or an integer >= 0")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", "None or an integer >= 0")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise InvalidParameterError("stop", f"stop must contain only non-empty strings, got {self.stop!r}.")
        for t, b in (self.logit_bias or {}).items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or not isinstance(b, (int, float)) \
                    or not math.isfinite(b):
                raise InvalidParameterError("logit_bias", f"logit_bias must map token ids (integers >= 0) to finite "
                                                          f"numbers, got {t!r}: {b!r}.")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise InvalidParameterError(
                    "stop_token_ids", f"stop_token_ids must contain only non-negative integers, got {self.stop_token_ids!r}."
                )

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)
