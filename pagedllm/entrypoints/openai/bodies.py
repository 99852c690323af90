"""What the server answers with: every response body and stream chunk, as the pydantic models that /openapi.json
publishes. The routes build these and send `to_json()` of them, so the document is the code: a field the
document does not name cannot be sent (extra fields are refused when a body is built).

A field left out when a body is built is left out of its JSON (OpenAI sends `usage` in stream chunks only when
asked for, `stop_reason` only on a choice's last chunk); a field given as None is sent as null."""
from __future__ import annotations

from typing import Any, ClassVar, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ALWAYS_SENT: ClassVar[tuple[str, ...]] = ()  # fields sent (as null at least) though not given

    def model_post_init(self, _context: Any) -> None:
        self.__pydantic_fields_set__.update(_always_sent(type(self)))

    def to_json(self) -> dict:
        """The body as JSON-ready data: the fields that were given, and those always sent."""
        return self.model_dump(mode="json", exclude_unset=True)

    def sse(self) -> str:
        """The body as one server-sent event."""
        return f"data: {self.model_dump_json(exclude_unset=True)}\n\n"

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler) -> dict:
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        always = [name for name in _always_sent(cls) if name not in target.get("required", [])]
        if always:  # the document says they are always there
            target["required"] = [*target.get("required", []), *always]
        return schema


_ALWAYS_SENT: dict[type, frozenset[str]] = {}


def _always_sent(cls: type[Body]) -> frozenset[str]:
    """`ALWAYS_SENT` and the fields with one possible value (`object`)."""
    if cls not in _ALWAYS_SENT:
        _ALWAYS_SENT[cls] = frozenset(cls.ALWAYS_SENT) | frozenset(
            name for name, f in cls.model_fields.items()
            if get_origin(f.annotation) is Literal and len(get_args(f.annotation)) == 1)
    return _ALWAYS_SENT[cls]


class ErrorDetail(Body):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(Body):
    """Every error, as OpenAI sends it."""

    error: ErrorDetail


class Usage(Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Body):
    tokens: list[str | None]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None


class CompletionResponse(Body):
    """POST /v1/completions; with "stream": true each server-sent event's data is one of these (usage only
    on the last, when stream_options.include_usage), then "[DONE]"."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(Body):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Body):
    content: list[ChatTokenLogprob]


class ChatAudio(Body):
    id: str
    data: str  # base64 of the audio file
    expires_at: int
    transcript: str


class FunctionCall(Body):
    name: str
    arguments: str  # JSON text


class ToolCallOut(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_delta(self, index: int) -> ToolCallDelta:
        """The whole call as one piece of a stream."""
        return ToolCallDelta(index=index, id=self.id, type=self.type,
                             function=FunctionCallDelta(name=self.function.name, arguments=self.function.arguments))


class FunctionCallDelta(Body):
    name: str | None = None  # in the call's first piece only
    arguments: str  # the next piece of the JSON text


class ToolCallDelta(Body):
    """A piece of a streamed call (as OpenAI): the first has id, type and name; the rest only arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatMessageOut(Body):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser: the think block (vLLM's name)
    audio: ChatAudio | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(Body):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatAudioDelta(Body):
    """A chunk of streamed audio: base64 16-bit PCM, mono, at the codec's rate (24 kHz for Higgs Audio v2)."""

    id: str
    data: str
    transcript: str | None = None  # in the first chunk
    expires_at: int | None = None  # in the first chunk


class ChatDelta(Body):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    audio: ChatAudioDelta | None = None


class ChatChunkChoice(Body):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # on the choice's last chunk

    ALWAYS_SENT = ("logprobs", "finish_reason")  # null until there is one


class ChatCompletionChunk(Body):
    """One server-sent event of a streamed chat completion (then "[DONE]")."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(Body):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(Body):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(Body):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(Body):
    prompt: str


class TokenizerInfo(Body):
    """GET /tokenizer_info (vLLM's): the tokenizer's special tokens and template; {"tokenizer": null} for a model
    served without one."""

    tokenizer: None = None
    tokenizer_class: str | None = None
    eos_token: str | None = None
    eos_token_id: int | None = None
    bos_token: str | None = None
    bos_token_id: int | None = None
    pad_token: str | None = None
    pad_token_id: int | None = None
    chat_template: str | dict[str, str] | None = None  # (named templates: a dict)
    model_max_length: int | None = None
    vocab_size: int | None = None


class VersionResponse(Body):
    version: str


class Voice(Body):
    id: str
    object: Literal["voice"] = "voice"
    name: str
    format: str
    transcript: str | None


class VoiceList(Body):
    object: Literal["list"] = "list"
    data: list[Voice]
    voices: list[Voice]  # the same list under the key Open WebUI's TTS settings read


class AudioModel(Body):
    id: str


class AudioModelList(Body):
    """GET /v1/audio/models: the served names (Open WebUI's TTS settings list them as `models`)."""

    models: list[AudioModel]


class MemoryResponse(Body):
    """The memory plan (`pagedllm plan --json`'s fields) and what the KV cache holds now."""

    model_config = ConfigDict(extra="allow")
    kv_cache_usage: dict[str, Any]
    requests: list[dict[str, Any]]
    num_waiting: int
    num_swapped: int
