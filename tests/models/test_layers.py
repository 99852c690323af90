"""CPU fast paths of the Linear layers give the plain PyTorch product's results."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor import cpu_ops as layers
from pagedllm.model_executor.cpu_kernels import cpu_kernels
from pagedllm.model_executor.cpu_ops import pack_linear_weights

needs_bf16_mkldnn = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="this CPU has no oneDNN bf16 support: its packing is not used here (the kernels' packing and the "
           "fp32 route are tested below)")
needs_packed_linear = pytest.mark.skipif(
    cpu_kernels() is None or not (cpu_kernels().packed_linear_supported() or cpu_kernels().packed_linear_fma_supported()),
    reason="neither AMX / AVX512-BF16 nor AVX2 / FMA here: only the oneDNN packing or fp32 applies")


class _TiedModel(nn.Module):
    def __init__(self, vocab: int = 300) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 64)
        self.proj = nn.Linear(64, 96, bias=True)
        self.head = nn.Linear(64, vocab, bias=False)
        self.head.weight = self.embed.weight


def _model(vocab: int = 300) -> _TiedModel:
    torch.manual_seed(0)
    return _TiedModel(vocab).to(torch.bfloat16).eval()


@needs_bf16_mkldnn
@pytest.mark.parametrize("rows", [1, 3, 32, 40])
@pytest.mark.parametrize("packing", ["cpu_kernels", "onednn"])
def test_packed_and_tied_linears_match_plain_linear(rows, packing, monkeypatch):
    """A 300-row tied head is not whole 16-column blocks: it keeps its plain weight either way."""
    if packing == "onednn":  # as on a machine where the kernels cannot be built
        monkeypatch.setattr(layers, "cpu_kernels", lambda: None)
    model = _model()
    plain_proj_w, plain_proj_b = model.proj.weight.detach().clone(), model.proj.bias.detach().clone()
    packed = pack_linear_weights(model)
    assert packed == 96 * 64 * 2  # only the untied projection is re-laid; the tied head keeps its weight
    assert model.head.weight is model.embed.weight and model.head.weight.numel() == 300 * 64
    x = torch.randn(rows, 64).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(model.proj(x), F.linear(x, plain_proj_w, plain_proj_b), rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(model.head(x), F.linear(x, model.embed.weight), rtol=1.6e-2, atol=1e-2)


@needs_packed_linear
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_a_tied_head_is_packed_once_for_head_and_embedding(rows):
    model = _model(vocab=320)
    table = model.embed.weight.detach().clone()
    plain_proj_w, plain_proj_b = model.proj.weight.detach().clone(), model.proj.bias.detach().clone()
    assert pack_linear_weights(model) == (96 + 320) * 64 * 2  # the shared table counted once
    assert model.embed.packed_weight is model.head.packed_weight
    assert model.head.weight.numel() == 0 and model.embed.weight is model.head.weight
    ids = torch.tensor([0, 319, 17, 17])
    x = torch.randn(rows, 64).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(model.embed(ids), table[ids])
        torch.testing.assert_close(model.head(x), F.linear(x, table), rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(model.proj(x), F.linear(x, plain_proj_w, plain_proj_b), rtol=1.6e-2, atol=1e-2)


@needs_packed_linear
@pytest.mark.parametrize("rows", [1, 64])
def test_gate_up_packed_for_the_fused_silu(rows):
    """A Linear marked feeds_silu_and_mul: its forward is still the [gate | up] product, and its
    fused_silu_and_mul gives SiLU(gate) * up of that product, bit for bit."""
    torch.manual_seed(0)
    gate_up = nn.Linear(64, 2 * 48, bias=True).to(torch.bfloat16)
    gate_up.feeds_silu_and_mul = True
    plain_w, plain_b = gate_up.weight.detach().clone(), gate_up.bias.detach().clone()
    assert pack_linear_weights(gate_up) == 96 * 64 * 2
    x = torch.randn(rows, 64).to(torch.bfloat16)
    with torch.inference_mode():
        product = gate_up(x)
        torch.testing.assert_close(product, F.linear(x, plain_w, plain_b), rtol=1.6e-2, atol=1e-2)
        assert torch.equal(gate_up.fused_silu_and_mul(x), cpu_kernels().silu_and_mul(product))


@needs_packed_linear
@pytest.mark.parametrize("rows", [1, 3, 5, 40])
def test_without_onednn_bf16_whole_block_weights_go_to_the_kernels(rows, monkeypatch):
    """A CPU without oneDNN bf16 (AVX2 only; where AMX is there, its kernels): whole-block weights are
    packed for cpu_kernels; a 300-row tied head (not whole blocks) keeps its plain weight, and without
    AMX multiplies many rows in fp32."""
    monkeypatch.setattr(layers, "_onednn_bf16", lambda: False)
    model = _model()
    plain_proj_w, plain_proj_b = model.proj.weight.detach().clone(), model.proj.bias.detach().clone()
    assert pack_linear_weights(model) == 96 * 64 * 2
    assert model.proj.weight.numel() == 0 and model.proj.packed_weight.shape == (96 // 16, 32, 16, 2)
    assert model.head.weight is model.embed.weight and model.head.weight.numel() == 300 * 64
    assert hasattr(model.head, "plain_forward") == (not cpu_kernels().packed_linear_supported())
    x = torch.randn(rows, 64).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(model.proj(x), F.linear(x.float(), plain_proj_w.float(), plain_proj_b.float()).bfloat16(),
                                   rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(model.head(x), F.linear(x.float(), model.embed.weight.float()).bfloat16(),
                                   rtol=1.6e-2, atol=1e-2)


def test_float32_weights_are_left_alone():
    model = _TiedModel().eval()
    assert pack_linear_weights(model) == 0
    assert model.proj.weight.numel() == 96 * 64 and "forward" not in vars(model.head)


@pytest.mark.parametrize("rows", [1, 64])
def test_vocab_major_logits_are_the_lm_heads_product(tmp_path, rows):
    """compute_logits(vocab_major=True) on a tied bf16 head: the same products, laid out (vocab, rows);
    a packed head (untied, or tied and packed with its embedding for the kernels) ignores the request.
    Runs on every CPU: which of the two a head is depends on the packing this CPU gets."""
    from pagedllm import LLM
    from tests.helpers import make_tiny_model

    for tied in (True, False):
        path = make_tiny_model(tmp_path / f"tied{tied}", "llama", tie_word_embeddings=tied)
        model = LLM(str(path), dtype="bfloat16", max_model_len=64).llm_engine.runner.model
        hidden = torch.randn(rows, model.config.hidden_size).to(torch.bfloat16)
        with torch.inference_mode():
            plain, vocab_major = model.compute_logits(hidden), model.compute_logits(hidden, vocab_major=True)
        torch.testing.assert_close(vocab_major, plain, rtol=1.6e-2, atol=1e-2)
        if tied and rows > 1 and model.lm_head.weight.numel() > 0:  # a plain tied head (no AMX packing)
            assert vocab_major.stride() == (1, rows)
        else:
            assert vocab_major.is_contiguous()


@pytest.mark.parametrize("rows", [1, layers.UPCAST_MIN_ROWS - 1, layers.UPCAST_MIN_ROWS, 40])
def test_without_bf16_arithmetic_many_rows_multiply_in_fp32(rows, monkeypatch):
    """What pack_linear_weights does on a CPU with no bf16 arithmetic and no kernels to pack for (run
    here on any CPU): from UPCAST_MIN_ROWS rows a bf16 Linear multiplies fp32 copies of its weight, a
    slice at a time (the 1,100-row tied head spans three slices); 2-4 rows take the native GEMV; others
    the bf16 product."""
    model = _model(vocab=1100)
    upcasts, upcast_linear = [], layers.upcast_linear
    monkeypatch.setattr(layers, "upcast_linear", lambda *a: upcasts.append(a[0].shape) or upcast_linear(*a))
    layers._use_fp32_arithmetic(model)
    assert model.head.weight is model.embed.weight and "forward" in vars(model.proj)
    x = torch.randn(2, rows, 64).to(torch.bfloat16)
    with torch.inference_mode():
        for module in (model.proj, model.head):
            w, b = module.weight.float(), None if module.bias is None else module.bias.float()
            expected = F.linear(x.float(), w, b).to(torch.bfloat16)
            torch.testing.assert_close(module(x), expected, rtol=1.6e-2, atol=1e-2)
    assert len(upcasts) == (2 if 2 * rows >= layers.UPCAST_MIN_ROWS else 0)


def test_without_bf16_arithmetic_two_to_four_rows_take_the_gemv(monkeypatch):
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the native kernels could not be built here (their PyTorch twins run; tested above)")
    calls = []

    class Recorder:
        def gemv_bf16(self, x, w):
            calls.append(tuple(x.shape))
            return kernels.gemv_bf16(x, w)

    monkeypatch.setattr(layers, "cpu_kernels", lambda: Recorder())
    model = _model(vocab=1100)
    layers._use_fp32_arithmetic(model)
    for rows in (1, 2, 4, 5):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        with torch.inference_mode():
            expected = F.linear(x.float(), model.proj.weight.float(), model.proj.bias.float())
            torch.testing.assert_close(model.proj(x), expected.to(torch.bfloat16), rtol=1.6e-2, atol=2e-2)
    assert calls == [(2, 64), (4, 64)]


def test_upcast_linear_is_the_fp32_product_rounded_once():
    torch.manual_seed(1)
    x, w, b = torch.randn(3, 20, 64).bfloat16(), torch.randn(1100, 64).bfloat16(), torch.randn(1100).bfloat16()
    out = layers.upcast_linear(x, w, b)
    assert out.shape == (3, 20, 1100) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x.float(), w.float(), b.float()).bfloat16(), rtol=0, atol=0.02)
    # Closer to the fp32 product than the bf16 one can be: one rounding, at the end.
    exact = F.linear(x.double(), w.double(), b.double())
    assert (out.double() - exact).abs().max() <= (exact.abs().max() * 2 ** -8)
