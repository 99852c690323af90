"""Automatic prefix caching end to end on a tiny model (float32): outputs identical with caching on
and off and equal to transformers, while the engine really serves tokens from the cache."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import build_parser, engine_args_from
from pagedllm.entrypoints.openai.api_server import build_parser as server_parser
from pagedllm.entrypoints.openai.api_server import refuse_unimplemented
from pagedllm.errors import InvalidPromptError
from tests.helpers import hf_greedy

LOGPROB_TOL = 1e-4
MAX_TOKENS = 10
SHARED = list(range(40, 57))  # 17 tokens: four full blocks of 4, then one token
ENGINE = {"dtype": "float32", "max_model_len": 96, "block_size": 4, "num_gpu_blocks_override": 256}


@pytest.fixture(scope="module")
def path(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def cached(path) -> LLM:
    return LLM(str(path), **ENGINE)


@pytest.fixture(scope="module")
def uncached(path) -> LLM:
    llm = LLM(str(path), enable_prefix_caching=False, **ENGINE)
    assert not llm.llm_engine.kv_cache.enable_caching
    return llm


def greedy(llm: LLM, prompts: list[list[int] | dict], max_tokens: int = MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    prompts = [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.kv_cache.num_free_blocks == llm.llm_engine.kv_cache.pool.num_blocks
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def hits(llm: LLM) -> tuple[int, int]:
    stats = llm.llm_engine.prefix_cache_stats
    return stats.queries, stats.hits


def check_equal_everywhere(path, cached: LLM, uncached: LLM, prompts: list[list[int]],
                           max_tokens: int = MAX_TOKENS) -> int:
    """Run the prompts on both engines; both equal transformers. Returns the hit tokens of the run."""
    before = hits(cached)
    got_on, got_off = greedy(cached, prompts, max_tokens), greedy(uncached, prompts, max_tokens)
    after = hits(cached)
    assert after[0] - before[0] == sum(len(p) for p in prompts)  # every admission was one lookup
    for prompt, (ids_on, lps_on), (ids_off, lps_off) in zip(prompts, got_on, got_off):
        ref_ids, ref_lps = hf_greedy(path, prompt, max_tokens)
        assert ids_on == ids_off == ref_ids, f"prompt of {len(prompt)} tokens diverged"
        assert max(abs(a - b) for a, b in zip(lps_on, ref_lps)) < LOGPROB_TOL
        assert max(abs(a - b) for a, b in zip(lps_on, lps_off)) < LOGPROB_TOL
    assert hits(uncached) == (0, 0)
    return after[1] - before[1]


def test_identical_prompts_in_one_batch_share_blocks(path, cached, uncached):
    prompt = list(range(200, 223))  # 23 tokens: 5 full blocks
    hit = check_equal_everywhere(path, cached, uncached, [prompt, prompt, prompt])
    assert hit == 2 * 20  # the 2nd and 3rd hit the 1st one's blocks in the same step


def test_partly_shared_prefix_with_different_tails(path, cached, uncached):
    tails = [[300], [301, 302, 303, 304, 305], list(range(310, 322))]
    check_equal_everywhere(path, cached, uncached, [SHARED])  # warm the cache with the shared part
    hit = check_equal_everywhere(path, cached, uncached, [SHARED + t for t in tails])
    assert hit == 3 * 16  # four shared full blocks each; the 17th token is in a block of its own


def test_fully_cached_prompt_recomputes_its_last_block(path, cached, uncached):
    prompt = list(range(400, 416))  # exactly 4 blocks
    check_equal_everywhere(path, cached, uncached, [prompt])
    hit = check_equal_everywhere(path, cached, uncached, [prompt])  # an exact repeat
    assert hit == 12  # at most 15 tokens may come from the cache: 3 whole blocks


def test_generated_tokens_are_cached_too(path, cached, uncached):
    """A follow-up prompt that extends an earlier prompt + its completion hits past the prompt."""
    prompt = list(range(450, 459))  # 9 tokens
    ((ids, _),) = greedy(cached, [prompt], max_tokens=12)
    follow_up = prompt + ids[:11] + [5, 6]  # the last sampled token was never computed
    hit = check_equal_everywhere(path, cached, uncached, [follow_up])
    assert hit == 20  # 9 prompt + 11 computed output tokens = 5 full blocks


def test_n_samples_with_a_seed_equal_caching_off(cached, uncached):
    params = SamplingParams(n=4, temperature=0.9, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 119))}
    before = hits(cached)
    (on,) = cached.generate([prompt], params, use_tqdm=False)
    (off,) = uncached.generate([prompt], params, use_tqdm=False)
    assert [c.token_ids for c in on.outputs] == [c.token_ids for c in off.outputs]
    assert len({tuple(c.token_ids) for c in on.outputs}) > 1  # really sampled
    assert hits(cached)[1] - before[1] == 3 * 16  # samples 1..3 share the prompt's 4 full blocks
    cached.llm_engine.check_integrity()


def test_cache_salt_separates_requests(cached):
    prompt = list(range(470, 483))
    greedy(cached, [{"prompt_token_ids": prompt, "cache_salt": "alice"}])
    before = hits(cached)
    greedy(cached, [{"prompt_token_ids": prompt, "cache_salt": "bob"}, {"prompt_token_ids": prompt}])
    assert hits(cached)[1] == before[1]  # neither another salt nor no salt reads alice's blocks
    greedy(cached, [{"prompt_token_ids": prompt, "cache_salt": "alice"}])
    assert hits(cached)[1] == before[1] + 12
    for bad in ("", 7):
        with pytest.raises(InvalidPromptError, match="cache_salt"):
            cached.generate({"prompt_token_ids": prompt, "cache_salt": bad}, use_tqdm=False)


def test_prompt_logprobs_are_computed_not_cached(cached, uncached):
    prompt = {"prompt_token_ids": list(range(250, 273))}
    greedy(cached, [prompt])  # now cached: a lookup would hit 20 tokens
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    before = hits(cached)
    (on,) = cached.generate([prompt], params, use_tqdm=False)
    (off,) = uncached.generate([prompt], params, use_tqdm=False)
    assert hits(cached)[1] == before[1]
    assert len(on.prompt_logprobs) == 23 and on.prompt_logprobs[0] is None
    for a, b in zip(on.prompt_logprobs[1:], off.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[k].logprob - b[k].logprob) < LOGPROB_TOL for k in a)


def test_recompute_preemption_with_caching(path):
    """A pool of 16 blocks of 4 holds one max-length sequence: prompts with a shared prefix preempt
    each other, and resumed requests find their own and each other's blocks again."""
    llm = LLM(str(path), dtype="float32", max_model_len=64, block_size=4, num_gpu_blocks_override=16)
    prompts = [SHARED + [490 + i] * (i + 1) for i in range(4)]
    max_tokens = 30
    outs = greedy(llm, prompts, max_tokens)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.prefix_cache_stats.hits > 0
    for prompt, (ids, lps) in zip(prompts, outs):
        ref_ids, ref_lps = hf_greedy(path, prompt, max_tokens)
        assert ids == ref_ids
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < LOGPROB_TOL


# -- settings ---------------------------------------------------------------------------------

def test_flags_turn_prefix_caching_on_and_off():
    def parsed(*flags: str) -> bool:
        return engine_args_from(build_parser().parse_args(["generate", "x", *flags])).enable_prefix_caching

    assert parsed() is True and parsed("--enable-prefix-caching") is True
    assert parsed("--no-enable-prefix-caching") is False
    ns = server_parser().parse_args(["--no-enable-prefix-caching"])
    refuse_unimplemented(ns)  # a real flag now, not a refused one
    assert engine_args_from(ns).enable_prefix_caching is False
    assert EngineArgs().enable_prefix_caching is True


def test_enable_prefix_caching_must_be_a_bool(path):
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        LLM(str(path), enable_prefix_caching="no", **ENGINE)


def test_bench_throughput_reports_prefix_cache_hits_of_a_shared_prefix(tiny_models, tmp_path):
    import json

    from pagedllm.bench.throughput import main as bench_main

    out = tmp_path / "bench.json"
    common = ["--model", str(tiny_models["llama"]), "--dtype", "float32", "--max-model-len", "128",
              "--block-size", "4", "--num-prompts", "6", "--prefix-len", "32", "--input-len", "8",
              "--output-len", "4", "--ignore-eos", "--output-json", str(out)]
    assert bench_main(common) == 0
    (on,) = json.loads(out.read_text())["results"]
    assert on["prefix_cache_queried_tokens"] == 6 * 40
    # The first request computes the 32-token prefix; the other five hit its 8 full blocks (the warm-up
    # ran on reversed prompts and left nothing to hit).
    assert on["prefix_cache_hit_tokens"] == 5 * 32
    assert bench_main([*common, "--no-enable-prefix-caching"]) == 0
    (off,) = json.loads(out.read_text())["results"]
    assert off["prefix_cache_hit_tokens"] == 0
