"""An LLMEngine that also holds a speech model's audio tokenizer, with its memory in the engine's plan.

The codec is loaded after the engine has measured its own weights, activation peak and runtime
overhead (so none of those include the codec) and before the KV cache is sized from the plan (so
the codec's weights and measured peak are taken from the KV cache's budget): the hook between the
two is LLMEngine._plan_memory. The plan shows the codec on its own line.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from pagedllm.audio.tokenizer import AudioTokenizer
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.memory.plan import ComponentMemory, MemoryPlan

logger = logging.getLogger(__name__)

# Loads the codec on the engine's device and returns it with the memory to plan for it (and, for
# example, a cache living in the same memory), given the engine's plan without them.
ComponentLoader = Callable[[EngineConfig, MemoryPlan], tuple[AudioTokenizer, list[ComponentMemory]]]


class AudioLLMEngine(LLMEngine):
    def __init__(self, config: EngineConfig, tokenizer, load_audio_tokenizer: ComponentLoader) -> None:
        self._load_audio_tokenizer = load_audio_tokenizer
        self.audio_tokenizer: AudioTokenizer | None = None
        super().__init__(config, tokenizer)

    def _plan_memory(self, config: EngineConfig, at_start) -> MemoryPlan:
        plan = super()._plan_memory(config, at_start)
        self.audio_tokenizer, components = self._load_audio_tokenizer(config, plan)
        for c in components:
            logger.info("%s: weights %d bytes, peak %d bytes (%s)", c.name, c.weight_bytes, c.activation_bytes,
                        c.source)
        return replace(plan, components=plan.components + tuple(components))
