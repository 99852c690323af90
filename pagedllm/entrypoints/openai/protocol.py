"""OpenAI API request bodies (with vLLM's extra sampling fields) as pydantic models.

Unknown fields are rejected (400) rather than silently ignored; fields OpenAI defines that we do
not implement are accepted only at their neutral value. Types are strict where OpenAI's are: a token id is
an integer (not 1.0 or true), a flag a boolean (not "false"), a number a number (not "1").
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.sampling_params import SamplingParams


STRICT = ConfigDict(extra="forbid", strict=True)
NonEmptyStr = Annotated[str, Field(min_length=1)]
# vLLM's default --max-logprobs. More than the vocabulary fails the engine step (torch.topk), and
# with it every running request: such a request is refused before it reaches the engine.
MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    n: int = Field(default=1, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1, le=2**63 - 1)  # more overflows int64 in the sampler
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    logit_bias: dict[str, float] | None = None
    # vLLM's: requests with different salts never share prefix-cache blocks (no timing side channel).
    cache_salt: str | None = Field(default=None, min_length=1)
    # vLLM's: lower is more important; decides which running request is preempted first.
    priority: int = 0

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, why) for OpenAI fields set to values we don't implement."""
        out = []
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported"))
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            out.append(("stream_options", "stream_options.continuous_usage_stats is not supported"))
        return out

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None, default_max_tokens: int
                           ) -> SamplingParams:
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(
            n=self.n, temperature=temperature, top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens, min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.best_of is not None and self.best_of != self.n:
            out.append(("best_of", f"best_of must equal n ({self.n}) or be omitted; got {self.best_of}"))
        if self.suffix:
            out.append(("suffix", "suffix is not supported"))
        return out


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text", "json_object", "json_schema"]


class ChatAudioOutput(BaseModel):
    """OpenAI's `audio` of a chat request with modalities ["text", "audio"]: the voice and file format."""

    model_config = STRICT
    voice: str | None = None  # a --voice-presets-dir voice; None: the model's own choice
    format: str = "wav"


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template: str | None = None
    add_generation_prompt: bool = True
    echo: bool = False
    # OpenAI's audio output: modalities ["text", "audio"] and the audio's voice and format.
    modalities: list[Literal["text", "audio"]] | None = None
    audio: ChatAudioOutput | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.response_format is not None and self.response_format.type != "text":
            out.append(("response_format", f"response_format type {self.response_format.type!r} is not "
                                           f"supported (only 'text')"))
        if self.tools:
            out.append(("tools", "tool calling is not supported"))
        if self.tool_choice not in (None, "none", "auto"):
            out.append(("tool_choice", "tool calling is not supported"))
        if self.top_logprobs is not None and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs needs logprobs=true"))
        return out


class SpeechRequest(BaseModel):
    """OpenAI's POST /v1/audio/speech, plus streaming and sampling fields (vLLM style)."""

    model_config = STRICT
    model: str | None = None
    input: str = Field(min_length=1)
    voice: str | None = None  # a --voice-presets-dir voice; None: the model's own choice
    instructions: str | None = None  # the scene description of the prompt
    response_format: str = "wav"
    speed: float = 1.0
    stream: bool = False  # WAV header (or nothing, for pcm) then PCM chunks as frames are decoded
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, le=2**63 - 1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    max_tokens: int | None = None  # generation steps (frames) at most


class TokenizeRequest(BaseModel):
    """Exactly one of `prompt` and `messages` (neither may be null)."""

    model_config = ConfigDict(extra="forbid", strict=True,
                              json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    model: str | None = None
    prompt: str = None  # type: ignore[assignment]  (absent: None; null is refused)
    messages: list[ChatMessage] = Field(default=None, min_length=1)  # type: ignore[assignment]
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]  # (and below the vocabulary size: the document says it)
