"""The engine's input and output sides, each on its own: the input processor turns a prompt into engine requests
(one per sample) or refuses it, queuing nothing; the output processor turns a step's rows into RequestOutputs."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.request import RequestStatus
from pagedllm.errors import InvalidParameterError
from pagedllm.model_executor.model_runner import ModelRunnerOutput
from pagedllm.model_executor.sampler import SampledRow


@pytest.fixture(scope="module")
def engine(tiny_models):
    return LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64).llm_engine


def test_the_input_side_fans_out_n_and_queues_nothing(engine):
    new = engine.inputs.process("x", [1, 2, 3], SamplingParams(n=3, seed=5, max_tokens=4))
    assert [r.request_id for r in new.requests] == ["0_x", "1_x", "2_x"]
    assert [r.sampling_params.seed for r in new.requests] == [5, 6, 7] and new.prompt_token_ids == [1, 2, 3]
    assert engine.stats().num_waiting == 0 and "x" not in engine.outputs
    vocab = engine.config.model.vocab_size
    with pytest.raises(InvalidParameterError, match="logit_bias token ids"):
        engine.inputs.process("y", [1, 2, 3], SamplingParams(logit_bias={vocab: 1.0}))


def test_the_output_side_makes_outputs_and_drops_the_rows_of_an_aborted_request(engine):
    ended = []
    outputs = type(engine.outputs)(None, None, lambda req, status: ended.append((req.request_id, status)))
    new = engine.inputs.process("z", [1, 2, 3], SamplingParams(max_tokens=4))
    outputs.add("z", None, [1, 2, 3], new.params, new.requests, stream=True)
    [req] = new.requests
    req.append_token(7)
    [out] = outputs.process(ModelRunnerOutput({"z": SampledRow(7)}, {}))
    assert out.request_id == "z" and out.outputs[0].token_ids == [7] and not out.finished
    assert outputs.abort("z") == [req] and "z" not in outputs and ended == []
    assert outputs.process(ModelRunnerOutput({"z": SampledRow(8)}, {})) == []  # aborted: its rows are dropped
    assert req.status != RequestStatus.FINISHED_STOPPED
