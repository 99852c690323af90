"""Greedy tokens and logprobs identical to transformers (fp32), for every architecture and attention
backend, under every scheduling regime: one big step, chunked prefill, preemption, and several block
sizes; and bf16
logprobs within bf16 noise of transformers in bf16 (the CPU's packed kernels)."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.attention.cpu_backend import DECODE_KERNEL_HEAD_DIMS
from tests.helpers import ARCHS, MOE_ARCHS, hf_greedy, make_tiny_model

# Different lengths, so batching pads and chunking splits prompts at different places.
PROMPTS = [[5, 6, 7, 8, 9], list(range(30, 63)), [11, 12, 13], list(range(100, 117))]
MAX_TOKENS = 14
LOGPROB_TOL = 1e-4
LOGPROB_TOL_BF16 = 0.25

REGIMES = {
    "default": dict(block_size=16),
    "block_size_1": dict(block_size=1),
    "block_size_32": dict(block_size=32),
    # A budget smaller than most prompts: prefill in chunks, mixed with other requests' decodes.
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=7),
    # 16 blocks of 4 tokens hold one max_model_len sequence but not all four requests at once.
    "preemption": dict(block_size=4, num_gpu_blocks_override=16),
}


def _reference(path, cache={}):  # noqa: B006 - a per-session memo of transformers' outputs
    key = str(path)
    if key not in cache:
        cache[key] = [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]
    return cache[key]


def _check_against_reference(llm: LLM, path, max_tokens: int = MAX_TOKENS) -> None:
    """Greedy tokens and their logprobs equal transformers' first `max_tokens`."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out, (ref_ids, ref_lps) in zip(PROMPTS, outs, _reference(path)):
        got = out.outputs[0]
        assert out.prompt_token_ids == prompt
        assert got.token_ids == ref_ids[:max_tokens], f"prompt of {len(prompt)} tokens diverged"
        got_lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(got_lps, ref_lps)) < LOGPROB_TOL
        assert got.finish_reason == "length"
    llm.llm_engine.check_integrity()
    kv = llm.llm_engine.kv_cache  # every block back in the pool (but the null block window tables point to)
    assert kv.num_free_blocks == llm.llm_engine.memory_plan.num_blocks - (kv.null_block is not None)


# Triton's kernels run under its interpreter here (seconds per engine): every regime on one architecture of each
# head size (llama 16, qwen3 32, the one with q/k norms). mistral (32) and qwen2 (16, q/k/v bias) differ from
# those outside the attention kernel only, which the torch cases check on every regime.
TRITON_ARCHS = ("llama", "qwen3")
# Interpreted, a decode step costs ~0.3 s: 6 tokens (the prompts' prefill and 5 decode steps, batches of 4 rows
# and mixed steps under chunking) unless the regime needs the steps (preemption: blocks run out mid-decode).
TRITON_TOKENS = 6
# auto is the cpu backend where its decode kernel has the model's head size (mistral, qwen3: 32), else torch
# (llama, qwen2: 16), which the torch cases already run: there, auto runs once, for its choice.
AUTO_IS_CPU = ("mistral", "qwen3")


def _cases() -> list[tuple[str, str, str]]:
    cases = []
    for arch in ARCHS:
        for regime in REGIMES:
            cases.append((arch, regime, "torch"))
            if arch in AUTO_IS_CPU or regime == "default":
                cases.append((arch, regime, "auto"))
            if arch in TRITON_ARCHS:
                cases.append((arch, regime, "triton"))
    for arch in MOE_ARCHS:  # the experts' path is the same whatever the attention backend and block size
        cases += [(arch, regime, "torch") for regime in ("default", "chunked_prefill", "preemption")]
        cases.append((arch, "default", "auto"))
    # gpt-oss' windows and sinks in the triton kernels, prefill chunks and decodes in mixed steps (the cpu
    # backend's decode kernel: test_sliding_window_models_match_transformers, at a head size it is built for)
    cases.append(("gpt_oss", "chunked_prefill", "triton"))
    return cases


@pytest.mark.parametrize("arch,regime,backend", _cases(), ids=lambda v: v)
def test_greedy_matches_transformers(tiny_models, arch, regime, backend):
    """Every attention backend, on every architecture, in every regime (see _cases for the triton and auto
    cases that run)."""
    kwargs = dict(dtype="float32", max_model_len=64, num_gpu_blocks_override=512) | REGIMES[regime]
    if regime == "preemption" and arch == "gpt_oss":
        # Three KV groups of one layer (kv_layout.py): a block is a layer's, and one 64-token sequence whose
        # prompt is prefilled in one step peaks at 16 blocks in each group, plus the null block: 49.
        kwargs["num_gpu_blocks_override"] = 49
    llm = LLM(str(tiny_models[arch]), attention_backend=backend, **kwargs)
    head_dim = llm.llm_engine.config.model.head_dim
    chosen = ("cpu" if head_dim in DECODE_KERNEL_HEAD_DIMS else "torch") if backend == "auto" else backend
    assert llm.llm_engine.executor.driver.attn_backend.name == chosen
    interpreted_short = backend == "triton" and regime != "preemption"
    _check_against_reference(llm, tiny_models[arch], TRITON_TOKENS if interpreted_short else MAX_TOKENS)
    if regime == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0}, None,
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}])
def test_rope_variants_match_transformers(tmp_path, rope):
    path = make_tiny_model(tmp_path / "m", "llama", rope_scaling=rope, tie_word_embeddings=True)
    _check_against_reference(LLM(str(path), dtype="float32", max_model_len=128), path)


@pytest.mark.parametrize("arch,overrides", [
    ("mistral", {"sliding_window": 8}),  # every layer windowed
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),  # layers 1+ (layer_types)
    ("mixtral", {"sliding_window": 8}),
    ("gpt_oss", {"head_dim": 32}),  # windowed layers 0 and 2, sinks everywhere: the cpu decode kernel's head size
])
def test_sliding_window_models_match_transformers(tmp_path, arch, overrides):
    """Windows of 8 tokens, shorter than every prompt but one: no longer refused, and attended as transformers
    attends them, in the cpu backend where its decode kernel has the head size (windows and sinks included)."""
    path = make_tiny_model(tmp_path / "m", arch, **overrides)
    llm = LLM(str(path), dtype="float32", max_model_len=64)
    kernel = llm.llm_engine.config.model.head_dim in DECODE_KERNEL_HEAD_DIMS  # all but mixtral's 16
    assert llm.llm_engine.executor.driver.attn_backend.name == ("cpu" if kernel else "torch")
    windows = [layer.self_attn.attn.sliding_window for layer in llm.llm_engine.executor.driver.model.model.layers]
    assert windows == {"qwen3": [None, 8], "gpt_oss": [8, None, 8]}.get(arch, [8, 8])
    _check_against_reference(llm, path)


def test_sharded_checkpoint_matches_transformers(tmp_path):
    path = make_tiny_model(tmp_path / "sharded", "qwen3", shards=3)
    assert (path / "model.safetensors.index.json").is_file()
    _check_against_reference(LLM(str(path), dtype="float32", max_model_len=128), path)


def test_llama_with_attention_and_mlp_bias_matches_transformers(tmp_path):
    path = make_tiny_model(tmp_path / "bias", "llama", attention_bias=True, mlp_bias=True)
    _check_against_reference(LLM(str(path), dtype="float32", max_model_len=128), path)


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {}), ("llama", {"tie_word_embeddings": True}),
                                            ("qwen3_moe", {})])
def test_bfloat16_logprobs_close_to_transformers_bfloat16(tmp_path, arch, overrides, cpu_path):
    """bf16 on CPU, on every CPU path this machine can run (cpu_isa.py): cpu_kernels' packed Linears with the
    tied head's packed embedding and the fused MLP (amx, avx2), oneDNN's (avx512_bf16), each expert packed as a
    dense Linear is, or PyTorch's ops (none). Prompt logprobs (a 33-row prefill) and the logprobs of 8 greedy
    decode steps (one row each) stay within bf16 noise of transformers running the same weights in bf16."""
    import torch

    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "m", arch, **overrides)
    prompt = list(range(30, 63))
    llm = LLM(str(path), dtype="bfloat16", max_model_len=64)
    model = llm.llm_engine.executor.driver.model
    own_kernels = cpu_path in ("amx", "avx2")
    mlp = model.model.layers[0].mlp
    if arch in MOE_ARCHS:
        experts = mlp.experts
        assert experts.method.name == ("packed-experts" if cpu_path != "none" else "grouped")
        assert (experts.w13_weight.numel() == 0) == (cpu_path != "none")  # the stacked weights freed once packed
        if cpu_path != "none":  # each expert in the path's layout, as a dense MLP's
            layout = "kernel-packed-gate-up" if own_kernels else "onednn-packed"
            assert {g.method.name for g in experts.method.gate_up} == {layout}
        mlp = model.model.layers[1].mlp  # (a dense layer)
    assert (mlp.down_proj.weight.numel() == 0) == (cpu_path != "none")  # re-laid for the path's kernels
    assert (mlp.gate_up_proj.method.name == "kernel-packed-gate-up") == own_kernels  # SiLU as the product leaves
    assert model.model.norm.native_cpu == (cpu_path != "none")  # the norms' CPU kernels
    if own_kernels and model.config.vocab_size % 16 == 0:
        assert model.lm_head.weight.numel() == 0  # packed (tied: one copy with the embedding)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    generated = out.outputs[0].token_ids
    ours = [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
    ours += [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, generated)]

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    tokens = prompt + generated
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)
    ref_lps = [float(ref[i - 1, tokens[i]]) for i in range(1, len(tokens))]
    diffs = [abs(a - b) for a, b in zip(ours, ref_lps)]
    # bf16 rounds every product's output: ~0.4% of logits of std ~5 (max seen 0.07-0.10). A wrong
    # kernel is off by units (gate / up blocks paired wrongly: 20.8).
    assert max(diffs) < LOGPROB_TOL_BF16, max(diffs)
