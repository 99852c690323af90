"""Start-up of the audio server: the codec loaded inside the engine's memory plan, then checked
against the model, the voices, and the cache of encoded audio."""
from __future__ import annotations

import logging
from pathlib import Path

from pagedllm.audio.engine import AudioTokenizerComponent
from pagedllm.audio.memory import measured_audio_tokenizer_memory
from pagedllm.audio.mm_cache import EncodedAudioCache
from pagedllm.audio.prompt import check_special_tokens
from pagedllm.audio.tokenizer import AudioTokenizer, resolve_audio_tokenizer
from pagedllm.audio.voices import load_voice_presets
from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.audio_args import AudioServerConfig
from pagedllm.entrypoints.openai.serving import ServingContext
from pagedllm.entrypoints.openai.serving_audio import AudioServing
from pagedllm.memory.plan import ComponentMemory, MemoryPlan

logger = logging.getLogger(__name__)


def create_audio_engine(config: EngineConfig, tokenizer, audio: AudioServerConfig) -> LLMEngine:
    """The engine, with the codec loaded on its device and planned beside the model."""

    def load(engine_config: EngineConfig, plan: MemoryPlan) -> tuple[AudioTokenizer, list[ComponentMemory]]:
        source = resolve_audio_tokenizer(audio.tokenizer or "", audio.tokenizer_path)
        dummy = engine_config.model.load_format == "dummy" and not source.has_weights
        codec = AudioTokenizer.load(source, engine_config.device, dummy=dummy)
        components = [measured_audio_tokenizer_memory(codec, engine_config.model.max_model_len)]
        if audio.mm_cache_bytes and (plan.device.device == "cpu" or plan.device.unified):
            # Host memory is the device's here: the cache of encoded audio may take this much of it.
            components.append(ComponentMemory("multimodal cache (--mm-processor-cache-gb)", audio.mm_cache_bytes, 0,
                                              "its size limit"))
        return codec, components

    return LLMEngine(config, tokenizer, components=[AudioTokenizerComponent(load)])


def create_audio_serving(engine: AsyncLLMEngine, ctx: ServingContext, audio: AudioServerConfig) -> AudioServing:
    """Check the codec, the text tokenizer and the voices against the model; build the cache."""
    llm_engine = engine.engine
    codec: AudioTokenizer = next(c.codec for c in llm_engine.components if isinstance(c, AudioTokenizerComponent))
    generation = llm_engine.audio
    if generation is None:
        raise ValueError(f"--audio-tokenizer-type is for speech models; {llm_engine.config.model.model!r} "
                         f"({llm_engine.config.model.architecture}) generates no audio")
    spec = generation.spec
    if codec.num_codebooks != spec.num_codebooks:
        raise ValueError(f"the audio tokenizer has {codec.num_codebooks} codebooks, the model {spec.num_codebooks}")
    if codec.codebook_size > min(spec.stream_bos_id, spec.stream_eos_id):
        raise ValueError(f"the audio tokenizer's codes go up to {codec.codebook_size - 1}, into the model's stream "
                         f"bos/eos ids ({spec.stream_bos_id}, {spec.stream_eos_id})")
    if llm_engine.tokenizer is None:
        raise ValueError("a speech model needs its text tokenizer (tokenizer files in the model folder or --tokenizer)")
    check_special_tokens(llm_engine.tokenizer, spec)
    voices = load_voice_presets(audio.voice_presets_dir) if audio.voice_presets_dir else {}
    cache = EncodedAudioCache(audio.mm_cache_bytes) if audio.mm_cache_bytes else None
    logger.info("audio: %s (%d codebooks, %d Hz, %d frames/s), %d voices, encoded-audio cache %s, limit %s per prompt",
                codec.name, codec.num_codebooks, codec.sampling_rate, codec.frame_rate, len(voices),
                f"{audio.mm_cache_bytes} bytes" if cache is not None else "off",
                audio.limit_audio_per_prompt if audio.limit_audio_per_prompt is not None else "none")
    return AudioServing(ctx, codec, llm_engine.tokenizer, spec, voices, cache, audio.limit_audio_per_prompt,
                        stop_after_silence_frames=audio.stop_after_silence_frames,
                        voices_dir=Path(audio.voice_presets_dir).expanduser() if audio.voice_presets_dir else None,
                        max_reference_seconds=audio.max_reference_seconds)
