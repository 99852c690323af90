"""The triton attention backend's kernels (triton_kernels.py) against the torch backend, run by
Triton's interpreter on the CPU: decode, prefill, chunked prefill and mixed steps in one launch,
block sizes 16 and 32, GQA groups 1/2/8, head sizes 64/80/96/128/256, float32 and bfloat16, fp8
caches with scales, contexts over many blocks, and the split-K decode path. Then whole models: the
tiny Higgs Audio v2 on the triton backend (text models: test_parity.py, every backend)."""
from __future__ import annotations

import math
import os

import pytest
import torch

from pagedllm.model_executor.attention import (
    AttentionShape,
    PagedAttention,
    TorchAttentionBackend,
    build_attention_metadata,
    forward_context,
    select_attention_backend,
    unsupported_reason,
)
from pagedllm.model_executor.attention.triton_backend import TritonAttentionBackend
from pagedllm.utils import cdiv

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="set by tests/conftest.py wherever there is no GPU")


def make_layer(heads, kv_heads, head_dim, kv_dtype, num_slots, scales=(1.0, 1.0), seed=0):
    attn = PagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5)
    gen = torch.Generator().manual_seed(seed)
    # A pool that is not zero: slots past a sequence's keys hold values that must not reach the output.
    cache = (torch.randn(2, kv_heads, num_slots, head_dim, generator=gen) * 3).to(kv_dtype)
    attn.k_cache, attn.v_cache = cache[0], cache[1]
    attn.k_scale, attn.v_scale = scales
    return attn


def scattered_tables(starts, lengths, block_size, num_blocks, seed=0):
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for s, n in zip(starts, lengths):
        count = cdiv(s + n, block_size)
        tables.append(perm[used:used + count])
        used += count
    assert used <= num_blocks
    return tables


def run(backend, attn, step, q, k, v):
    """One step on a copy of the layer's cache: (output, K cache, V cache) after it."""
    starts, lengths, tables, block_size = step
    meta = build_attention_metadata(starts, lengths, tables, block_size, CPU, backend)
    k_cache, v_cache = attn.k_cache, attn.v_cache
    attn.k_cache, attn.v_cache = k_cache.clone(), v_cache.clone()
    try:
        with forward_context(meta):
            out = attn(q, k, v)
        return out, attn.k_cache, attn.v_cache
    finally:
        attn.k_cache, attn.v_cache = k_cache, v_cache


def compare(starts, lengths, heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
            kv_dtype=None, scales=(1.0, 1.0), split_below=0, seed=0, window=None, sinks=False):
    kv_dtype = kv_dtype or dtype
    num_blocks = sum(cdiv(s + n, block_size) for s, n in zip(starts, lengths)) + 5
    attn = make_layer(heads, kv_heads, head_dim, kv_dtype, num_blocks * block_size, scales, seed)
    attn.sliding_window = window
    if sinks:  # logits of the order of the scores', so the sink takes a real share of each softmax
        attn.enable_sinks()
        attn.sinks.data = torch.randn(heads, generator=torch.Generator().manual_seed(seed + 2)) * 2
    step = (starts, lengths, scattered_tables(starts, lengths, block_size, num_blocks, seed), block_size)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, h, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    triton_backend = TritonAttentionBackend(CPU)
    triton_backend.split_below = split_below
    got, got_k, got_v = run(triton_backend, attn, step, q, k, v)
    ref, ref_k, ref_v = run(TorchAttentionBackend(), attn, step, q, k, v)
    assert got.shape == ref.shape == q.shape and got.dtype == dtype
    if kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # The same fp8 values, but for ties that the interpreter's float8 rounding breaks the other way.
        for a, b in ((got_k, ref_k), (got_v, ref_v)):
            differ = (a.float() != b.float()).float().mean().item()
            assert differ < 0.01, differ
    else:
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)  # the write, exactly
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        return got
    # 16-bit: the torch backend rounds scores to the model dtype, the kernel keeps them in float32, so
    # both are held to the float32 result of the same (rounded) inputs: the kernel no further from it.
    # Each against the cache it wrote (fp8 ties may differ); the bound allows two units in the last place
    # of the output's largest values, where the two roundings part.
    truth = _truth(got_k, got_v, scales, step, q)
    err_kernel = (got.float() - truth).abs().max().item()
    err_torch = (ref.float() - _truth(ref_k, ref_v, scales, step, q)).abs().max().item()
    ulp = 2.0 ** (math.floor(math.log2(truth.abs().max().item())) - 7)  # bfloat16: 8 significant bits
    assert err_kernel <= max(1.5 * err_torch, 2 * ulp), (err_kernel, err_torch, ulp)
    return got


def _truth(k_cache, v_cache, scales, step, q):
    """Float32 attention over caches that already hold the step's K/V (dequantized; the write repeats them)."""
    starts, lengths, tables, block_size = step
    attn = PagedAttention(q.shape[1], k_cache.shape[0], q.shape[2], q.shape[2] ** -0.5)
    attn.k_cache, attn.v_cache = k_cache.float() * scales[0], v_cache.float() * scales[1]
    q = q.float()
    meta = build_attention_metadata(starts, lengths, tables, block_size, CPU)
    slots = meta.slot_mapping
    k = attn.k_cache[:, slots].transpose(0, 1).contiguous()
    v = attn.v_cache[:, slots].transpose(0, 1).contiguous()
    with forward_context(meta):
        return attn(q, k, v)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 4), (16, 2)])  # GQA groups 1, 2, 8
def test_decode(heads, kv_heads, block_size):
    # Keys seen: 1 (a first token), part of a block, exactly one block, many blocks (300 keys).
    compare([0, 5, block_size - 1, 2 * block_size - 1, 299], [1] * 5, heads, kv_heads, block_size=block_size)


@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_and_chunked_prefill(block_size):
    compare([0, 0], [37, 90], block_size=block_size)  # whole prompts, one spanning several query tiles
    compare([16, 70, 3], [20, 9, 64], block_size=block_size)  # chunks after cached keys


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 4), (16, 2)])
def test_mixed_step_in_one_launch(heads, kv_heads):
    """Decodes beside prefill chunks and a whole prompt: one kernel launch for the step."""
    compare([40, 0, 17, 3, 130, 0], [1, 9, 1, 5, 1, 70], heads, kv_heads)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_sizes(head_dim):
    compare([0, 33, 7], [12, 1, 4], heads=4, kv_heads=2, head_dim=head_dim)


def test_bfloat16():
    compare([40, 0, 17, 100], [1, 9, 1, 30], dtype=torch.bfloat16)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 0.25)])
def test_fp8_cache_dequantized_in_the_kernel(kv_dtype, scales):
    compare([40, 0, 17, 100], [1, 9, 1, 30], dtype=torch.bfloat16, kv_dtype=kv_dtype, scales=scales)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 1)])
def test_split_k_decode_over_long_contexts(heads, kv_heads):
    """Few programs (requests x KV heads) and long contexts: the keys split into partitions, then combined."""
    got = compare([1500, 700, 20], [1, 1, 1], heads, kv_heads, head_dim=64, split_below=64)
    unsplit = compare([1500, 700, 20], [1, 1, 1], heads, kv_heads, head_dim=64, split_below=0)
    torch.testing.assert_close(got, unsplit, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,sinks", [(24, False), (None, True), (7, True)])
def test_sliding_windows_and_sinks(window, sinks):
    """gpt-oss' attention: a window shorter than the contexts (decodes, a prefill chunk, a whole prompt in one
    step), sinks in each softmax; and (sinks) the split-K decode, whose sinks join when partitions are combined
    (the window's keys then fall in the last partition)."""
    compare([40, 0, 70, 3], [1, 45, 20, 1], window=window, sinks=sinks)
    if sinks:
        got = compare([1100, 600], [1, 1], 4, 4, split_below=64, window=window, sinks=sinks)
        unsplit = compare([1100, 600], [1, 1], 4, 4, split_below=0, window=window, sinks=sinks)
        torch.testing.assert_close(got, unsplit, rtol=1e-5, atol=1e-5)


def test_triton_backend_refusals():
    shape = AttentionShape(CPU, 8, 2, 64, torch.float32, torch.float32)
    assert unsupported_reason("triton", shape) is None  # under the interpreter
    big = AttentionShape(CPU, 8, 2, 512, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="--attention-backend triton cannot run this model here: its kernels take "
                                         "head sizes up to 256, not 512. Backends that can: torch"):
        select_attention_backend("triton", big)


def test_triton_backend_needs_a_gpu_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    shape = AttentionShape(CPU, 8, 2, 64, torch.float32, torch.float32)
    assert unsupported_reason("triton", shape).startswith("it runs on CUDA GPUs")
    assert select_attention_backend("auto", shape).name == "cpu"


def test_higgs_audio_runs_on_every_backend(tmp_path):
    """The tiny Higgs Audio v2 (its dual-FFN layers and audio routing around the same attention): greedy
    tokens and audio codes equal on the torch, cpu and triton backends, and to transformers' generate."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.model_executor.audio_sampling import extract_audio_codes
    from tests.higgs_helpers import TINY_SPEC, audio_prompt, hf_higgs_generate, make_tiny_higgs_model, text_prompt

    path = str(make_tiny_higgs_model(tmp_path / "higgs", head_dim=32))  # a head size the cpu decode kernel has
    items = [(text_prompt(0, 9), None), audio_prompt(1, 4), (text_prompt(2, 17), None)]
    inputs = [{"prompt_token_ids": p} | ({} if f is None else {"audio_codes": f}) for p, f in items]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    results = {}
    for backend in ("torch", "cpu", "triton"):
        llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, block_size=4,
                  repetition_aware_sampling=False, attention_backend=backend,
                  num_gpu_blocks_override=64)  # no profile run (interpreted on triton: seconds)
        assert llm.llm_engine.executor.driver.attn_backend.name == backend
        outs = llm.generate(inputs, params, use_tqdm=False)
        results[backend] = [(o.outputs[0].token_ids, o.outputs[0].audio_codes) for o in outs]
    reference = []
    for prompt, frames in items:
        hf_frames, hf_tokens = hf_higgs_generate(path, prompt, frames, 12)
        reference.append((hf_tokens, extract_audio_codes(hf_frames, TINY_SPEC)))
    for backend in ("torch", "cpu", "triton"):
        for (tokens, codes), (ref_tokens, ref_codes) in zip(results[backend], reference, strict=True):
            assert tokens == ref_tokens and torch.equal(codes, ref_codes), backend


def test_step_metadata_lives_in_persistent_buffers():
    """With buffers allocated (as the model runner does), a step's metadata is views of the same device
    tensors every step, equal to freshly built ones; a step larger than the buffers gets fresh tensors."""
    backend = TritonAttentionBackend(CPU)
    fresh = backend.build_metadata([0, 40, 3], [9, 1, 5], [[4, 2], [7, 1, 0], [3]], 16, CPU)
    backend.allocate_buffers(32, 4, 8, CPU)
    first = backend.build_metadata([0, 40, 3], [9, 1, 5], [[4, 2], [7, 1, 0], [3]], 16, CPU)
    for name in ("positions", "slot_mapping", "query_start", "seq_lens", "block_table"):
        got, want = getattr(first, name), getattr(fresh, name)
        assert torch.equal(got, want), name
        assert got.data_ptr() == backend.buffers.device[name].data_ptr()
    assert (first.max_query_len, first.max_seq_len) == (fresh.max_query_len, fresh.max_seq_len) == (9, 41)
    second = backend.build_metadata([41], [1], [[7, 1, 0]], 16, CPU)
    assert second.block_table.data_ptr() == first.block_table.data_ptr()
    assert second.slot_mapping.tolist() == [0 * 16 + 41 % 16]  # position 41: the third block, block 0 and second.query_start.tolist() == [0, 1]
    big = backend.build_metadata([0], [40], [[0, 1, 2]], 16, CPU)  # 40 tokens > 32
    assert big.positions.data_ptr() != backend.buffers.device["positions"].data_ptr()
    assert big.positions.tolist() == list(range(40))
