"""The pooling runner (--runner pooling) against transformers on the same weights, fp32: embeddings pooled as the
checkpoint says (last token, mean, first token; normalised; a Matryoshka cut), for batched prompts of mixed lengths
split into prefill chunks, from text and from token ids; a sequence classifier's probabilities and a cross-encoder's
scores; Qwen3-Reranker's yes/no scoring; the refusals of a runner asked for the other kind of work; the memory plan's
prefill-only KV cache."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM
from pagedllm.entrypoints.scoring import pair_prompt
from pagedllm.errors import InvalidParameterError
from pagedllm.pooler_config import (
    PoolerConfig,
    parse_pooler_config,
    resolve_runner,
    sentence_transformers_pooling,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from tests.pooling_helpers import make_tiny_classifier, make_tiny_embedding_model

TEXTS = ["hello world", "a much longer sentence about embeddings, pooling and chunked prefill " * 3, "x",
         "the quick brown fox jumps over the lazy dog"]
TOL = 1e-5
CHUNK = 16  # max_num_batched_tokens: the longer prompts are computed in several chunks, beside the others


@pytest.fixture(scope="module")
def hf_base(tiny_models):
    from transformers import AutoModel, AutoTokenizer

    path = tiny_models["qwen3"]
    return AutoModel.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def _states(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_embeddings_equal_transformers_pooled_states(tiny_models, hf_base, pooling):
    model, tokenizer = hf_base
    overrides = None if pooling == "LAST" else json.dumps({"pooling_type": pooling})
    with LLM(str(tiny_models["qwen3"]), runner="pooling", pooler_config=overrides, dtype="float32",
             max_num_batched_tokens=CHUNK) as llm:
        assert llm.llm_engine.config.model.pooler.pooling_type == pooling
        outs = llm.embed(TEXTS, use_tqdm=False)
    lengths = set()
    for text, out in zip(TEXTS, outs):
        ids = tokenizer(text)["input_ids"]
        assert out.prompt_token_ids == ids
        lengths.add(len(ids))
        states = _states(model, ids)
        pooled = {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[pooling]
        ref = F.normalize(pooled, dim=-1)
        assert out.outputs.data.shape == (64,)
        assert torch.allclose(out.outputs.data, ref, atol=TOL, rtol=0), (pooling, len(ids))
    assert max(lengths) > 3 * CHUNK and min(lengths) < CHUNK  # mixed lengths, chunked prefill


def test_a_sentence_transformers_checkpoint_pools_as_its_modules_say(tmp_path, hf_base):
    """A bare Qwen3Model checkpoint (no `model.` prefix, no LM head) with mean pooling in modules.json: served as an
    embedding model with no flag; token-id prompts embed as their text does."""
    from transformers import AutoModel, AutoTokenizer

    path = make_tiny_embedding_model(tmp_path / "st", pooling="MEAN")
    assert sentence_transformers_pooling(path) == ("MEAN", True)
    model, tokenizer = AutoModel.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)
    with LLM(str(path), dtype="float32", max_num_batched_tokens=CHUNK) as llm:
        pooler = llm.llm_engine.config.model.pooler
        assert (pooler.task, pooler.pooling_type, pooler.normalize) == ("embed", "MEAN", True)
        assert "sentence-transformers" in pooler.source
        ids = [tokenizer(t)["input_ids"] for t in TEXTS]
        by_text = llm.embed(TEXTS, use_tqdm=False)
        by_ids = llm.embed([{"prompt_token_ids": i} for i in ids], use_tqdm=False)
    for i, a, b in zip(ids, by_text, by_ids):
        ref = F.normalize(_states(model, i).mean(0), dim=-1)
        assert torch.allclose(a.outputs.data, ref, atol=TOL, rtol=0)
        assert torch.equal(a.outputs.data, b.outputs.data)


def test_matryoshka_dimensions_cut_then_normalise(tiny_models, hf_base):
    model, tokenizer = hf_base
    with LLM(str(tiny_models["qwen3"]), runner="pooling", dtype="float32",
             hf_overrides={"matryoshka_dimensions": [16, 32, 64]}) as llm:
        out = llm.embed(TEXTS[:2], PoolingParams(dimensions=16), use_tqdm=False)
        with pytest.raises(InvalidParameterError, match=r"one of \[16, 32, 64\]"):
            llm.embed("x", PoolingParams(dimensions=20), use_tqdm=False)
    for text, o in zip(TEXTS, out):
        ref = F.normalize(_states(model, tokenizer(text)["input_ids"])[-1][:16], dim=-1)
        assert o.outputs.data.shape == (16,) and torch.allclose(o.outputs.data, ref, atol=TOL, rtol=0)
    with LLM(str(tiny_models["qwen3"]), runner="pooling", dtype="float32") as llm:
        with pytest.raises(InvalidParameterError, match="Matryoshka"):
            llm.embed("x", PoolingParams(dimensions=16), use_tqdm=False)


def test_a_sequence_classifier_equals_transformers(tmp_path):
    """Three labels: softmax of the score head on the last token's state; a prompt chunked or not."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_tiny_classifier(tmp_path / "cls3", num_labels=3)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with LLM(str(path), dtype="float32", max_num_batched_tokens=CHUNK) as llm:
        pooler = llm.llm_engine.config.model.pooler
        assert (pooler.task, pooler.head, pooler.num_labels) == ("classify", "score", 3)
        outs = llm.classify(TEXTS, use_tqdm=False)
        with pytest.raises(InvalidParameterError, match="single-label"):
            llm.score("a", "b", use_tqdm=False)
    for text, out in zip(TEXTS, outs):
        with torch.no_grad():
            ref = torch.softmax(hf(torch.tensor([tokenizer(text)["input_ids"]])).logits[0], dim=-1)
        assert torch.allclose(torch.tensor(out.outputs.probs), ref, atol=TOL, rtol=0)


def test_a_cross_encoder_scores_pairs_as_transformers(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_tiny_classifier(tmp_path / "cross", num_labels=1)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    docs = TEXTS[1:]
    with LLM(str(path), dtype="float32", max_num_batched_tokens=CHUNK) as llm:
        outs = llm.score(TEXTS[0], docs, use_tqdm=False)
        pairwise = llm.score(TEXTS[:2], docs[:2], use_tqdm=False)
        with pytest.raises(InvalidParameterError, match="data_1 has 2 items and data_2 3"):
            llm.score(TEXTS[:2], docs, use_tqdm=False)
    for doc, out in zip(docs, outs):
        ids = tokenizer(text=TEXTS[0], text_pair=doc)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = torch.sigmoid(hf(torch.tensor([ids])).logits[0, 0])
        assert math.isclose(out.outputs.score, float(ref), abs_tol=TOL)
    assert math.isclose(pairwise[0].outputs.score, outs[0].outputs.score, abs_tol=TOL)


def test_qwen3_reranker_scores_yes_against_no(tiny_models):
    """vLLM's recipe for Qwen3-Reranker (a causal LM): its LM head's yes and no rows score the model card's prompt,
    P(yes) of softmax(no, yes) at the last token. (The tiny vocabulary has no "yes" / "no": two of its tokens stand
    in for them.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_models["qwen3"]
    label_tokens = ["he", "me"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": label_tokens,
                 "is_original_qwen3_reranker": True}
    with LLM(str(path), dtype="float32", hf_overrides=overrides, max_num_batched_tokens=64) as llm:
        pooler = llm.llm_engine.config.model.pooler
        assert (pooler.head, pooler.num_labels, pooler.qwen3_reranker) == ("tokens", 1, True)
        outs = llm.score("what is a fox?", TEXTS, use_tqdm=False)
    no, yes = tokenizer.convert_tokens_to_ids(label_tokens)
    for doc, out in zip(TEXTS, outs):
        ids = pair_prompt(tokenizer, pooler, "what is a fox?", doc)["prompt_token_ids"]
        assert out.prompt_token_ids == ids and "<Document>: " + doc in tokenizer.decode(ids)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        ref = torch.softmax(torch.stack([logits[no], logits[yes]]), dim=0)[1]
        assert math.isclose(out.outputs.score, float(ref), abs_tol=TOL)


def test_an_embedding_model_scores_by_cosine_similarity(tiny_models):
    with LLM(str(tiny_models["qwen3"]), runner="pooling", dtype="float32") as llm:
        scores = llm.score(TEXTS[0], TEXTS, use_tqdm=False)
        vectors = llm.embed(TEXTS, use_tqdm=False)
    assert math.isclose(scores[0].outputs.score, 1.0, abs_tol=1e-6)
    for s, v in zip(scores, vectors):
        ref = F.cosine_similarity(vectors[0].outputs.data, v.outputs.data, dim=0)
        assert math.isclose(s.outputs.score, float(ref), abs_tol=1e-6)


def test_each_runner_refuses_the_other_kind_of_request(tiny_models):
    with LLM(str(tiny_models["qwen3"]), runner="pooling", dtype="float32") as llm:
        with pytest.raises(InvalidParameterError, match="does not generate"):
            llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(InvalidParameterError, match="not classify"):
            llm.classify("hi", use_tqdm=False)
        # A prompt may fill the whole context (nothing is generated after it), not one token more.
        max_len = llm.llm_engine.config.model.max_model_len
        assert len(llm.embed([1] * max_len, use_tqdm=False)[0].outputs.data) == 64
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            llm.embed([1] * (max_len + 1), use_tqdm=False)
        assert llm.embed([1] * (max_len + 1), truncate_prompt_tokens=-1, use_tqdm=False)[0].prompt_token_ids == \
            [1] * max_len
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.kv_cache.pool.num_used_blocks == 0  # every pooled request gave its blocks back
    with LLM(str(tiny_models["qwen3"]), dtype="float32") as llm:
        with pytest.raises(InvalidParameterError, match="--runner pooling"):
            llm.embed("hi", use_tqdm=False)


def test_the_memory_plan_holds_prompts_only(tiny_models):
    """No decode KV: the cache is capped at one max_model_len prompt plus one step's batch (each request's last
    block part-full), where the generate runner's cap is max_num_seqs whole sequences."""
    kwargs = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    with LLM(str(tiny_models["qwen3"]), runner="pooling", **kwargs) as llm:
        plan = llm.memory_plan
        assert plan.settings.pooling and not llm.llm_engine.config.cache.enable_prefix_caching
        assert plan.max_useful_blocks == 256 // 16 + 64 // 16 + 8 == plan.num_blocks
        assert "capped: pooling" in plan.table()
    with LLM(str(tiny_models["qwen3"]), **kwargs) as llm:
        assert llm.memory_plan.num_blocks == 8 * 256 // 16


def test_runner_resolution_and_pooler_config_refusals(tmp_path, tiny_models):
    cfg = type("Cfg", (), {})()
    folder = tiny_models["qwen3"]
    assert resolve_runner("auto", None, "Qwen3ForCausalLM", cfg, folder) is None
    assert resolve_runner("pooling", None, "Qwen3ForCausalLM", cfg, folder) == "embed"
    assert resolve_runner("auto", "score", "Qwen3Model", cfg, folder) == "embed"
    assert resolve_runner("auto", None, "Qwen3ForSequenceClassification", cfg, folder) == "classify"
    with pytest.raises(ValueError, match="contradict"):
        resolve_runner("generate", "embed", "Qwen3ForCausalLM", cfg, folder)
    with pytest.raises(ValueError, match="classifier_from_token"):
        resolve_runner("auto", "score", "Qwen3ForCausalLM", cfg, folder)
    with pytest.raises(ValueError, match="no language-model head"):
        resolve_runner("generate", None, "Qwen3Model", cfg, folder)
    with pytest.raises(ValueError, match=r"keys \['pooling'\] are not supported"):
        parse_pooler_config('{"pooling": "MEAN"}')
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS"):
        parse_pooler_config({"pooling_type": "MAX"})
    dense = make_tiny_embedding_model(tmp_path / "dense")
    modules = json.loads((dense / "modules.json").read_text())
    (dense / "modules.json").write_text(json.dumps(modules + [{"type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="Dense after the transformer is not supported"):
        LLM(str(dense))
    with pytest.raises(ValueError, match="GptOss"):
        LLM(str(tiny_models["gpt_oss"]), runner="pooling")
    assert PoolerConfig("embed", "MEAN", True).describe().startswith("embed: mean-token pooling, normalised")
