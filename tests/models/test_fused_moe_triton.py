"""The fused-MoE Triton kernel (fused_moe_triton.py) against the reference grouped forward (moe.py), run by
Triton's interpreter on the CPU: the expert alignment, float32 (the same experts chosen: equal to float32
rounding), bfloat16 within a stated number of units in the last place, biases and gpt-oss' activation, and a whole tiny
gpt-oss model generating greedily with its experts on the kernel."""
from __future__ import annotations

import math
import os

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.fused_moe_triton import BLOCK_M, INTERPRETED, TRITON_FUSED, align_by_expert, fused_moe
from pagedllm.model_executor.layers import ActAndMul, ClampedSwigluAndMul
from pagedllm.model_executor.moe import GROUPED, FusedMoE, Routing
from tests.helpers import hf_greedy

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="set by tests/conftest.py wherever there is no GPU")


def _layer(act, bias, experts=5, hidden=64, width=48, dtype=torch.float32, seed=0) -> FusedMoE:
    gen = torch.Generator().manual_seed(seed)
    moe = FusedMoE(experts, hidden, width, act, bias=bias)
    for p in moe.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.3).to(dtype)
    return moe


def test_slots_are_sorted_by_expert_in_whole_tiles():
    ids = torch.tensor([[2, 0], [2, 4], [0, 2]])
    sorted_ids, tile_expert = align_by_expert(ids, 5)
    tiles = sorted_ids.view(-1, BLOCK_M)
    pad = ids.numel()
    assert tile_expert.tolist()[:3] == [0, 2, 4] and set(tile_expert.tolist()[3:]) <= {-1}
    assert [sorted(t for t in tile.tolist() if t != pad) for tile in tiles[:3]] == [[1, 4], [0, 2, 5], [3]]
    assert (tiles[3:] == pad).all()


@pytest.mark.parametrize("act,bias", [(ActAndMul("silu"), False), (ClampedSwigluAndMul(1.702, 7.0), True)])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_fused_kernel_equals_the_grouped_reference_in_float32(act, bias, tokens):
    moe = _layer(act, bias)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=gen)
    weights, ids = Routing(top_k=2)(torch.randn(tokens, 5, generator=gen))
    torch.testing.assert_close(fused_moe(moe, x, weights, ids), GROUPED.apply(moe, x, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_fused_kernel_in_bfloat16_within_units_in_the_last_place():
    """Against float32 arithmetic on the same bf16 inputs: each path rounds to bf16 three times (the [gate | up]
    product, the down product, its weighted value) and once more in the top-k sum, in different orders of the
    fp32 sums inside. Rounding to nearest, as on a GPU, that stays within 2 ulp of the output's largest values
    (the reference's own error here: 1.2 ulp). Triton's interpreter truncates its fp32 -> bf16 casts (measured:
    49% of a GEMM's bf16 outputs one ulp smaller in magnitude than round-to-nearest, none larger), so there each
    of the kernels' three casts may lose one more ulp: 4 ulp (measured 3)."""
    moe = _layer(ActAndMul("silu"), False, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(33, 64, generator=gen).to(torch.bfloat16)
    weights, ids = Routing(top_k=2)(torch.randn(33, 5, generator=gen).to(torch.bfloat16))
    exact = _layer(ActAndMul("silu"), False, dtype=torch.bfloat16)
    for p in exact.parameters():
        p.data = p.data.float()
    truth = GROUPED.apply(exact, x.float(), weights.float(), ids)
    ulp = 2.0 ** (math.floor(math.log2(truth.abs().max().item())) - 7)  # bf16: 8 significant bits
    ref_error = (GROUPED.apply(moe, x, weights, ids).float() - truth).abs().max().item()
    kernel_error = (fused_moe(moe, x, weights, ids).float() - truth).abs().max().item()
    assert ref_error <= 2 * ulp
    assert kernel_error <= (4 if INTERPRETED else 2) * ulp, (kernel_error, ulp)


def test_a_gpt_oss_model_on_the_kernel_generates_what_transformers_does(tiny_models):
    path = tiny_models["gpt_oss"]
    llm = LLM(str(path), dtype="float32", max_model_len=64)
    for layer in llm.llm_engine.executor.driver.model.model.layers:
        layer.mlp.experts.method = TRITON_FUSED  # (a CUDA engine's choice at load)
    prompts = [list(range(30, 50)), [5, 6, 7]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 6)[0] for p in prompts]
