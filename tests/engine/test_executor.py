"""The executor seam: the engine reaches the model only through the Executor interface, and a step's plain
data holds everything the runner reads (so a runner that sees nothing but the steps, as another rank's
worker does, samples what the engine's own runner sampled)."""
from __future__ import annotations

import ast
import inspect
import pickle
from pathlib import Path

import pagedllm.engine as engine_package
from pagedllm import LLM, SamplingParams
from pagedllm.step_input import StepInput
from pagedllm.executor import Executor
from pagedllm.model_executor.model_runner import ModelRunner
from tests.sampling_features import ENGINE_FEATURES, run_features

def _interface() -> set[str]:
    return {name for name, _ in inspect.getmembers(Executor) if not name.startswith("_")}


def test_the_engine_reaches_the_runner_only_through_the_executor_interface():
    """No module of the engine reads or sets an attribute of a runner: it names no `runner`, and every
    attribute it takes of its executor is a method of the Executor interface."""
    interface = _interface()
    for path in sorted(Path(engine_package.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                # (EngineArgs.runner is vLLM's setting, generate or pooling: read on the args, never a model runner)
                settings = path.name == "arg_utils.py" and isinstance(node.value, ast.Name) and node.value.id == "self"
                assert node.attr != "runner" or settings, f"{path.name}:{node.lineno} reaches into a runner"
                if isinstance(node.value, ast.Attribute) and node.value.attr == "executor":
                    assert node.attr in interface, f"{path.name}:{node.lineno}: executor.{node.attr} is not the interface"
                    assert not isinstance(node.ctx, ast.Store), f"{path.name}:{node.lineno} sets an executor attribute"


def test_a_runner_that_sees_only_the_steps_samples_what_the_engines_runner_sampled(tiny_models):
    """Every step the engine sends (pickled, as a worker receives it) replayed on a second, fresh runner: it
    samples the same token for every request of every step, with every SamplingParams feature at once
    (seeds, n, penalties, logit_bias, min_tokens, stop tokens, each kind of structured output) under
    chunked prefill and preemption. Nothing the runner reads lives outside the step."""
    llm = LLM(str(tiny_models["qwen2"]), **ENGINE_FEATURES)
    engine = llm.llm_engine
    steps: list[StepInput] = []
    sampled: list[dict[str, int]] = []
    launch = engine.executor.execute_model

    def recording(step: StepInput):
        steps.append(pickle.loads(pickle.dumps(step)))
        pending = launch(step)
        original = pending.result

        def result():
            out = original()
            if len(sampled) < len(steps):
                sampled.append({rid: row.token_id for rid, row in out.sampled.items()})
            return out

        pending.result = result
        return pending

    engine.executor.execute_model = recording
    run_features(llm)
    assert engine.scheduler.num_preemptions > 0  # recomputed requests rebuilt their state from the steps
    assert any(s.grammar_bitmask is not None for s in steps)

    fresh = ModelRunner(engine.config)
    fresh.allocate_kv_cache(engine.memory_plan.num_blocks)
    replayed = [{rid: row.token_id for rid, row in fresh.execute(step).sampled.items()} for step in steps]
    assert replayed == sampled


def test_engines_made_one_after_another_each_end_cleanly(tiny_models):
    """Dropping the last reference to an engine shuts its executor down (weakref.finalize); shutdown twice is a
    no-op; a `with` block shuts down on leaving."""
    import gc
    import weakref

    with LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64) as llm:
        executor = llm.llm_engine.executor
        llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine._finalizer.alive
    llm.shutdown()  # again: nothing happens
    ref = weakref.ref(executor)
    del llm, executor
    gc.collect()
    assert ref() is None
