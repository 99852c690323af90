"""Async output processing: a step's outputs are made while the next step runs, with the same results."""
from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from pagedllm.entrypoints.llm import LLM

PROMPTS = ["hello world", "the quick brown fox", "a b c d e f", "lorem ipsum dolor"]


def _llm(path, async_output_proc: bool, batch_invariant: bool = False) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=96, max_num_seqs=8, async_output_proc=async_output_proc,
               batch_invariant=batch_invariant)


def _summary(outs):
    return [(o.request_id, [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob,
                             None if c.logprobs is None else [{t: round(lp.logprob, 5) for t, lp in e.items()}
                                                              for e in c.logprobs]) for c in o.outputs],
             None if o.prompt_logprobs is None else len(o.prompt_logprobs)) for o in outs]


def _assert_idle(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.memory_plan.num_blocks


@pytest.fixture(scope="module")
def path(tiny_models):
    return tiny_models["qwen3"]  # head size 32: the cpu attention backend, which batch-invariant mode needs


@pytest.fixture(scope="module")
def stop_texts(path) -> list[str]:
    """A piece of each prompt's greedy continuation, so that stop strings really end generation early."""
    llm = _llm(path, False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(len(t) > 6 for t in texts)
    return [t[len(t) // 2:len(t) // 2 + 2] for t in texts]


def _params(stop_texts: list[str]) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop_texts[0]]),
        SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop_texts[2]],
                       include_stop_str_in_output=True, prompt_logprobs=1),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=9, ignore_eos=True, stop_token_ids=[5]),
    ]


def test_outputs_equal_with_and_without_async_output_processing(path, stop_texts):
    """Async output processing changes which requests share a step (a request a stop string ends runs one step
    more), and on some CPUs a GEMM's rounding depends on its row count: the seeded samples are compared in
    batch-invariant mode, where a request's logits do not depend on its batch (what equal outputs need)."""
    params = _params(stop_texts)
    sync = _llm(path, False, batch_invariant=True)
    expected = sync.generate(PROMPTS, params, use_tqdm=False)
    assert expected[0].outputs[0].finish_reason == "stop"  # the stop string fired mid-generation
    assert len(expected[0].outputs[0].token_ids) < 12
    llm = _llm(path, True, batch_invariant=True)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert _summary(got) == _summary(expected)
    _assert_idle(llm)


def test_outputs_arrive_one_step_later_and_the_last_one_is_flushed(path):
    llm = _llm(path, True)
    engine = llm.llm_engine
    engine.add_request("a", "hello world", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), stream=True)
    per_step = []
    while engine.has_unfinished_requests():
        per_step.append([len(o.outputs[0].token_ids) for o in engine.step()])
    # Step 1 samples token 1 and returns nothing; each later step returns the previous one's; a last step,
    # with nothing scheduled, returns the final output.
    assert per_step == [[], [1], [2], [3]]
    _assert_idle(llm)


def test_a_request_aborted_between_steps_leaves_the_others_as_they_were(path):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = _llm(path, False).generate(["the quick brown fox"], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = _llm(path, True)
    engine = llm.llm_engine
    engine.add_request("keep", "the quick brown fox", params)
    engine.add_request("drop", "hello world", params)
    finished = []
    for _ in range(3):
        finished += engine.step()
    engine.abort_request("drop")  # its last step's row is still to be processed
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert [o.request_id for o in finished] == ["keep"]
    assert finished[0].outputs[0].token_ids == expected
    _assert_idle(llm)


def test_flags_choose_async_output_processing(path):
    from pagedllm.engine.arg_utils import EngineArgs

    assert not EngineArgs(model=str(path), device="cpu").create_engine_config().async_output_proc  # nothing to overlap
    assert EngineArgs(model=str(path), device="cpu", async_output_proc=True).create_engine_config().async_output_proc
    assert not EngineArgs(model=str(path), disable_async_output_proc=True).create_engine_config().async_output_proc
    with pytest.raises(ValueError, match="contradict"):
        EngineArgs(model=str(path), async_output_proc=True, disable_async_output_proc=True).create_engine_config()
