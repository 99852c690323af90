"""The scheduler hands the model runner plain data, and the runner owns per-request state (vLLM v1's
split): a request's static data goes once, its state (tokens, seeded generator, audio delay pattern)
stays in the runner until the request is reported finished, across preemptions."""
from __future__ import annotations

import ast
import inspect
import pickle

import pagedllm.engine.request as request_module
import pagedllm.step_input as step_input_module
from pagedllm import LLM, SamplingParams
from pagedllm.engine.request import Request
from pagedllm.step_input import NewRequestData, ScheduledTokens, StepInput


def _imports(module) -> set[str]:
    tree = ast.parse(inspect.getsource(module))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_requests_and_step_input_import_nothing_from_the_model_executor():
    for module in (request_module, step_input_module):
        assert not any(name.startswith("pagedllm.model_executor") for name in _imports(module)), module.__name__


def test_each_step_is_plain_data_and_new_requests_are_sent_once(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64, max_num_batched_tokens=8)
    engine = llm.llm_engine
    seen: list[StepInput] = []
    execute = engine.executor.driver.execute_async
    engine.executor.driver.execute_async = lambda step: seen.append(pickle.loads(pickle.dumps(step))) or execute(step)
    outs = llm.generate([{"prompt_token_ids": list(range(5, 17))}, {"prompt_token_ids": [3, 4, 5]}],
                        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    for step in seen:  # survives pickling (what a worker process would receive) and holds no engine object
        assert all(isinstance(s, ScheduledTokens) for s in step.scheduled)
        assert all(isinstance(n, NewRequestData) for n in step.new_requests)
        assert not any(isinstance(v, Request) for s in step.scheduled for v in vars(s).values())
    sent = [n.request_id for step in seen for n in step.new_requests]
    assert sorted(sent) == ["0", "1"]  # once each, although both ran several steps (8-token budget: chunked)
    assert seen[0].scheduled[0].num_new_tokens == 8 and not seen[0].scheduled[0].samples
    # The runner keeps its state until told: both finished in the last step, dropped at the next one.
    assert set(engine.executor.driver.requests) == {"0", "1"}
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    llm.generate([{"prompt_token_ids": [7, 8]}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert sorted(seen[-1].finished_request_ids) == ["0", "1"] and [n.request_id for n in seen[-1].new_requests] == ["2"]
    assert set(engine.executor.driver.requests) == {"2"}


def test_seeded_sampling_is_the_same_with_and_without_preemption(tiny_models):
    """A seeded request's generator lives in the runner's state, which outlives a recompute preemption:
    the sampled tokens are those of the run that was never preempted."""
    prompts = [{"prompt_token_ids": list(range(10 + i, 30 + i))} for i in range(4)]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=20, ignore_eos=True)
              for i in range(4)]
    free = LLM(str(tiny_models["qwen3"]), dtype="float32", max_model_len=64, block_size=4)
    tight = LLM(str(tiny_models["qwen3"]), dtype="float32", max_model_len=64, block_size=4,
                num_gpu_blocks_override=16)
    want = [o.outputs[0].token_ids for o in free.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert got == want
