"""Quantized checkpoints load as stored and generate what transformers generates from the dequantized weights.

Each checkpoint is a tiny random model quantized by its format's own library (tests/quant_checkpoints.py:
compressed-tensors for its FP8 / W4A16 schemes, transformers' FP8 quantizer for 128x128 blocks, the GPTQ and AWQ
specs byte for byte, MXFP4 as gpt-oss ships it). The reference is transformers in fp32 on the same model with the
dequantized weights; the engine computes in fp32 from the quantized bits, dequantizing them tile by tile. Both
multiply the same fp32 weights, so greedy tokens are equal and logprobs agree to fp32 rounding of differently
ordered sums: within LOGPROB_TOL.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagedllm import LLM, SamplingParams, UnsupportedModelError
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.plan import dry_run_plan
from pagedllm.memory.model_size import weight_bytes_from_config
from pagedllm.memory.plan import fmt_bytes
from pagedllm.model_executor.model_files import load_hf_config
from pagedllm.model_executor.quant.base import DequantLinearMethod
from pagedllm.model_executor.quant.experts import DequantMoEMethod
from pagedllm.model_executor.quant.mxfp4 import Mxfp4MoEMethod
from tests.helpers import make_tiny_model
from tests.quant_checkpoints import (
    hf_greedy_reference,
    write_awq,
    write_compressed_tensors,
    write_fp8_block,
    write_gptq,
    write_modelopt,
    write_mxfp4_gpt_oss,
)

LOGPROB_TOL = 1e-3
PROMPTS = [[5, 17, 33], [101, 7, 250, 3, 44, 9, 120], [2] * 13, [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72,
                                                               73, 74, 75, 76, 77, 78]]
STEPS = 32
# Dense dimensions in whole groups (32-128 columns) and whole 128x128 blocks, q/k/v each a multiple of 128 rows.
SHAPE = dict(hidden_size=128, intermediate_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2)

WRITERS = {
    "ct-fp8-channel": ("qwen3", lambda s, d: write_compressed_tensors(s, d, "fp8-channel")),
    "ct-fp8-tensor": ("llama", lambda s, d: write_compressed_tensors(s, d, "fp8-tensor")),
    "ct-fp8-block": ("qwen3", lambda s, d: write_compressed_tensors(s, d, "fp8-block")),
    "fp8-block": ("qwen3", lambda s, d: write_fp8_block(s, d)),
    "ct-w4a16-g32": ("qwen2", lambda s, d: write_compressed_tensors(s, d, "w4a16", group_size=32)),
    "ct-w4a16-asym-g64": ("llama", lambda s, d: write_compressed_tensors(s, d, "w4a16-asym", group_size=64)),
    "gptq-g32": ("qwen3", lambda s, d: write_gptq(s, d, group_size=32)),
    "gptq-g64-asym-act-order": ("llama", lambda s, d: write_gptq(s, d, group_size=64, sym=False, desc_act=True)),
    "gptq-v2-g128": ("qwen2", lambda s, d: write_gptq(s, d, group_size=128, checkpoint_format="gptq_v2")),
    "awq-g32": ("llama", lambda s, d: write_awq(s, d, group_size=32)),
    "ct-nvfp4": ("qwen3", lambda s, d: write_compressed_tensors(s, d, "nvfp4a16")),
    "mxfp4-gpt-oss": ("gpt_oss", lambda s, d: write_mxfp4_gpt_oss(s, d)),
    "modelopt-fp8": ("llama", lambda s, d: write_modelopt(s, d, "FP8")),
    "modelopt-nvfp4": ("qwen3", lambda s, d: write_modelopt(s, d, "NVFP4")),
    # Mixtures of experts whose experts are stored in the format too (Qwen3-30B-A3B-FP8's layout; Mixtral GPTQ/AWQ).
    "qwen3-moe-ct-fp8-channel": ("qwen3_moe", lambda s, d: write_compressed_tensors(s, d, "fp8-channel")),
    "qwen3-moe-fp8-block": ("qwen3_moe", lambda s, d: write_fp8_block(s, d)),
    "qwen3-moe-ct-w4a16-g32": ("qwen3_moe", lambda s, d: write_compressed_tensors(s, d, "w4a16", group_size=32)),
    "qwen3-moe-gptq-g64-act-order": ("qwen3_moe", lambda s, d: write_gptq(s, d, group_size=64, desc_act=True)),
    "mixtral-awq-g64": ("mixtral", lambda s, d: write_awq(s, d, group_size=64)),
}
MOE_SHAPE = dict(moe_intermediate_size=128)  # experts in whole 128-row blocks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    made = {}

    def get(case: str) -> Path:
        if case not in made:
            arch, write = WRITERS[case]
            shape = {} if arch == "gpt_oss" else {**SHAPE, **(MOE_SHAPE if arch == "qwen3_moe" else {})}
            src = make_tiny_model(root / f"{case}-dense", arch, **shape)
            made[case] = write(src, root / case)
        return made[case]

    return get


def _quantized_methods(llm: LLM) -> set[str]:
    model = llm.llm_engine.executor.driver.model
    return {type(m.method).__name__ for m in model.modules()
            if isinstance(getattr(m, "method", None), (DequantLinearMethod, Mxfp4MoEMethod, DequantMoEMethod))}


@pytest.mark.parametrize("case", list(WRITERS))
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(checkpoints, case):
    path = checkpoints(case)
    llm = LLM(str(path), dtype="float32", max_model_len=128, enable_prefix_caching=False)
    moe = WRITERS[case][0] in ("qwen3_moe", "mixtral")
    expected = {"DequantLinearMethod"} | ({"DequantMoEMethod"} if moe else set())
    assert _quantized_methods(llm) == ({"Mxfp4MoEMethod"} if case.startswith("mxfp4") else expected)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=0), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref_ids, ref_logprobs = hf_greedy_reference(path, prompt, STEPS)
        got = out.outputs[0]
        assert got.token_ids == ref_ids, case
        ours = [step[tok].logprob for step, tok in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < LOGPROB_TOL, case


def _tensor_bytes(path: Path) -> int:
    total = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            total += t.numel() * t.element_size()
    return total


def _as_bfloat16(src: Path) -> Path:
    """The checkpoint with its floating tensors in bf16, as hub checkpoints ship (a quantized one's dense parts and
    16-bit scales then take the bytes the plan counts in --dtype bfloat16)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()},
              str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    return src


# Layer shapes near real ones (the per-column tensors a GPTQ checkpoint stores are a small share of them there).
BYTES_SHAPE = dict(hidden_size=1024, intermediate_size=2048, head_dim=64, num_attention_heads=16,
                   num_key_value_heads=4, num_hidden_layers=1)
BYTES_CASES = {
    "ct-fp8-channel": ("qwen3", lambda s, d: write_compressed_tensors(s, d, "fp8-channel")),
    "fp8-block": ("qwen3", lambda s, d: write_fp8_block(s, d)),
    "ct-w4a16-asym-g128": ("llama", lambda s, d: write_compressed_tensors(s, d, "w4a16-asym", group_size=128)),
    "gptq-g128": ("qwen3", lambda s, d: write_gptq(s, d, group_size=128)),
    "awq-g128": ("llama", lambda s, d: write_awq(s, d, group_size=128)),
    "ct-nvfp4": ("qwen3", lambda s, d: write_compressed_tensors(s, d, "nvfp4a16")),
    "mxfp4-gpt-oss": ("gpt_oss", lambda s, d: write_mxfp4_gpt_oss(s, d)),
    "modelopt-nvfp4": ("qwen3", lambda s, d: write_modelopt(s, d, "NVFP4")),
}


@pytest.mark.parametrize("case", list(BYTES_CASES))
def test_plan_counts_the_stored_bytes(tmp_path, case):
    """The plan's weight bytes from config shapes alone equal the checkpoint's tensor bytes on disk (scales, zero
    points, act-order indices and all) within 1%, and what the engine then holds within 0.1%."""
    arch, write = BYTES_CASES[case]
    src = _as_bfloat16(make_tiny_model(tmp_path / "dense", arch, **({} if arch == "gpt_oss" else BYTES_SHAPE)))
    path = write(src, tmp_path / case)
    planned = weight_bytes_from_config(load_hf_config(path), torch.bfloat16)
    on_disk = _tensor_bytes(path)
    assert abs(planned - on_disk) <= 0.01 * on_disk, (planned, on_disk)
    dense = weight_bytes_from_config(load_hf_config(src), torch.bfloat16)
    assert planned < 0.75 * dense  # (the formats' bytes are counted, not the dense weights')
    llm = LLM(str(path), dtype="bfloat16", max_model_len=64, enable_prefix_caching=False)
    held = llm.llm_engine.executor.driver.weight_bytes
    assert abs(planned - held) <= 0.001 * held, (planned, held)
    assert _quantized_methods(llm)
    headers = dry_run_plan(EngineArgs(model=str(path), dtype="bfloat16", max_model_len=64), device="cpu",
                           device_memory="8GiB")
    assert headers.model.weights_source == "safetensors headers"
    assert abs(headers.weight_bytes - held) <= 0.01 * held, (headers.weight_bytes, held)


def test_quantized_experts_with_dummy_weights_hold_their_format(tmp_path):
    """Qwen3-MoE from a config alone, as its FP8 (128x128 blocks) checkpoint: every expert's projections hold fp8
    values and block scales, the plan counts those bytes, and requests complete."""
    src = make_tiny_model(tmp_path / "dense", "qwen3_moe", **SHAPE, **MOE_SHAPE)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head", "mlp.gate"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    llm = LLM(str(path), load_format="dummy", dtype="bfloat16", max_model_len=64)
    experts = llm.llm_engine.executor.driver.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and tuple(experts.w13_weight_scale.shape) == (8, 2, 1)
    assert llm.llm_engine.executor.driver.weight_bytes == weight_bytes_from_config(load_hf_config(path),
                                                                                   torch.bfloat16)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq checkpoint uses 8-bit weights"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq checkpoint uses 4-bit weights, version 'gemv'"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "quant_algo 'W4A8_AWQ'"),
    ({"quant_method": "hqq"}, "quant_method 'hqq'"),
])
def test_formats_not_loaded_are_refused_with_what_is(tmp_path, config, message):
    path = make_tiny_model(tmp_path / "m", "llama", **SHAPE)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": config}))
    with pytest.raises(UnsupportedModelError, match=f"{message}.*Supported: fp8 .*awq gemm.*mxfp4"):
        LLM(str(path))


def test_gpt_oss_20b_layer_shape_runs_in_mxfp4_with_dummy_weights(tmp_path):
    """The built-in gpt-oss-20b config (MXFP4 experts as shipped) with 2 of its 24 layers, 4 of its 32 experts (its
    top 4) and a small vocabulary (CI's memory): each layer's experts hold the MXFP4 bytes the plan counts, and
    requests complete."""
    from pagedllm.model_executor.model_files import resolve_model_path

    cfg = json.loads(resolve_model_path("gpt-oss-20b").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    cfg.update(num_hidden_layers=2, layer_types=cfg["layer_types"][:2], num_local_experts=4, vocab_size=1024)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    llm = LLM(str(path), load_format="dummy", dtype="bfloat16", max_model_len=256, max_num_batched_tokens=256)
    experts = llm.llm_engine.executor.driver.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.uint8 and tuple(experts.w13_weight.shape) == (4, 2 * 2880, 2880 // 2)
    assert tuple(experts.w2_scale.shape) == (4, 2880, 2880 // 32) and isinstance(experts.method, Mxfp4MoEMethod)
    held = llm.llm_engine.executor.driver.weight_bytes
    assert held == weight_bytes_from_config(load_hf_config(path), torch.bfloat16)
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": list(range(10, 200))}],
                        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


MLP = ("gate_proj", "up_proj", "down_proj")


def test_fp8_at_load_generates_what_transformers_does_on_those_weights(tmp_path):
    """--quantization fp8 on a 16/32-bit checkpoint: every decoder Linear held as fp8 e4m3 with a float32 scale per
    output row (absmax / 448), within fp8's rounding of the checkpoint's weights; greedy tokens and logprobs equal
    transformers' on the same model with those dequantized weights; the plan counts the bytes held."""
    from tests.helpers import greedy_generate, load_hf_model

    path = make_tiny_model(tmp_path / "dense", "qwen3", **SHAPE)
    llm = LLM(str(path), dtype="float32", max_model_len=128, quantization="fp8", enable_prefix_caching=False)
    model = llm.llm_engine.executor.driver.model
    reference = load_hf_model(path)
    dense = dict(reference.named_parameters())
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for ours, names in ((attn.qkv_proj, ("q_proj", "k_proj", "v_proj")), (attn.o_proj, ("o_proj",)),
                            (mlp.gate_up_proj, ("gate_proj", "up_proj")), (mlp.down_proj, ("down_proj",))):
            assert ours.weight.dtype == torch.float8_e4m3fn and ours.weight_scale.shape == (ours.out_features,)
            weight = ours.quant_format.dequantize(ours, 0, ours.out_features, torch.float32)
            params = [dense[f"model.layers.{i}.{'mlp' if n in MLP else 'self_attn'}.{n}.weight"] for n in names]
            for param, part in zip(params, weight.split([p.shape[0] for p in params])):
                assert (part - param).abs().max() <= 2 ** -4 * param.abs().max()  # e4m3: 3 mantissa bits
                param.data.copy_(part)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=0), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref_ids, ref_logprobs = greedy_generate(reference, prompt, STEPS)
        assert out.outputs[0].token_ids == ref_ids
        ours = [step[tok].logprob for step, tok in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < LOGPROB_TOL
    assert llm.memory_plan.weight_bytes == llm.llm_engine.executor.driver.weight_bytes
    assert weight_bytes_from_config(load_hf_config(path), torch.float32, "fp8") == \
        llm.llm_engine.executor.driver.weight_bytes


@pytest.mark.parametrize("model, fixes", [("llama-3.1-8b", {"int8", "fp8", "int4", "nvfp4"}),
                                          ("qwen3-30b-a3b", {"int4", "nvfp4"})])
def test_a_plan_that_does_not_fit_names_the_quantized_variants_that_would(model, fixes):
    """Llama-3.1-8B (14.96 GiB in bf16) on a 16 GiB GPU: int8 / fp8 made at load, int4 and nvfp4 checkpoints, each
    with its weights' bytes (int4: 5.31 GiB, as Llama-3.1-8B-Instruct-AWQ-INT4's 5.73 GB); Qwen3-30B-A3B (56.9 GiB) on
    32 GiB: only checkpoints stored smaller (its experts are not quantized at load)."""
    memory = {"llama-3.1-8b": "16GiB", "qwen3-30b-a3b": "32GiB"}[model]
    plan = dry_run_plan(EngineArgs(model=model, max_model_len=8192), device="cuda", device_memory=memory)
    assert not plan.fits
    offered = {f.value: f for f in plan.fixes() if f.flag == "--quantization"}
    assert offered.keys() == fixes
    for name, fix in offered.items():
        sized = dry_run_plan(EngineArgs(model=model, max_model_len=8192, quantization=name), device="cuda",
                             device_memory=memory)
        assert sized.fits and f"-> {fmt_bytes(sized.weight_bytes)}" in fix.effect
        assert ("loads as stored" in fix.effect) == (name in ("int4", "nvfp4"))
    if model == "llama-3.1-8b":
        int4 = dry_run_plan(EngineArgs(model=model, max_model_len=8192, quantization="int4"), device="cuda",
                            device_memory=memory)
        assert abs(int4.weight_bytes / 5.73e9 - 1) < 0.01
        assert "model weights (bfloat16, as an int4 checkpoint)" in int4.table()


@pytest.mark.parametrize("name, published_bytes", [
    ("openai/gpt-oss-20b", 13.76e9),  # model-0000{0,1,2}-of-00002.safetensors
    ("hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4", 5.73e9),
    ("nvidia/Llama-3.1-8B-Instruct-FP8", 9.08e9),
])
def test_built_in_shapes_of_quantized_checkpoints_plan_their_download_size(name, published_bytes):
    """The hub names of common quantized checkpoints resolve to built-in shapes, whose planned weights are their
    published safetensors' size within 2%."""
    plan = dry_run_plan(EngineArgs(model=name, max_model_len=4096), device="cuda", device_memory="80GiB")
    assert plan.model.stored_format and abs(plan.weight_bytes / published_bytes - 1) < 0.02
