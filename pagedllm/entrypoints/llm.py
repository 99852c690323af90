"""The offline LLM class: vLLM's interface over LLMEngine."""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from tqdm.auto import tqdm

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.entrypoints.scoring import Text, check_scores, cosine_scores, pair_prompt, score_pairs
from pagedllm.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def load_tokenizer(name_or_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(name_or_path))


class LLM:
    """Generate from a Hugging Face-format model folder (or the built-in demo model when model=None).

    Takes vLLM's constructor arguments; an argument pagedllm does not know is an error, never ignored.
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(
                f"LLM() got unsupported argument(s) {sorted(unknown)}. Supported: {sorted(EngineArgs.field_names())}")
        args = EngineArgs(model=model, **kwargs)
        config = args.create_engine_config()
        tokenizer = load_tokenizer(config.model.tokenizer) if config.model.tokenizer else None
        self.llm_engine = LLMEngine(config, tokenizer)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (their processes exit). The LLM is unusable after."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def memory_plan(self):
        return self.llm_engine.memory_plan

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of the prompts. One SamplingParams for all, or one per prompt.
        `priority`: one per prompt (vLLM's: lower is more important; decides who is preempted first)."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; "
                                 f"pass one, or one per prompt")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts; pass one per prompt")
        return self._run(prompts, params_list, use_tqdm, priorities)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text, ids = self.llm_engine.apply_chat_template(conv, chat_template, add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    # -- the pooling runner (--runner pooling): embeddings, classifiers, scores ----------------------------------
    def encode(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
               use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Each prompt's pooled output, in the order of the prompts (a pooling model's: embeddings or probabilities).
        `truncate_prompt_tokens`: keep each prompt's last N tokens (-1: max_model_len)."""
        pooler = self.llm_engine.config.model.pooler
        params = pooling_params or PoolingParams(pooler.task if pooler is not None else "embed")
        prompts = [self._truncated(p, truncate_prompt_tokens) for p in _prompt_list(prompts)]
        return self._run(prompts, [params] * len(prompts), use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Embeddings (`out.outputs.embedding`), of an embedding model."""
        return self.encode(prompts, pooling_params or PoolingParams("embed"), use_tqdm, truncate_prompt_tokens)

    def classify(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
                 use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """A classifier's probabilities (`out.outputs.probs`)."""
        return self.encode(prompts, pooling_params or PoolingParams("classify"), use_tqdm, truncate_prompt_tokens)

    def score(self, data_1: Text | list[Text], data_2: Text | list[Text], use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Relevance of each pair (`out.outputs.score`), vLLM's pairing (scoring.score_pairs): a cross-encoder reads
        each pair as one prompt; an embedding model scores the cosine similarity of the two sides' embeddings."""
        pooler = self.llm_engine.config.model.pooler
        check_scores(pooler)
        pairs = score_pairs(data_1, data_2, ("data_1", "data_2"))
        if pooler.task == "classify":
            tokenizer = self.llm_engine.tokenizer
            prompts = [pair_prompt(tokenizer, pooler, q, d) for q, d in pairs]
            return self.classify(prompts, None, use_tqdm, truncate_prompt_tokens)
        embedded = self.embed([side for pair in pairs for side in pair], None, use_tqdm, truncate_prompt_tokens)
        scores = cosine_scores([e.outputs.data for e in embedded[0::2]], [e.outputs.data for e in embedded[1::2]])
        return [PoolingRequestOutput(f"score-{i}", None, q.prompt_token_ids + d.prompt_token_ids,
                                     PoolingOutput(torch.tensor([s])))
                for i, (q, d, s) in enumerate(zip(embedded[0::2], embedded[1::2], scores))]

    def _truncated(self, prompt: PromptType, keep: int | None) -> PromptType:
        if keep is None:
            return prompt
        if keep == -1:
            keep = self.llm_engine.config.model.max_model_len
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"truncate_prompt_tokens must be -1 (max_model_len) or an integer >= 1, got {keep!r}.")
        _, ids = self.llm_engine.tokenize_prompt(prompt)
        return {"prompt_token_ids": ids[-keep:]}

    def _run(self, prompts: list, params_list: list[SamplingParams | PoolingParams], use_tqdm: bool,
             priorities: list[int] | None = None) -> list[RequestOutput | PoolingRequestOutput]:
        engine = self.llm_engine
        ids = []
        priorities = priorities or [0] * len(prompts)
        try:
            for prompt, params, priority in zip(prompts, params_list, priorities):
                ids.append(engine.add_request(None, prompt, params, priority=priority))
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, unit="req") as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[rid] for rid in ids]


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list:
    """One prompt (a text, a dict, a list of token ids) or several, as a list."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        return [prompts]
    return list(prompts)
