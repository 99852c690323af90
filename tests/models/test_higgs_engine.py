"""Higgs Audio v2 in the paged engine, end to end (float32, tiny random checkpoints): greedy audio
codes and tokens equal transformers' generate alone, batched, staggered, with chunked prefill, under
preemption (recompute and swap) and beside a text model's engine; seeded sampling reproducible and
batch-independent; prefix caching keyed by the audio codes; streaming; typed errors for bad input."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from pagedllm import LLM, InvalidPromptError, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.errors import UnsupportedSamplingParamsError
from pagedllm.memory.model_size import estimate_activation_bytes, logits_per_row
from pagedllm.model_executor.audio_sampling import (
    RepetitionAwareSampling,
    extract_audio_codes,
)
from pagedllm.model_executor.model_files import load_hf_config, preset_config
from tests.helpers import hf_greedy
from tests.higgs_helpers import TINY_SPEC as SPEC
from tests.higgs_helpers import (
    audio_prompt,
    hf_higgs_generate,
    make_tiny_higgs_model,
    text_prompt,
)

MAX_FRAMES = 24
K = SPEC.num_codebooks
ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "block_size": 4,
          "repetition_aware_sampling": False}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_FRAMES)
SAMPLED = SamplingParams(temperature=1.0, top_k=12, top_p=0.95, max_tokens=24)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return str(make_tiny_higgs_model(tmp_path_factory.mktemp("higgs-engine") / "tiny"))


@pytest.fixture(scope="module")
def llm(path) -> LLM:
    return LLM(path, **ENGINE)


def prompts() -> list[tuple[list[int], torch.Tensor | None]]:
    """Text-only prompts and prompts with a reference-voice span, of different lengths."""
    return [(text_prompt(s, 5 + 4 * s), None) for s in range(4)] + [audio_prompt(s, 3 + s) for s in range(4)]


def as_input(prompt: list[int], frames: torch.Tensor | None) -> dict:
    return {"prompt_token_ids": prompt} | ({} if frames is None else {"audio_codes": frames})


@pytest.fixture(scope="module")
def reference(path) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens and codes (delay pattern removed) for each of `prompts()`."""
    out = []
    for prompt, frames in prompts():
        hf_frames, hf_tokens = hf_higgs_generate(path, prompt, frames, MAX_FRAMES)
        out.append((hf_tokens, extract_audio_codes(hf_frames, SPEC)))
    return out


def generate(llm: LLM, items, params: SamplingParams | list[SamplingParams] = GREEDY):
    outs = llm.generate([as_input(p, f) for p, f in items], params, use_tqdm=False)
    assert_no_leak(llm)
    return [(o.outputs[0].token_ids, o.outputs[0].audio_codes) for o in outs]


def assert_no_leak(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.pool.num_blocks
    assert not engine.has_unfinished_requests()


def assert_equal_outputs(got, expected) -> None:
    for i, ((tokens, codes), (ref_tokens, ref_codes)) in enumerate(zip(got, expected, strict=True)):
        assert tokens == ref_tokens, f"prompt {i}"
        assert torch.equal(codes, ref_codes), f"prompt {i}"


# -- greedy parity with transformers ------------------------------------------------------------------

def test_greedy_matches_transformers_one_by_one(llm, reference):
    for item, expected in zip(prompts(), reference):
        assert_equal_outputs(generate(llm, [item]), [expected])


def test_greedy_matches_transformers_batched(llm, reference):
    got = generate(llm, prompts())
    assert_equal_outputs(got, reference)
    ended = [tokens for tokens, _ in got if tokens[-1] == SPEC.eos_token_id]
    assert ended and len(ended) < len(got)  # some end by the delay pattern, others by max_tokens


def test_output_shape_and_finish_reasons(llm):
    outs = llm.generate([as_input(*audio_prompt(0)), as_input(text_prompt(1), None)],
                        [GREEDY, GREEDY.clone(max_tokens=7)], use_tqdm=False)
    ended, capped = outs[0].outputs[0], outs[1].outputs[0]
    assert ended.finish_reason == "stop" and ended.token_ids[-1] == SPEC.eos_token_id and ended.text == ""
    assert capped.finish_reason == "length" and len(capped.token_ids) == 7
    assert capped.audio_codes.shape == (7 - K, K) and capped.audio_codes.dtype == torch.long
    assert set(capped.token_ids) <= set(SPEC.placeholder_token_ids)
    assert outs[0].prompt_token_ids == audio_prompt(0)[0]


def test_staggered_arrivals_mix_prefill_and_decode(llm, reference):
    """Requests join while others decode: text prefill, audio-span prefill and audio decode share steps."""
    engine, items = llm.llm_engine, prompts()
    results, mixed = {}, False
    for i, (prompt, frames) in enumerate(items):
        engine.add_request(f"r{i}", as_input(prompt, frames), GREEDY)
        for out in engine.step():
            results[out.request_id] = out
        mixed |= engine.last_step_num_requests > 1
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = out
    assert mixed
    got = [(results[f"r{i}"].outputs[0].token_ids, results[f"r{i}"].outputs[0].audio_codes) for i in range(len(items))]
    assert_equal_outputs(got, reference)
    assert_no_leak(llm)


def test_chunked_prefill_cuts_inside_audio_spans(path, reference):
    llm = LLM(path, max_num_batched_tokens=5, **ENGINE)
    assert_equal_outputs(generate(llm, prompts()), reference)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_parity(path, reference, mode):
    swap = {"swap_space": 2**-13, "preemption_mode": "swap"} if mode == "swap" else {"preemption_mode": "recompute"}
    llm = LLM(path, **(ENGINE | {"num_gpu_blocks_override": 32, "max_num_batched_tokens": 16}), **swap)
    assert_equal_outputs(generate(llm, prompts()), reference)
    stats = llm.llm_engine.preemption_stats
    assert (stats.swap if mode == "swap" else stats.recompute) > 0
    assert llm.llm_engine.kv_cache.num_swapped_blocks == 0


def test_beside_a_text_model_engine(path, reference, tiny_models):
    """A tiny Llama engine in the same process, stepped in turn with the audio engine."""
    text_llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=96, block_size=4)
    audio_llm = LLM(path, **ENGINE)
    text_prompts = [list(range(10 + 3 * i, 20 + 5 * i)) for i in range(3)]
    text_params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engines = (text_llm.llm_engine, audio_llm.llm_engine)
    for i, p in enumerate(text_prompts):
        engines[0].add_request(f"t{i}", {"prompt_token_ids": p}, text_params)
    for i, item in enumerate(prompts()):
        engines[1].add_request(f"a{i}", as_input(*item), GREEDY)
    done = {}
    while any(e.has_unfinished_requests() for e in engines):
        for engine in engines:
            done.update((o.request_id, o.outputs[0]) for o in engine.step())
    for i, p in enumerate(text_prompts):
        assert done[f"t{i}"].token_ids == hf_greedy(tiny_models["llama"], p, 12)[0]
        assert done[f"t{i}"].audio_codes is None
    got = [(done[f"a{i}"].token_ids, done[f"a{i}"].audio_codes) for i in range(len(reference))]
    assert_equal_outputs(got, reference)


# -- prompt forms -----------------------------------------------------------------------------------

def test_audio_clips_expand_like_the_processor(llm):
    """{"audio": [codes]} with one audio token per clip equals the processor's expanded form."""
    prompt, frames = audio_prompt(5)
    codes = extract_audio_codes(frames, SPEC)  # the clip's own codes (frames, K)
    start = prompt.index(SPEC.audio_token_id)
    end = len(prompt) - prompt[::-1].index(SPEC.audio_delay_token_id)
    compact = prompt[:start] + [SPEC.audio_token_id] + prompt[end:]
    expanded = llm.generate(as_input(prompt, frames), GREEDY, use_tqdm=False)[0]
    clipped = llm.generate({"prompt_token_ids": compact, "audio": [codes.tolist()]}, GREEDY, use_tqdm=False)[0]
    assert clipped.prompt_token_ids == prompt
    assert clipped.outputs[0].token_ids == expanded.outputs[0].token_ids
    assert torch.equal(clipped.outputs[0].audio_codes, expanded.outputs[0].audio_codes)
    # An output's codes go back in as a reference voice.
    again = llm.generate({"prompt_token_ids": compact, "audio": [expanded.outputs[0].audio_codes]}, GREEDY,
                         use_tqdm=False)[0]
    assert again.outputs[0].finish_reason is not None
    assert_no_leak(llm)


# -- sampling -----------------------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    item = audio_prompt(6)
    seeded = SAMPLED.clone(seed=1234)
    alone = generate(llm, [item], seeded)
    assert _same(generate(llm, [item], seeded), alone)
    neighbours = [(text_prompt(7), None), audio_prompt(8), (text_prompt(9), None)]
    batch = generate(llm, [neighbours[0], item, *neighbours[1:]], [SAMPLED, seeded, GREEDY, SAMPLED.clone(seed=5)])
    assert _same([batch[1]], alone)
    assert not _same(generate(llm, [item], SAMPLED.clone(seed=4321)), alone)


def _same(a, b) -> bool:
    return all(ta == tb and torch.equal(ca, cb) for (ta, ca), (tb, cb) in zip(a, b, strict=True))


def test_n_samples_with_seeds(llm):
    params = SAMPLED.clone(n=3, seed=11)
    out = llm.generate(as_input(*audio_prompt(1)), params, use_tqdm=False)[0].outputs
    assert len(out) == 3 and len({tuple(o.token_ids) + tuple(o.audio_codes.flatten().tolist()) for o in out}) > 1
    for j, o in enumerate(out):  # sample j draws from seed 11 + j, as a request of its own
        alone = llm.generate(as_input(*audio_prompt(1)), SAMPLED.clone(seed=11 + j), use_tqdm=False)[0].outputs[0]
        assert o.token_ids == alone.token_ids and torch.equal(o.audio_codes, alone.audio_codes)
    assert_no_leak(llm)


def test_ignore_eos_runs_to_max_tokens(llm):
    greedy = generate(llm, [(text_prompt(0, 5), None)])[0][0]
    assert greedy[-1] == SPEC.eos_token_id and len(greedy) < 40
    tokens, codes = generate(llm, [(text_prompt(0, 5), None)], GREEDY.clone(max_tokens=40, ignore_eos=True))[0]
    assert len(tokens) == 40 and SPEC.audio_delay_token_id not in tokens
    assert codes.shape == (40 - K, K) and not bool((codes == SPEC.stream_eos_id).any())


def test_repetition_aware_sampling_from_generation_config(tmp_path):
    path = make_tiny_higgs_model(tmp_path / "ras")
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(gen | {"ras_win_len": 7, "ras_win_max_num_repeat": 2}))
    on = LLM(str(path), **(ENGINE | {"repetition_aware_sampling": True}))
    assert on.llm_engine.audio.ras == RepetitionAwareSampling(7, 2)
    out = on.generate(as_input(*audio_prompt(0)), SAMPLED.clone(seed=3), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason is not None
    assert LLM(str(path), **ENGINE).llm_engine.audio.ras is None


# -- prefix caching -------------------------------------------------------------------------------------

def test_prefix_cache_keys_blocks_by_their_audio_codes(path):
    """Same placeholders, different codes: only the text-only blocks before the span hit; the same
    codes hit the span too, and every output equals a caching-off engine's."""
    cached, plain = LLM(path, **ENGINE), LLM(path, enable_prefix_caching=False, **ENGINE)
    text = [1, *range(2, 9)]  # two full text blocks of 4
    prompt = [*text, SPEC.audio_bos_token_id, SPEC.audio_token_id, 9, SPEC.audio_bos_token_id]
    clips = [torch.randint(0, SPEC.stream_bos_id, (6, K), generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    runs = [clips[0], clips[1], clips[0]]
    stats = cached.llm_engine.prefix_cache_stats
    hits = []
    for clip in runs:
        before = stats.hits
        item = {"prompt_token_ids": prompt, "audio": [clip]}
        got = cached.generate(item, GREEDY, use_tqdm=False)[0].outputs[0]
        want = plain.generate(item, GREEDY, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids and torch.equal(got.audio_codes, want.audio_codes)
        hits.append(stats.hits - before)
    num_prompt = len(prompt) - 1 + 6 + K + 1
    assert hits[0] == 0 and hits[1] == len(text)
    assert hits[2] == (num_prompt - 1) // 4 * 4  # every full prompt block but the one holding the last token
    assert_no_leak(cached)


# -- bad input --------------------------------------------------------------------------------------------

BAD_PROMPTS = {
    "wrong shape": lambda p, f: {"prompt_token_ids": p, "audio_codes": f[:, :2]},
    "too few frames": lambda p, f: {"prompt_token_ids": p, "audio_codes": f[1:]},
    "out of range": lambda p, f: {"prompt_token_ids": p, "audio_codes": f + SPEC.codebook_size},
    "negative": lambda p, f: {"prompt_token_ids": p, "audio_codes": f - 100},
    "float codes": lambda p, f: {"prompt_token_ids": p, "audio_codes": f.float()},
    "placeholders without codes": lambda p, f: {"prompt_token_ids": p},
    "both forms": lambda p, f: {"prompt_token_ids": p, "audio_codes": f, "audio": [f]},
    "clip count": lambda p, f: {"prompt_token_ids": [1, SPEC.audio_token_id, 60], "audio": [f[:3], f[:3]]},
    "clip with stream ids": lambda p, f: {"prompt_token_ids": [1, SPEC.audio_token_id, 60], "audio": [f]},
    "clips not a list": lambda p, f: {"prompt_token_ids": [1, SPEC.audio_token_id, 60], "audio": "x"},
}


@pytest.mark.parametrize("kind", sorted(BAD_PROMPTS))
def test_bad_audio_prompts_are_refused(llm, kind):
    prompt, frames = audio_prompt(0)
    with pytest.raises(InvalidPromptError):
        llm.generate(BAD_PROMPTS[kind](prompt, frames), GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("params", [
    {"logprobs": 1}, {"prompt_logprobs": 0}, {"min_p": 0.1}, {"repetition_penalty": 1.2},
    {"presence_penalty": 0.5}, {"stop": ["x"]}, {"stop_token_ids": [5]}, {"min_tokens": 2},
])
def test_unsupported_sampling_params_are_refused(llm, reference, params):
    with pytest.raises(UnsupportedSamplingParamsError, match=next(iter(params))):
        llm.generate(as_input(*audio_prompt(0)), SamplingParams(max_tokens=8, **params), use_tqdm=False)
    # The engine still serves.
    assert_equal_outputs(generate(llm, prompts()[4:5]), reference[4:5])


def test_a_text_model_refuses_audio(tiny_models):
    text_llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64)
    with pytest.raises(InvalidPromptError, match="takes no audio"):
        text_llm.generate({"prompt_token_ids": [1, 2], "audio_codes": [[1, 2, 3, 4]]}, use_tqdm=False)


# -- streaming -------------------------------------------------------------------------------------------

def test_async_stream_carries_new_frames_each_step(llm, reference):
    prompt, frames = prompts()[5]

    async def run() -> list:
        engine = AsyncLLMEngine(llm.llm_engine)
        try:
            stream = await engine.add_request("s", as_input(prompt, frames), GREEDY)
            return [out.outputs[0] async for out in stream]
        finally:
            engine.shutdown()

    outs = asyncio.run(run())
    lengths = [len(o.audio_codes) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] > lengths[0]
    assert len(outs) == len(reference[5][0])  # one output per generated frame
    for o in outs:  # each is a prefix of the final codes
        assert torch.equal(o.audio_codes, reference[5][1][:len(o.audio_codes)])
    assert outs[-1].token_ids == reference[5][0] and torch.equal(outs[-1].audio_codes, reference[5][1])


# -- the memory plan ---------------------------------------------------------------------------------------

def test_activation_estimate_sizes_sampling_by_codebooks():
    """256 sampled rows of 8 x 1026 codebook logits, not of the 128256-token text vocabulary."""
    cfg = load_hf_config(preset_config("higgs-audio-v2-3b"))
    assert logits_per_row(cfg) == 8 * 1026
    one_row = estimate_activation_bytes(cfg, torch.bfloat16, 2048, 1)
    rows = estimate_activation_bytes(cfg, torch.bfloat16, 2048, 256) - one_row
    assert rows == 255 * 8 * 1026 * (2 + 5 * 4 + 8)


def test_engine_profiles_the_audio_model(path):
    llm = LLM(path, **{k: v for k, v in ENGINE.items() if k != "block_size"})  # no override: a profile run
    assert llm.memory_plan.model.activation_source == "measured"
    assert EngineArgs(model=path, repetition_aware_sampling=False).create_engine_config().model.repetition_aware_sampling is False


# -- the audio bench ---------------------------------------------------------------------------------------

def test_bench_audio_runs_both_backends(path, tmp_path, capsys):
    from pagedllm.bench.audio import main

    out = tmp_path / "bench.json"
    assert main(["--model", path, "--dtype", "float32", "--device", "cpu", "--frames", "6", "--prompt-len", "12",
                 "--num-prompts", "2", "--backend", "pagedllm", "--backend", "transformers",
                 "--output-json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["backend"] for r in results] == ["pagedllm", "transformers"]
    assert all(r["frames"] == 6 and r["decode_frames_per_s"] > 0 for r in results)
    assert "frames/s decode" in capsys.readouterr().out


def test_cli_flag_turns_repetition_aware_sampling_off(path):
    from pagedllm.entrypoints.cli import build_parser, engine_args_from

    ns = build_parser().parse_args(["generate", "--model", path, "--no-repetition-aware-sampling", "x"])
    assert engine_args_from(ns).repetition_aware_sampling is False
