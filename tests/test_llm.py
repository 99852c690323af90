"""The offline API end to end: prompts, outputs, stopping, sampling, errors, loading."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedllm import LLM, InvalidPromptError, SamplingParams, UnsupportedModelError
from tests.helpers import hf_greedy, load_hf_model, make_tiny_model


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=96)


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    outs = llm.generate(["Hello there", {"prompt_token_ids": [4, 5, 6]}, {"prompt": "A cat"}], greedy(),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello there", None, "A cat"]
    assert outs[0].prompt_token_ids == tok.encode("Hello there")
    assert outs[0].prompt_token_ids[0] == tok.bos_token_id
    assert outs[1].prompt_token_ids == [4, 5, 6]
    single = llm.generate("Hello there", greedy(), use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.index == 0 and len(c.token_ids) == 12 and c.finish_reason == "length"
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.logprobs is None and c.cumulative_logprob is None


def test_per_prompt_sampling_params(llm):
    outs = llm.generate([[4, 5], [6, 7]], [greedy(3), greedy(5)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate([[1], [2], [3]], [greedy(), greedy()], use_tqdm=False)


def test_text_prompt_matches_transformers(llm, tiny_models):
    prompt_ids = llm.get_tokenizer().encode("Once upon a time")
    ref, _ = hf_greedy(tiny_models["llama"], prompt_ids, 10)
    assert llm.generate("Once upon a time", greedy(10), use_tqdm=False)[0].outputs[0].token_ids == ref


def test_logprobs_format(llm):
    out = llm.generate([[7, 8, 9]], greedy(6, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        values = sorted((lp.logprob for lp in entry.values()), reverse=True)
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert all(isinstance(lp.decoded_token, str) for lp in entry.values())
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_prompt_logprobs_match_transformers(llm, tiny_models):
    prompt = list(range(40, 60))
    out = llm.generate([prompt], greedy(2, prompt_logprobs=2), use_tqdm=False)[0]
    model = load_hf_model(tiny_models["llama"])
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert entry[prompt[i]].logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
        assert entry[prompt[i]].rank == int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1
        assert len(entry) in (2, 3)


def test_prompt_logprobs_survive_chunking_and_preemption(tiny_models):
    chunked = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64, block_size=4,
                  max_num_batched_tokens=5, num_gpu_blocks_override=16)
    whole = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64)
    prompts = [list(range(40, 60)), list(range(70, 95)), list(range(5, 30))]
    a = chunked.generate(prompts, greedy(20, prompt_logprobs=1), use_tqdm=False)
    b = whole.generate(prompts, greedy(20, prompt_logprobs=1), use_tqdm=False)
    assert chunked.llm_engine.scheduler.num_preemptions > 0
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert len(x.prompt_logprobs) == len(y.prompt_logprobs)
        for ex, ey in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert ex.keys() == ey.keys()
            for k in ex:
                assert ex[k].logprob == pytest.approx(ey[k].logprob, abs=1e-4)


def test_stop_strings_and_token_ids(llm):
    base = llm.generate([[10, 11, 12]], greedy(16), use_tqdm=False)[0].outputs[0]
    stop = base.text[5:8]
    assert stop.strip(), "pick a visible stop string"
    cut = llm.generate([[10, 11, 12]], greedy(16, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.text == base.text[: base.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate([[10, 11, 12]], greedy(16, stop=stop, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == base.text[: base.text.index(stop) + len(stop)]

    target = base.token_ids[3]
    first = base.token_ids.index(target)
    by_id = llm.generate([[10, 11, 12]], greedy(16, stop_token_ids=[target]), use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == base.token_ids[: first + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == target
    with_min = llm.generate([[10, 11, 12]], greedy(16, stop_token_ids=[target], min_tokens=first + 2),
                            use_tqdm=False)[0].outputs[0]
    assert len(with_min.token_ids) > first + 1


def test_eos_from_generation_config(tmp_path, tiny_models):
    path = tmp_path / "m"
    shutil.copytree(tiny_models["qwen2"], path)
    probe = LLM(str(path), dtype="float32", max_model_len=64)
    base = probe.generate([[3, 4, 5]], greedy(12), use_tqdm=False)[0].outputs[0]
    eos = base.token_ids[4]
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [eos, 1]
    (path / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(path), dtype="float32", max_model_len=64)
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    n = base.token_ids.index(eos) + 1
    assert out.token_ids == base.token_ids[:n] and out.finish_reason == "stop" and out.stop_reason is None
    ignoring = llm.generate([[3, 4, 5]], greedy(12), use_tqdm=False)[0].outputs[0]
    assert ignoring.token_ids == base.token_ids


def test_max_model_len_ends_generation(llm):
    out = llm.generate([list(range(3, 3 + 93))], greedy(50), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    unlimited = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert len(unlimited.token_ids) == 94


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate([[20, 21, 22]], params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([[20, 21, 22]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)] * 3
    batch = llm.generate([[1, 2, 3, 4], [20, 21, 22], list(range(30, 50)), [9]], [others[0], params] + others[1:],
                         use_tqdm=False)
    assert alone == again == batch[1].outputs[0].token_ids
    other_seed = llm.generate([[20, 21, 22]], params.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_samples(llm):
    outs = llm.generate([[5, 6, 7]], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True),
                        use_tqdm=False)
    samples = outs[0].outputs
    assert [s.index for s in samples] == [0, 1, 2] and all(len(s.token_ids) == 8 for s in samples)
    assert len({tuple(s.token_ids) for s in samples}) > 1
    same = llm.generate([[5, 6, 7]], greedy(8, n=2), use_tqdm=False)[0].outputs
    assert same[0].token_ids == same[1].token_ids


def test_chat_applies_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, greedy(4), use_tqdm=False)[0]
    expected = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert out.prompt_token_ids == list(expected)
    assert out.prompt_token_ids.count(tok.bos_token_id) == 1


def test_bad_prompts_raise_and_engine_keeps_serving(llm):
    with pytest.raises(InvalidPromptError, match="empty"):
        llm.generate([[]], greedy(), use_tqdm=False)
    with pytest.raises(InvalidPromptError, match="max_model_len is 96"):
        llm.generate([list(range(1, 97))], greedy(), use_tqdm=False)
    with pytest.raises(InvalidPromptError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**6]], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[1, 2]], greedy(stop_token_ids=[10**6]), use_tqdm=False)
    # A batch with one bad prompt is rejected whole, and nothing of it stays queued.
    with pytest.raises(InvalidPromptError):
        llm.generate([[1, 2], []], greedy(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate([[1, 2]], greedy(), use_tqdm=False)[0].outputs[0].token_ids) == 12
    llm.llm_engine.check_integrity()


def test_unknown_llm_argument_is_refused(tiny_models):
    with pytest.raises(TypeError, match="pipeline_parallel_size"):
        LLM(str(tiny_models["llama"]), pipeline_parallel_size=2)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0] * 8,
                           "long_factor": [2.0] * 8, "original_max_position_embeddings": 128}}, "longrope"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ],
)
def test_unsupported_rope_is_refused_by_name(tmp_path, overrides, match):
    path = make_tiny_model(tmp_path / "m", "llama", **overrides)
    with pytest.raises(UnsupportedModelError, match=match):
        LLM(str(path), dtype="float32")


def test_unknown_architecture_refused(tmp_path, tiny_models):
    path = tmp_path / "m"
    shutil.copytree(tiny_models["llama"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM"):
        LLM(str(path))


def test_max_model_len_beyond_positions_refused(tiny_models):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(tiny_models["llama"]), max_model_len=100_000)


def test_pool_too_small_for_one_sequence(tiny_models):
    from pagedllm import KVCacheMemoryError

    with pytest.raises(KVCacheMemoryError, match="max seq len"):
        LLM(str(tiny_models["llama"]), max_model_len=128, block_size=16, num_gpu_blocks_override=4)


def test_dtype_resolution(tmp_path, tiny_models):
    llm = LLM(str(tiny_models["qwen3"]), max_model_len=64)
    assert llm.llm_engine.config.model.dtype == torch.float32  # auto = the checkpoint's
    path = tmp_path / "fp16"
    shutil.copytree(tiny_models["qwen3"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = "float16"
    (path / "config.json").write_text(json.dumps(cfg))
    half = LLM(str(path), max_model_len=64)
    assert half.llm_engine.config.model.dtype == torch.bfloat16  # float16 checkpoints run as bf16 on CPU
    out = half.generate([[1, 2, 3]], greedy(5), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(path), dtype="int8")


def test_dummy_weights_from_a_bare_config(tmp_path, tiny_models):
    cfg = tmp_path / "shape.json"
    shutil.copy(tiny_models["qwen2"] / "config.json", cfg)
    llm = LLM(str(cfg), load_format="dummy", max_model_len=64)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""
    with pytest.raises(InvalidPromptError, match="no tokenizer"):
        llm.generate("text needs a tokenizer", greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="load_format='dummy'"):
        LLM(str(cfg))


def test_missing_weights_named(tmp_path, tiny_models):
    path = tmp_path / "noweights"
    shutil.copytree(tiny_models["llama"], path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(path))


def test_hub_name_resolved_through_local_cache(tmp_path, tiny_models, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-llama" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_models["llama"], snapshot)
    (cache / "models--acme--tiny-llama" / "refs").mkdir(parents=True)
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM("acme/tiny-llama", dtype="float32", max_model_len=64)
    assert llm.llm_engine.config.model.path == snapshot
    assert len(llm.generate("hi", greedy(3), use_tqdm=False)[0].outputs[0].token_ids) == 3
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        LLM("acme/not-there")


def test_logprobs_past_max_logprobs_refused(llm, tiny_models):
    with pytest.raises(ValueError, match=r"logprobs must be at most 20 \(max_logprobs"):  # vLLM's default
        llm.generate([[1, 2]], greedy(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([[1, 2]], greedy(prompt_logprobs=10**6), use_tqdm=False)
    assert len(llm.generate([[1, 2]], greedy(logprobs=2), use_tqdm=False)[0].outputs[0].logprobs) == 12
    whole = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=32, max_logprobs=-1)
    vocab = whole.llm_engine.config.model.vocab_size
    (out,) = whole.generate([[1, 2]], greedy(2, logprobs=vocab), use_tqdm=False)[0].outputs
    assert [len(entry) for entry in out.logprobs] == [vocab, vocab]  # every token's logprob
    with pytest.raises(ValueError, match=f"at most {vocab}"):  # more than the vocabulary would fail the step
        whole.generate([[1, 2]], greedy(2, logprobs=vocab + 1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs must be -1"):
        LLM(str(tiny_models["llama"]), max_logprobs=-2)
