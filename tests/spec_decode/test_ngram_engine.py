"""Speculative decoding with n-gram drafts in the engine, tiny fp32 checkpoints: greedy tokens and logprobs equal
to no speculation (and to transformers) for four architectures under chunked prefill, recompute and swap
preemption and prefix caching; penalties, min_tokens, stop tokens and stop strings on every checked position; a
structured output beside speculating requests; sampled tokens distributed as the target's (chi-square against
transformers' own probabilities), a biased accept rule failing the same test; the blocks of rejected drafts
given back."""
from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import GuidedDecodingParams
from tests.helpers import ARCHS, hf_greedy, load_hf_model, make_tiny_model
from tests.test_sampler import chi2_sf

ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 160, "block_size": 4, "max_num_batched_tokens": 16}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
# Prompts with repeated spans (drafts found in the prompt) and without; the tiny models' outputs loop, so
# drafts from their own output come too.
PROMPTS = [list(range(5, 30)) * 3, [7, 8, 9, 10] * 8, list(range(100, 141)), [3, 4, 5] * 9 + [60]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)


def _run(path, params=GREEDY, prompts=PROMPTS, spec=NGRAM, **engine):
    with LLM(str(path), speculative_config=spec, **{**ENGINE, **engine}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.spec_decode_stats
        preemptions = llm.llm_engine.preemption_stats
        llm.llm_engine.check_integrity()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] if o.outputs[0].logprobs
                else None for o in outs]
    return tokens, logprobs, stats, preemptions, [o.outputs[0] for o in outs]


def _assert_exercised(stats):
    """Drafts were checked, some kept and some rejected: both paths ran."""
    assert stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_ngram_drafts_is_token_identical_to_no_speculation(tiny_models, arch):
    path = tiny_models[arch]
    ref_tokens, ref_lps, _, _, _ = _run(path, spec=None)
    tokens, lps, stats, _, _ = _run(path)
    _assert_exercised(stats)
    assert tokens == ref_tokens
    for a, b in zip(lps, ref_lps):
        assert a == pytest.approx(b, abs=1e-4)
    hf_tokens, _ = hf_greedy(path, PROMPTS[1], 40)
    assert tokens[1] == hf_tokens


@pytest.mark.parametrize("engine", [{"num_gpu_blocks_override": 40},
                                    {"num_gpu_blocks_override": 40, "swap_space": 0.01},
                                    {"max_num_batched_tokens": 64}],
                         ids=["recompute", "swap", "prefix-cache"])
def test_preemption_and_prefix_caching_keep_greedy_outputs(tiny_models, engine):
    path = tiny_models["llama"]
    prompts = PROMPTS + PROMPTS[:2]  # the repeats hit the prefix cache
    ref, _, _, _, _ = _run(path, prompts=prompts, spec=None)
    tokens, _, stats, preemptions, _ = _run(path, prompts=prompts, **engine)
    _assert_exercised(stats)
    assert tokens == ref
    if "num_gpu_blocks_override" in engine:
        assert (preemptions.swap if "swap_space" in engine else preemptions.recompute) > 0


def test_penalties_min_tokens_and_stops_apply_at_every_checked_position(tiny_models):
    path = tiny_models["qwen3"]
    ref, _, _, _, _ = _run(path, spec=None)
    stop_token = ref[0][12]  # a token the first request writes after its 12th: its run ends there
    params = [SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3, presence_penalty=0.4,
                             frequency_penalty=0.2, min_tokens=6, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=17, stop_token_ids=[stop_token], ignore_eos=True)]
    for p in params:
        ref_p, ref_lp, _, _, ref_out = _run(path, params=p, spec=None)
        got, lp, stats, _, out = _run(path, params=p)
        assert stats.num_drafts > 0
        assert got == ref_p
        assert [o.finish_reason for o in out] == [o.finish_reason for o in ref_out]
        if ref_lp[0] is not None:
            assert lp[0] == pytest.approx(ref_lp[0], abs=1e-4)


def test_a_stop_string_inside_a_run_of_kept_drafts_ends_the_output_there(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama")
    prompt = "a b c d e f g a b c d e f g a b c d e f g a b c d e f g"
    plain = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with LLM(str(path), **ENGINE) as llm:
        text = llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0].text
    assert len(text) > 8
    stop = text[4:7]  # a string the reference writes early: its tokens may come inside one step's run
    stopped = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    outs = []
    for spec in (None, NGRAM):
        with LLM(str(path), speculative_config=spec, **ENGINE) as llm:
            out = llm.generate([prompt], stopped, use_tqdm=False)[0].outputs[0]
            outs.append((out.text, out.token_ids, out.finish_reason, out.stop_reason))
    assert outs[1] == outs[0]
    assert outs[0][2] == "stop" and outs[0][3] == stop


def test_a_structured_output_beside_speculating_requests(tiny_models):
    path = tiny_models["llama"]
    choice = SamplingParams(temperature=0.0, max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    results = []
    for spec in (None, NGRAM):
        with LLM(str(path), speculative_config=spec, **ENGINE) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS] + ["Answer:"],
                                [GREEDY] * len(PROMPTS) + [choice], use_tqdm=False)
            stats = llm.llm_engine.spec_decode_stats
        results.append([o.outputs[0].token_ids for o in outs] + [outs[-1].outputs[0].text])
    assert results[1] == results[0]
    assert results[1][-1] in ("yes", "no")
    assert stats.num_drafts > 0


def test_rejected_drafts_give_their_blocks_back(tiny_models):
    with LLM(str(tiny_models["llama"]), speculative_config=NGRAM, **ENGINE) as llm:
        engine = llm.llm_engine
        engine.add_request("r", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
        kv = engine.kv_cache
        rejected = 0
        while engine.has_unfinished_requests():
            before = engine.spec_decode_stats.num_draft_tokens - engine.spec_decode_stats.num_accepted_tokens
            engine.step()
            engine.check_integrity()
            req = next((r for r in engine.scheduler.running if r.request_id == "r"), None)
            if req is not None and req.num_output_tokens:  # decoding: the blocks of its computed tokens, none for drafts
                assert kv.num_blocks_held("r") == kv.blocks_needed(req.num_computed_tokens)
                assert req.num_computed_tokens == req.num_tokens - 1
            rejected += engine.spec_decode_stats.num_draft_tokens - engine.spec_decode_stats.num_accepted_tokens - before
        assert rejected > 0
        assert kv.pool.num_used_blocks == 0


TEMPERATURE = 0.8


def _marginal_of_second_token(path, prompt: list[int], temperature: float = TEMPERATURE) -> torch.Tensor:
    """P(second generated token): sum over the first token t of p(t) p(. | t), by transformers (first tokens of
    probability below 1e-6 left out: they move no expected count by a hundredth)."""
    model = load_hf_model(path)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        first = torch.softmax(out.logits[0, -1].double() / temperature, -1)
        likely = torch.nonzero(first > 1e-6).squeeze(1)
        cache = out.cache
        cache.batch_repeat_interleave(len(likely))  # the prompt's K/V once for every first token
        second = torch.softmax(model(likely[:, None], cache=cache).logits[:, -1].double() / temperature, -1)
    marginal = first[likely] @ second
    return marginal / marginal.sum()


def _second_token_p_value(path, prompt: list[int], expected: torch.Tensor) -> tuple[float, object]:
    samples = 3000
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=3, n=samples, seed=1234)
    spec = {**NGRAM, "num_speculative_tokens": 1, "prompt_lookup_max": 4}
    with LLM(str(path), speculative_config=spec, dtype="float32", max_num_seqs=256) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        stats = llm.llm_engine.spec_decode_stats
    tokens = torch.tensor([o.token_ids[1] for o in out.outputs])
    expected = expected * samples
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    big = expected >= 5  # cells expected 5+ times on their own, the rest pooled into one
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    stat = float(((obs - exp) ** 2 / exp).sum())
    return chi2_sf(stat, len(obs) - 1), stats


def test_sampled_tokens_follow_the_target_distribution_and_a_biased_rule_does_not(monkeypatch):
    """The second token of each sample is the one drafts decide (the first comes from the prompt's forward). The
    demo model (trained on its corpus) continuing a passage of the corpus that its prompt already holds: drafts
    are found for most samples and a fair share kept. Over 3000 samples the counts match transformers'
    probabilities; a rule checking drafts against sqrt(p) (renormalised) instead of p fails."""
    from transformers import AutoTokenizer

    from pagedllm.demo import CORPUS, demo_model_path

    path = demo_model_path()
    text = CORPUS[:CORPUS.index("One day")] + "Once upon a time there was a little village by the"
    prompt = AutoTokenizer.from_pretrained(str(path))(text)["input_ids"]
    expected = _marginal_of_second_token(path, prompt)
    p_value, stats = _second_token_p_value(path, prompt, expected)
    assert stats.num_drafts >= 1500 and 0.1 * stats.num_draft_tokens < stats.num_accepted_tokens
    assert p_value > 1e-4

    from pagedllm.model_executor import model_runner
    from pagedllm.spec_decode import verify

    def biased(probs, drafts, accept_u, draw_u, draft_probs=None):
        return verify.sampled_chain(probs.sqrt() / probs.sqrt().sum(-1, keepdim=True), drafts, accept_u, draw_u)

    monkeypatch.setattr(model_runner, "sampled_chain", biased)
    p_value, _ = _second_token_p_value(path, prompt, expected)
    assert p_value < 1e-6


def test_two_tensor_parallel_ranks_check_drafts_as_one_does(tiny_models):
    """Rank 0 proposes and checks; the other rank gets each step's kept drafts with the sampled token."""
    path = tiny_models["mistral"]
    ref, ref_lps, _, _, _ = _run(path, spec=None)
    tokens, lps, stats, preemptions, _ = _run(path, tensor_parallel_size=2, num_gpu_blocks_override=40)
    _assert_exercised(stats)
    assert preemptions.recompute > 0
    assert tokens == ref
    for a, b in zip(lps, ref_lps):
        assert a == pytest.approx(b, abs=1e-4)


def test_a_structured_outputs_drafts_are_checked_against_its_grammar(tiny_models):
    """A constrained request gets drafts too: each draft position's row is masked by the grammar as if the drafts
    before it were kept. A choice the prompt already holds: after its first token the grammar allows one path,
    which the drafts from the prompt follow, so they are kept; a JSON schema's output equals no speculation's."""
    path = tiny_models["llama"]
    sentence = "the quick brown fox jumps over the lazy dog"
    requests = [(f"{sentence}. {sentence}. Again:", SamplingParams(
                    temperature=0.0, max_tokens=40, guided_decoding=GuidedDecodingParams(choice=[sentence, "no"]))),
                ('{"name": "ab", "ok": true} {"name": "ab", "ok": true} ', SamplingParams(
                    temperature=0.0, max_tokens=60, guided_decoding=GuidedDecodingParams(json={
                        "type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                         "ok": {"type": "boolean"}},
                        "required": ["name", "ok"], "additionalProperties": False})))]
    results = []
    for spec in (None, NGRAM):
        with LLM(str(path), speculative_config=spec, **ENGINE) as llm:
            outs = [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0] for prompt, params in requests]
            if spec is not None:
                stats = llm.llm_engine.spec_decode_stats
        results.append([(o.text, o.token_ids) for o in outs])
    assert results[1] == results[0]
    assert results[1][0][0] in (sentence, "no")
    json.loads(results[1][1][0])
    assert stats.num_accepted_tokens > 0
