"""Architecture name (config.json "architectures") -> our implementation."""
from __future__ import annotations

from pagedllm.errors import UnsupportedModelError
from pagedllm.pooler_config import BARE_DECODERS, SEQUENCE_CLASSIFIERS
from pagedllm.model_executor.models.higgs_audio_v2 import (
    HiggsAudioV2ForConditionalGeneration,
)
from pagedllm.model_executor.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from pagedllm.model_executor.models.gpt_oss import GptOssForCausalLM
from pagedllm.model_executor.models.moe_llama import MixtralForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "HiggsAudioV2ForConditionalGeneration": HiggsAudioV2ForConditionalGeneration,  # model_type higgs_audio_v2
}

# Pooling checkpoints of the same decoders (pooler_config.py): a sequence classifier's, and a bare decoder's.
MODEL_REGISTRY.update({arch: MODEL_REGISTRY[causal] for arch, causal in {**SEQUENCE_CLASSIFIERS, **BARE_DECODERS}.items()})


def get_model_class(hf_config) -> tuple[str, type]:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return arch, MODEL_REGISTRY[arch]
    raise UnsupportedModelError(
        f"model architecture {archs or '(none in config.json)'} is not supported. "
        f"Supported architectures: {', '.join(MODEL_REGISTRY)}."
    )
