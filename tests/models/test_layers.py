"""CPU methods of the Linear layers (cpu_ops.py) give the plain PyTorch product's results."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor import cpu_ops as layers
from pagedllm.model_executor.cpu_isa import CPU_ISAS, CpuIsaError, available_cpu_isas, cpu_isa
from pagedllm.model_executor.cpu_isa import cpu_kernels
from pagedllm.model_executor.cpu_ops import pack_linear_weights
from pagedllm.model_executor.linear import UNQUANTIZED, Embedding, GateUpLinear, Linear

OWN_KERNELS = ("amx", "avx2")  # the paths whose weights cpu_kernels packs (packed_linear.cpp)


class _TiedModel(nn.Module):
    def __init__(self, vocab: int = 300) -> None:
        super().__init__()
        self.embed = Embedding(vocab, 64)
        self.proj = Linear(64, 96, bias=True)
        self.head = Linear(64, vocab, bias=False)
        self.head.weight = self.embed.weight


def _model(vocab: int = 300) -> _TiedModel:
    torch.manual_seed(0)
    return _TiedModel(vocab).to(torch.bfloat16).eval()


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> None:
    """Within bf16 rounding of the product in fp32 (what every path approximates)."""
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), expected, rtol=1.6e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 3, 32, 40])
def test_a_head_not_in_whole_blocks_keeps_its_plain_weight(rows, cpu_path):
    """Every path: a 300-row tied head is not whole 16-column blocks, so it keeps its plain weight with the
    embedding (on avx512_bf16 beside oneDNN's copy); the untied projection is re-laid except with no kernels
    (`none`: fp32 products instead)."""
    model = _model()
    plain_proj_w, plain_proj_b = model.proj.weight.detach().clone(), model.proj.bias.detach().clone()
    packed = pack_linear_weights(model)
    assert packed == {"none": 0, "avx512_bf16": (96 + 300) * 64 * 2}.get(cpu_path, 96 * 64 * 2)
    assert model.head.weight is model.embed.weight and model.head.weight.numel() == 300 * 64
    assert isinstance(model.head.method, layers.OneDnnPackedLinear) == (cpu_path == "avx512_bf16")
    # No bf16 arithmetic (avx2, none): many rows of the head multiply in fp32 (upcast_linear).
    assert isinstance(model.head.method, layers.UpcastLinear) == (cpu_path in ("avx2", "none"))
    assert (model.proj.weight.numel() == 0) == (cpu_path != "none")
    if cpu_path in OWN_KERNELS:
        assert model.proj.method.packed_weight.shape == (96 // 16, 32, 16, 2)
    x = torch.randn(rows, 64).to(torch.bfloat16)
    with torch.inference_mode():
        _close(model.proj(x), x, plain_proj_w, plain_proj_b)
        _close(model.head(x), x, model.embed.weight)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_a_tied_head_in_whole_blocks_is_packed_once_for_head_and_embedding(rows, cpu_path):
    """amx and avx2 (cpu_kernels' layout): a tied head in whole blocks is packed once, and the embedding reads its
    rows back out of it. avx512_bf16: oneDNN's layout, which an embedding cannot read, is a second copy for the
    head (counted), the plain table stays for the embedding; none packs nothing."""
    model = _model(vocab=320)
    table = model.embed.weight.detach().clone()
    plain_proj_w, plain_proj_b = model.proj.weight.detach().clone(), model.proj.bias.detach().clone()
    expected = {"amx": (96 + 320) * 64 * 2, "avx2": (96 + 320) * 64 * 2, "avx512_bf16": (96 + 320) * 64 * 2,
                "none": 0}
    assert pack_linear_weights(model) == expected[cpu_path]  # the shared table counted once (with its copy)
    if cpu_path in OWN_KERNELS:
        assert model.embed.method.packed_weight is model.head.method.packed_weight
        assert model.head.weight.numel() == 0 and model.embed.weight is model.head.weight
    else:
        assert model.head.weight is model.embed.weight and model.head.weight.numel() == 320 * 64
        assert isinstance(model.head.method, layers.OneDnnPackedLinear) == (cpu_path == "avx512_bf16")
    ids = torch.tensor([0, 319, 17, 17])
    x = torch.randn(rows, 64).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(model.embed(ids), table[ids])
        _close(model.head(x), x, table)
        _close(model.proj(x), x, plain_proj_w, plain_proj_b)


@pytest.mark.parametrize("rows", [1, 64])
def test_gate_up_packed_for_the_fused_silu(rows, cpu_path):
    """A GateUpLinear gives SiLU(gate) * up on every path, its method's product is the [gate | up] product; where
    cpu_kernels pack it (amx, avx2) the SiLU is computed as the product leaves the kernel: bit for bit what the
    SiLU kernel makes of that product."""
    torch.manual_seed(0)
    gate_up = GateUpLinear(64, 48, bias=True, hidden_act="silu").to(torch.bfloat16)
    plain_w, plain_b = gate_up.weight.detach().clone(), gate_up.bias.detach().clone()
    assert pack_linear_weights(gate_up) == (0 if cpu_path == "none" else 96 * 64 * 2)
    assert isinstance(gate_up.method, layers.KernelPackedGateUp) == (cpu_path in OWN_KERNELS)
    x = torch.randn(rows, 64).to(torch.bfloat16)
    with torch.inference_mode():
        product = gate_up.method.apply(gate_up, x)
        _close(product, x, plain_w, plain_b)
        gate, up = F.linear(x.float(), plain_w.float(), plain_b.float()).chunk(2, dim=-1)
        torch.testing.assert_close(gate_up(x).float(), F.silu(gate) * up, rtol=3e-2, atol=3e-2)
        if cpu_path in OWN_KERNELS:
            assert torch.equal(gate_up(x), cpu_kernels().silu_and_mul(product))


def test_a_path_above_the_machines_is_refused(monkeypatch):
    """PAGEDLLM_CPU_ISA may only lower the path: a higher one (or a name that is none) is refused, naming what
    this machine can run."""
    best = available_cpu_isas()[0]
    higher = CPU_ISAS[CPU_ISAS.index(best) + 1:]
    for name in higher:
        monkeypatch.setenv("PAGEDLLM_CPU_ISA", name)
        with pytest.raises(CpuIsaError, match=f"best CPU path is {best}; it can run {best}"):
            cpu_isa()
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "avx1024")
    with pytest.raises(CpuIsaError, match="'avx1024' is not a CPU path: use one of amx, avx512_bf16, avx2, none"):
        cpu_isa()
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "none")
    assert cpu_isa() == "none" and cpu_kernels() is None
    monkeypatch.delenv("PAGEDLLM_CPU_ISA")
    assert cpu_isa() == best


def test_float32_weights_are_left_alone():
    model = _TiedModel().eval()
    assert pack_linear_weights(model) == 0
    assert model.proj.weight.numel() == 96 * 64 and model.head.method is UNQUANTIZED


@pytest.mark.parametrize("rows", [1, 64])
def test_vocab_major_logits_are_the_lm_heads_product(tmp_path, rows):
    """compute_logits(vocab_major=True) on a tied bf16 head: the same products, laid out (vocab, rows);
    a packed head (untied, or tied and packed with its embedding for the kernels) ignores the request.
    Runs on every CPU: which of the two a head is depends on the packing this CPU gets."""
    from pagedllm import LLM
    from tests.helpers import make_tiny_model

    for tied in (True, False):
        path = make_tiny_model(tmp_path / f"tied{tied}", "llama", tie_word_embeddings=tied)
        model = LLM(str(path), dtype="bfloat16", max_model_len=64).llm_engine.executor.driver.model
        hidden = torch.randn(rows, model.config.hidden_size).to(torch.bfloat16)
        with torch.inference_mode():
            plain, vocab_major = model.compute_logits(hidden), model.compute_logits(hidden, vocab_major=True)
        torch.testing.assert_close(vocab_major, plain, rtol=1.6e-2, atol=1e-2)
        if tied and rows > 1 and isinstance(model.lm_head.method, layers.CpuLinear):  # a plain tied head
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
    layers._use_fp32_arithmetic(model, vocab_major=False)
    assert model.head.weight is model.embed.weight and isinstance(model.proj.method, layers.UpcastLinear)
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
    layers._use_fp32_arithmetic(model, vocab_major=False)
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
