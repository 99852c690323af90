"""The native CPU decode-attention kernel against its PyTorch twin (gathered K/V, batched matmuls),
on paged caches with scattered blocks, GQA, ragged lengths and block sizes with and without a
power of two (in bfloat16, 16-slot blocks take the AMX score path where the CPU has it, 12-slot ones
the vector path); and the fallbacks when the kernel cannot be had."""
from __future__ import annotations

import logging

import pytest
import torch

from pagedllm.model_executor import cpu_kernels as cpu_kernels_module
from pagedllm.model_executor.attention import (
    AttentionShape,
    PagedAttention,
    TorchAttentionBackend,
    build_attention_metadata,
    forward_context,
    select_attention_backend,
    unsupported_reason,
)
from pagedllm.model_executor.attention import cpu_backend as cpu_backend_module
from pagedllm.model_executor.attention.cpu_backend import CpuAttentionBackend
from pagedllm.model_executor.cpu_isa import available_cpu_isas, expected_cpu_isas
from pagedllm.model_executor.cpu_isa import cpu_kernels
from pagedllm.utils import cdiv

CPU = torch.device("cpu")


def _attention(heads, kv_heads, head_dim, dtype, num_blocks, block_size, gen):
    attn = PagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5)
    cache = torch.randn(2, kv_heads, num_blocks * block_size, head_dim, generator=gen).to(dtype)
    attn.k_cache, attn.v_cache = cache[0], cache[1]
    return attn


def _step(starts, lengths, block_size, num_blocks, gen):
    """One step with each request's blocks scattered over the pool: (starts, lengths, tables, block_size)."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for s, n in zip(starts, lengths):
        count = cdiv(s + n, block_size)
        tables.append(perm[used:used + count])
        used += count
    return starts, lengths, tables, block_size


def _decode_step(attn, dtype, num_blocks: int, block_size: int, gen):
    """A decode step of six requests seeing 1 key (a first token), a partial block, exactly one block and many
    blocks: (step, q, k, v)."""
    starts = [0, 5, block_size - 1, 3 * block_size - 1, 150, 97]
    step = _step(starts, [1] * len(starts), block_size, num_blocks, gen)
    q, k, v = (torch.randn(len(starts), heads, attn.head_dim, generator=gen).to(dtype)
               for heads in (attn.num_heads, attn.num_kv_heads, attn.num_kv_heads))
    return step, q, k, v


def _run(attn, step, q, k, v, use_kernel: bool):
    """The step through the cpu backend (native kernels) or the torch backend (its twin)."""
    backend = CpuAttentionBackend() if use_kernel else TorchAttentionBackend()
    meta = build_attention_metadata(*step, CPU, backend)
    k_cache, v_cache = attn.k_cache, attn.v_cache
    attn.k_cache, attn.v_cache = k_cache.clone(), v_cache.clone()  # each run writes this step's K/V afresh
    try:
        with forward_context(meta):
            return attn(q, k, v)
    finally:
        attn.k_cache, attn.v_cache = k_cache, v_cache


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 64), (8, 8, 128), (6, 2, 32), (16, 1, 96), (4, 2, 256), (4, 1, 80)])
@pytest.mark.parametrize("block_size", [16, 12])
def test_decode_kernel_matches_the_pytorch_path(dtype, tol, heads, kv_heads, head_dim, block_size, kernel_path):
    assert cpu_kernels() is not None, "the C++ kernels must build on this machine (gcc and Python headers)"
    gen = torch.Generator().manual_seed(0)
    num_blocks = 200
    attn = _attention(heads, kv_heads, head_dim, dtype, num_blocks, block_size, gen)
    step, q, k, v = _decode_step(attn, dtype, num_blocks, block_size, gen)
    assert build_attention_metadata(*step, CPU).groups[0].covers_step
    ours = _run(attn, step, q, k, v, True)
    twin = _run(attn, step, q, k, v, False)
    assert ours.dtype == dtype and ours.shape == (len(q), heads, head_dim)
    torch.testing.assert_close(ours.float(), twin.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(14, 2, 64, 16), (8, 8, 32, 12)])
@pytest.mark.parametrize("window,sinks", [(7, False), (None, True), (20, True)])
def test_decode_kernel_with_sliding_windows_and_sinks(dtype, tol, heads, kv_heads, head_dim, block_size, window,
                                                      sinks, kernel_path):
    """gpt-oss' attention in the decode kernel: keys from len - window on (windows shorter and longer than a
    block and than the sequence), each head's sink in its denominator; equal to the torch path's mask and sinks."""
    gen = torch.Generator().manual_seed(5)
    attn = _attention(heads, kv_heads, head_dim, dtype, 200, block_size, gen)
    attn.sliding_window = window
    if sinks:
        attn.enable_sinks()
        attn.sinks.data = torch.randn(heads, generator=gen).to(dtype)
    step, q, k, v = _decode_step(attn, dtype, 200, block_size, gen)
    ours = _run(attn, step, q, k, v, True)
    twin = _run(attn, step, q, k, v, False)
    torch.testing.assert_close(ours.float(), twin.float(), rtol=tol, atol=tol)
    attn.sliding_window, attn.sinks = None, None
    assert not torch.allclose(_run(attn, step, q, k, v, True).float(), ours.float(), rtol=tol, atol=tol)


def test_decode_kernel_ignores_what_lies_before_the_window():
    """The keys before a window are not read: NaN there (a block given back to the pool, its table entry the
    null block) does not reach the output."""
    kernels = cpu_kernels()
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, bs, head_dim = 14, 2, 16, 64
    k_cache = torch.randn(kv_heads, 8 * bs, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(kv_heads, 8 * bs, head_dim, generator=gen).bfloat16()
    table, lens = torch.tensor([[5, 2, 3]]), torch.tensor([45])  # keys 0..44; a window of 20 sees 25..44
    q = torch.randn(1, heads, head_dim, generator=gen).bfloat16()
    clean = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, head_dim ** -0.5, bs, 20, None)
    k_cache[:, 5 * bs:6 * bs] = float("nan")  # block 5: keys 0..15
    k_cache[:, 2 * bs:2 * bs + 9] = float("nan")  # keys 16..24 of block 2, before the window in its tile
    v_cache[:, 2 * bs:2 * bs + 9] = float("inf")
    dirty = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, head_dim ** -0.5, bs, 20, None)
    assert torch.isfinite(dirty.float()).all()
    assert torch.equal(dirty, clean)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_kernel_ignores_what_lies_past_the_last_key(head_dim):
    """In bfloat16 with 16-slot blocks the scores are taken 16 keys at a time from the block (the AMX
    path on CPUs that have it): slots past a sequence's last key hold whatever the pool held, NaN or
    inf included, and must not reach the output."""
    kernels = cpu_kernels()
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, bs = 14, 2, 16
    k_cache = torch.randn(kv_heads, 8 * bs, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(kv_heads, 8 * bs, head_dim, generator=gen).bfloat16()
    table, lens = torch.tensor([[5, 2], [7, 0]]), torch.tensor([21, 16])
    q = torch.randn(2, heads, head_dim, generator=gen).bfloat16()
    clean = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, head_dim ** -0.5, bs, 0, None)
    k_cache[:, 2 * bs + 5:3 * bs] = float("nan")  # block 2 after the 21st key of sequence 0
    v_cache[:, 2 * bs + 5:3 * bs] = float("inf")
    k_cache[:, 0:bs] = float("nan")  # block 0: sequence 1's second block, beyond its 16 keys
    dirty = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, head_dim ** -0.5, bs, 0, None)
    assert torch.isfinite(dirty.float()).all()
    assert torch.equal(dirty, clean)


def test_decode_kernel_in_a_step_with_prefill_chunks():
    """Decodes beside prefill chunks: the kernel's rows land at their tokens, the chunks are untouched."""
    gen = torch.Generator().manual_seed(1)
    attn = _attention(8, 2, 64, torch.float32, 64, 16, gen)
    starts, lengths = [40, 0, 17, 3], [1, 9, 1, 5]
    step = _step(starts, lengths, 16, 64, gen)
    meta = build_attention_metadata(*step, CPU)
    assert [g.is_decode for g in meta.groups] == [True, False] and not meta.groups[0].covers_step
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, h, 64, generator=gen) for h in (8, 2, 2))
    ours = _run(attn, step, q, k, v, True)
    twin = _run(attn, step, q, k, v, False)
    torch.testing.assert_close(ours, twin, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(14, 2, 64, 16), (8, 8, 32, 12)])
@pytest.mark.parametrize("window,sinks", [(None, False), (7, False), (None, True), (20, True)])
@pytest.mark.parametrize("starts,lengths", [
    ([0, 0, 0], [37, 16, 1]),  # fresh prompts only: the group is the whole step (no index maps)
    ([0, 40, 150, 9], [30, 23, 2, 1]),  # chunks after earlier ones (keys before the step's queries), a decode
])
def test_prefill_kernel_matches_the_pytorch_path(dtype, tol, heads, kv_heads, head_dim, block_size, window, sinks,
                                                 starts, lengths, monkeypatch):
    """Prefill groups through the prefill kernel, each query over its request's keys 0..its position (causal,
    windows and sinks as in decode; prompts longer and shorter than its 16-query blocks), equal to the torch
    path's masked SDPA; PyTorch's attention is not called."""
    gen = torch.Generator().manual_seed(7)
    attn = _attention(heads, kv_heads, head_dim, dtype, 64, block_size, gen)
    attn.sliding_window = window
    if sinks:
        attn.enable_sinks()
        attn.sinks.data = torch.randn(heads, generator=gen).to(dtype)
    step = _step(starts, lengths, block_size, 64, gen)
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, h, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    twin = _run(attn, step, q, k, v, False)
    import torch.nn.functional as F

    def refused(*args, **kwargs):
        raise AssertionError("the cpu backend called PyTorch's attention")

    monkeypatch.setattr(F, "scaled_dot_product_attention", refused)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", refused)
    ours = _run(attn, step, q, k, v, True)
    torch.testing.assert_close(ours.float(), twin.float(), rtol=tol, atol=tol)


def test_prefill_kernel_reads_no_key_outside_its_queries_windows():
    """Slots past a request's last key and blocks before its earliest query's window (given back to the pool,
    the table's entry the null block) hold NaN and inf: none of it reaches the output."""
    kernels = cpu_kernels()
    gen = torch.Generator().manual_seed(6)
    heads, kv_heads, bs, head_dim, window = 8, 2, 16, 64, 20
    k_cache = torch.randn(kv_heads, 10 * bs, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(kv_heads, 10 * bs, head_dim, generator=gen).bfloat16()
    table = torch.tensor([[5, 2, 3, 7]])  # a chunk of 19 queries at positions 40..58: keys 21..58 are read
    q = torch.randn(19, heads, head_dim, generator=gen).bfloat16()
    args = (table, torch.tensor([0]), torch.tensor([19]), torch.tensor([40]), head_dim ** -0.5, bs, window, None)
    clean = kernels.paged_prefill_attention(q, k_cache, v_cache, *args)
    k_cache[:, 5 * bs:6 * bs] = float("nan")  # block 5: keys 0..15, before every query's window
    k_cache[:, 2 * bs:2 * bs + 5] = float("nan")  # keys 16..20 of block 2
    v_cache[:, 2 * bs:2 * bs + 5] = float("inf")
    k_cache[:, 7 * bs + 11:8 * bs] = float("nan")  # past the last key (58) in block 7
    v_cache[:, 7 * bs + 11:8 * bs] = float("inf")
    dirty = kernels.paged_prefill_attention(q, k_cache, v_cache, *args)
    assert torch.isfinite(dirty.float()).all()
    assert torch.equal(dirty, clean)


def test_prefill_kernel_refuses_indices_outside_its_inputs():
    kernels = cpu_kernels()
    q, cache = torch.zeros(4, 2, 64), torch.zeros(1, 32, 64)
    ok = (torch.tensor([[1]]), torch.tensor([0]), torch.tensor([4]), torch.tensor([0]), 0.125, 16, 0, None)
    assert kernels.paged_prefill_attention(q, cache, cache, *ok).shape == q.shape
    with pytest.raises(RuntimeError, match="outside q"):
        kernels.paged_prefill_attention(q, cache, cache, ok[0], torch.tensor([1]), torch.tensor([4]), *ok[3:])
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        kernels.paged_prefill_attention(q, cache, cache, torch.tensor([[2]]), *ok[1:])
    with pytest.raises(RuntimeError, match="its block table holds"):
        kernels.paged_prefill_attention(q, cache, cache, ok[0], ok[1], ok[2], torch.tensor([13]), *ok[4:])


def _shape(head_dim=64, dtype=torch.float32, kv_dtype=None):
    return AttentionShape(CPU, 4, 2, head_dim, dtype, kv_dtype or dtype)


def test_cpu_backend_is_chosen_only_where_its_kernels_apply():
    """Where the native kernels cannot run the model, the cpu backend is refused with the reason (auto
    takes torch): never a silent switch to other arithmetic inside a step."""
    assert unsupported_reason("cpu", _shape()) is None
    assert select_attention_backend("auto", _shape()).name == "cpu"
    cases = {
        "not bfloat16": _shape(kv_dtype=torch.bfloat16),  # a cache in another dtype than the queries
        "not float8_e4m3fn": _shape(kv_dtype=torch.float8_e4m3fn),
        "not 48": _shape(head_dim=48),  # a head size the decode kernel is not built for
        "not float16": _shape(dtype=torch.float16),
    }
    for words, shape in cases.items():
        assert words in unsupported_reason("cpu", shape)
        assert select_attention_backend("auto", shape).name == "torch"
        with pytest.raises(ValueError, match=f"--attention-backend cpu cannot run this model here: .*{words}.*"
                                             f"Backends that can: torch"):
            select_attention_backend("cpu", shape)
    cuda = AttentionShape(torch.device("cuda"), 4, 2, 64, torch.float32, torch.float32)
    assert unsupported_reason("cpu", cuda) == "it runs on the CPU only"


def test_kernels_off_by_environment(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    cpu_kernels_module.load_cpu_kernels.cache_clear()
    try:
        assert cpu_kernels() is None
        assert "could not be built" in unsupported_reason("cpu", _shape())
        assert select_attention_backend("auto", _shape()).name == "torch"
    finally:
        cpu_kernels_module.load_cpu_kernels.cache_clear()


def _broken(*args, **kwargs):
    raise RuntimeError("Error building extension 'pagedllm_cpu': g++: command not found")


def test_a_failed_build_falls_back_with_a_warning(monkeypatch, caplog, tmp_path):
    import torch.utils.cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built there: the builder runs
    monkeypatch.setattr(torch.utils.cpp_extension, "load", _broken)
    cpu_kernels_module.load_cpu_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_kernels_module.__name__):
            assert cpu_kernels() is None
        assert "g++: command not found" in caplog.text and "PyTorch ops instead" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_kernels_module.load_cpu_kernels.cache_clear()
    assert cpu_kernels() is not None  # built again from the disk cache once the builder works
    assert cpu_backend_module.cpu_kernels is cpu_kernels


def test_a_built_extension_loads_without_running_the_builder(monkeypatch):
    """Once built, the kernels load from PyTorch's extension cache directly: the builder (ninja) never runs
    again, so two ninja versions on one machine cannot make each process rebuild them."""
    import torch.utils.cpp_extension

    assert cpu_kernels() is not None  # built (or loaded) the usual way
    monkeypatch.setattr(torch.utils.cpp_extension, "load", _broken)
    cpu_kernels_module.load_cpu_kernels.cache_clear()
    try:
        kernels = cpu_kernels()
        assert kernels is not None and hasattr(kernels, "paged_decode_attention")
    finally:
        monkeypatch.undo()
        cpu_kernels_module.load_cpu_kernels.cache_clear()


def test_a_lock_left_by_an_interrupted_build_is_removed(monkeypatch, tmp_path, caplog):
    """A build killed midway leaves PyTorch's lock file, which makes every later build wait for good:
    an old one is removed with a warning, a fresh one (a build running now) is left alone."""
    import os
    import time

    import torch.utils.cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    seen = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load",
                        lambda name, *args, **kwargs: seen.append((tmp_path / name / "lock").exists()) or object())
    lock = tmp_path / cpu_kernels_module.build_name() / "lock"
    lock.parent.mkdir()
    try:
        lock.touch()
        cpu_kernels_module.load_cpu_kernels.cache_clear()
        assert cpu_kernels() is not None and seen == [True]  # a fresh lock: another build owns it
        hour_ago = time.time() - 3600
        os.utime(lock, (hour_ago, hour_ago))
        cpu_kernels_module.load_cpu_kernels.cache_clear()
        with caplog.at_level(logging.WARNING, logger=cpu_kernels_module.__name__):
            assert cpu_kernels() is not None and seen == [True, False]
        assert "interrupted kernel build" in caplog.text and not lock.exists()
    finally:
        monkeypatch.undo()
        cpu_kernels_module.load_cpu_kernels.cache_clear()


# --------------------------------------------------------------------------------------------
# Fused elementwise kernels: bit-identical to the PyTorch ops they replace in bfloat16 (the
# reference's rounding points are kept), within float32 rounding in float32.
# --------------------------------------------------------------------------------------------
def _same(ours: torch.Tensor, twin: torch.Tensor) -> None:
    if ours.dtype == torch.bfloat16:
        assert torch.equal(ours, twin), (ours.float() - twin.float()).abs().max().item()
    else:
        torch.testing.assert_close(ours, twin, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_the_residual_add(dtype):
    """The norm's CPU forward against its reference one."""
    from pagedllm.model_executor.layers import RMSNorm

    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(96, 1e-5).to(dtype)
    norm.weight.data.copy_(torch.rand(96, generator=gen) + 0.5)
    x, residual = (torch.randn(37, 96, generator=gen).mul(4).to(dtype) for _ in range(2))
    with torch.inference_mode():
        ours = norm.forward_cpu(x)
        stream = residual.clone()
        ours_fused, ours_stream = norm.forward_cpu(x, stream)
        twin = norm.forward_native(x)
        twin_fused, twin_stream = norm.forward_native(x, residual.clone())
    reference = norm.weight * torch.nn.functional.rms_norm(x.float(), (96,), eps=1e-5).to(dtype)
    _same(ours, twin)
    _same(ours, reference)
    assert torch.equal(ours_stream, twin_stream) and torch.equal(twin_stream, residual + x)
    assert ours_stream is stream  # the kernel updated the stream in place
    _same(ours_fused, twin_fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [4864, 100])  # a multiple of 16 and one with a tail
def test_silu_and_mul_is_silu_gate_times_up(dtype, width):
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(9, 2 * width, generator=gen).mul(6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # far tails of the sigmoid
    gate, up = gate_up.chunk(2, dim=-1)
    _same(cpu_kernels().silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_a_strided_view_of_qkv(dtype):
    from pagedllm.model_executor.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(5)
    rotary = RotaryEmbedding(64, 300, {"rope_theta": 10000.0})
    tokens, heads, kv_heads = 11, 6, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * 64, generator=gen).to(dtype)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    twin = rotary.forward_native(positions, qkv[:, :(heads + kv_heads) * 64].view(tokens, heads + kv_heads, 64).clone())
    before_v = qkv[:, (heads + kv_heads) * 64:].clone()
    view = qkv[:, :(heads + kv_heads) * 64].view(tokens, heads + kv_heads, 64)
    ours = rotary.forward_cpu(positions, view)
    assert ours.data_ptr() == view.data_ptr()  # rotated in place, inside the qkv buffer
    _same(ours, twin)
    assert torch.equal(qkv[:, (heads + kv_heads) * 64:], before_v)  # values untouched


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(1001, 896), (7, 100)])  # rows not a multiple of 4, K with a tail
def test_gemv_is_the_linear_product(rows, n, k):
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    ours = cpu_kernels().gemv_bf16(x, w)
    assert ours.shape == (rows, n) and ours.dtype == torch.bfloat16
    exact = x.double() @ w.double().T
    # One rounding of a float32 sum, as the reference's bf16 matmul: within a bf16 ulp or two.
    torch.testing.assert_close(ours.double(), exact, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ours.float(), torch.nn.functional.linear(x, w).float(), rtol=1.6e-2, atol=1e-2)


def test_kernels_refuse_indices_outside_their_tables():
    """Every read of the attention and rotary kernels goes through block ids, key counts and positions:
    out-of-range ones raise a clear error instead of reading past the cache or the table."""
    kernels = cpu_kernels()
    cache = torch.zeros(2, 4 * 16, 64)
    q = torch.zeros(1, 4, 64)
    ok = kernels.paged_decode_attention(q, cache, cache, torch.tensor([[3]]), torch.tensor([16]), 0.125, 16, 0, None)
    assert ok.shape == (1, 4, 64)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        kernels.paged_decode_attention(q, cache, cache, torch.tensor([[4]]), torch.tensor([5]), 0.125, 16, 0, None)
    with pytest.raises(RuntimeError, match="keys; its block table holds"):
        kernels.paged_decode_attention(q, cache, cache, torch.tensor([[0]]), torch.tensor([17]), 0.125, 16, 0, None)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        kernels.rotary_embedding(torch.zeros(2, 1, 8), torch.tensor([0, 10]), torch.zeros(10, 8), torch.zeros(10, 8))



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_kernel_is_index_copy_along_slots(dtype):
    """write_kv_cache stores K and V rows where write_kv's index_copy_ does, from strided views of a QKV
    product (as the attention layer passes them), and touches no other slot."""
    from pagedllm.model_executor.kv_quant import write_kv
    kernels = cpu_kernels()
    gen = torch.Generator().manual_seed(0)
    tokens, kv_heads, dim, slots_total = 37, 2, 64, 300
    qkv = torch.randn(tokens, (14 + 2 * kv_heads) * dim, generator=gen).to(dtype)
    k = qkv[:, 14 * dim:(14 + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (14 + kv_heads) * dim:].view(tokens, kv_heads, dim)
    slots = torch.randperm(slots_total, generator=gen)[:tokens]
    cache = torch.randn(2, kv_heads, slots_total, dim, generator=gen).to(dtype)
    expected = cache.clone()
    write_kv(expected[0], slots, k, 1.0)
    write_kv(expected[1], slots, v, 1.0)
    kernels.write_kv_cache(cache[0], cache[1], slots, k, v)
    assert torch.equal(cache, expected)
    assert not torch.equal(cache[0][:, slots], torch.zeros_like(cache[0][:, slots]))


def test_kv_write_kernel_refuses_what_it_cannot_store():
    kernels = cpu_kernels()
    cache = torch.zeros(2, 2, 32, 64)
    k = torch.ones(3, 2, 64)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        kernels.write_kv_cache(cache[0], cache[1], torch.tensor([0, 5, 32]), k, k)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        kernels.write_kv_cache(cache[0], cache[1], torch.tensor([0, -1, 2]), k, k)
    assert torch.equal(cache, torch.zeros_like(cache)), "a refused write stores nothing"
    with pytest.raises(RuntimeError, match="share one dtype"):
        kernels.write_kv_cache(cache[0], cache[1], torch.tensor([0, 1, 2]), k.bfloat16(), k.bfloat16())
    with pytest.raises(RuntimeError, match="int64"):
        kernels.write_kv_cache(cache[0], cache[1], torch.tensor([0, 1, 2], dtype=torch.int32), k, k)
    with pytest.raises(RuntimeError, match="kv_heads, dim"):
        kernels.write_kv_cache(cache[0], cache[1], torch.tensor([0, 1, 2]), torch.ones(3, 4, 64), torch.ones(3, 4, 64))


def test_argmax_kernel_refuses_what_it_cannot_read():
    """The argmax kernel takes (rows, cols) float32 / bfloat16 with contiguous rows and says so."""
    kernels = cpu_kernels()
    assert kernels.argmax_rows(torch.tensor([[1.0, 3.0, 3.0]])).tolist() == [1]
    with pytest.raises(RuntimeError, match="must be a float32 or bfloat16 CPU tensor"):
        kernels.argmax_rows(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernels.argmax_rows(torch.zeros(3, 4).T)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernels.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernels.argmax_rows(torch.zeros(4))

# The paths of packed_linear.cpp this machine can run: AMX where it has it, and the AVX2 / FMA one (what
# every CPU without AMX runs, AVX-512 ones included) forced below it with PAGEDLLM_CPU_ISA.
KERNEL_PATHS = [p for p in expected_cpu_isas() if p in ("amx", "avx2")]  # (cpu_path checks it)


@pytest.fixture(params=KERNEL_PATHS or [pytest.param(None, marks=pytest.mark.skip(
    reason="neither AMX / AVX512-BF16 nor AVX2 / FMA here: pack_linear_weights uses oneDNN or fp32 (test_layers)"))])
def kernel_path(request, monkeypatch) -> str:
    assert available_cpu_isas() == expected_cpu_isas(), "the kernels built here run other paths than the flags say"
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", request.param)
    assert cpu_kernels().packed_linear_supported() == (request.param == "amx")
    return request.param


# Whichever path this CPU has. AMX: the dot-product path (1-4), one to four AMX row tiles with a padded
# last one (5, 16, 17, 33, 64), and row bands of 32 x 32 blocks with ragged ends (65, 100, 300). AVX2 /
# FMA: the few-row tiles (1-4), 4-row tiles with ragged ends (5, 17, 33, 65, 100), 128-row bands (300).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 33, 64, 65, 100, 300])
@pytest.mark.parametrize("n,k", [(1152, 896), (48, 64), (16, 4864)])  # odd column-block counts at 48 and 16
def test_packed_linear_is_the_linear_product(rows, n, k, kernel_path):
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    kernels = cpu_kernels()
    packed = kernels.pack_linear_weight(w)
    assert packed.shape == (n // 16, k // 2, 16, 2) and packed.numel() == w.numel()
    for b in (None, bias):
        ours = kernels.packed_linear(x, packed, None if b is None else b.float())
        assert ours.shape == (rows, n) and ours.dtype == torch.bfloat16
        exact = x.double() @ w.double().T + (0 if b is None else b.double())
        # float32 sums of exact products, rounded once to bf16: within a bf16 ulp of the exact value.
        torch.testing.assert_close(ours.double(), exact, rtol=8e-3, atol=1e-3 * k ** 0.5)
    # Leading dimensions pass through, as with F.linear.
    assert kernels.packed_linear(x.view(1, rows, k), packed, None).shape == (1, rows, n)


def test_packed_embedding_reads_the_rows_back(kernel_path):
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    kernels = cpu_kernels()
    packed = kernels.pack_linear_weight(table)
    ids = torch.tensor([[0, 95, 17], [16, 15, 17]])
    assert torch.equal(kernels.packed_embedding(ids, packed), table[ids])  # bit for bit, any id shape
    with pytest.raises(RuntimeError, match="token id 96 is out of range for an embedding of 96 rows"):
        kernels.packed_embedding(torch.tensor([3, 96]), packed)
    with pytest.raises(RuntimeError, match="token id -1 is out of range"):
        kernels.packed_embedding(torch.tensor([-1]), packed)


def test_packed_linear_refuses_what_it_cannot_multiply(kernel_path):
    kernels = cpu_kernels()
    with pytest.raises(RuntimeError, match="N % 16 == 0 and K % 32 == 0"):
        kernels.pack_linear_weight(torch.zeros(40, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="N % 16 == 0 and K % 32 == 0"):
        kernels.pack_linear_weight(torch.zeros(32, 64))  # float32
    packed = kernels.pack_linear_weight(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"x must be bfloat16 \(\.\.\., 64\)"):
        kernels.packed_linear(torch.zeros(2, 96, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match=r"x must be bfloat16"):
        kernels.packed_linear(torch.zeros(2, 64), packed, None)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous float32 \(32,\) vector"):
        kernels.packed_linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, torch.zeros(32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="packed must be a weight from pack_linear_weight"):
        kernels.packed_linear(torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16), None)
    assert kernels.packed_linear(torch.zeros(0, 64, dtype=torch.bfloat16), packed, None).shape == (0, 32)


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 33, 64, 65, 100])
def test_packed_silu_mul_is_silu_and_mul_of_the_product(rows, kernel_path):
    """Gate / up blocks alternating in the packed weight: SiLU(gate) * up straight out of the product,
    the same bits as the Linear's output put through silu_and_mul."""
    gen = torch.Generator().manual_seed(rows)
    width, k = 96, 128  # 6 column blocks per half
    w = (torch.randn(2 * width, k, generator=gen) * 0.1).to(torch.bfloat16)
    bias = torch.randn(2 * width, generator=gen).float()
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    kernels = cpu_kernels()

    def alternate(t):
        return t.unflatten(0, (2, -1, 16)).transpose(0, 1).flatten(0, 2)

    packed_plain, packed_alternating = kernels.pack_linear_weight(w), kernels.pack_linear_weight(alternate(w))
    for b in (None, bias):
        plain = kernels.packed_linear(x, packed_plain, b)
        fused = kernels.packed_linear_silu_mul(x, packed_alternating, None if b is None else alternate(b).contiguous())
        assert fused.shape == (rows, width)
        assert torch.equal(fused, kernels.silu_and_mul(plain))
    with pytest.raises(RuntimeError, match="even number of 16-column blocks"):
        kernels.packed_linear_silu_mul(x, kernels.pack_linear_weight(w[:48]), None)


def test_cpu_engines_get_the_native_ops_once_at_load(tiny_models):
    """The op table is chosen at load: a CPU engine's norms, rotary embedding and SiLU-and-multiply run their
    CPU forwards, its LM head may answer vocab-major; a module made outside an engine runs the reference."""
    from pagedllm import LLM
    from pagedllm.model_executor import cpu_ops
    from pagedllm.model_executor.layers import ActAndMul, CustomOp, RMSNorm, RotaryEmbedding

    model = LLM(str(tiny_models["qwen3"]), dtype="float32", max_model_len=64).llm_engine.executor.driver.model
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    assert {type(m) for m in ops} == {RMSNorm, RotaryEmbedding, ActAndMul}
    assert all(m.native_cpu for m in ops)
    assert isinstance(model.lm_head.method, cpu_ops.CpuLinear) and model.lm_head.method.vocab_major
    assert RMSNorm(8).native_cpu is False  # outside an engine: the reference


def test_no_native_ops_under_cpu_isa_none(tiny_models, monkeypatch):
    """PAGEDLLM_CPU_ISA=none: no native kernel anywhere (the PyTorch reference ops, the torch attention backend),
    and the cpu backend refused by that name."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.model_executor.layers import CustomOp

    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "none")
    llm = LLM(str(tiny_models["qwen3"]), dtype="bfloat16", max_model_len=64)
    runner = llm.llm_engine.executor.driver
    assert runner.attn_backend.name == "torch"
    assert not any(m.native_cpu for m in runner.model.modules() if isinstance(m, CustomOp))
    assert "PAGEDLLM_CPU_ISA=none" in unsupported_reason("cpu", _shape())
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_no_native_ops_without_the_kernels(tiny_models, monkeypatch):
    from pagedllm import LLM
    from pagedllm.model_executor import cpu_ops, layers
    from pagedllm.model_executor.layers import CustomOp

    monkeypatch.setattr(cpu_ops, "cpu_kernels", lambda: None)
    monkeypatch.setattr(layers, "cpu_kernels", lambda: None)
    model = LLM(str(tiny_models["qwen3"]), dtype="float32", max_model_len=64,
                attention_backend="torch").llm_engine.executor.driver.model
    assert not any(m.native_cpu for m in model.modules() if isinstance(m, CustomOp))
    assert model.lm_head.method.name == "plain"


def test_the_kernel_cache_name_is_keyed_by_the_cpu_the_torch_build_and_the_source(monkeypatch):
    """Two venvs (two torch installs), or two versions of the kernels, keep two builds instead of rebuilding one
    at every switch."""
    import torch

    here = cpu_kernels_module._cpu_signature()
    assert cpu_kernels_module._cpu_signature() == here  # stable
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/site-packages/torch/__init__.py")
    other_venv = cpu_kernels_module._cpu_signature()
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    other_version = cpu_kernels_module._cpu_signature()
    monkeypatch.undo()
    other_source = cpu_kernels_module._cpu_signature("// another version of the kernels")
    assert len({here, other_venv, other_version, other_source}) == 4
    source = cpu_kernels_module.kernel_source() + cpu_kernels_module._bindings_source()  # both units' text
    assert cpu_kernels_module.build_name() == f"pagedllm_cpu_{cpu_kernels_module._cpu_signature(source)}"
