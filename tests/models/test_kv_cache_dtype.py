"""--kv-cache-dtype: the cache op's write/read round trip, per-tensor scales from the checkpoint, and
fp8 / bfloat16 caches against the auto-dtype run of the same weights."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.config import CacheConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.model_executor.kv_quant import dequantize, quantize, read_kv, write_kv
from tests.helpers import make_tiny_model

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


# -- the cache op ------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, 0.05, 3.0])
@pytest.mark.parametrize("dtype", FP8)
def test_round_trip_within_the_formats_relative_error(dtype, scale):
    """Round to nearest: within half a unit in the last place (eps / 2) over the normal range; below it,
    within half the smallest subnormal (eps * smallest_normal / 2), both times the scale."""
    finfo = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(0)
    log_mag = torch.empty(8192).uniform_(math.log(finfo.smallest_normal), math.log(finfo.max), generator=gen)
    x = torch.exp(log_mag) * torch.randn(8192, generator=gen).sign() * scale
    back = dequantize(quantize(x, scale, dtype), scale, torch.float32)
    assert ((back - x).abs() / x.abs()).max() <= finfo.eps / 2 * (1 + 1e-5)

    tiny = torch.empty(4096).uniform_(-finfo.smallest_normal, finfo.smallest_normal, generator=gen) * scale
    back = dequantize(quantize(tiny, scale, dtype), scale, torch.float32)
    assert (back - tiny).abs().max() <= finfo.eps * finfo.smallest_normal / 2 * scale * (1 + 1e-5)


@pytest.mark.parametrize("dtype", FP8)
def test_huge_values_saturate_instead_of_becoming_nan_or_inf(dtype):
    fmax = torch.finfo(dtype).max
    x = torch.tensor([1e6, -1e30, float("inf"), -float("inf"), 2 * fmax, 0.5], dtype=torch.bfloat16)
    stored = quantize(x, 2.0, dtype)
    back = dequantize(stored, 2.0, torch.float32)
    assert torch.isfinite(stored.float()).all()
    assert back.tolist() == [2 * fmax, -2 * fmax, 2 * fmax, -2 * fmax, 2 * fmax, 0.5]


@pytest.mark.parametrize("cache_dtype", [*FP8, torch.bfloat16])
def test_write_then_read_through_block_tables(cache_dtype):
    block_size, heads, dim, scale = 4, 2, 8, 0.5
    cache = torch.zeros(heads, 6 * block_size, dim, dtype=cache_dtype)  # head-major
    x = torch.randn(3, heads, dim, dtype=torch.float32)
    slots = torch.tensor([1, 9, 22])  # blocks 0, 2 and 5
    write_kv(cache, slots, x, scale)
    got = read_kv(cache, torch.tensor([[0, 2], [5, 0]]), block_size, scale, torch.float32)  # two block tables
    assert got.shape == (heads, 2, 2 * block_size, dim) and got.dtype == torch.float32
    expected = dequantize(quantize(x, scale, cache_dtype), scale, torch.float32) if cache_dtype in FP8 \
        else x.to(cache_dtype).float()
    # request 0 reads block 0 then block 2 (slot 9 = its key 4 + 1); request 1 reads block 5 (slot 22 = key 2)
    assert torch.equal(got[:, 0, 1], expected[0]) and torch.equal(got[:, 0, block_size + 1], expected[1])
    assert torch.equal(got[:, 1, 2], expected[2])
    written = torch.zeros(6 * block_size, dtype=torch.bool)
    written[slots] = True
    assert (cache[:, ~written].float() == 0).all()  # no other slot touched


def test_same_dtype_read_is_not_converted():
    x = torch.randn(4, 2, 8, dtype=torch.bfloat16)
    assert dequantize(x, 1.0, torch.bfloat16) is x  # auto cache: no copy, no scale


# -- settings --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["fp8_e4m3fn", "int8", "float8", "half", "", None])
def test_unknown_kv_cache_dtype_is_refused_naming_the_allowed_values(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, float16, float32, fp8, "
                                         "fp8_e4m3, fp8_e5m2"):
        CacheConfig(cache_dtype=bad)


def test_engine_args_refuse_an_unknown_kv_cache_dtype(tiny_models):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(model=str(tiny_models["llama"]), kv_cache_dtype="fp4").create_engine_config()


@pytest.mark.parametrize("name, model_dtype, expected", [
    ("auto", "float32", torch.float32), ("auto", "bfloat16", torch.bfloat16), ("bfloat16", "float32", torch.bfloat16),
    ("fp8", "bfloat16", torch.float8_e4m3fn), ("fp8_e4m3", "float32", torch.float8_e4m3fn),
    ("fp8_e5m2", "bfloat16", torch.float8_e5m2), ("float32", "bfloat16", torch.float32),
])
def test_engine_config_resolves_the_cache_dtype(tiny_models, name, model_dtype, expected):
    config = EngineArgs(model=str(tiny_models["llama"]), dtype=model_dtype, kv_cache_dtype=name).create_engine_config()
    assert config.cache.cache_dtype == name and config.kv_cache_dtype == expected


# -- scales from the checkpoint ------------------------------------------------------------------------
def _with_scales(path, scales: dict[str, torch.Tensor]):
    tensors = load_file(str(path / "model.safetensors"))
    save_file({**tensors, **scales}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_checkpoint_scales_are_used_on_write_and_read(tmp_path):
    """Power-of-two scales change the stored fp8 numbers by exactly that power (wherever both are normal
    numbers): the write divides by the scale. Layer 0's K/V depend on the prompt tokens alone, so the
    two runs store the same values there; deeper layers see the read, which multiplies the scale back."""
    plain = make_tiny_model(tmp_path / "plain", "llama")
    scaled = _with_scales(make_tiny_model(tmp_path / "scaled", "llama"), {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(2.0),  # vLLM's deprecated one-scale form
    })
    params = SamplingParams(temperature=0.0, max_tokens=1)  # the prompt's 20 tokens are written
    runs = {}
    for name, path in (("plain", plain), ("scaled", scaled)):
        llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_dtype="fp8", num_gpu_blocks_override=8)
        llm.generate({"prompt_token_ids": list(range(30, 50))}, params, use_tqdm=False)
        runs[name] = llm.llm_engine.executor.driver
    layers = runs["scaled"].model.attention_layers()
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.5, 0.25), (2.0, 2.0)]
    assert all((a.k_scale, a.v_scale) == (1.0, 1.0) for a in runs["plain"].model.attention_layers())
    smallest_normal = torch.finfo(torch.float8_e4m3fn).smallest_normal
    for kv, scale in ((0, 0.5), (1, 0.25)):
        ours, ref = runs["scaled"].kv_cache[0, kv].float(), runs["plain"].kv_cache[0, kv].float()
        normal = (ours.abs() >= smallest_normal) & (ref.abs() >= smallest_normal)
        assert normal.sum() >= 0.9 * 20 * ref[:, 0].numel()  # 20 written slots of (kv_heads, dim)
        assert torch.equal(ours[normal] * scale, ref[normal])


@pytest.mark.parametrize("scale, match", [(torch.tensor([0.5, 0.5]), "one per tensor"),
                                          (torch.tensor(-1.0), "finite and > 0"),
                                          (torch.tensor(float("nan")), "finite and > 0")])
def test_bad_checkpoint_scales_are_refused(tmp_path, scale, match):
    path = _with_scales(make_tiny_model(tmp_path / "m", "llama"), {"model.layers.0.self_attn.k_scale": scale})
    with pytest.raises(ValueError, match=match):
        LLM(str(path), dtype="float32", max_model_len=64, kv_cache_dtype="fp8")


# -- against the auto-dtype run ---------------------------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 9], list(range(30, 63)), [11, 12, 13], list(range(100, 117))]
STEPS = 16
# Per cache dtype: (top-1 agreement >= , max |logprob difference| <= , mean |logprob difference| <= ) over the
# 4 x 16 reference steps. The tiny models' logits are scaled up for clear argmax margins (tests/helpers.py),
# which scales K/V rounding into logprob differences about 20x the format's relative error: measured
# (llama, qwen2, qwen3; float32 and bfloat16 models) top-1 >= 0.97 / 0.84 / 0.75, max 0.04 / 1.17 / 2.71,
# mean 0.008 / 0.153 / 0.279 for bfloat16 / fp8_e4m3 / fp8_e5m2 caches.
TOLERANCES = {"bfloat16": (0.9, 0.1, 0.02), "fp8_e4m3": (0.75, 1.5, 0.25), "fp8_e5m2": (0.65, 3.0, 0.5)}


def _greedy(llm: LLM) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]


def _teacher_forced(llm: LLM, continuations: list[list[int]]) -> list[tuple[float, int]]:
    """(logprob, rank) of each reference token given the reference's context (prompt logprobs)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    seqs = [p + c for p, c in zip(PROMPTS, continuations)]
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
    return [(o.prompt_logprobs[i][s[i]].logprob, o.prompt_logprobs[i][s[i]].rank)
            for o, s, p in zip(outs, seqs, PROMPTS) for i in range(len(p), len(s))]


@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_narrow_caches_stay_close_to_the_auto_run(tiny_models, arch, model_dtype):
    """Teacher-forced on the auto run's greedy tokens (so every step sees the same context): top-1 agreement
    and the chosen tokens' logprob differences within TOLERANCES. Free-running greedy decoding (the decode
    path): identical tokens with logprobs within the same bound up to the first divergence."""
    path = str(tiny_models[arch])
    base = LLM(path, dtype=model_dtype, max_model_len=64)
    ref = _greedy(base)
    continuations = [r.token_ids for r in ref]
    ref_forced = _teacher_forced(base, continuations)
    mean_errors = {}
    for cache_dtype in (["bfloat16"] if model_dtype == "float32" else []) + ["fp8_e4m3", "fp8_e5m2"]:
        min_top1, max_diff, max_mean = TOLERANCES[cache_dtype]
        llm = LLM(path, dtype=model_dtype, max_model_len=64, kv_cache_dtype=cache_dtype)
        kv_cache = llm.llm_engine.executor.driver.kv_cache
        assert kv_cache.dtype == llm.llm_engine.config.kv_cache_dtype != base.llm_engine.executor.driver.kv_cache.dtype
        forced = _teacher_forced(llm, continuations)
        diffs = [abs(a - b) for (a, _), (b, _) in zip(forced, ref_forced)]
        top1 = sum(rank == 1 for _, rank in forced) / len(forced)
        assert len(forced) == len(PROMPTS) * STEPS
        assert top1 >= min_top1, (cache_dtype, top1)
        assert max(diffs) <= max_diff and sum(diffs) / len(diffs) <= max_mean, (cache_dtype, max(diffs))
        mean_errors[cache_dtype] = sum(diffs) / len(diffs)

        for r, g in zip(ref, _greedy(llm)):
            assert len(g.token_ids) == STEPS
            assert all(math.isfinite(lp[t].logprob) for lp, t in zip(g.logprobs, g.token_ids))
            for step, (a, b) in enumerate(zip(r.token_ids, g.token_ids)):
                if a != b:
                    break
                assert abs(r.logprobs[step][a].logprob - g.logprobs[step][b].logprob) <= max_diff
    # Fewer mantissa bits, larger error: e5m2 (2 bits) > e4m3 (3 bits) > bfloat16 (7 bits).
    assert mean_errors["fp8_e5m2"] > mean_errors["fp8_e4m3"] > mean_errors.get("bfloat16", 0)
