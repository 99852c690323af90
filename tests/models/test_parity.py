"""Greedy tokens and logprobs identical to transformers (fp32), for every architecture, under every
scheduling regime: one big step, chunked prefill, preemption, and several block sizes."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import ARCHS, hf_greedy, make_tiny_model

# Different lengths, so batching pads and chunking splits prompts at different places.
PROMPTS = [[5, 6, 7, 8, 9], list(range(30, 63)), [11, 12, 13], list(range(100, 117))]
MAX_TOKENS = 14
LOGPROB_TOL = 1e-4

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


def _check_against_reference(llm: LLM, path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out, (ref_ids, ref_lps) in zip(PROMPTS, outs, _reference(path)):
        got = out.outputs[0]
        assert out.prompt_token_ids == prompt
        assert got.token_ids == ref_ids, f"prompt of {len(prompt)} tokens diverged"
        got_lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(got_lps, ref_lps)) < LOGPROB_TOL
        assert got.finish_reason == "length"
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.kv_cache.num_free_blocks == llm.llm_engine.memory_plan.num_blocks


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_models, arch, regime):
    kwargs = dict(dtype="float32", max_model_len=64, num_gpu_blocks_override=512) | REGIMES[regime]
    llm = LLM(str(tiny_models[arch]), **kwargs)
    _check_against_reference(llm, tiny_models[arch])
    if regime == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0}, None])
def test_rope_variants_match_transformers(tmp_path, rope):
    path = make_tiny_model(tmp_path / "m", "llama", rope_scaling=rope, tie_word_embeddings=True)
    _check_against_reference(LLM(str(path), dtype="float32", max_model_len=128), path)


def test_sharded_checkpoint_matches_transformers(tmp_path):
    path = make_tiny_model(tmp_path / "sharded", "qwen3", shards=3)
    assert (path / "model.safetensors.index.json").is_file()
    _check_against_reference(LLM(str(path), dtype="float32", max_model_len=128), path)


def test_llama_with_attention_and_mlp_bias_matches_transformers(tmp_path):
    path = make_tiny_model(tmp_path / "bias", "llama", attention_bias=True, mlp_bias=True)
    _check_against_reference(LLM(str(path), dtype="float32", max_model_len=128), path)
