"""How a pooling model turns a prompt's hidden states into its output (vLLM's --runner pooling): which runner a
model gets (--runner, --task), which token states are pooled (last, mean, first: from the checkpoint's
sentence-transformers files, else the architecture's default, else --pooler-config) and what head follows (none for
an embedding, a sequence classifier's `score` matrix, or LM-head rows of label tokens: Qwen3-Reranker's yes/no)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

RUNNERS = ("auto", "generate", "pooling")
# --task, vLLM's names: embed (embedding is its older spelling), classify, score (a cross-encoder's relevance: a
# single-label classifier, or cosine similarity of an embedding model's vectors).
TASKS = ("auto", "generate", "embed", "embedding", "classify", "score")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
POOLER_CONFIG_KEYS = ("pooling_type", "normalize", "use_activation", "activation")
# Architectures whose decoder pagedllm can pool (the Llama family; gpt-oss and the audio model generate only).
POOLABLE = ("Llama", "Mistral", "Qwen2", "Qwen3", "Qwen3Moe", "Mixtral")
SEQUENCE_CLASSIFIERS = {f"{family}ForSequenceClassification": f"{family}ForCausalLM" for family in POOLABLE}
BARE_DECODERS = {f"{family}Model": f"{family}ForCausalLM" for family in POOLABLE}  # embedding checkpoints
# Qwen3-Reranker's prompt (its model card), for `is_original_qwen3_reranker` (vLLM's hf_overrides recipe).
QWEN3_RERANKER_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
                         "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                         "<|im_start|>user\n")
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
RERANKER_RECIPE = ('--hf-overrides \'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
                   '["no", "yes"], "is_original_qwen3_reranker": true}\'')


@dataclass(frozen=True)
class PoolerConfig:
    """A pooling model's output. `head`: none (the pooled state is the embedding), score (a classifier's
    (num_labels, hidden) matrix from the checkpoint) or tokens (that matrix made at load from the LM head's rows of
    `label_token_ids`; with `qwen3_reranker` one row, yes minus no, so its sigmoid is softmax(no, yes)[yes])."""

    task: str  # embed or classify
    pooling_type: str  # LAST, MEAN or CLS
    normalize: bool  # embeddings L2-normalised (after a Matryoshka cut)
    head: str = "none"
    num_labels: int = 0
    label_token_ids: tuple[int, ...] = ()
    use_activation: bool = True  # classify: sigmoid for one label, softmax over several
    matryoshka_dimensions: tuple[int, ...] | None = None  # None: not a Matryoshka model; (): any size
    qwen3_reranker: bool = False
    source: str = "default"  # where pooling_type and normalize came from (the start-up log says)

    def describe(self) -> str:
        head = {"none": "", "score": f", a {self.num_labels}-label classifier",
                "tokens": f", a classifier from the LM head's rows of tokens {list(self.label_token_ids)}"}[self.head]
        norm = ", normalised" if self.task == "embed" and self.normalize else ""
        return f"{self.task}: {self.pooling_type.lower()}-token pooling{norm}{head} ({self.source})"

    @property
    def scores(self) -> bool:
        """Relevance scores (/score, /rerank) come from this model: a single-label classifier, or embeddings."""
        return self.task == "embed" or self.num_labels == 1


def resolve_runner(runner: str, task: str | None, architecture: str, hf_config, path: Path) -> str | None:
    """The pooling task the model runs (embed, classify), or None for the generate runner."""
    task = task or "auto"
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {runner!r}.")
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}; got {task!r}.")
    classifier = architecture in SEQUENCE_CLASSIFIERS or getattr(hf_config, "classifier_from_token", None)
    if task == "generate" or runner == "generate":
        if task not in ("auto", "generate"):
            raise ValueError(f"--runner generate and --task {task} contradict each other: {task} needs the pooling "
                             f"runner (--runner pooling).")
        if architecture in SEQUENCE_CLASSIFIERS or architecture in BARE_DECODERS:
            raise ValueError(f"{architecture} has no language-model head to generate with: serve it with "
                             f"--runner pooling (embeddings, scores).")
        return None
    if task in ("embed", "embedding"):
        return "embed"
    if task == "classify" or (task == "score" and classifier):
        if not classifier:
            raise ValueError(f"--task classify needs a classifier: a *ForSequenceClassification checkpoint, or a "
                             f"causal LM whose label tokens are named (Qwen3-Reranker: {RERANKER_RECIPE}).")
        return "classify"
    if task == "score":
        if architecture in BARE_DECODERS:
            return "embed"  # scores are the cosine similarities of its embeddings
        raise ValueError(f"--task score on {architecture} needs its label tokens: a causal LM scores a pair by the "
                         f"logits of named tokens (Qwen3-Reranker: {RERANKER_RECIPE}); for the cosine similarity of "
                         f"embeddings, use --task embed.")
    # auto: what the checkpoint says it is
    if classifier:
        return "classify"
    if architecture in BARE_DECODERS or runner == "pooling":
        return "embed"
    if sentence_transformers_pooling(path) is not None:
        logger.info("%s holds a sentence-transformers pooling module (modules.json): serving it as an embedding "
                    "model (--runner generate to generate with it)", path)
        return "embed"
    return None


def sentence_transformers_pooling(path: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from a sentence-transformers checkpoint's modules.json, or None if it has none.
    A module after pooling that pagedllm would not run (a Dense projection) is refused rather than skipped."""
    modules_file = path / "modules.json" if path.is_dir() else None
    if modules_file is None or not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling, normalize = None, False
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith(".Pooling"):
            pooling = _pooling_mode(path / module.get("path", ""), path)
        elif kind.endswith(".Normalize"):
            normalize = True
        elif not kind.endswith(".Transformer"):
            raise ValueError(f"{modules_file}: module {kind} after the transformer is not supported (pagedllm runs "
                             f"pooling and normalisation only); it would change every embedding.")
    return None if pooling is None else (pooling, normalize)


def _pooling_mode(folder: Path, path: Path) -> str:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path}: modules.json names a pooling module at {folder} with no config.json")
    modes = json.loads(config_file.read_text())
    on = [k for k, v in modes.items() if k.startswith("pooling_mode_") and v]
    known = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
    if len(on) != 1 or on[0] not in known:
        raise ValueError(f"{config_file}: pooling modes {on or 'none'} are not supported: one of "
                         f"{', '.join(known)} is.")
    return known[on[0]]


def parse_pooler_config(text: str | dict | None) -> dict:
    """--pooler-config (JSON) as a dict of the keys pagedllm reads; an unknown key is refused."""
    text = _json_object(text, "--pooler-config")
    unknown = set(text) - set(POOLER_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"--pooler-config keys {sorted(unknown)} are not supported; these are: "
                         f"{', '.join(POOLER_CONFIG_KEYS)}.")
    pooling_type = text.get("pooling_type")
    if pooling_type is not None and str(pooling_type).upper() not in POOLING_TYPES:
        raise ValueError(f"--pooler-config pooling_type must be one of {', '.join(POOLING_TYPES)}; got "
                         f"{pooling_type!r}.")
    for key in ("normalize", "use_activation", "activation"):
        if key in text and not isinstance(text[key], bool):
            raise ValueError(f"--pooler-config {key} must be true or false, got {text[key]!r}.")
    return text


def pooler_config(task: str, architecture: str, hf_config, path: Path, overrides: dict, tokenizer_path) -> PoolerConfig:
    """The pooler of a model the pooling runner serves for `task` (resolve_runner's answer)."""
    if not any(architecture.startswith(family) for family in POOLABLE) or "GptOss" in architecture:
        raise ValueError(f"--runner pooling: {architecture} cannot be pooled yet (the Llama family can: "
                         f"{', '.join(POOLABLE)}).")
    found = sentence_transformers_pooling(path)
    pooling_type, normalize, source = "LAST", task == "embed", "the architecture's default"
    if found is not None:
        (pooling_type, normalize), source = found, "the checkpoint's sentence-transformers modules"
    if "pooling_type" in overrides or "normalize" in overrides:
        source = "--pooler-config"
    pooling_type = str(overrides.get("pooling_type", pooling_type)).upper()
    normalize = bool(overrides.get("normalize", normalize))
    use_activation = bool(overrides.get("use_activation", overrides.get("activation", True)))
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka = tuple(dims) if dims else (() if getattr(hf_config, "is_matryoshka", False) else None)
    if task == "embed":
        return PoolerConfig("embed", pooling_type, normalize, matryoshka_dimensions=matryoshka, source=source)
    label_tokens = getattr(hf_config, "classifier_from_token", None)
    if not label_tokens:
        num_labels = int(getattr(hf_config, "num_labels", 0) or len(getattr(hf_config, "id2label", None) or ()) or 1)
        return PoolerConfig("classify", pooling_type, False, "score", num_labels, use_activation=use_activation,
                            source=source)
    ids = _label_token_ids(list(label_tokens), tokenizer_path)
    reranker = bool(getattr(hf_config, "is_original_qwen3_reranker", False))
    if reranker and len(ids) != 2:
        raise ValueError(f"is_original_qwen3_reranker scores with two label tokens (no, yes); classifier_from_token "
                         f"names {len(ids)}.")
    num_labels = 1 if reranker else len(ids)
    return PoolerConfig("classify", pooling_type, False, "tokens", num_labels, ids, use_activation,
                        qwen3_reranker=reranker, source=source)


def _label_token_ids(tokens: list, tokenizer_path) -> tuple[int, ...]:
    if not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of token strings, got {tokens!r}.")
    if tokenizer_path is None:
        raise ValueError("classifier_from_token names tokens, and this model has no tokenizer to find them in.")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    ids = []
    for token in tokens:
        encoded = tokenizer.convert_tokens_to_ids(token)
        if encoded is None or encoded == tokenizer.unk_token_id:
            raise ValueError(f"classifier_from_token {token!r} is not one token of this model's vocabulary.")
        ids.append(int(encoded))
    return tuple(ids)


def apply_hf_overrides(hf_config, overrides: str | dict | None) -> dict:
    """--hf-overrides (JSON): set on the model's config as loaded (vLLM's flag: `architectures`,
    `classifier_from_token`, `is_matryoshka`, ...). Returns the overrides applied."""
    overrides = _json_object(overrides, "--hf-overrides")
    for key, value in overrides.items():
        setattr(hf_config, key, value)
    return overrides


def _json_object(value: str | dict | None, flag: str) -> dict:
    """A flag's JSON object (given as text on a command line, as a dict to LLM(...)); None: empty."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(value).__name__}.")
    return value
