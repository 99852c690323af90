"""OpenAI API request bodies (with vLLM's extra sampling fields) as pydantic models.

Unknown fields are ignored with one warning per field name (as vLLM: clients send fields of newer API
versions); fields OpenAI defines that pagedllm cannot honour are refused only at values that would change the
answer. Types are strict where OpenAI's are: a token id is an integer (not 1.0 or true), a flag a boolean (not
"false"), a number a number (not "1").
"""
from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import GuidedDecodingParams

logger = logging.getLogger(__name__)

_WARNED: set[tuple[str, str]] = set()
_MAX_WARNED = 1000  # field names remembered (a fuzzer sends endless new ones)


class LenientModel(BaseModel):
    """Unknown fields are dropped, with one warning per (request kind, field name)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in data.keys() - cls._known_fields():
                key = (cls.__name__, str(name)[:100])
                if key not in _WARNED and len(_WARNED) < _MAX_WARNED:
                    _WARNED.add(key)
                    logger.warning("ignoring the unknown field %r of %s requests (and from now on, silently)",
                                   key[1], cls.__name__)
        return data

    @classmethod
    def _known_fields(cls) -> set[str]:
        """Field names and the aliases clients send them under (`json` for the attribute `json_`)."""
        return set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}


NonEmptyStr = Annotated[str, Field(min_length=1)]
MAX_AUDIO_CHUNK_FRAMES = 250  # 10 s of audio at 25 frames/s in one streamed chunk
MAX_AUDIO_OVERLAP_FRAMES = 64  # frames of context decoded each side of a chunk
MAX_SILENCE_FRAMES = 1500  # a minute at 25 frames/s


class StreamOptions(LenientModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(LenientModel):
    """vLLM's `structured_outputs` object: one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingRequest(LenientModel):
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
    prompt_logprobs: int | None = Field(default=None, ge=0)  # (at most --max-logprobs)
    logit_bias: dict[str, float] | None = None
    # vLLM's: requests with different salts never share prefix-cache blocks (no timing side channel).
    cache_salt: str | None = Field(default=None, min_length=1)
    # vLLM's: lower is more important; decides which running request is preempted first.
    priority: int = 0
    # Structured outputs (vLLM's extra fields; chat's response_format too): at most one of them.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    def guided_decoding(self) -> GuidedDecodingParams | None:
        """The request's constraint, named by the field that set it; None: free text."""
        given = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(GuidedDecodingParams(json_object=True, param="response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise InvalidParameterError("response_format", "response_format json_schema needs "
                                                               "{\"json_schema\": {\"schema\": {...}}}")
            given.append(GuidedDecodingParams(json=rf.json_schema.json_schema, param="response_format"))
        for field_name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                                 ("guided_grammar", "grammar")):
            value = getattr(self, field_name)
            if value is not None:
                given.append(GuidedDecodingParams(**{kind: value}, param=field_name))
        so = self.structured_outputs
        if so is not None:
            given.append(GuidedDecodingParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                              json_object=bool(so.json_object), param="structured_outputs"))
        if len(given) > 1:
            raise InvalidParameterError(given[1].param, f"{given[0].param} and {given[1].param} both constrain the "
                                                        f"output: give one")
        return given[0] if given else None

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, why) for OpenAI fields set to values we don't implement."""
        out = []
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
            logit_bias=_token_bias(self.logit_bias), guided_decoding=self.guided_decoding(),
        )


def _token_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON object keys) with integer keys."""
    if not logit_bias:
        return None
    bad = [k for k in logit_bias if not k.isdigit()]
    if bad:
        raise InvalidParameterError("logit_bias", f"logit_bias keys must be token ids (non-negative integers), "
                                                  f"got {bad[:3]!r}.")
    return {int(k): v for k, v in logit_bias.items()}


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0)  # (at most --max-logprobs)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _token_ids_in_one_pass(cls, value: Any, handler):
        """Token ids are checked in one pass of the list: pydantic's union tries each member on every element
        (a million ids held the event loop 1.6 s). Anything else goes through the union as before."""
        if isinstance(value, list) and value:
            if all(type(t) is int for t in value):
                return value
            if all(type(p) is list and all(type(t) is int for t in p) for p in value):
                return value
        return handler(value)

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


class ChatAudioOutput(LenientModel):
    """OpenAI's `audio` of a chat request with modalities ["text", "audio"]: the voice and file format."""

    voice: str | None = None  # a --voice-presets-dir voice; None: the model's own choice
    format: str | None = None  # None: wav, or pcm16 when streamed


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)  # (at most --max-logprobs)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (enable_thinking: false)
    add_generation_prompt: bool = True
    echo: bool = False
    # OpenAI's audio output: modalities ["text", "audio"] and the audio's voice and format.
    modalities: list[Literal["text", "audio"]] | None = None
    audio: ChatAudioOutput | None = None
    # A reference voice for audio output (vLLM-Omni's names), as /v1/audio/speech takes it.
    ref_audio: str | None = Field(default=None, min_length=1)
    ref_text: str | None = Field(default=None, min_length=1)
    # Streamed audio (as the reference server): frames per chunk, and frames of context decoded each side.
    audio_chunk_size: int | None = Field(default=None, ge=1, le=MAX_AUDIO_CHUNK_FRAMES)
    audio_chunk_overlap_size: int | None = Field(default=None, ge=0, le=MAX_AUDIO_OVERLAP_FRAMES)
    # End audio after this many frames in a row of near-silence (0: off; None: the server's flag).
    stop_after_silence_frames: int | None = Field(default=None, ge=0, le=MAX_SILENCE_FRAMES)
    # OpenAI fields that do not change the answer: accepted at any value and ignored.
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prediction: dict[str, Any] | None = None
    # OpenAI fields that would change it: refused unless at their neutral value.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.functions:
            out.append(("functions", "functions (the deprecated form of tools) are not supported"))
        if self.function_call not in (None, "none", "auto"):
            out.append(("function_call", "function_call is not supported"))
        if self.web_search_options is not None:
            out.append(("web_search_options", "web search is not supported"))
        if self.top_logprobs is not None and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs needs logprobs=true"))
        taken = sorted(set(self.chat_template_kwargs or {}) & RESERVED_TEMPLATE_VARIABLES)
        if taken:
            out.append(("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(taken)}: the request's "
                                                f"own fields give those"))
        return out


# What the chat template's renderer sets itself (transformers' apply_chat_template): not for chat_template_kwargs.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token", "unk_token", "pad_token",
})


class SpeechRequest(LenientModel):
    """OpenAI's POST /v1/audio/speech, plus streaming and sampling fields (vLLM style)."""

    model: str | None = None
    input: str = Field(min_length=1)
    voice: str | None = None  # a --voice-presets-dir voice; None: the model's own choice
    instructions: str | None = None  # the scene description of the prompt
    response_format: str = "wav"
    speed: float = 1.0
    stream: bool = False  # WAV header (or nothing, for pcm) then PCM chunks as frames are decoded
    # A reference voice in the request (vLLM-Omni's names): a clip (base64, or a data: URL) and its transcript.
    ref_audio: str | None = Field(default=None, min_length=1)
    ref_text: str | None = Field(default=None, min_length=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, le=2**63 - 1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    max_tokens: int | None = None  # generation steps (frames) at most
    audio_chunk_size: int | None = Field(default=None, ge=1, le=MAX_AUDIO_CHUNK_FRAMES)
    audio_chunk_overlap_size: int | None = Field(default=None, ge=0, le=MAX_AUDIO_OVERLAP_FRAMES)
    # End audio after this many frames in a row of near-silence (0: off; None: the server's flag).
    stop_after_silence_frames: int | None = Field(default=None, ge=0, le=MAX_SILENCE_FRAMES)


class TokenizeRequest(LenientModel):
    """Exactly one of `prompt` and `messages` (neither may be null)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    model: str | None = None
    prompt: str = None  # type: ignore[assignment]  (absent: None; null is refused)
    messages: list[ChatMessage] = Field(default=None, min_length=1)  # type: ignore[assignment]
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(LenientModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]  # (and below the vocabulary size: the document says it)
