"""Every SamplingParams feature in one batch, and what each promises: shared by the executor tests (one
device, tensor parallelism over processes and over Ray), which run the same requests everywhere."""
from __future__ import annotations

import json
import re

from pagedllm import SamplingParams
from pagedllm.structured_output import GuidedDecodingParams

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def feature_requests(eos: int) -> list[tuple[dict, SamplingParams]]:
    """One request per SamplingParams feature, prompts of different lengths (chunked prefill splits them)."""
    p = [{"prompt_token_ids": list(range(10 + 3 * i, 10 + 3 * i + 5 + 2 * i))} for i in range(14)]
    greedy = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [
        (p[0], SamplingParams(**greedy)),
        (p[1], SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=11, max_tokens=10, ignore_eos=True)),
        (p[2], SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=8, ignore_eos=True, logprobs=3)),
        (p[3], SamplingParams(**greedy, logprobs=2, prompt_logprobs=2)),
        (p[4], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[7, 8, 9], min_tokens=3)),
        (p[5], SamplingParams(**greedy, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3)),
        (p[6], SamplingParams(**greedy, logit_bias={17: 100.0})),
        (p[7], SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6, logit_bias={eos: 100.0})),
        (p[8], SamplingParams(temperature=0.0, max_tokens=12, guided_decoding=GuidedDecodingParams(
            choice=["alpha", "beta gamma"]))),
        (p[9], SamplingParams(temperature=0.0, max_tokens=16, guided_decoding=GuidedDecodingParams(
            regex=r"[0-9]{3}-[a-z]{2}"))),
        (p[10], SamplingParams(temperature=0.0, max_tokens=40, guided_decoding=GuidedDecodingParams(json=SCHEMA))),
        (p[11], SamplingParams(temperature=0.0, max_tokens=40, guided_decoding=GuidedDecodingParams(
            json_object=True))),
        (p[12], SamplingParams(temperature=0.0, max_tokens=10, guided_decoding=GuidedDecodingParams(
            grammar='root ::= "yes" | "no" | "maybe"'))),
        (p[13], SamplingParams(**greedy, stop=["e"], include_stop_str_in_output=True)),
    ]


def check_constraints(outs, eos: int) -> None:
    """Each constrained request's output is what its constraint allows."""
    texts = {i: o.outputs[0].text for i, o in enumerate(outs)}
    assert outs[6].outputs[0].token_ids == [17] * 10  # logit_bias
    biased_eos = outs[7].outputs[0].token_ids  # min_tokens holds the (biased) EOS back for 6 tokens
    assert len(biased_eos) == 7 and biased_eos[-1] == eos and eos not in biased_eos[:6]
    assert len(outs[2].outputs) == 2 and all(len(c.logprobs) == 8 for c in outs[2].outputs)
    assert len(outs[3].prompt_logprobs) == len(outs[3].prompt_token_ids)
    assert texts[8] in ("alpha", "beta gamma")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[9])
    value = json.loads(texts[10])
    assert set(value) == {"n", "ok"} and isinstance(value["n"], int) and isinstance(value["ok"], bool)
    any_object = outs[11].outputs[0]  # any JSON object: whole when it ended by itself, else a prefix of one
    assert texts[11].startswith("{")
    if any_object.finish_reason == "stop":
        assert isinstance(json.loads(texts[11]), dict)
    assert texts[12] in ("yes", "no", "maybe")


SAMPLED = (1, 2)  # the requests that sample: the others' outputs are the same on every executor (fp32)

# Engine settings that put the requests through chunked prefill, prefix caching and preemption.
ENGINE_FEATURES = {"dtype": "float32", "device": "cpu", "max_model_len": 96, "block_size": 4,
                   "max_num_batched_tokens": 24, "num_gpu_blocks_override": 40, "seed": 7}


def run_features(llm) -> list:
    """The feature requests' outputs on `llm`, their constraints checked."""
    eos = llm.llm_engine.config.model.hf_config.eos_token_id
    requests = feature_requests(eos)
    outs = llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
    check_constraints(outs, eos)
    return outs


def same_greedy_outputs(outs, reference) -> None:
    """Every greedy request's tokens and text equal the reference's, its logprobs within float noise."""
    for i, (out, ref) in enumerate(zip(outs, reference)):
        if i in SAMPLED:
            continue
        got, want = out.outputs[0], ref.outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), i
        if want.logprobs is not None:
            for mine, theirs in zip(got.logprobs, want.logprobs):
                assert mine.keys() == theirs.keys()
                assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-4 for t in mine)
