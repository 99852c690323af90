"""Decode steps from CUDA graphs (model_executor/cuda_graphs.py), through their CPU twin: the triton
attention backend under Triton's interpreter, graphs "replayed" by EagerReplay over the same persistent
buffers and metadata. Tokens and logprobs with graphs equal those without (greedy and seeded sampling),
over batch sizes that hit every captured size with padded rows; padded rows write only the null block;
the Higgs Audio v2 decode runs from graphs too. The same checks run on a GPU in tools/gpu-check (graphs)."""
from __future__ import annotations

import os

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import graph_batch_sizes
from pagedllm.model_executor.cuda_graphs import DecodeGraphs, EagerReplay

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="set by tests/conftest.py wherever there is no GPU")

# Lengths and output lengths differ, so requests finish one by one: decode batches of 7, 6, .., 1 rows.
PROMPTS = [[5, 6, 7, 8, 9], list(range(30, 63)), [11, 12, 13], list(range(100, 117)), [3], [40, 41], [7] * 9]
MAX_TOKENS = [2, 3, 4, 5, 6, 7, 8]  # decode steps of 7, 6, .., 1 rows: one each (interpreted: ~0.3 s a step)


def test_default_sizes_are_vllms_up_to_max_num_seqs():
    assert graph_batch_sizes(256)[:6] == (1, 2, 4, 8, 16, 24) and graph_batch_sizes(256)[-1] == 256
    assert len(graph_batch_sizes(256)) == 35
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)  # max_num_seqs itself: every decode step has a graph
    assert graph_batch_sizes(3) == (1, 2, 3)
    assert graph_batch_sizes(8, [4, 2, 64, 2]) == (2, 4)  # sorted, unique, none above max_num_seqs


@pytest.mark.parametrize("sizes", [[0], [], [2, -1], [1.5]])
def test_bad_sizes_are_refused(tiny_models, sizes):
    with pytest.raises(ValueError, match="cuda_graph_sizes must be batch sizes >= 1"):
        LLM(str(tiny_models["llama"]), cuda_graph_sizes=sizes)


def _llm(path, enforce_eager, **kwargs) -> LLM:
    # A 128-token budget holds the 70 prompt tokens in one step; a KV cache sized here skips the profile run
    # (interpreted: seconds per engine), which these tests do not look at.
    kwargs = {"num_gpu_blocks_override": 64} | kwargs
    return LLM(str(path), dtype="float32", max_model_len=64, attention_backend="triton", max_num_seqs=8,
               max_num_batched_tokens=128, enforce_eager=enforce_eager, **kwargs)


def _generate(path, enforce_eager, params_of, **kwargs):
    llm = _llm(path, enforce_eager, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [params_of(n) for n in MAX_TOKENS],
                        use_tqdm=False)
    return llm, [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                 for o in outs]


def _replays(llm) -> dict[int, int]:
    """Count the replays of each graph size from here on."""
    graphs, counts = llm.llm_engine.executor.driver.graphs, {}
    original = graphs.get

    def counting_get(batch_size):
        counts[batch_size] = counts.get(batch_size, 0) + 1
        return original(batch_size)

    graphs.get = counting_get
    return counts


# Each case runs the interpreted kernels twice (seconds each): each architecture with one sampling mode.
# gpt-oss: three KV groups (kv_layout.py), each with its own backend's persistent buffers; windows and sinks.
@pytest.mark.parametrize("arch,sampling", [("llama", "greedy"), ("qwen3", "seeded"), ("gpt_oss", "greedy")])
def test_tokens_with_graphs_equal_tokens_without(tiny_models, arch, sampling):
    """Every size (1, 2, 4, 8) replayed, most with padded rows (7, 6, 5 and 3 rows); the prefill steps
    run eagerly. Same tokens; logprobs within float32 rounding (a padded batch's matmuls are another
    size, which may sum in another order: 2e-7 seen)."""
    def params_of(n):
        if sampling == "greedy":
            return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
        return SamplingParams(temperature=0.9, top_p=0.95, max_tokens=n, ignore_eos=True, logprobs=1, seed=n)

    eager_llm, eager = _generate(tiny_models[arch], True, params_of)
    assert eager_llm.llm_engine.executor.driver.graphs is None
    llm = _llm(tiny_models[arch], False)
    counts = _replays(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [params_of(n) for n in MAX_TOKENS],
                        use_tqdm=False)
    graphed = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
               for o in outs]
    assert [t for t, _ in graphed] == [t for t, _ in eager]
    for (_, lps), (_, ref) in zip(graphed, eager):
        assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-5
    assert set(counts) == {1, 2, 4, 8} and sum(counts.values()) == max(MAX_TOKENS) - 1
    assert sorted(llm.llm_engine.executor.driver.graphs.steps) == [1, 2, 4, 8]
    llm.llm_engine.check_integrity()


def test_padded_rows_write_only_the_null_block(tiny_models):
    """The same requests with and without graphs write the same slots of the pool with the same K/V
    (within float32 rounding: padded batches' matmuls are another size); the padded rows' writes are
    all in the null block (one past the pool), which the block manager never hands out."""
    params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)  # noqa: E731
    eager_llm, _ = _generate(tiny_models["llama"], True, params, enable_prefix_caching=False)
    llm, _ = _generate(tiny_models["llama"], False, params, enable_prefix_caching=False)
    runner, eager_runner = llm.llm_engine.executor.driver, eager_llm.llm_engine.executor.driver
    num_blocks, block = llm.llm_engine.memory_plan.num_blocks, runner.block_size
    assert runner.null_block == num_blocks and eager_runner.null_block is None
    assert runner.kv_cache.shape[3] == (num_blocks + 1) * block
    assert eager_runner.kv_cache.shape[3] == num_blocks * block
    pool = runner.kv_cache[:, :, :, :num_blocks * block]
    assert torch.equal(pool.abs().sum(-1) != 0, eager_runner.kv_cache.abs().sum(-1) != 0)  # the same slots
    torch.testing.assert_close(pool, eager_runner.kv_cache, rtol=1e-5, atol=1e-5)
    null = runner.kv_cache[:, :, :, num_blocks * block:]
    assert null[:, :, :, 0].abs().sum() > 0  # position 0 of the null block: every padded row's K/V
    assert null[:, :, :, 1:].abs().sum() == 0


def test_graphs_off_for_enforce_eager_and_backends_that_cannot(tiny_models):
    path = str(tiny_models["llama"])
    small = dict(max_model_len=64, max_num_batched_tokens=64)  # a short profile run under the interpreter
    assert LLM(path, attention_backend="triton", enforce_eager=True, max_num_seqs=8,
               **small).llm_engine.executor.driver.graphs is None
    runner = LLM(path, attention_backend="torch", max_num_seqs=8, **small).llm_engine.executor.driver
    assert runner.graphs is None
    assert runner.graphs_off_reason() == "the torch attention backend builds its inputs on the host each step"
    assert LLM(path, attention_backend="triton", max_num_seqs=12, cuda_graph_sizes=[1, 4],
               **small).llm_engine.executor.driver.graphs.sizes == (1, 4)


def test_steps_past_the_largest_size_run_eagerly(tiny_models):
    """--cuda-graph-sizes 2: a decode of 7 rows runs eagerly, the last two rows' steps from the graph."""
    params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)  # noqa: E731
    _, eager = _generate(tiny_models["llama"], True, params)
    llm = _llm(tiny_models["llama"], False, cuda_graph_sizes=[2])
    counts = _replays(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [params(n) for n in MAX_TOKENS], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [tokens for tokens, _ in eager]
    assert counts == {2: MAX_TOKENS[-1] - MAX_TOKENS[-3]}  # the steps with one or two requests left


def test_capture_all_captures_every_size_largest_first():
    order = []

    def make_step(batch_size):
        buffer = torch.zeros(batch_size)
        return lambda: buffer + batch_size

    graphs = DecodeGraphs((1, 2, 4), EagerReplay(), make_step, order.append)
    graphs.capture_all(torch.device("cpu"))
    assert order == [4, 2, 1] and sorted(graphs.steps) == [1, 2, 4]
    assert graphs.pool_bytes is None  # measured on a GPU only
    assert graphs.batch_size_for(3) == 4 and graphs.batch_size_for(5) is None
    step = graphs.get(2)
    step.output.zero_()
    step.replay()  # refills the output captured in place
    assert step.output.tolist() == [2.0, 2.0]


def test_higgs_audio_decodes_from_graphs(tmp_path):
    """Frames in, frames out: the tiny Higgs Audio v2's decode steps replay graphs (every row audio);
    the same tokens and codes as without graphs."""
    from tests.higgs_helpers import audio_prompt, make_tiny_higgs_model, text_prompt

    path = str(make_tiny_higgs_model(tmp_path / "higgs"))
    items = [(text_prompt(0, 9), None), audio_prompt(1, 4), (text_prompt(2, 17), None)]
    inputs = [{"prompt_token_ids": p} | ({} if f is None else {"audio_codes": f}) for p, f in items]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    results = {}
    for eager in (True, False):
        llm = LLM(path, dtype="float32", max_model_len=128, block_size=4, repetition_aware_sampling=False,
                  attention_backend="triton", enforce_eager=eager, max_num_seqs=4,
                  num_gpu_blocks_override=64)  # no (interpreted) profile run
        counts = {} if eager else _replays(llm)
        outs = llm.generate(inputs, params, use_tqdm=False)
        results[eager] = [(o.outputs[0].token_ids, o.outputs[0].audio_codes) for o in outs]
        if not eager:
            assert sum(counts.values()) >= 10
    for (tokens, codes), (ref_tokens, ref_codes) in zip(results[False], results[True], strict=True):
        assert tokens == ref_tokens and torch.equal(codes, ref_codes)
