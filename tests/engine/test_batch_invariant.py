"""Batch-invariant mode (`--batch-invariant`, VLLM_BATCH_INVARIANT=1): a seeded request's logprobs, tokens and
audio frames are bit for bit the same alone, beside other requests, and with its prompt chunked any way; on
the cpu backend (fp32, bf16, int8 weights) and the triton one (under Triton's interpreter)."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import build_parser, engine_args_from
from pagedllm.model_executor.batch_invariant import TILE_ROWS, tiled
from tests.helpers import make_tiny_model

SEEDED = SamplingParams(temperature=1.0, max_tokens=8, logprobs=2, seed=7)
TARGET = {"prompt_token_ids": list(range(5, 31))}  # 26 tokens: several chunks at max_num_batched_tokens 8
OTHERS = [{"prompt_token_ids": list(range(9, 9 + n))} for n in (3, 40, 17)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """Head size 32: one the cpu backend's decode kernel is built for (the usual tiny models have 16)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("batch-invariant") / "llama", "llama", hidden_size=128,
                               intermediate_size=352))


def test_tiles_make_each_row_independent_of_the_others():
    def depends_on_row_count(x: torch.Tensor) -> torch.Tensor:  # the worst case: a result set by the shape
        return x * x.shape[0]

    for rows in (1, 5, 16, 17, 40):
        x = torch.randn(rows, 8)
        assert torch.equal(tiled(depends_on_row_count)(x), x * TILE_ROWS)
    linear = torch.nn.Linear(896, 64, bias=False)
    batch = torch.randn(37, 896)
    with torch.no_grad():
        apart = torch.cat([tiled(linear)(batch[i:i + 1]) for i in range(37)])
        assert torch.equal(tiled(linear)(batch), apart)
        assert torch.equal(tiled(linear)(batch[None, 3:9])[0], apart[3:9])  # leading dims kept


def _seeded_run(llm: LLM, target: dict = TARGET, others: list[dict] = OTHERS,
                params: SamplingParams = SEEDED) -> tuple[list[int], list[float]]:
    """The target's tokens and their logprobs, alone and then beside other requests (it runs second)."""
    alone = llm.generate(target, params, use_tqdm=False)[0].outputs[0]
    beside = llm.generate([others[0], target, *others[1:]], params, use_tqdm=False)[1].outputs[0]
    runs = []
    for out in (alone, beside):
        runs.append((out.token_ids, [step[t].logprob for step, t in zip(out.logprobs, out.token_ids, strict=True)]))
    assert runs[0] == runs[1], "a request's logprobs changed with the batch around it"
    return runs[0]


@pytest.mark.parametrize(("dtype", "quantization"), [("float32", None), ("bfloat16", None), ("float32", "int8")])
def test_logprobs_are_the_same_alone_beside_others_and_chunked(model_path, dtype, quantization):
    runs = []
    for chunk in (512, 8):  # the whole prompt in one step; 8 tokens a step, shared with the other requests
        llm = LLM(model_path, dtype=dtype, device="cpu", max_model_len=128, block_size=4, batch_invariant=True,
                  max_num_batched_tokens=chunk, quantization=quantization)
        assert llm.llm_engine.executor.driver.attn_backend.name == "cpu"
        runs.append(_seeded_run(llm))
    assert runs[0] == runs[1]


def test_triton_backend_is_batch_invariant_too(model_path):
    """Shorter: the interpreter runs each program of each kernel launch in Python."""
    target, others = {"prompt_token_ids": list(range(5, 15))}, [{"prompt_token_ids": [9, 10, 11]}, OTHERS[2]]
    runs = []
    for chunk in (16, 6):  # (the start-up profile runs a whole step of per-query programs: keep it small)
        llm = LLM(model_path, dtype="float32", device="cpu", max_model_len=128, block_size=4, batch_invariant=True,
                  max_num_batched_tokens=chunk, attention_backend="triton")
        runs.append(_seeded_run(llm, target, others, SEEDED.clone(max_tokens=3)))
    assert runs[0] == runs[1]


def test_seeded_audio_is_the_same_in_any_batch(tmp_path):
    """Higgs Audio v2: a seeded, sampled request's audio codes alone with its prompt in one step, and beside
    text and audio requests (some sampled, one greedy) with prompts chunked 8 tokens a step."""
    from tests.higgs_helpers import audio_prompt, make_tiny_higgs_model, text_prompt

    path = str(make_tiny_higgs_model(tmp_path / "higgs", head_dim=32, hidden_size=128))
    seeded = SamplingParams(temperature=1.0, top_k=12, top_p=0.95, max_tokens=24, seed=99)

    def inp(prompt, frames):
        return {"prompt_token_ids": prompt} | ({} if frames is None else {"audio_codes": frames})

    target = inp(*audio_prompt(6))
    others = [inp(text_prompt(7), None), inp(*audio_prompt(8)), inp(text_prompt(9, 30), None)]
    results = []
    for chunk, batch, params in ((512, [target], [seeded]),
                                 (8, [others[0], target, *others[1:]],
                                  [SamplingParams(temperature=1.0, max_tokens=20), seeded,
                                   SamplingParams(temperature=0.0, max_tokens=30), seeded.clone(seed=5)])):
        llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, block_size=4, batch_invariant=True,
                  max_num_batched_tokens=chunk)
        out = llm.generate(batch, params, use_tqdm=False)[batch.index(target)].outputs[0]
        results.append((out.token_ids, out.audio_codes))
    (tokens, codes), (tokens_beside, codes_beside) = results
    assert codes.shape[0] > 4 and tokens == tokens_beside and torch.equal(codes, codes_beside)


def test_the_torch_backend_is_refused_with_what_can(model_path):
    with pytest.raises(ValueError, match="torch cannot run this model here: in batch-invariant mode.*cpu"):
        LLM(model_path, device="cpu", attention_backend="torch", batch_invariant=True)
    # auto with no backend able: the tiny default shapes (head size 16) have no cpu decode kernel
    small = make_tiny_model(model_path + "-16", "llama")
    with pytest.raises(ValueError, match=r"--batch-invariant needs .*cpu cannot \(its decode kernel .*16.*torch "
                                         r"cannot .*Drop --batch-invariant"):
        LLM(str(small), device="cpu", batch_invariant=True)


def test_the_flag_and_vllms_environment_variable(monkeypatch):
    parse = build_parser().parse_args
    assert engine_args_from(parse(["serve", "m", "--batch-invariant"])).batch_invariant is True
    args = engine_args_from(parse(["serve", "m"]))
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert args._batch_invariant() is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert args._batch_invariant() is True
    assert EngineArgs(model="m", batch_invariant=False)._batch_invariant() is False  # the flag wins
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT must be 0 or 1, got 'yes'"):
        args._batch_invariant()
