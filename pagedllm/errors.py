"""Typed exceptions users can catch: ValueErrors for bad input or an impossible configuration, WorkerError when
a tensor-parallel worker is lost."""


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


class WorkerError(RuntimeError):
    """A tensor-parallel worker died, failed or stopped answering: the engine cannot go on (its requests
    fail; a server reports unhealthy and exits)."""
