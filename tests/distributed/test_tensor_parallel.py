"""Tensor parallelism on gloo (two CPU processes), tiny fp32 checkpoints: greedy tokens with
--tensor-parallel-size 2 equal to one rank's, and to transformers', for each architecture (Qwen2's single KV
head replicated on both ranks, its tied embedding split by vocabulary) and Higgs Audio v2's codes, with
chunked prefill and under preemption; sizes that cannot split a model are refused with the ones that can;
the per-rank plan is what each rank allocates; no worker outlives its engine."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.sharding import ShardLayout, tensor_parallel_sizes, verify_tensor_parallel_size
from tests.distributed.test_tp_server import worker_pids
from tests.helpers import ARCHS, hf_greedy
from tests.sampling_features import ENGINE_FEATURES, run_features, same_greedy_outputs

PROMPTS = [[5 + i for i in range(n)] for n in (7, 19, 33, 4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1, prompt_logprobs=1)
ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 64, "block_size": 4}


def _outputs(llm: LLM, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
             [None if d is None else d[t].logprob for d, t in zip(o.prompt_logprobs, p)])
            for o, p in zip(outs, prompts)]


# Of the mixtures of experts: Mixtral (each expert's w1/w3/w2 sliced by rank) and gpt-oss (stacked experts sliced
# after reading, sinks split with their heads); Qwen3-MoE's expert names are the dense ones, at the experts' width.
@pytest.mark.parametrize("arch", ARCHS + ("mixtral", "gpt_oss"))
def test_two_ranks_generate_what_one_does(tiny_models, arch):
    path = str(tiny_models[arch])
    with LLM(path, **ENGINE) as one:
        reference = _outputs(one)
    # 16 tokens a step: prompts are chunked; 20 blocks of 4 tokens (80 of the 111 the prompts need): preemption.
    # gpt-oss' three KV groups of one layer each (kv_layout.py): 36 blocks, where the four need ~54 at the end.
    blocks = 36 if arch == "gpt_oss" else 20
    with LLM(path, tensor_parallel_size=2, max_num_batched_tokens=16, num_gpu_blocks_override=blocks, **ENGINE) as two:
        executor = two.llm_engine.executor
        assert executor.size == 2 and executor.driver.shards.heads == 2
        outputs = _outputs(two)
        assert two.llm_engine.preemption_stats.recompute > 0
    for (tokens, logprobs, prompt_lps), (ref_tokens, ref_logprobs, ref_prompt_lps) in zip(outputs, reference):
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
        assert prompt_lps[1:] == pytest.approx(ref_prompt_lps[1:], abs=1e-4)
    hf_tokens, _ = hf_greedy(path, PROMPTS[1], 12)
    assert outputs[1][0] == hf_tokens


@pytest.mark.parametrize("settings", [{"kv_cache_dtype": "fp8"}, {"quantization": "int8"}, {"quantization": "fp8"}])
def test_an_fp8_cache_and_int8_or_fp8_weights_split_too(tiny_models, settings):
    """Each rank quantizes its own shard, a row-parallel one with the whole row's scale (the ranks agree on
    it): the same int8 / fp8 weights as one rank's; the fp8 cache's heads are split as they are."""
    path = str(tiny_models["mistral"])
    with LLM(path, **ENGINE, **settings) as one:
        reference = _outputs(one, PROMPTS[:2])
    with LLM(path, tensor_parallel_size=2, **ENGINE, **settings) as two:
        outputs = _outputs(two, PROMPTS[:2])
    for (tokens, logprobs, _), (ref_tokens, ref_logprobs, _) in zip(outputs, reference):
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)


def test_sizes_that_cannot_split_a_model_are_refused_with_those_that_can(tiny_models):
    from pagedllm.model_executor.model_files import load_hf_config

    cfg = load_hf_config(tiny_models["llama"])  # 4 heads, 2 KV heads, MLP 128
    assert tensor_parallel_sizes(cfg) == [1, 2, 4]
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3 cannot split this model: the model has 4 "
                                         r"attention heads. Sizes that work: 1, 2, 4\."):
        LLM(str(tiny_models["llama"]), tensor_parallel_size=3, device="cpu")
    with pytest.raises(ValueError, match="the model has 4 attention heads. Sizes that work: 1, 2, 4"):
        verify_tensor_parallel_size(cfg, 8)
    layout = ShardLayout.of(cfg, rank=1, size=4)  # 2 KV heads over 4 ranks: ranks 2 and 3 share KV head 1
    assert (layout.heads, layout.kv_heads, layout.first_kv_head) == (1, 1, 0)
    assert ShardLayout.of(cfg, rank=3, size=4).first_kv_head == 1


def test_higgs_audio_on_two_ranks_speaks_what_one_does(tmp_path):
    """Its text embedding split by vocabulary, the audio embedding and audio head replicated, the dual FFN
    split like the MLP; rank 0's sampled frames reach the worker's delay-pattern state. Greedy and seeded
    codes equal one rank's, prompts chunked."""
    speaks_what_one_rank_does(tmp_path, "mp")


def speaks_what_one_rank_does(tmp_path, backend: str) -> None:
    """The tiny Higgs Audio v2 on two ranks over `backend` (mp or ray): the same tokens and codes as on one."""
    from tests.higgs_helpers import audio_prompt, make_tiny_higgs_model, text_prompt

    path = str(make_tiny_higgs_model(tmp_path / "higgs"))
    items = [(text_prompt(0, 9), None), audio_prompt(1, 4), (text_prompt(2, 17), None)]
    inputs = [{"prompt_token_ids": p} | ({} if f is None else {"audio_codes": f}) for p, f in items]
    params = [SamplingParams(temperature=0.0, max_tokens=16), SamplingParams(temperature=1.0, seed=3, max_tokens=16),
              SamplingParams(temperature=0.0, max_tokens=16)]
    engine = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "block_size": 4,
              "repetition_aware_sampling": False}
    results = []
    for tp, chunk in ((1, 512), (2, 8)):
        with LLM(path, tensor_parallel_size=tp, max_num_batched_tokens=chunk, distributed_executor_backend=backend,
                 **engine) as llm:
            outs = llm.generate(inputs, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].audio_codes) for o in outs])
    for (tokens, codes), (ref_tokens, ref_codes) in zip(results[1], results[0], strict=True):
        assert codes.shape[0] > 2 and tokens == ref_tokens and torch.equal(codes, ref_codes)


def test_the_per_rank_plan_is_what_each_rank_allocates_and_workers_end_with_their_engine(tiny_models):
    """`plan --tensor-parallel-size 2` counts one rank's KV heads (1 of the 2): with the same KV budget, twice
    the blocks of one rank; the engine allocates that many on every rank. Then shutdown ends the worker."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.plan import dry_run_plan

    path, budget = str(tiny_models["llama"]), "96KiB"
    planned = dry_run_plan(EngineArgs(model=path, kv_cache_memory=budget, **ENGINE), device="cpu",
                           tensor_parallel_size=2)
    one_rank = dry_run_plan(EngineArgs(model=path, kv_cache_memory=budget, **ENGINE), device="cpu")
    assert planned.num_blocks == 2 * one_rank.num_blocks == 96 * 1024 // (2 * 2 * 1 * 16 * 4 * 4)
    llm = LLM(path, tensor_parallel_size=2, kv_cache_memory=budget, **ENGINE)
    runner = llm.llm_engine.executor.driver
    assert llm.memory_plan.num_blocks == planned.num_blocks == llm.llm_engine.kv_cache.pool.num_blocks
    assert runner.kv_cache.shape[2] == 1 and runner.kv_cache.shape[3] == planned.num_blocks * 4  # 1 KV head here
    assert llm.llm_engine.executor.collective_rpc("kv_cache_blocks") == [planned.num_blocks] * 2
    procs = list(llm.llm_engine.executor.workers.procs)
    assert procs and all(p.poll() is None for p in procs)
    llm.shutdown()
    assert all(p.returncode is not None for p in procs)
    assert not torch.distributed.is_initialized()


def test_a_worker_that_stops_answering_is_an_error_within_the_timeout(tiny_models, monkeypatch):
    import os
    import signal
    import time

    from pagedllm.errors import WorkerError

    monkeypatch.setenv("PAGEDLLM_WORKER_TIMEOUT_S", "3")
    llm = LLM(str(tiny_models["llama"]), tensor_parallel_size=2, **ENGINE)
    [worker] = llm.llm_engine.executor.workers.procs
    os.kill(worker.pid, signal.SIGSTOP)  # alive, silent
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"did not answer within 3 s: PAGEDLLM_WORKER_TIMEOUT_S"):
            llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        llm.shutdown()
    assert worker.returncode is not None


def test_the_plan_is_made_for_the_rank_with_the_least_memory():
    """Rank 0's GPU and each worker's, as measured before loading: another process on rank 1's GPU makes the
    plan smaller for every rank (on a CPU the workers report none: rank 0's share of the host stands)."""
    from pagedllm.executor.tensor_parallel import TensorParallelExecutor
    from pagedllm.executor.worker import WorkerInfo
    from pagedllm.memory.device import DeviceMemory

    gib = 1 << 30
    executor = object.__new__(TensorParallelExecutor)  # only its readings
    mine = DeviceMemory("cuda", 80 * gib, 1 * gib, False)
    busy = DeviceMemory("cuda", 80 * gib, 30 * gib, False)
    executor.worker_infos = [WorkerInfo(1, 1, 0, busy), WorkerInfo(2, 2, 0, None)]
    assert executor.plan_device_memory(mine) is busy
    executor.worker_infos = [WorkerInfo(1, 1, 0, None)]
    assert executor.plan_device_memory(mine) is mine


def test_every_sampling_feature_holds_on_two_ranks(tiny_models):
    """Every SamplingParams feature at once (seeds, n, logprobs, penalties, logit_bias, min_tokens, stop strings
    and tokens, each kind of structured output), through chunked prefill, prefix caching and preemption (by swap
    and by recompute): each constraint holds on two ranks, and the greedy outputs are one rank's."""
    path = str(tiny_models["qwen2"])
    with LLM(path, **ENGINE_FEATURES, swap_space=0.001) as one:
        reference = run_features(one)
    with LLM(path, tensor_parallel_size=2, **ENGINE_FEATURES, swap_space=0.001) as two:
        outs = run_features(two)
        stats = two.llm_engine.preemption_stats
        assert stats.swap > 0 or stats.recompute > 0
    same_greedy_outputs(outs, reference)


def test_engines_made_and_dropped_in_turn_all_generate_and_leave_no_worker(tiny_models):
    """A notebook's pattern: five tensor-parallel engines, each dropped (no shutdown call) before the next is made.
    Dropping the last reference stops the workers and leaves the process group, so the next one starts; so
    does a rendezvous that failed in between (torch counts its groups: the next one here must still be the
    fresh worker's "0")."""
    import gc
    import os

    from pagedllm.distributed.parallel_state import init_tensor_parallel
    from pagedllm.executor.multiproc import free_port

    path = str(tiny_models["llama"])
    seen = []
    for i in range(5):
        llm = LLM(path, tensor_parallel_size=2, **ENGINE)
        seen += llm.llm_engine.executor.workers.procs
        seen.append(_outputs(llm, PROMPTS[:1])[0][0])
        del llm
        gc.collect()
        assert not torch.distributed.is_initialized()
        assert worker_pids(os.getpid()) == []
        if i == 1:
            with pytest.raises(torch.distributed.DistStoreError):  # no rank 1 ever comes
                init_tensor_parallel(0, 2, f"tcp://127.0.0.1:{free_port()}", torch.device("cpu"), timeout_s=1)
    tokens = seen[1::2]
    assert all(t == tokens[0] and len(t) == 12 for t in tokens)
    assert all(p.poll() is not None for p in seen[0::2])
