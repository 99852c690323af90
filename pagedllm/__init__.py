"""pagedllm: LLM inference and serving over a paged KV cache."""
from pagedllm.errors import InvalidPromptError, KVCacheMemoryError, UnsupportedModelError
from pagedllm.outputs import CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "PoolingParams", "PoolingRequestOutput",
    "PoolingOutput",
    "KVCacheMemoryError", "UnsupportedModelError", "InvalidPromptError", "__version__",
]


def __getattr__(name):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
