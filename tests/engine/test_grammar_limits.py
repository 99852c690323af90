"""What one structured-output constraint may cost: its size and shape are refused before any work (naming the
flag), and a compile in the worker process ends at its deadline, when cancelled, or at its memory cap, leaving
the compiler able to compile the next constraint."""
from __future__ import annotations

import threading
import time

import pytest
from transformers import AutoTokenizer

from pagedllm.errors import InvalidParameterError
from pagedllm.isolated_worker import WorkerCancelled
from pagedllm.structured_output import GrammarCompiler, GuidedDecodingParams
from pagedllm.structured_output_limits import StructuredOutputLimits


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models["llama"])


def optional_properties(n: int) -> GuidedDecodingParams:
    """An object of n optional integer properties: compile time grows much faster than n."""
    return GuidedDecodingParams(json={"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                       for i in range(n)}}, param="response_format")


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


SMALL = GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.mark.parametrize("params, flag", [
    (optional_properties(513), "--structured-outputs-max-properties"),
    (GuidedDecodingParams(json={"anyOf": [{"const": i} for i in range(129)]}), "--structured-outputs-max-alternatives"),
    (GuidedDecodingParams(json={"enum": list(range(129))}), "--structured-outputs-max-alternatives"),
    (GuidedDecodingParams(choice=[f"c{i}" for i in range(129)]), "--structured-outputs-max-alternatives"),
    (GuidedDecodingParams(json=nested(33)), "--structured-outputs-max-depth"),
    (GuidedDecodingParams(regex="a" * (64 << 10) + "b"), "--structured-outputs-max-bytes"),
    (GuidedDecodingParams(json={"type": "string", "description": "x" * (64 << 10)}), "--structured-outputs-max-bytes"),
])
def test_a_constraint_over_a_limit_is_refused_before_any_work(tokenizer, params, flag):
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    start = time.perf_counter()
    with pytest.raises(InvalidParameterError, match=flag) as e:
        compiler.compile(params)
    assert time.perf_counter() - start < 0.5
    assert e.value.param == params.param
    assert compiler.take_compile_times() == []  # nothing was compiled


def test_the_limits_at_their_edge_compile(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    compiler.compile(GuidedDecodingParams(json={"anyOf": [{"const": i} for i in range(128)]}))
    compiler.compile(GuidedDecodingParams(json=nested(32)))
    compiler.compile(GuidedDecodingParams(choice=[f"c{i}" for i in range(128)]))


def test_a_compile_past_its_deadline_is_killed_and_the_next_one_works(tokenizer):
    limits = StructuredOutputLimits(max_properties=100_000, max_spec_bytes=10 << 20, compile_timeout_s=0.5)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), limits=limits)
    compiler.compile(SMALL)  # the worker is started (its start-up is not part of a deadline)
    start = time.perf_counter()
    with pytest.raises(InvalidParameterError, match="did not compile within 0.5 s.*--structured-outputs-compile-"
                                                    "timeout") as e:
        compiler.compile(optional_properties(3000))  # seconds to compile on any machine
    assert time.perf_counter() - start < 3.0
    assert e.value.param == "response_format"
    assert compiler.worker.restarts == 1
    grammar = compiler.compile(GuidedDecodingParams(regex="[ab]{2}"))  # a fresh worker, then here
    assert grammar.memory_size_bytes > 0
    compiler.shutdown()


def test_an_invalid_constraint_in_the_worker_is_a_400_naming_the_field(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), limits=StructuredOutputLimits(compile_timeout_s=30))
    with pytest.raises(InvalidParameterError, match="guided_grammar: invalid grammar"):
        compiler.compile(GuidedDecodingParams(grammar="root ::= missing_rule", param="guided_grammar"))
    assert compiler.worker.restarts == 0  # an error is an answer, not a kill
    compiler.shutdown()


def test_a_cancelled_compile_ends_at_once(tokenizer):
    limits = StructuredOutputLimits(max_properties=100_000, max_spec_bytes=10 << 20, compile_timeout_s=60)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), limits=limits)
    compiler.compile(SMALL)
    cancel = threading.Event()
    outcome: list = []

    def run():
        try:
            compiler.compile(optional_properties(3000), cancel)
        except BaseException as e:  # noqa: BLE001 - looked at below
            outcome.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    for _ in range(500):  # until the compile is under way (it then takes seconds: the cancel lands in it)
        if cancel in compiler._running:
            break
        time.sleep(0.01)
    cancelled_at = time.perf_counter()
    compiler.cancel_all()
    thread.join(10)
    assert time.perf_counter() - cancelled_at < 2.0
    assert len(outcome) == 1 and isinstance(outcome[0], WorkerCancelled)
    assert compiler.compile(SMALL) is not None
    compiler.shutdown()


def test_a_compile_over_its_memory_cap_is_refused_naming_the_flag(tokenizer):
    limits = StructuredOutputLimits(max_properties=100_000, max_spec_bytes=10 << 20, compile_timeout_s=120,
                                    compile_memory_bytes=32 << 20)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), limits=limits)
    with pytest.raises(InvalidParameterError, match="--structured-outputs-compile-memory"):
        compiler.compile(optional_properties(3000))
    compiler.shutdown()
