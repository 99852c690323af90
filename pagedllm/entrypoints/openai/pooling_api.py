"""The pooling runner's routes' work (--runner pooling): OpenAI's `/v1/embeddings`, and vLLM's `/v1/score` and
`/v1/rerank` (Jina's and Cohere's shape) over a cross-encoder or an embedding model (scoring.py pairs them). Each
prompt is one engine request: they batch continuously with every other request of the server."""
from __future__ import annotations

import base64
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import Request
from pydantic import Field, field_validator

from pagedllm.entrypoints.openai.bodies import Body
from pagedllm.entrypoints.openai.errors import APIError, param_of
from pagedllm.entrypoints.openai.protocol import LenientModel, NonEmptyStr
from pagedllm.entrypoints.openai.serving import ServingContext, _collect, _completion_prompts, _start
from pagedllm.entrypoints.scoring import check_scores, cosine_scores, pair_prompt, score_pairs
from pagedllm.errors import InvalidParameterError
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

Text = NonEmptyStr
TokenIds = Annotated[list[int], Field(min_length=1)]
Texts = Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
TruncateTokens = Annotated[int, Field(ge=-1)]


class _PoolingRequest(LenientModel):
    model: str | None = None
    truncate_prompt_tokens: TruncateTokens | None = None  # vLLM's: keep each prompt's last N tokens (-1: max_model_len)
    priority: int = 0

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (max_model_len) or >= 1")
        return value


class EmbeddingRequest(_PoolingRequest):
    input: Texts
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None  # vLLM's: None is the model's pooler config


class ClassificationRequest(_PoolingRequest):
    input: Texts
    add_special_tokens: bool = True
    use_activation: bool | None = None


class ScoreRequest(_PoolingRequest):
    text_1: Texts
    text_2: Texts
    use_activation: bool | None = None


class RerankRequest(_PoolingRequest):
    query: Text | TokenIds
    documents: Annotated[list[Text], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    top_n: Annotated[int, Field(ge=0)] = 0  # 0: every document
    return_documents: bool = True
    use_activation: bool | None = None


class PoolingUsage(Body):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(Body):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32 (encoding_format base64)


class EmbeddingResponse(Body):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreData(Body):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(Body):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class ClassificationData(Body):
    index: int
    label: str | None  # the highest probability's label (the checkpoint's id2label)
    probs: list[float]
    num_classes: int


class ClassificationResponse(Body):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class RerankDocument(Body):
    text: str | None = None
    token_ids: list[int] | None = None


class RerankResult(Body):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(Body):
    total_tokens: int


class RerankResponse(Body):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


def _pooler_for(ctx: ServingContext, api: str, task: str | None):
    """The served model's pooler config, if it gives what `api` needs (`task`; None: scores)."""
    pooler = ctx.engine.engine.config.model.pooler
    try:
        if task is None:
            check_scores(pooler)
        elif pooler is None or pooler.task != task:
            what = "an embedding model" if task == "embed" else "a classifier"
            raise InvalidParameterError("model", f"it needs {what} served with --runner pooling"
                                                 f"{'' if pooler is None else f'; this one is {pooler.describe()}'}.")
    except InvalidParameterError as e:
        raise APIError(400, f"The model does not support the {api} API: {e}", "model") from None
    return pooler


async def _prompt_ids(ctx: ServingContext, prompt: str | dict, keep: int | None, add_special_tokens: bool,
                      param: str = "input") -> dict:
    """A prompt as {"prompt", "prompt_token_ids"}, its last `keep` tokens only when truncated."""
    if isinstance(prompt, str):
        if keep is None:
            ids = await ctx.tokenize(prompt, param, add_special_tokens)
        else:  # (the whole text is tokenized: its end is kept)
            tokenizer = ctx._tokenizer()
            ids = await ctx.run(lambda: tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        prompt = {"prompt": prompt, "prompt_token_ids": ids}
    if keep is not None:
        keep = ctx.max_model_len if keep == -1 else keep
        prompt = {**prompt, "prompt_token_ids": prompt["prompt_token_ids"][-keep:]}
    return prompt


async def _pool(ctx: ServingContext, prefix: str, prompts: list, params: PoolingParams, body: _PoolingRequest,
                raw: Request, add_special_tokens: bool = True, param: str = "input") -> list[PoolingRequestOutput]:
    """Every prompt pooled, in order (a client that leaves aborts them all)."""
    with ctx.admit() as admission:
        prompts = [await _prompt_ids(ctx, p, body.truncate_prompt_tokens, add_special_tokens, param) for p in prompts]
        streams = await _start(ctx, prefix, prompts, params, priority=body.priority, admission=admission, raw=raw,
                               prompt_param=param)
    return await _collect(streams, raw)


def _pooling_params(**fields: Any) -> PoolingParams:
    try:
        return PoolingParams(**fields)
    except ValueError as e:
        raise APIError(400, str(e), param_of(e)) from None


def _usage(outputs: list[PoolingRequestOutput]) -> int:
    return sum(len(o.prompt_token_ids) for o in outputs)


async def create_embeddings(ctx: ServingContext, body: EmbeddingRequest, raw: Request) -> EmbeddingResponse:
    model = ctx.model_name(body.model)
    _pooler_for(ctx, "Embeddings", "embed")
    params = _pooling_params(task="embed", dimensions=body.dimensions, normalize=body.normalize)
    prompts = _completion_prompts(body.input, "input")
    outputs = await _pool(ctx, "embd", prompts, params, body, raw, body.add_special_tokens)
    data = [EmbeddingData(index=i, embedding=_encoded(o.outputs.data, body.encoding_format))
            for i, o in enumerate(outputs)]
    tokens = _usage(outputs)
    return EmbeddingResponse(id=f"embd-{uuid.uuid4().hex}", created=int(time.time()), model=model, data=data,
                             usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))


async def create_classification(ctx: ServingContext, body: ClassificationRequest,
                                raw: Request) -> ClassificationResponse:
    """vLLM's /classify: each input's class probabilities (a sequence classifier's), with its top label."""
    model = ctx.model_name(body.model)
    _pooler_for(ctx, "Classification", "classify")
    params = _pooling_params(task="classify", use_activation=body.use_activation)
    outputs = await _pool(ctx, "classify", _completion_prompts(body.input, "input"), params, body, raw,
                          body.add_special_tokens)
    labels = getattr(ctx.engine.engine.config.model.hf_config, "id2label", None) or {}
    data = []
    for i, o in enumerate(outputs):
        probs = o.outputs.probs
        top = max(range(len(probs)), key=probs.__getitem__)
        data.append(ClassificationData(index=i, label=labels.get(top, labels.get(str(top))), probs=probs,
                                       num_classes=len(probs)))
    tokens = _usage(outputs)
    return ClassificationResponse(id=f"classify-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                                  data=data, usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _encoded(vector, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # what the openai SDK asks for by default, and decodes with numpy
        return base64.b64encode(vector.float().numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def _scores(ctx: ServingContext, pairs: list, body: _PoolingRequest, raw: Request, prefix: str,
                  api: str, names: tuple[str, str]) -> tuple[list[float], int]:
    """Each pair's relevance and the prompt tokens read: a cross-encoder's score of the pair as one prompt, or the
    cosine similarity of an embedding model's vectors of its two sides."""
    pooler = _pooler_for(ctx, api, None)
    if pooler.task == "classify":
        try:
            prompts = [await ctx.run(pair_prompt, ctx.engine.engine.tokenizer, pooler, q, d) for q, d in pairs]
        except InvalidParameterError as e:
            raise APIError(400, str(e), e.param) from None
        params = _pooling_params(task="classify", use_activation=getattr(body, "use_activation", None))
        outputs = await _pool(ctx, prefix, prompts, params, body, raw, param=names[0])
        return [o.outputs.score for o in outputs], _usage(outputs)
    # An embedding model: each distinct text (a rerank's query, once) embedded once, then each pair's cosine.
    distinct = {_key(side): side for pair in pairs for side in pair}
    sides = [_completion_prompts(side, names[0])[0] for side in distinct.values()]
    outputs = await _pool(ctx, prefix, sides, _pooling_params(task="embed"), body, raw, param=names[0])
    vector = {key: o.outputs.data for key, o in zip(distinct, outputs)}
    return cosine_scores([vector[_key(q)] for q, _ in pairs], [vector[_key(d)] for _, d in pairs]), _usage(outputs)


def _key(side: str | list[int]) -> str | tuple[int, ...]:
    return side if isinstance(side, str) else tuple(side)


def _pairs(first, second, names: tuple[str, str]) -> list:
    try:
        return score_pairs(first, second, names)
    except InvalidParameterError as e:
        raise APIError(400, str(e), e.param) from None


async def create_score(ctx: ServingContext, body: ScoreRequest, raw: Request) -> ScoreResponse:
    model = ctx.model_name(body.model)
    names = ("text_1", "text_2")
    scores, tokens = await _scores(ctx, _pairs(body.text_1, body.text_2, names), body, raw, "score", "Score", names)
    return ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                         data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                         usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))


async def create_rerank(ctx: ServingContext, body: RerankRequest, raw: Request) -> RerankResponse:
    model = ctx.model_name(body.model)
    if not body.documents:
        raise APIError(400, "documents must hold at least one document", "documents")
    names = ("query", "documents")
    scores, tokens = await _scores(ctx, _pairs(body.query, body.documents, names), body, raw, "rerank", "Rerank",
                                   names)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or None]
    results = []
    for i in order:
        doc = body.documents[i]
        document = None
        if body.return_documents:
            document = RerankDocument(text=doc) if isinstance(doc, str) else RerankDocument(token_ids=doc)
        results.append(RerankResult(index=i, relevance_score=scores[i], document=document))
    return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model, results=results,
                          usage=RerankUsage(total_tokens=tokens))
