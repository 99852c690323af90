"""A speech model's audio tokenizer as a planned component of the engine (LLMEngine's `components`): loaded on the
engine's device after the engine has measured itself and before the KV cache is sized, its memory on its own line
of the plan."""
from __future__ import annotations

from collections.abc import Callable

from pagedllm.audio.tokenizer import AudioTokenizer
from pagedllm.config import EngineConfig
from pagedllm.memory.plan import ComponentMemory, MemoryPlan

# Loads the codec on the engine's device and returns it with the memory to plan for it (and, for
# example, a cache living in the same memory), given the engine's plan without them.
ComponentLoader = Callable[[EngineConfig, MemoryPlan], tuple[AudioTokenizer, list[ComponentMemory]]]


class AudioTokenizerComponent:
    """The codec, once the engine has loaded it (`codec`)."""

    def __init__(self, load_audio_tokenizer: ComponentLoader) -> None:
        self._load = load_audio_tokenizer
        self.codec: AudioTokenizer | None = None

    def load(self, config: EngineConfig, plan: MemoryPlan) -> list[ComponentMemory]:
        self.codec, parts = self._load(config, plan)
        return parts
