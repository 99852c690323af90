"""--cpu-offload-gb: refused on a CPU-only engine; the offload mechanism itself is device-agnostic and
runs here with host = device = CPU (through the engine config, which the CPU refusal in EngineArgs
guards): outputs identical to the run without it, the last layers' weights kept in one flat host
buffer per layer between forwards and computed from device slots during them, and the plan counting
the device-resident weights plus the two slots."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.plan import dry_run_plan
from pagedllm.memory.model_size import layer_weight_bytes_from_config
from pagedllm.memory.plan import ASSUMED_H2D_BYTES_PER_S, GiB
from pagedllm.model_executor.attention import build_attention_metadata, forward_context
from pagedllm.model_executor.offload import num_offloaded_layers, param_bytes
from tests.helpers import make_tiny_model

PROMPTS = [[5, 6, 7, 8, 9], list(range(30, 63)), [11, 12, 13]]


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("offload") / "qwen3", "qwen3", num_hidden_layers=4)


def _engine(path, offload_bytes: int, quantization: str | None = None) -> LLMEngine:
    """An engine on the CPU whose config asks for offloading (the way a CUDA engine's would)."""
    config = EngineArgs(model=str(path), dtype="float32", max_model_len=64, device="cpu",
                        quantization=quantization, num_gpu_blocks_override=64).create_engine_config()
    return LLMEngine(replace(config, model=replace(config.model, cpu_offload_bytes=offload_bytes)))


def _greedy(engine: LLMEngine) -> dict[str, tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                outs[out.request_id] = (c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
    return outs


def test_cpu_offload_is_refused_on_a_cpu_engine(four_layers):
    with pytest.raises(ValueError, match="nothing to do on a CPU-only engine.*already live in host memory"):
        LLM(str(four_layers), device="cpu", cpu_offload_gb=1)
    with pytest.raises(ValueError, match="cpu_offload_gb must be a number of GiB >= 0"):
        EngineArgs(model=str(four_layers), device="cpu", cpu_offload_gb=-1).create_engine_config()
    assert EngineArgs(model=str(four_layers), device="cpu").create_engine_config().model.cpu_offload_bytes == 0


def test_offloaded_layers_count():
    assert num_offloaded_layers(0, 100, 4) == 0
    assert num_offloaded_layers(99, 100, 4) == 0  # less than one layer: nothing
    assert num_offloaded_layers(250, 100, 4) == 2  # whole layers only
    assert num_offloaded_layers(10**9, 100, 4) == 4


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_offloaded_run_is_identical_and_keeps_the_last_layers_on_the_host(four_layers, quantization):
    reference = _greedy(_engine(four_layers, 0, quantization))
    layer_bytes = param_bytes(_engine(four_layers, 0, quantization).executor.driver.model.decoder_layers()[0])
    engine = _engine(four_layers, 3 * layer_bytes + 1, quantization)
    layers = engine.executor.driver.model.decoder_layers()
    offloads = engine.executor.driver.loaded.offloads
    assert len(offloads) == 3 and engine.executor.driver.offloaded_weight_bytes == 3 * layer_bytes
    # Each offloaded layer's parameters are views into one flat host buffer.
    for offload in offloads:
        start, end = offload.buffer.data_ptr(), offload.buffer.data_ptr() + offload.buffer.numel()
        assert all(start <= p.data_ptr() < end for p, _ in offload.host)
        assert offload.buffer.numel() >= offload.num_bytes

    # During its forward a layer computes with fresh copies; between forwards it holds the host tensors.
    seen_during_forward = []

    def record(module, args):
        seen_during_forward.append([p.data_ptr() for p in module.parameters()])
    layers[3].register_forward_pre_hook(record)  # runs after the offload's own pre-hook
    host_ptrs = [t.data_ptr() for _, t in offloads[2].host]
    assert [p.data_ptr() for p in layers[3].parameters()] == host_ptrs

    assert _greedy(engine) == reference  # identical tokens and logprobs
    assert seen_during_forward and all(set(ptrs).isdisjoint(host_ptrs) for ptrs in seen_during_forward)
    assert [p.data_ptr() for p in layers[3].parameters()] == host_ptrs
    hosted = {id(p) for o in offloads for p, _ in o.host}
    assert all(id(p) in hosted for layer in layers[1:] for p in layer.parameters())  # the last layers
    assert not any(id(p) in hosted for layer in layers[:1] for p in layer.parameters())

    # The plan: device-resident weights plus the two slots the offloaded layers pass through.
    plan = engine.memory_plan
    cfg = engine.config.model.hf_config
    assert layer_weight_bytes_from_config(cfg, engine.config.model.dtype, quantization) == layer_bytes
    assert plan.offloaded_layers == 3 and plan.offloaded_weight_bytes == 3 * layer_bytes
    runner = engine.executor.driver
    assert plan.weight_bytes == runner.weight_bytes - runner.offloaded_weight_bytes + 2 * layer_bytes
    assert 2 * layer_bytes <= runner.offload_slot_bytes <= 2 * layer_bytes + 2 * 256 * len(offloads[0].host)
    assert "3 of 4 layers" in plan.table() and "through 2 device slots" in plan.table()


def test_offloaded_layers_run_in_any_number_and_after_a_failed_forward(four_layers):
    """One offloaded layer (one slot), all four (the first one is offloaded too), and a forward that
    raises midway: the next forward still computes the same tokens."""
    reference = _greedy(_engine(four_layers, 0))
    layer_bytes = param_bytes(_engine(four_layers, 0).executor.driver.model.decoder_layers()[0])
    for n in (1, 4):
        engine = _engine(four_layers, n * layer_bytes)
        assert len(engine.executor.driver.loaded.offloads) == n
        assert len(engine.executor.driver.loaded.offloader.slots) == min(n, 2)
        assert _greedy(engine) == reference

    engine = _engine(four_layers, 3 * layer_bytes)
    layers = engine.executor.driver.model.decoder_layers()
    hook = layers[2].register_forward_pre_hook(lambda module, args: (_ for _ in ()).throw(RuntimeError("boom")))
    meta = build_attention_metadata([0], [2], [[0]], engine.config.cache.block_size, torch.device("cpu"),
                                    engine.executor.driver.attn_backend)
    with pytest.raises(RuntimeError, match="boom"), forward_context(meta), torch.inference_mode():
        engine.executor.driver.model(torch.tensor([5, 6]), meta.positions)  # layer 1 ran from its slot, then 2 raised
    hook.remove()
    host = engine.executor.driver.loaded.offloads
    assert _greedy(engine) == reference
    assert all(p.data_ptr() == view.data_ptr() for h in host for p, view in h.host)  # none left on a slot


def _cuda_plan(**changes):
    args = EngineArgs(model="llama-3.1-8b", dtype="bfloat16", max_model_len=8192, device="cuda", **changes)
    return dry_run_plan(args, device="cuda", device_memory="16GiB")


def test_cpu_offload_is_a_fix_on_a_cuda_device_with_the_smallest_size_that_fits():
    plan = _cuda_plan()
    assert not plan.fits
    fix = next(f for f in plan.fixes() if f.flag == "--cpu-offload-gb")
    fixed = _cuda_plan(cpu_offload_gb=float(fix.value))
    assert fixed.fits and fix.effect.startswith(fixed.effect()) and "saved)" in fix.effect
    layer = fixed.model.layer_weight_bytes(fixed.settings)
    n = fixed.offloaded_layers
    assert fixed.weight_bytes == plan.weight_bytes - (n - 2) * layer  # two layers' slots stay on the device
    assert not _cuda_plan(cpu_offload_gb=(n - 1) * layer / GiB).fits  # one layer fewer does not fit
    assert fixed.to_json()["offloaded_layers"] == n
    # Its cost: the offloaded bytes copied each step, at the assumed PCIe rate on a described device.
    assert fix.extra_step_ms == pytest.approx(n * layer / ASSUMED_H2D_BYTES_PER_S * 1000)
    assert f"+{fix.extra_step_ms:.0f} ms per step at 25.0 GB/s (PCIe 4.0 x16, assumed" in fix.effect
    assert next(f for f in plan.to_json()["fixes"] if f["flag"] == "--cpu-offload-gb")["extra_step_ms"] == \
        fix.extra_step_ms
    measured = replace(plan, device=replace(plan.device, h2d_bytes_per_s=50e9))
    fix = next(f for f in measured.fixes() if f.flag == "--cpu-offload-gb")
    assert fix.extra_step_ms == pytest.approx(n * layer / 50e9 * 1000)
    assert "at 50.0 GB/s host-to-device, measured" in fix.effect


def test_no_offload_fix_where_it_cannot_help():
    assert _cuda_plan(cpu_offload_gb=0.41).offloaded_layers == 1  # one 8B layer is 0.41 GiB
    assert _cuda_plan(cpu_offload_gb=0.41).weight_bytes == _cuda_plan().weight_bytes  # one layer saves nothing
    assert _cuda_plan(cpu_offload_gb=0.82).weight_bytes == _cuda_plan().weight_bytes  # two layers, two slots
    unified = dry_run_plan(EngineArgs(model="llama-3.1-8b", dtype="bfloat16", max_model_len=8192),
                           device="cuda", device_memory="16GiB", unified=True)
    assert not unified.fits and "--cpu-offload-gb" not in {f.flag for f in unified.fixes()}
    on_cpu = dry_run_plan(EngineArgs(model="llama-3.1-8b", dtype="bfloat16", max_model_len=8192),
                          device="cpu", device_memory="16GiB")
    assert not on_cpu.fits and "--cpu-offload-gb" not in {f.flag for f in on_cpu.fixes()}
