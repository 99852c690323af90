"""--quantization int8: the quantizer's error bound, the CPU fast path against the generic one, the
outputs against the full-precision run of the same weights (stated tolerances), bad values refused,
and the memory plan's weight bytes equal to what the engine holds."""
from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM, SamplingParams, UnsupportedModelError
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.plan import dry_run_plan
from pagedllm.memory.model_size import weight_bytes_from_config
from pagedllm.model_executor.cpu_ops import tied_head_copy_bytes
from pagedllm.model_executor.linear import Linear
from pagedllm.model_executor.model_files import load_hf_config
from pagedllm.model_executor.quantization import (
    INT8PACK_MAX_ROWS,
    INT8,
    quantize_linear,
    quantize_int8,
)
from tests.helpers import ARCHS, make_tiny_model

# Tolerances of int8 against the full-precision run of the same tiny random weights. Measured on
# these models: teacher-forced top-1 agreement 0.92-0.98 and |logprob difference| <= 0.34 nats; for
# scale, bfloat16 against float32 gives 0.97-0.99 and <= 0.28 (int8's per-weight error is 2-3x bf16's).
MIN_TOP1_AGREEMENT = 0.9
MAX_LOGPROB_DIFF = 0.5  # nats, for the reference's tokens, on identical contexts
PROMPTS = [[5, 6, 7, 8, 9], list(range(30, 63)), [11, 12, 13], list(range(100, 117)), [400, 3, 77, 91, 250, 18]]
STEPS = 16


# -- the quantizer -----------------------------------------------------------------------------------
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantized_weight_is_within_half_a_step_of_the_original(scale_dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=gen) * 0.1
    w[3] = 0.0  # an all-zero row
    w[5, 7] = 4.0  # an outlier: its row gets a coarse scale
    q, scale = quantize_int8(w, scale_dtype)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == scale_dtype and scale.shape == (48,)
    assert q.abs().max() <= 127 and (q == -128).sum() == 0  # symmetric range
    nonzero = torch.ones(48, dtype=torch.bool)
    nonzero[3] = False
    assert (q[nonzero].abs().amax(dim=1) == 127).all()  # each row's absmax maps to +-127
    assert (q[3] == 0).all()
    step = scale.double()[:, None]
    error = (w.double() - q.double() * step).abs()
    assert (error <= step / 2 * (1 + 1e-6)).all()


def test_int8pack_fast_path_equals_the_generic_path():
    gen = torch.Generator().manual_seed(1)
    layer = Linear(64, 40, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 64, generator=gen) * 0.1)
        layer.bias.copy_(torch.randn(40, generator=gen) * 0.1)
    quantize_linear(layer)
    for rows in range(1, INT8PACK_MAX_ROWS + 1):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        assert INT8._int8pack_applies(layer, x)
        fast, generic = INT8._int8pack(layer, x), INT8._generic(layer, x)
        assert fast.dtype == generic.dtype == torch.bfloat16
        # Both round to bf16 once or twice; 1% of the output's scale bounds it (measured ~0.2%).
        assert (fast.float() - generic.float()).abs().max() <= 0.01 * generic.float().abs().max()
    # 3-D input, bias: forward takes the fast path at few rows and agrees with the generic one.
    x = torch.randn(2, 3, 64, generator=gen).to(torch.bfloat16)
    out = layer(x)
    ref = INT8._generic(layer, x.reshape(6, 64)) + layer.bias
    assert out.shape == (2, 3, 40)
    assert (out.reshape(6, 40).float() - ref.float()).abs().max() <= 0.01 * ref.float().abs().max()


def test_int8pack_is_only_used_where_it_is_correct_and_fast():
    layer, odd_k = Linear(64, 8).to(torch.bfloat16), Linear(40, 8).to(torch.bfloat16)  # K % 16 != 0 breaks it
    quantize_linear(layer)
    quantize_linear(odd_k)
    assert not INT8._int8pack_applies(layer, torch.zeros(INT8PACK_MAX_ROWS + 1, 64, dtype=torch.bfloat16))  # prefill
    assert not INT8._int8pack_applies(layer, torch.zeros(1, 64))  # float32: its fp32 kernel is slow
    assert not INT8._int8pack_applies(odd_k, torch.zeros(1, 40, dtype=torch.bfloat16))


# -- the engine --------------------------------------------------------------------------------------
def _greedy(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def test_decoder_linears_are_int8_and_the_rest_stays_in_the_model_dtype(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", max_model_len=64, quantization="int8")
    model = llm.llm_engine.executor.driver.model
    for layer in model.decoder_layers():
        quantized = [m for m in layer.modules() if isinstance(m, Linear)]
        assert len(quantized) == 4 and all(m.method is INT8 for m in quantized)  # qkv, o_proj, gate_up, down_proj
        assert all(m.weight.dtype == torch.int8 and m.weight.numel() > 0 for m in quantized)  # not packed
        assert all(m.weight_scale.dtype == torch.bfloat16 for m in quantized)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head.method is not INT8  # the LM head stays bf16 (packed on CPU)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_int8_outputs_are_close_to_full_precision(tiny_models, arch, dtype):
    path, kw = str(tiny_models[arch]), {"dtype": dtype, "max_model_len": 64, "num_gpu_blocks_override": 64}
    full = _greedy(LLM(path, **kw), PROMPTS)
    int8_llm = LLM(path, quantization="int8", **kw)
    int8 = _greedy(int8_llm, PROMPTS)

    # Free-running greedy: until the first token where they part, the chosen tokens' logprobs agree.
    for f, q in zip(full, int8):
        same = next((i for i, (a, b) in enumerate(zip(f.token_ids, q.token_ids)) if a != b), STEPS)
        for i in range(same):
            tok = f.token_ids[i]
            assert abs(f.logprobs[i][tok].logprob - q.logprobs[i][tok].logprob) < MAX_LOGPROB_DIFF

    # Teacher-forced over the first STEPS steps: int8 reads the full-precision greedy sequence as its
    # prompt; at every step its top-1 is compared with the full-precision greedy token.
    forced = int8_llm.generate([{"prompt_token_ids": p + f.token_ids} for p, f in zip(PROMPTS, full)],
                               SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    agree, diffs = [], []
    for prompt, f, out in zip(PROMPTS, full, forced):
        for i, tok in enumerate(f.token_ids):
            lp = out.prompt_logprobs[len(prompt) + i][tok]
            agree.append(lp.rank == 1)
            diffs.append(abs(lp.logprob - f.logprobs[i][tok].logprob))
    assert sum(agree) / len(agree) >= MIN_TOP1_AGREEMENT, (sum(agree) / len(agree), max(diffs))
    assert max(diffs) < MAX_LOGPROB_DIFF


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_plan_weight_bytes_equal_what_the_engine_holds(tiny_models, arch, dtype):
    path = tiny_models[arch]
    torch_dtype = getattr(torch, dtype)
    llm = LLM(str(path), dtype=dtype, max_model_len=64, quantization="int8")
    held = llm.llm_engine.executor.driver.weight_bytes
    assert llm.memory_plan.weight_bytes == held
    full = LLM(str(path), dtype=dtype, max_model_len=64).llm_engine.executor.driver.weight_bytes
    assert held < full
    # Before loading: the safetensors headers, and the config's shapes.
    headers = dry_run_plan(EngineArgs(model=str(path), dtype=dtype, max_model_len=64, quantization="int8"),
                           device="cpu", device_memory="8GiB")
    assert headers.model.weights_source == "safetensors headers" and headers.weight_bytes == held
    cfg = load_hf_config(path)  # (+ oneDNN's copy of a tied bf16 head on the avx512_bf16 path: cpu_ops.py)
    assert weight_bytes_from_config(cfg, torch_dtype, "int8") + tied_head_copy_bytes(cfg, torch_dtype) == held
    # Dummy weights (a bare config.json) are quantized too, to the same bytes.
    dummy = LLM(str(path / "config.json"), load_format="dummy", dtype=dtype, max_model_len=64, quantization="int8")
    assert dummy.llm_engine.executor.driver.weight_bytes == held


def test_bad_quantization_values_are_refused(tiny_models):
    with pytest.raises(ValueError, match="quantization must be one of int8, fp8, int4, nvfp4, .* or None"):
        LLM(str(tiny_models["llama"]), quantization="int3")
    for name in ("int4", "gptq"):  # a checkpoint's format: loaded as stored, never made at load
        with pytest.raises(ValueError, match=f"--quantization {name} names a checkpoint's format.*int8 or fp8"):
            EngineArgs(model=str(tiny_models["llama"]), quantization=name).create_engine_config()


def test_int8_at_load_is_refused_for_an_already_quantized_checkpoint(tmp_path):
    """A quantized checkpoint loads as stored (tests/models/test_quant_checkpoints.py); --quantization int8 on top of
    it is refused by name, and a format pagedllm does not load is refused with the list of those it does."""
    path = make_tiny_model(tmp_path / "gptq", "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="already quantized .*int4 weights \\(gptq\\).* drop --quantization"):
        LLM(str(path), quantization="int8")
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="quant_method 'bitsandbytes'.*Supported: fp8 .*gptq"):
        LLM(str(path))


# -- the plan and the command line ---------------------------------------------------------------------
def test_plan_command_shows_the_smaller_weights(tiny_models, capsys):
    base = ["plan", str(tiny_models["llama"]), "--device", "cpu", "--device-memory", "8GiB", "--json"]
    assert main(base) == 0
    full = json.loads(capsys.readouterr().out)
    assert main([*base, "--quantization", "int8"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert int8["quantization"] == "int8" and full["quantization"] is None
    assert int8["weights_bytes"] < full["weights_bytes"]
    assert main([*base[:-1], "-q", "int8"]) == 0
    assert "model weights (float32, int8 decoder linears)" in capsys.readouterr().out


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("memory, max_model_len, cause", [
    ("16GiB", 8192, "less than the model's weights"),  # the weights do not fit
    ("32GiB", 131072, "one sequence of max_model_len 131072 needs"),  # the KV cache is short
])
def test_int8_is_a_fix_when_weights_or_kv_cache_do_not_fit(device, memory, max_model_len, cause):
    def make(**changes):
        args = EngineArgs(model="llama-3.1-8b", dtype="bfloat16", max_model_len=max_model_len, **changes)
        return dry_run_plan(args, device=device, device_memory=memory)

    plan = make()
    assert not plan.fits and cause in plan.cause
    fix = next(f for f in plan.fixes() if f.flag == "--quantization")
    assert fix.value == "int8"
    fixed = make(quantization="int8")  # verified by re-planning with the flag
    assert fixed.fits and fix.effect.startswith(fixed.effect())
    saved = plan.weight_bytes - fixed.weight_bytes
    # 8B: 6.98e9 decoder-Linear parameters go from 2 bytes to 1 (+ a bf16 scale per row).
    assert 6.4e9 < saved < 7.0e9 and "(6.50 GiB saved)" in fix.effect
    assert "--quantization" not in {f.flag for f in fixed.with_settings(max_model_len=131072 * 4).fixes()}


def test_serve_and_bench_flags_reach_the_engine():
    from pagedllm.entrypoints.cli import engine_args_from
    from pagedllm.entrypoints.openai.api_server import (
        build_parser,
        refuse_unimplemented,
    )

    ns = build_parser().parse_args(["--quantization", "int8", "--cpu-offload-gb", "2.5"])
    refuse_unimplemented(ns)  # both are real flags now, not refused ones
    args = engine_args_from(ns)
    assert args.quantization == "int8" and args.cpu_offload_gb == 2.5
