"""Higgs Audio v2: our model and audio sampling against transformers' reference (float32).

Our model runs through the paged attention path (a KV cache bound to its layers, metadata from
build_attention_metadata), driven here step by step as the model runner will drive it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.errors import UnsupportedModelError
from pagedllm.memory.model_size import num_params_from_config
from pagedllm.model_executor.attention import bind_kv_cache, build_attention_metadata, forward_context, kv_cache_shape
from pagedllm.model_executor.audio_sampling import (
    AudioGenerationState,
    RepetitionAwareSampling,
    apply_delay_pattern,
    audio_placeholder_ids,
    build_delay_pattern,
    delay_pattern_masks,
    extract_audio_codes,
    revert_delay_pattern,
    sample_audio_steps,
    verify_audio_sampling_params,
)
from pagedllm.model_executor.loader import load_model
from pagedllm.model_executor.model_files import load_hf_config, preset_config
from pagedllm.model_executor.models.higgs_audio_v2 import (
    HiggsAudioV2ForConditionalGeneration,
)
from pagedllm.sampling_params import SamplingParams
from tests.higgs_helpers import (
    TINY_HIGGS_CONFIG,
    hf_higgs_generate,
    load_hf_higgs,
    make_tiny_higgs_model,
)
from tests.higgs_helpers import TINY_SPEC as SPEC
from tests.higgs_helpers import audio_prompt as _audio_prompt
from tests.higgs_helpers import text_prompt as _text_prompt

LOGIT_TOL = 1e-4
K = TINY_HIGGS_CONFIG["num_codebooks"]
C = TINY_HIGGS_CONFIG["codebook_size"]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny_higgs(tmp_path_factory) -> str:
    return str(make_tiny_higgs_model(tmp_path_factory.mktemp("higgs") / "tiny"))


@pytest.fixture(scope="module")
def our_model(tiny_higgs) -> HiggsAudioV2ForConditionalGeneration:
    return _load(tiny_higgs)


def _load(model: str, **kwargs) -> HiggsAudioV2ForConditionalGeneration:
    config = EngineArgs(model=model, dtype="float32", device="cpu", max_model_len=256, **kwargs).create_engine_config()
    return load_model(config.model, torch.device("cpu")).model


@dataclass
class Chunk:
    """Tokens of one sequence computed in a step, with the frames of its audio positions."""

    seq: int
    token_ids: list[int]
    audio_codes: torch.Tensor | None = None  # (audio positions, K)


class PagedHarness:
    """A minimal model runner: one KV cache, fixed block tables, several sequences, flat steps."""

    def __init__(self, model, num_seqs: int = 2, block_size: int = 4, blocks_per_seq: int = 32) -> None:
        cfg = model.config
        self.model, self.block_size = model, block_size
        slots = num_seqs * blocks_per_seq * block_size
        self.kv_cache = torch.zeros(kv_cache_shape(cfg.num_hidden_layers, cfg.num_key_value_heads, slots, cfg.head_dim))
        bind_kv_cache(model.attention_layers(), self.kv_cache)
        self.tables = [list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq)) for s in range(num_seqs)]
        self.num_computed = [0] * num_seqs

    @torch.inference_mode()
    def step(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        """Run the chunks as one flat batch; the hidden states of each chunk's tokens."""
        meta = build_attention_metadata([self.num_computed[c.seq] for c in chunks], [len(c.token_ids) for c in chunks],
                                        [self.tables[c.seq] for c in chunks], self.block_size, torch.device("cpu"))
        ids = torch.tensor([t for c in chunks for t in c.token_ids])
        frames = [c.audio_codes for c in chunks if c.audio_codes is not None]
        codes = torch.cat(frames) if frames else None
        with forward_context(meta):
            hidden = self.model(ids, meta.positions, audio_codes=codes)
        for c in chunks:
            self.num_computed[c.seq] += len(c.token_ids)
        return list(hidden.split([len(c.token_ids) for c in chunks]))

    @torch.inference_mode()
    def logits(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        return [self.model.compute_logits(h) for h in self.step(chunks)]


def _hf_logits(path: str, prompt: list[int], frames: torch.Tensor | None) -> torch.Tensor:
    kwargs = {} if frames is None else _audio_kwargs(frames)
    with torch.no_grad():
        out = load_hf_higgs(path)(input_ids=torch.tensor([prompt]), **kwargs)
    return out.logits[0].view(len(prompt), K, C)


def _audio_kwargs(frames: torch.Tensor) -> dict:
    """The reference's audio inputs for a batch of one: every frame valid."""
    return {"audio_input_ids": frames[None], "audio_input_ids_mask": torch.ones((1, len(frames)), dtype=torch.bool)}


def _split_frames(prompt: list[int], frames: torch.Tensor | None, cut: int) -> list[torch.Tensor | None]:
    """The frames of prompt[:cut] and of prompt[cut:] (placeholders take frames in order)."""
    if frames is None:
        return [None, None]
    n = sum(t in SPEC.placeholder_token_ids for t in prompt[:cut])
    return [frames[:n], frames[n:]]


# -- forward parity ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["text", "audio_span"])
@pytest.mark.parametrize("cut", [None, 4, 10])
def test_prefill_logits_match_transformers(tiny_higgs, our_model, kind, cut):
    """Whole prompt in one step, or in two chunks (a cut at 10 falls inside the audio span)."""
    prompt, frames = _audio_prompt(1) if kind == "audio_span" else (_text_prompt(1), None)
    expected = _hf_logits(tiny_higgs, prompt, frames)
    harness = PagedHarness(our_model)
    if cut is None:
        got = harness.logits([Chunk(0, prompt, frames)])[0]
    else:
        first, second = _split_frames(prompt, frames, cut)
        got = torch.cat([harness.logits([Chunk(0, prompt[:cut], first)])[0],
                         harness.logits([Chunk(0, prompt[cut:], second)])[0]])
    torch.testing.assert_close(got, expected, atol=LOGIT_TOL, rtol=0)


def test_explicit_audio_mask_equals_placeholder_mask(our_model):
    """An explicit mask routes like the placeholders, and the ids under it are never read."""
    prompt, frames = _audio_prompt(2)
    ids = torch.tensor(prompt)
    mask = our_model.placeholder_mask(ids)
    assert int(mask.sum()) == len(frames)
    harness = PagedHarness(our_model)
    meta = build_attention_metadata([0], [len(prompt)], [harness.tables[0]], harness.block_size, torch.device("cpu"))
    with torch.inference_mode(), forward_context(meta):
        derived = our_model(ids, meta.positions, audio_codes=frames)
        explicit = our_model(ids.masked_fill(mask, 0), meta.positions, audio_codes=frames, audio_mask=mask)
    torch.testing.assert_close(derived, explicit, atol=0, rtol=0)
    with pytest.raises(ValueError, match="audio_codes must have shape"), forward_context(meta):
        our_model(ids, meta.positions, audio_codes=frames[1:])


@pytest.mark.parametrize("kind", ["text", "audio_span"])
def test_audio_decode_steps_match_transformers(tiny_higgs, our_model, kind):
    """Decode: the reference passes only audio_input_ids (no input_ids, so no mask: every position
    takes the audio path); we pass the placeholder token, whose mask is True, and the frame."""
    from transformers import DynamicCache

    prompt, frames = _audio_prompt(3) if kind == "audio_span" else (_text_prompt(3), None)
    hf = load_hf_higgs(tiny_higgs)
    gen = torch.Generator().manual_seed(3)
    decode = torch.randint(0, C, (5, K), generator=gen)
    decode[0] = SPEC.stream_bos_id
    placeholders = [SPEC.audio_token_id] * 3 + [SPEC.audio_delay_token_id] * 2
    cache = DynamicCache(config=hf.config)
    kwargs = {} if frames is None else _audio_kwargs(frames)
    harness = PagedHarness(our_model)
    with torch.no_grad():
        hf(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, **kwargs)
        harness.step([Chunk(0, prompt, frames)])
        for frame, token in zip(decode, placeholders):
            expected = hf(audio_input_ids=frame[None, None], cache=cache, use_cache=True).logits[0].view(1, K, C)
            got = harness.logits([Chunk(0, [token], frame[None])])[0]
            torch.testing.assert_close(got, expected, atol=LOGIT_TOL, rtol=0)


def test_mixed_batch_matches_separate_runs(our_model):
    """A text prefill, an audio-span prefill and an audio decode in one flat step route per token."""
    text, (audio, frames) = _text_prompt(4), _audio_prompt(4)
    alone = PagedHarness(our_model, num_seqs=3)
    ref = [alone.logits([Chunk(0, text)])[0], alone.logits([Chunk(1, audio, frames)])[0]]
    alone.step([Chunk(2, text)])
    frame = torch.full((1, K), 5)
    ref.append(alone.logits([Chunk(2, [SPEC.audio_token_id], frame)])[0])

    batched = PagedHarness(our_model, num_seqs=3)
    batched.step([Chunk(2, text)])
    got = batched.logits([Chunk(0, text), Chunk(1, audio, frames), Chunk(2, [SPEC.audio_token_id], frame)])
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=LOGIT_TOL, rtol=0)


# -- greedy generation parity -----------------------------------------------------------------------

def _generate(model, prompt: list[int], frames: torch.Tensor | None, max_new_tokens: int,
              params: SamplingParams = GREEDY, seed: int | None = None) -> tuple[torch.Tensor, list[int]]:
    """Our generation loop for one request: prefill, then one frame per step until audio ends."""
    harness = PagedHarness(model, num_seqs=1, blocks_per_seq=64)
    state = AudioGenerationState.from_prompt(model.audio_spec, prompt, frames, seed=seed)
    generator = torch.Generator().manual_seed(0)
    logits = harness.logits([Chunk(0, prompt, frames)])[0][-1:]
    tokens: list[int] = []
    while True:
        step = sample_audio_steps([state], logits, [params], generator)[0]
        tokens.append(step.token_id)
        if step.finished or len(tokens) == max_new_tokens:
            return torch.tensor(state.frames), tokens
        logits = harness.logits([Chunk(0, [step.token_id], torch.tensor([step.codes]))])[0]


@pytest.mark.parametrize("prompt_seed", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["text", "audio_span"])
def test_greedy_generation_matches_transformers(tiny_higgs, our_model, kind, prompt_seed):
    prompt, frames = _audio_prompt(prompt_seed) if kind == "audio_span" else (_text_prompt(prompt_seed), None)
    expected_frames, expected_tokens = hf_higgs_generate(tiny_higgs, prompt, frames, max_new_tokens=60)
    got_frames, got_tokens = _generate(our_model, prompt, frames, max_new_tokens=60)
    assert got_tokens == expected_tokens
    assert torch.equal(got_frames, expected_frames)


def test_greedy_generation_reaches_the_end_of_audio(tiny_higgs, our_model):
    """At least one parity prompt ends audio (all codebooks at stream eos, then eos) before the cap,
    so the staggered eos masks and the end are covered, not just the bos side."""
    ended = []
    for seed in range(4):
        for prompt, frames in (_audio_prompt(seed), (_text_prompt(seed), None)):
            got_frames, tokens = _generate(our_model, prompt, frames, max_new_tokens=60)
            if tokens[-1] == SPEC.eos_token_id:
                ended.append(got_frames)
                assert SPEC.audio_delay_token_id in tokens
    assert ended
    codes = extract_audio_codes(ended[0], SPEC)
    assert codes.shape[1] == K and bool((codes < SPEC.stream_bos_id).all())


# -- the delay pattern and sampling -----------------------------------------------------------------

def _reference_processor():
    from transformers.models.higgs_audio_v2.generation_higgs_audio_v2 import (
        HiggsAudioV2DelayPatternLogitsProcessor,
    )

    return HiggsAudioV2DelayPatternLogitsProcessor(
        delay_pattern=SPEC.delays, audio_bos_token_id=SPEC.audio_bos_token_id,
        audio_eos_token_id=SPEC.audio_delay_token_id, audio_stream_bos_id=SPEC.stream_bos_id,
        audio_stream_eos_id=SPEC.stream_eos_id, num_codebooks=K, codebook_size=C,
    )


def _random_prompt(gen: torch.Generator) -> list[int]:
    """Short prompts whose last K tokens hold audio bos / delay tokens at every offset (or none)."""
    length = int(torch.randint(1, 9, (1,), generator=gen))
    choices = torch.tensor([5, 7, SPEC.audio_bos_token_id, SPEC.audio_delay_token_id, SPEC.audio_token_id])
    ids = choices[torch.randint(0, len(choices), (length,), generator=gen)].tolist()
    if torch.rand(1, generator=gen) < 0.5:
        ids[-1] = SPEC.audio_bos_token_id
    return ids


@pytest.mark.parametrize("sampled", [False, True])
def test_delay_pattern_matches_reference_processor(sampled):
    """Over many seeds: our masked logits equal the reference processor's on the same inputs, and
    the codes we emit are allowed by them (and are their argmax when greedy)."""
    params = SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=0) if sampled else GREEDY
    for seed in range(150):
        gen = torch.Generator().manual_seed(seed)
        prompt = _random_prompt(gen)
        state = AudioGenerationState.from_prompt(SPEC, prompt, seed=seed)
        processor, input_ids = _reference_processor(), torch.tensor([prompt])
        for _ in range(14):
            logits = torch.randn((1, K, C), generator=gen) * 3
            logits[..., SPEC.stream_eos_id] += 4 * torch.rand((1, K), generator=gen)  # reach eos often
            expected = processor(input_ids, logits.reshape(1, K * C)).view(1, K, C)
            masks = delay_pattern_masks(state)
            ours = apply_delay_pattern(logits, torch.tensor([masks.force_bos]), torch.tensor([masks.force_eos]), SPEC)
            assert torch.equal(ours, expected), f"seed {seed}"
            step = sample_audio_steps([state], logits, [params], torch.Generator().manual_seed(seed))[0]
            codes = torch.tensor(step.codes)
            allowed = torch.isfinite(expected[0])
            # A codebook forced to both stream bos and eos (possible for odd prompts) has no allowed
            # id: the reference's argmax gives 0 there, and so do we, greedy or not.
            dead = ~allowed.any(-1)
            assert bool((allowed[torch.arange(K), codes] | dead).all()), f"seed {seed}"
            assert bool((codes[dead] == 0).all())
            if not sampled:
                assert torch.equal(codes, expected[0].argmax(-1))
            input_ids = torch.cat([input_ids, torch.tensor([[step.token_id]])], dim=1)
            if step.finished:
                assert step.token_id == SPEC.eos_token_id
                break


def test_audio_ends_when_every_codebook_emits_stream_eos():
    """Codebook 2 emits eos freely; codebooks 0, 1, 2, 3 are then forced one per step: the frame of
    the fourth step is all eos, and the tokens go delay, delay, ..., eos."""
    state = AudioGenerationState.from_prompt(SPEC, [5, 6, 7, 8, 9])
    state.bos_countdown = [-1] * K  # past the bos side
    logits = torch.zeros((1, K, C))
    logits[..., 3] = 1.0
    logits[0, 2, SPEC.stream_eos_id] = 2.0
    steps = [sample_audio_steps([state], logits, [GREEDY], torch.Generator())[0]]
    logits[0, 2, SPEC.stream_eos_id] = 0.0
    while not steps[-1].finished:
        steps.append(sample_audio_steps([state], logits, [GREEDY], torch.Generator())[0])
    assert [s.codes for s in steps] == [[3, 3, 31, 3], [31, 3, 3, 3], [31, 31, 3, 3], [31, 31, 31, 3], [31] * K]
    assert [s.token_id for s in steps] == [62, 62, 62, 62, 63]


def test_seeded_sampling_is_reproducible_and_batch_independent():
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=10, seed=1234)
    other = SamplingParams(temperature=0.8)
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn((1, K, C), generator=gen) for _ in range(6)]
    noise = [torch.randn((1, K, C), generator=gen) for _ in range(6)]

    def run(with_neighbour: bool, seed: int = 1234) -> list[list[int]]:
        state = AudioGenerationState.from_prompt(SPEC, [5, SPEC.audio_bos_token_id], seed=seed)
        neighbour = AudioGenerationState.from_prompt(SPEC, [SPEC.audio_bos_token_id])
        shared = torch.Generator().manual_seed(99)
        out = []
        for lg, nz in zip(logits, noise):
            if with_neighbour:
                batch = torch.cat([nz, lg])
                out.append(sample_audio_steps([neighbour, state], batch, [other, params], shared)[1].codes)
            else:
                out.append(sample_audio_steps([state], lg, [params], shared)[0].codes)
        return out

    alone = run(False)
    assert run(False) == alone
    assert run(True) == alone
    assert run(False, seed=4321) != alone


def test_repetition_aware_sampling_redraws_repeated_codes():
    """RAS: a codebook whose pick occurs max_repeat times in the window is redrawn from the raw
    logits (here near-uniform, so the redraw usually differs); others keep the greedy pick."""
    ras = RepetitionAwareSampling(window=7, max_repeat=2)
    prompt_frames = torch.tensor([[4, 9, 31, 30], [4, 8, 31, 30], [7, 9, 31, 30]])
    logits = torch.zeros((1, K, C))
    logits[..., 4] = 0.01  # greedy picks 4 in every codebook; only codebook 0 repeats it twice
    logits[0, 2, 4] = logits[0, 3, 4] = 0.0
    logits[0, 2, 31] = logits[0, 3, 30] = 0.01  # codebooks 2, 3 pick stream eos / bos: never counted
    redrawn = set()
    for seed in range(20):
        state = AudioGenerationState.from_prompt(SPEC, [5, 6, 7, 8, 9], prompt_frames, ras=ras, seed=seed)
        state.bos_countdown = [-1] * K
        codes = sample_audio_steps([state], logits, [GREEDY], torch.Generator())[0].codes
        assert codes[1:] == [4, 31, 30]
        redrawn.add(codes[0])
    assert len(redrawn) > 1
    assert RepetitionAwareSampling.from_generation_config({"ras_win_len": 7, "ras_win_max_num_repeat": 2}) == ras
    assert RepetitionAwareSampling.from_generation_config({"eos_token_id": 63}) is None


def test_unsupported_sampling_settings_are_refused_by_name():
    verify_audio_sampling_params(SamplingParams(temperature=0.7, top_k=50, top_p=0.95, seed=3))
    with pytest.raises(ValueError, match="min_p, repetition_penalty not supported"):
        verify_audio_sampling_params(SamplingParams(repetition_penalty=1.1, min_p=0.1))


def test_delay_pattern_round_trip_matches_reference_processor():
    from types import SimpleNamespace

    from transformers.models.higgs_audio_v2.processing_higgs_audio_v2 import (
        HiggsAudioV2Processor,
    )

    proc = SimpleNamespace(audio_stream_bos_id=SPEC.stream_bos_id, audio_stream_eos_id=SPEC.stream_eos_id)
    codes = torch.randint(0, SPEC.stream_bos_id, (9, K), generator=torch.Generator().manual_seed(0))
    with_markers = torch.cat([torch.full((1, K), SPEC.stream_bos_id), codes, torch.full((1, K), SPEC.stream_eos_id)])
    expected = HiggsAudioV2Processor.build_delay_pattern(proc, with_markers.T[None])[0].T
    frames = build_delay_pattern(codes, SPEC)
    assert torch.equal(frames, expected)
    assert len(audio_placeholder_ids(len(frames), SPEC)) == len(frames)
    assert torch.equal(revert_delay_pattern(frames[1:-1]), HiggsAudioV2Processor.revert_delay_pattern(proc, frames[1:-1]))
    assert torch.equal(extract_audio_codes(frames, SPEC), codes)


# -- loading, config checks, parameter count ----------------------------------------------------------

def test_checkpoint_text_head_is_ignored_and_every_weight_loaded(our_model, tiny_higgs):
    hf = load_hf_higgs(tiny_higgs)
    assert hf.text_lm_head is None
    torch.testing.assert_close(our_model.audio_lm_head.weight, hf.audio_lm_head.weight, atol=0, rtol=0)
    ours = our_model.model.layers[1].audio_mlp.gate_up_proj.weight
    theirs = hf.model.layers[1].audio_mlp
    torch.testing.assert_close(ours, torch.cat([theirs.gate_proj.weight, theirs.up_proj.weight]), atol=0, rtol=0)


def test_dummy_weights_from_config_file(tiny_higgs, tmp_path):
    model = _load(str(tiny_higgs) + "/config.json", load_format="dummy")
    assert isinstance(model, HiggsAudioV2ForConditionalGeneration)
    prompt, frames = _audio_prompt(0)
    logits = PagedHarness(model).logits([Chunk(0, prompt, frames)])[0]
    assert logits.shape == (len(prompt), K, C) and bool(torch.isfinite(logits).all())


def test_codebook_without_room_for_stream_ids_is_refused(tmp_path):
    cfg = json.loads(preset_config("higgs-audio-v2-3b").read_text()) | {"codebook_size": 1024}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="codebook_size=1024"):
        _load(str(tmp_path / "config.json"), load_format="dummy")


def test_3b_preset_parameter_count_matches_transformers():
    from transformers import HiggsAudioV2ForConditionalGeneration as HFModel

    cfg = load_hf_config(preset_config("higgs-audio-v2-3b"))
    with torch.device("meta"):
        hf_count = sum(p.numel() for p in HFModel(cfg).parameters())
        ours = sum(p.numel() for p in HiggsAudioV2ForConditionalGeneration(cfg, max_positions=16).parameters())
    assert num_params_from_config(cfg) == hf_count == ours
