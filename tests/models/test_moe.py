"""Mixtures of experts (Qwen3-MoE, Mixtral): the experts' grouped forward against a per-token loop, routing as
transformers routes, greedy outputs equal to transformers' with prefix caching (the scheduling regimes are in
test_parity.py), and the dense and sparse layers a Qwen3-MoE config asks for."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers import ActAndMul
from pagedllm.model_executor.models.llama import LlamaMLP
from pagedllm.model_executor.moe import ExpertGroups, FusedMoE, Routing, SparseMoeBlock
from tests.helpers import MOE_ARCHS, hf_greedy


def _random_moe(num_experts=6, hidden=32, width=16, bias=False, seed=0) -> FusedMoE:
    gen = torch.Generator().manual_seed(seed)
    moe = FusedMoE(num_experts, hidden, width, ActAndMul("silu"), bias=bias)
    for p in moe.parameters():
        p.data = torch.randn(p.shape, generator=gen)
    return moe


def _per_token(moe: FusedMoE, x, weights, ids) -> torch.Tensor:
    """The definition: for each token, the weighted sum of its experts' outputs."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t].tolist()):
            b13 = None if moe.w13_bias is None else moe.w13_bias[e]
            b2 = None if moe.w2_bias is None else moe.w2_bias[e]
            gate, up = F.linear(x[t], moe.w13_weight[e], b13).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, moe.w2_weight[e], b2)
    return out


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_experts_equal_the_per_token_sum(bias):
    moe = _random_moe(bias=bias)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 32, generator=gen, dtype=torch.float64).float()
    weights, ids = Routing(top_k=3)(torch.randn(9, 6, generator=gen))
    torch.testing.assert_close(moe(x, weights, ids), _per_token(moe, x, weights, ids), rtol=1e-5, atol=1e-5)
    unused = torch.zeros(9, 3, dtype=torch.long)  # every token to expert 0: the others never run
    assert [e for e, _, _ in ExpertGroups.of(unused, 6).runs()] == [0]


def test_routing_as_transformers_routes():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.0, 2.9]])
    weights, ids = Routing(top_k=2, renormalize=False)(logits)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 3], [0, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))  # Qwen3-MoE without norm_topk_prob
    renormalized, _ = Routing(top_k=2)(logits)
    torch.testing.assert_close(renormalized.sum(-1), torch.ones(2))
    gpt_oss, _ = Routing(top_k=2, topk_then_softmax=True)(logits)  # softmax over the two chosen logits
    torch.testing.assert_close(gpt_oss[0], torch.softmax(torch.tensor([2.0, 1.5]), -1))


def test_qwen3_moe_layers_are_sparse_or_dense_as_configured(tiny_models):
    llm = LLM(str(tiny_models["qwen3_moe"]), dtype="float32", max_model_len=64)
    layers = llm.llm_engine.executor.driver.model.model.layers
    kinds = [type(layer.mlp) for layer in layers]
    assert kinds == [SparseMoeBlock, LlamaMLP, SparseMoeBlock]  # mlp_only_layers = [1]
    experts = layers[0].mlp.experts
    assert (experts.num_experts, experts.width) == (8, 32)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_prefix_cached_prompts_match_transformers(tiny_models, arch):
    """Four prompts sharing a 20-token prefix, generated twice: the second time from cached blocks."""
    path = tiny_models[arch]
    prefix = list(range(40, 60))
    prompts = [prefix + [7 + i] * (i + 1) for i in range(4)]
    llm = LLM(str(path), dtype="float32", max_model_len=64, block_size=4, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    refs = [hf_greedy(path, p, 32)[0] for p in prompts]
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.llm_engine.stats().prefix_cache.hits >= 4 * 20


def test_plans_hold_every_expert_and_int8_is_refused(tiny_models):
    from pagedllm.errors import UnsupportedModelError
    from pagedllm.memory.model_size import num_params_from_config
    from pagedllm.model_executor.model_files import load_hf_config, resolve_model_path

    cfg = load_hf_config(resolve_model_path("qwen3-30b-a3b"))  # the built-in shape
    assert abs(num_params_from_config(cfg) / 30.53e9 - 1) < 0.01  # Qwen3-30B-A3B: 30.5B, every expert counted
    llm = LLM(str(tiny_models["mixtral"]), dtype="float32", max_model_len=64)
    model = llm.llm_engine.executor.driver.model
    assert num_params_from_config(model.config) == sum(p.numel() for p in model.parameters())
    assert "every expert held: 4 per sparse layer, 2 used per token" in llm.memory_plan.table()
    with pytest.raises(UnsupportedModelError, match="experts"):
        LLM(str(tiny_models["mixtral"]), quantization="int8")


def test_a_decode_step_reads_the_experts_its_tokens_choose():
    """The roofline's floor: Qwen3-30B-A3B multiplies 3.04B parameters per token (its card: 3.3B activated,
    the input embedding's 0.31B with them) and a step reads more experts as the batch grows (E (1 - (1 - k/E)^b)
    of 128 per layer), toward all 30.5B."""
    from pagedllm.memory.model_size import decode_active_share, expert_params_from_config, num_params_from_config
    from pagedllm.model_executor.model_files import load_hf_config, resolve_model_path

    cfg = load_hf_config(resolve_model_path("qwen3-30b-a3b"))
    total = num_params_from_config(cfg)
    (read_1, used), (read_32, used_32) = decode_active_share(cfg, 1), decode_active_share(cfg, 32)
    assert abs((used * total + cfg.vocab_size * cfg.hidden_size) / 1e9 - 3.35) < 0.01
    assert used == used_32 and read_1 == used
    experts, table = expert_params_from_config(cfg), cfg.vocab_size * cfg.hidden_size
    experts_read = (read_32 * total - (total - table - experts)) / experts
    assert experts_read == pytest.approx(1 - (1 - 8 / 128) ** 32)  # 87% of the experts
    assert decode_active_share(load_hf_config(resolve_model_path("qwen2.5-0.5b")), 8) == (1.0, 1.0)  # tied
