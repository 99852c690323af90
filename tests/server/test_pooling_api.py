"""The pooling runner behind the server: the real `openai` SDK's `embeddings.create` (its default base64 encoding and
float), batched inputs of mixed lengths and token ids, equal to the offline engine's (which test_pooling.py checks
against transformers); /v1/score and /v1/rerank over an embedding model (cosine) and over a cross-encoder (its
scores as transformers computes them), in order, top_n; and the refusals, by name: generation on a pooling server,
pooling on a generative one, a Matryoshka cut of a model without one, a prompt over the context."""
from __future__ import annotations

import base64
import math

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.pooling_helpers import make_tiny_classifier
from tests.server.conftest import AUTH, _start_server, _stop_server

TEXTS = ["hello world", "a much longer sentence about embeddings, pooling and chunked prefill " * 3, "x"]


@pytest.fixture(scope="module")
def embed_server(tiny_models, tmp_path_factory):
    proc, url, _ = _start_server(tiny_models["qwen3"], tmp_path_factory.mktemp("embed_server"),
                                 ["--runner", "pooling", "--max-num-batched-tokens", "16"])
    yield url
    _stop_server(proc)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return make_tiny_classifier(tmp_path_factory.mktemp("cross") / "cross", num_labels=1)


@pytest.fixture(scope="module")
def cross_server(cross_encoder, tmp_path_factory):
    proc, url, _ = _start_server(cross_encoder, tmp_path_factory.mktemp("cross_server"), [])
    yield url
    _stop_server(proc)


@pytest.fixture(scope="module")
def offline_embeddings(tiny_models):
    from pagedllm import LLM

    with LLM(str(tiny_models["qwen3"]), runner="pooling", dtype="float32", max_model_len=128) as llm:
        tokenizer = llm.get_tokenizer()
        ids = [tokenizer.encode(t) for t in TEXTS]
        return ids, [o.outputs.data for o in llm.embed(TEXTS, use_tqdm=False)]


def test_the_openai_sdk_embeds_as_the_offline_engine(embed_server, offline_embeddings):
    ids, reference = offline_embeddings
    client = openai.OpenAI(base_url=f"{embed_server}/v1", api_key="none", max_retries=0)
    default = client.embeddings.create(model="tiny", input=TEXTS)  # the SDK asks for base64 and decodes it
    floats = client.embeddings.create(model="alias", input=TEXTS, encoding_format="float")
    by_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    for response in (default, floats, by_ids):
        assert [d.index for d in response.data] == [0, 1, 2]
        assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
        for d, ref in zip(response.data, reference):
            assert np.allclose(d.embedding, ref.numpy(), atol=1e-6, rtol=0)
    assert default.model == "tiny" and floats.model == "alias"
    one = client.embeddings.create(model="tiny", input=ids[0], encoding_format="float")
    assert len(one.data) == 1 and np.allclose(one.data[0].embedding, reference[0].numpy(), atol=1e-6, rtol=0)


def test_base64_is_little_endian_float32(embed_server, offline_embeddings):
    _, reference = offline_embeddings
    body = httpx.post(f"{embed_server}/v1/embeddings", json={"input": TEXTS[2], "encoding_format": "base64"}).json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert len(raw) == 4 * 64 and np.allclose(np.frombuffer(raw, "<f4"), reference[2].numpy(), atol=1e-6, rtol=0)
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"


def test_scores_and_rerank_of_an_embedding_model_are_cosines(embed_server, offline_embeddings):
    _, reference = offline_embeddings
    cosines = [float(torch.nn.functional.cosine_similarity(reference[0], r, dim=0)) for r in reference]
    score = httpx.post(f"{embed_server}/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS}).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2]
    assert all(math.isclose(d["score"], c, abs_tol=1e-5) for d, c in zip(score["data"], cosines))
    rerank = httpx.post(f"{embed_server}/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1}).json()
    best = max((1, 2), key=lambda i: cosines[i])
    assert [r["index"] for r in rerank["results"]] == [best - 1]
    assert rerank["results"][0]["document"] == {"text": TEXTS[best]}
    assert math.isclose(rerank["results"][0]["relevance_score"], cosines[best], abs_tol=1e-5)


def test_a_cross_encoder_reranks_as_transformers_scores(cross_server, cross_encoder):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(cross_encoder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(cross_encoder)
    query, docs = "what is a fox?", TEXTS + ["the quick brown fox"]
    with torch.no_grad():
        ref = [float(torch.sigmoid(hf(torch.tensor([tokenizer(text=query, text_pair=d)["input_ids"]])).logits[0, 0]))
               for d in docs]
    rerank = httpx.post(f"{cross_server}/v1/rerank", json={"model": "tiny", "query": query, "documents": docs},
                        timeout=60).json()
    order = sorted(range(len(docs)), key=lambda i: -ref[i])
    assert [r["index"] for r in rerank["results"]] == order
    assert all(math.isclose(r["relevance_score"], ref[r["index"]], abs_tol=1e-5) for r in rerank["results"])
    score = httpx.post(f"{cross_server}/score", json={"text_1": [query, query], "text_2": docs[:2]}).json()
    assert [round(d["score"], 5) for d in score["data"]] == [round(r, 5) for r in ref[:2]]
    embed = httpx.post(f"{cross_server}/v1/embeddings", json={"input": "x"})
    assert embed.status_code == 400 and "does not support the Embeddings API" in embed.json()["error"]["message"]


def test_refusals_name_what_was_wrong(embed_server, server_url):
    def error(url: str, path: str, body: dict, headers: dict | None = None) -> dict:
        r = httpx.post(f"{url}{path}", json=body, headers=headers or {}, timeout=30)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    chat = error(embed_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert "does not support the Chat Completions API" in chat["message"] and "pooling runner" in chat["message"]
    assert "does not support the Completions API" in error(embed_server, "/v1/completions", {"prompt": "hi"})["message"]
    dims = error(embed_server, "/v1/embeddings", {"input": "hi", "dimensions": 8})
    assert dims["param"] == "dimensions" and "Matryoshka" in dims["message"]
    assert error(embed_server, "/v1/embeddings", {"input": []})["param"] == "input"
    long = error(embed_server, "/v1/embeddings", {"input": [1] * 129})
    assert long["param"] == "input" and "truncate_prompt_tokens" in long["message"]
    kept = httpx.post(f"{embed_server}/v1/embeddings", json={"input": [1] * 129, "truncate_prompt_tokens": 7}).json()
    assert kept["usage"]["prompt_tokens"] == 7
    assert error(embed_server, "/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})["param"] == "text_1"
    generative = error(server_url, "/v1/embeddings", {"model": "tiny", "input": "hi"}, AUTH)
    assert "does not support the Embeddings API" in generative["message"] and "--runner pooling" in generative["message"]
    assert "does not support the Rerank API" in error(server_url, "/v1/rerank", {"query": "a", "documents": ["b"]},
                                                       AUTH)["message"]
    assert "needs a classifier" in error(embed_server, "/classify", {"input": "hi"})["message"]


def test_classify_gives_each_inputs_probabilities_and_label(tmp_path_factory):
    """vLLM's /classify on a 3-label sequence classifier: transformers' softmax probabilities, the top label from
    the checkpoint's id2label; an embedding model's server refuses it by name."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_tiny_classifier(tmp_path_factory.mktemp("cls3") / "cls3", num_labels=3)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    proc, url, _ = _start_server(path, tmp_path_factory.mktemp("cls3_server"), [])
    try:
        body = httpx.post(f"{url}/classify", json={"input": TEXTS}, timeout=60).json()
    finally:
        _stop_server(proc)
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["object"] == "list"
    for text, d in zip(TEXTS, body["data"]):
        with torch.no_grad():
            ref = torch.softmax(hf(torch.tensor([tokenizer(text)["input_ids"]])).logits[0], dim=-1)
        assert d["num_classes"] == 3 and np.allclose(d["probs"], ref.numpy(), atol=1e-5)
        assert d["label"] == hf.config.id2label[int(ref.argmax())]
