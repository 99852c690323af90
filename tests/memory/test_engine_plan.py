"""The engine's memory plan on this CPU machine, with tiny models: the KV blocks it allocates are
exactly what the plan's own measured numbers give, and measured weights match the safetensors headers."""
from __future__ import annotations

import math

import pytest
import torch

from pagedllm import LLM, KVCacheMemoryError, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.plan import dry_run_plan
from pagedllm.memory.model_size import weight_bytes_from_headers
from pagedllm.model_executor.cpu_isa import cpu_isa
from pagedllm.model_executor.model_files import load_hf_config, weight_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kv_per_token_by_hand(path, dtype: torch.dtype) -> int:
    cfg = load_hf_config(path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype.itemsize


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("qwen2", "float32"), ("llama", "bfloat16"),
                                         ("qwen2", "bfloat16"), ("qwen3_moe", "bfloat16")])
def test_engine_blocks_and_weights_match_the_plan(tiny_models, arch, dtype):
    path = tiny_models[arch]
    torch_dtype = DTYPES[dtype]
    llm = LLM(str(path), dtype=dtype, max_model_len=64)
    engine, plan = llm.llm_engine, llm.memory_plan
    assert plan.device.device == "cpu" and plan.device.source == "measured"
    assert plan.model.weights_source == "measured" and plan.model.overhead_source == "measured"

    # Weights: measured bytes == the safetensors headers at the engine dtype (tied lm_head counted once).
    cfg = load_hf_config(path)
    tied = bool(cfg.tie_word_embeddings)
    assert tied == (arch == "qwen2")
    headers = weight_bytes_from_headers(weight_files(path), torch_dtype, tied)
    # On the avx512_bf16 path a tied bf16 head also holds oneDNN's copy beside the embedding's table (cpu_ops.py).
    copy = cfg.vocab_size * cfg.hidden_size * 2 if tied and dtype == "bfloat16" and cpu_isa() == "avx512_bf16" else 0
    assert engine.executor.driver.weight_bytes == headers + copy == plan.weight_bytes
    assert ("the tied LM head twice" in plan.table()) == (copy > 0)
    assert headers == weight_bytes_from_headers(weight_files(path), torch.float32, tied) * torch_dtype.itemsize // 4

    # KV bytes per token by hand.
    kv = kv_per_token_by_hand(path, torch_dtype)
    assert plan.kv_bytes_per_token == kv

    # The number of blocks, recomputed from the plan's own measured inputs.
    bs = engine.config.cache.block_size
    left = (plan.budget_bytes - plan.device.used_by_others_bytes - plan.weight_bytes - plan.activation_bytes
            - plan.overhead_bytes)
    assert plan.budget_bytes == int(plan.device.total_bytes * 0.9)
    expected = min(left // (kv * bs), engine.config.scheduler.max_num_seqs * math.ceil(64 / bs))
    assert plan.fits and expected > 0
    assert plan.num_blocks == expected
    assert engine.kv_cache.pool.num_blocks == expected
    kv_cache = engine.executor.driver.kv_cache
    assert tuple(kv_cache.shape) == (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, expected * bs,
                                     kv_cache.shape[-1])
    assert kv_cache.dtype == torch_dtype
    assert kv_cache.numel() * kv_cache.element_size() == plan.kv_cache_bytes == expected * bs * kv

    # A dry run of the same folder predicts the same weights and KV per token (it loads no weight).
    dry = dry_run_plan(EngineArgs(model=str(path), dtype=dtype, max_model_len=64), device="cpu",
                       device_memory="8GiB")
    assert dry.model.weights_source == "safetensors headers"
    assert dry.weight_bytes == engine.executor.driver.weight_bytes and dry.kv_bytes_per_token == kv


def test_kv_cache_memory_decides_the_blocks(tiny_models):
    path = tiny_models["llama"]
    kv = kv_per_token_by_hand(path, torch.float32)
    budget = 1000 * kv + 7
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory=budget)
    plan = llm.memory_plan
    assert plan.kv_budget_bytes == budget
    assert llm.llm_engine.kv_cache.pool.num_blocks == plan.num_blocks == budget // (16 * kv) == 62
    assert llm.llm_engine.executor.driver.kv_cache.shape[3] == 62 * 16


def test_auto_max_model_len_with_kv_cache_memory(tiny_models):
    path = tiny_models["llama"]
    kv = kv_per_token_by_hand(path, torch.float32)
    llm = LLM(str(path), dtype="float32", max_model_len="auto", kv_cache_memory=100 * kv)
    plan = llm.memory_plan
    assert plan.settings.max_model_len is None
    assert plan.max_model_len_fit == 96  # 6 whole blocks of 16 tokens
    assert llm.llm_engine.config.model.max_model_len == 96 == plan.max_model_len
    assert llm.llm_engine.executor.driver.config.model.max_model_len == 96  # the runner runs with the planned one
    assert llm.llm_engine.kv_cache.pool.num_blocks == 6
    # It serves requests up to that length.
    out = llm.generate({"prompt_token_ids": list(range(5, 85))},
                       SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 96
    assert out.outputs[0].finish_reason == "length"


def test_too_small_kv_cache_memory_raises_with_the_max_seq_len_message(tiny_models):
    path = tiny_models["qwen2"]
    kv = kv_per_token_by_hand(path, torch.float32)
    with pytest.raises(KVCacheMemoryError) as e:
        LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory=32 * kv)
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert msg.startswith("The model's max seq len (64) is larger than the maximum number of tokens that can be "
                          "stored in KV cache (32)")
    assert "left for the KV cache" in msg and "cause:" in msg
    assert f"--kv-cache-memory {64 * kv}: " in msg and "--max-model-len 32: " in msg
    # Each suggested fix works when applied to the engine.
    assert LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory=64 * kv).memory_plan.num_blocks == 4
    assert LLM(str(path), dtype="float32", max_model_len=32, kv_cache_memory=32 * kv).memory_plan.num_blocks == 2


def test_num_gpu_blocks_override_is_used_as_is(tiny_models):
    llm = LLM(str(tiny_models["qwen3"]), dtype="float32", max_model_len=64, num_gpu_blocks_override=9)
    assert llm.memory_plan.num_blocks == llm.llm_engine.kv_cache.pool.num_blocks == 9
    assert llm.llm_engine.executor.driver.kv_cache.shape[3] == 9 * 16
    with pytest.raises(KVCacheMemoryError, match=r"^The model's max seq len \(64\)"):
        LLM(str(tiny_models["qwen3"]), dtype="float32", max_model_len=64, num_gpu_blocks_override=3)


def test_failed_kv_cache_allocation_is_a_kv_cache_memory_error(tiny_models, monkeypatch):
    """Memory taken between the plan and the allocation: a KVCacheMemoryError that says so, not a raw OOM."""
    from pagedllm.model_executor.model_runner import ModelRunner

    def no_memory(self, num_blocks, config=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore details")
    from dataclasses import replace

    from pagedllm.engine import llm_engine

    monkeypatch.setattr(ModelRunner, "allocate_kv_cache", no_memory)
    measured = llm_engine.device_memory
    monkeypatch.setattr(llm_engine, "device_memory", lambda d: replace(measured(d), page_cache_bytes=0))
    with pytest.raises(KVCacheMemoryError) as e:
        LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64, kv_cache_memory="1MiB")
    msg = str(e.value)
    assert msg.startswith("No available memory for the cache blocks: allocating the planned KV cache")
    assert "(CUDA out of memory. Tried to allocate 20.00 GiB)" in msg
    assert "another process took memory after the engine measured" in msg and "left for the KV cache" in msg
    # With page cache in the device's memory, that is what the kernel did not give back.
    monkeypatch.setattr(llm_engine, "device_memory", lambda d: replace(measured(d), page_cache_bytes=5 << 30))
    with pytest.raises(KVCacheMemoryError, match="(?s)counted 5.00 GiB of page cache as free.*drop_caches"):
        LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64, kv_cache_memory="1MiB")


def test_cpu_offload_is_refused_on_unified_memory(tiny_models, monkeypatch):
    """On an integrated GPU the host memory is the device's: offloading would move nothing. Refused before
    any weight is loaded."""
    from dataclasses import replace

    from pagedllm.engine import llm_engine
    from pagedllm.memory.device import DeviceMemory
    from pagedllm.model_executor import model_runner

    monkeypatch.setattr(llm_engine, "device_memory", lambda device: DeviceMemory(
        "cuda", 119 << 30, 30 << 30, unified=True, name="NVIDIA GB10", page_cache_bytes=60 << 30))
    monkeypatch.setattr(model_runner, "load_model", lambda *a: pytest.fail("loaded weights"))
    config = EngineArgs(model=str(tiny_models["llama"]), dtype="float32", max_model_len=64,
                        device="cpu").create_engine_config()
    config = replace(config, model=replace(config.model, cpu_offload_bytes=1 << 30))
    with pytest.raises(ValueError, match="--cpu-offload-gb has nothing to do on NVIDIA GB10: its memory is unified"):
        llm_engine.LLMEngine(config)
