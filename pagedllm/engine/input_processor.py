"""The engine's input side (vLLM v1's InputProcessor): a prompt and its SamplingParams checked and made into
engine Requests, one per sample of `n`: tokenized (or its chat template rendered), its audio expanded, every
value against the model's limits, a structured output compiled. Bad input is refused here, with the field
named, before anything is queued."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.engine.audio_inputs import AudioGeneration, AudioPrompt, refuse_audio
from pagedllm.engine.request import Request
from pagedllm.errors import InvalidParameterError, InvalidPromptError
from pagedllm.model_executor.audio_sampling import verify_audio_sampling_params
from pagedllm.model_executor.model_files import generation_eos_ids
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import StructuredOutputManager

PromptType = str | list[int] | dict


@dataclass
class ProcessedRequest:
    """What one submitted request became: its prompt and one engine request per sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    requests: list[Request]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer, audio: AudioGeneration | None,
                 structured_outputs: StructuredOutputManager) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.audio = audio  # an audio model's prompts and sampling (None for a text model)
        self.structured_outputs = structured_outputs
        self.eos_token_ids = self._eos_token_ids()

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams, strict_length: bool = False,
                priority: int = 0) -> ProcessedRequest:
        """With `strict_length`, prompt + max_tokens over max_model_len is an error (the server's rule) instead of
        generation ending at max_model_len (the offline rule)."""
        self.check_priority(priority)
        self._check_runner(params)
        if isinstance(params, PoolingParams):
            return self._pooling_request(request_id, prompt, params, priority)
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
        self._validate_params(params)
        requests = []
        for j in range(params.n):
            child_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + j)
            # The n samples are queued one after another: the later ones hit the first one's prompt
            # blocks in the prefix cache, even when all are scheduled in the same step.
            requests.append(Request(
                f"{request_id}" if params.n == 1 else f"{j}_{request_id}", ids, child_params,
                self.eos_token_ids if audio_prompt is None else set(),  # audio ends by its codes
                max_len, cache_salt=cache_salt, priority=priority,
                **self._audio_request_args(audio_prompt, child_params)))
        return ProcessedRequest(request_id, text, ids, params, requests)

    def _check_runner(self, params) -> None:
        """Sampling requests go to the generate runner, pooling requests to the pooling runner."""
        pooler = self.config.model.pooler
        if isinstance(params, PoolingParams):
            if pooler is None:
                raise InvalidParameterError("model", "this engine runs the generate runner: embeddings and scores need "
                                                     "a pooling model served with --runner pooling (or --task embed).")
            if params.task != pooler.task:
                can = "embeddings (and scores by cosine similarity)" if pooler.task == "embed" else \
                    "classification and scores"
                raise InvalidParameterError("model", f"this pooling model ({pooler.describe()}) gives {can}, not "
                                                     f"{params.task}.")
            return
        if pooler is not None:
            raise InvalidParameterError("model", f"this engine runs the pooling runner ({pooler.describe()}): it "
                                                 f"embeds and scores, it does not generate. Serve a generative model "
                                                 f"(or this one with --runner generate) to generate.")

    def _pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                         priority: int) -> ProcessedRequest:
        """A pooling request: its whole prompt (up to max_model_len tokens) is computed and pooled; it generates
        nothing, so it carries SamplingParams that sample nothing."""
        text, ids = self.tokenize_prompt(prompt)
        refuse_audio(prompt)
        self._validate_prompt(ids, room_for_output=False)
        pooler, hidden = self.config.model.pooler, self.config.model.hf_config.hidden_size
        if params.dimensions is not None:
            if pooler.matryoshka_dimensions is None:
                raise InvalidParameterError("dimensions", "this model does not support Matryoshka representation: "
                                                          "its embeddings cannot be cut to fewer dimensions (leave "
                                                          "dimensions out, or name a Matryoshka model's "
                                                          "is_matryoshka in --hf-overrides).")
            allowed = pooler.matryoshka_dimensions
            if params.dimensions > hidden or (allowed and params.dimensions not in allowed):
                raise InvalidParameterError("dimensions", f"dimensions must be "
                                                          f"{'one of ' + str(list(allowed)) if allowed else f'1..{hidden}'}"
                                                          f", got {params.dimensions}.")
        request = Request(request_id, ids, SamplingParams(max_tokens=1), set(), self.config.model.max_model_len + 1,
                          cache_salt=self._cache_salt(prompt), priority=priority, pooling_params=params)
        return ProcessedRequest(request_id, text, ids, params, [request])

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
                            add_generation_prompt: bool = True, tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """Render a conversation (and the tools it may call) with the model's (or the given) chat template ->
        (text, token ids). `template_kwargs`: more variables for the template (`enable_thinking`)."""
        if self.tokenizer is None:
            raise InvalidPromptError("chat needs a tokenizer with a chat template; this model has no tokenizer")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise InvalidPromptError("this model's tokenizer has no chat template; pass one (--chat-template)")
        text = self.tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, tools=tools,
                                                  **(template_kwargs or {}))
        # The template already holds the special tokens (BOS): don't add them twice.
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def check_priority(self, priority: int) -> None:
        """A request's priority counts only under --scheduling-policy priority (as vLLM): elsewhere anything but
        0 is refused, so no client can put itself first on a server whose operator did not ask for it."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise InvalidParameterError("priority", f"priority {priority} needs the engine started with "
                                                    f"--scheduling-policy priority (scheduling_policy='priority'); "
                                                    f"under {self.config.scheduler.policy} every request's is 0.")

    def _eos_token_ids(self) -> set[int]:
        ids = generation_eos_ids(self.config.model.path)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        if not ids:
            eos = getattr(self.config.model.hf_config, "eos_token_id", None)
            ids = set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
        return ids

    @staticmethod
    def _cache_salt(prompt: PromptType) -> str | None:
        """A prompt dict's `cache_salt`: requests with different salts never share cached blocks."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidPromptError(f"cache_salt must be a non-empty string, got {salt!r}")
        return salt

    def _validate_prompt(self, ids: list[int], room_for_output: bool = True) -> None:
        max_len = self.config.model.max_model_len
        if not ids:
            raise InvalidPromptError("the prompt is empty: it must hold at least one token")
        if not room_for_output and len(ids) > max_len:
            raise InvalidPromptError(f"the prompt has {len(ids)} tokens, but this model's maximum context length "
                                     f"(max_model_len) is {max_len} tokens: shorten it (or truncate it: "
                                     f"truncate_prompt_tokens)")
        if room_for_output and len(ids) >= max_len:
            raise InvalidPromptError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {max_len}: it must be at most "
                f"{max_len - 1} tokens to leave room for one generated token")
        vocab = self.config.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidPromptError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def _validate_params(self, params: SamplingParams) -> None:
        vocab, most = self.config.model.vocab_size, self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > most:
                raise InvalidParameterError(name, f"{name} must be at most {most} (max_logprobs; -1 allows up to "
                                                  f"the vocabulary size, {vocab}), got {value}.")
        bad_bias = [t for t in params.logit_bias or {} if t >= vocab]
        if bad_bias:
            raise InvalidParameterError("logit_bias", f"logit_bias token ids {bad_bias[:5]} are outside the vocabulary "
                                                      f"[0, {vocab})")
        if params.guided_decoding is not None:
            self.structured_outputs.compile(params.guided_decoding)  # an invalid constraint fails here, not in a step
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise InvalidParameterError("stop_token_ids", f"stop_token_ids {bad_stop} are outside the vocabulary "
                                                          f"[0, {vocab})")

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
