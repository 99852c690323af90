"""Typed exceptions users can catch. All are ValueErrors: bad input or an impossible configuration."""


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or config feature pagedllm does not implement."""


class KVCacheMemoryError(ValueError):
    """The KV cache cannot be given enough memory (the message holds the breakdown and the fix)."""


class InvalidPromptError(ValueError):
    """A prompt that can never be served: empty, too long, or holding ids outside the vocabulary."""


class UnsupportedSamplingParamsError(ValueError):
    """Sampling settings the model cannot honour (e.g. logprobs or penalties for audio codes)."""


class InvalidParameterError(ValueError):
    """A request parameter with a value that is not allowed; `param` names it (the API's error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
