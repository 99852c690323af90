"""A structured output that starts after given output tokens (a thinking model's end of reasoning: the server sets
`start_after` under --reasoning-parser): the output before them is free, the output after them follows the
constraint, and the request ends when the constraint is complete."""
from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.structured_output import GuidedDecodingParams, constraint_start

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_models):
    with LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=128) as llm:
        yield llm


def test_the_constraint_starts_after_its_marker(llm):
    tokenizer = llm.get_tokenizer()
    (marker,) = tokenizer.encode("Tom", add_special_tokens=False)  # a token no JSON reply of SCHEMA starts with
    bias = {marker: 100.0}  # the model would write it at every step it may
    free = SamplingParams(max_tokens=60, temperature=0, logit_bias=bias,
                          guided_decoding=GuidedDecodingParams(json=SCHEMA, start_after=(marker,)))
    (out,) = llm.generate("Think, then answer.", free, use_tqdm=False)
    ids = out.outputs[0].token_ids
    assert ids[0] == marker  # before the marker the output is free (the bias wins)
    answer = tokenizer.decode(ids[1:], skip_special_tokens=True)
    assert out.outputs[0].finish_reason == "stop" and set(json.loads(answer)) == {"n"}  # after it: the schema
    strict = SamplingParams(max_tokens=60, temperature=0, logit_bias=bias, guided_decoding=GuidedDecodingParams(
        json=SCHEMA))
    (out,) = llm.generate("Think, then answer.", strict, use_tqdm=False)
    assert out.outputs[0].token_ids[0] != marker  # from the first token: the schema never allows it


def test_the_start_is_found_across_steps():
    params = GuidedDecodingParams(json=SCHEMA, start_after=(7, 8))
    assert constraint_start(params, [1, 7]) is None
    assert constraint_start(params, [1, 7, 8, 5], searched=2) == 3  # the run straddles what was searched
    assert constraint_start(params, [7, 8, 1], searched=0) == 2
    assert constraint_start(GuidedDecodingParams(json=SCHEMA), [1, 2]) == 0
