"""Tiny pooling checkpoints as the hub ships them, made from a tiny Qwen3 (helpers.make_tiny_model) with
transformers itself: a bare decoder saved as sentence-transformers embedding models are (Qwen3Model tensors with no
`model.` prefix, modules.json + 1_Pooling/config.json + Normalize), and a sequence classifier (a `score` head)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.helpers import make_tiny_model

ST_MODES = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token"}


def _tokenizer_files(source: Path, path: Path) -> None:
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name in ("vocab.json", "merges.txt"):
            shutil.copy(f, path / f.name)


def make_tiny_embedding_model(path: Path, pooling: str = "MEAN", normalize: bool = True, seed: int = 0) -> Path:
    """A sentence-transformers embedding checkpoint: architectures ["Qwen3Model"], bare decoder tensors, its
    pooling mode and normalisation in modules.json."""
    from transformers import AutoModel

    causal = make_tiny_model(path.with_name(path.name + "-causal"), "qwen3", seed=seed)
    AutoModel.from_pretrained(causal, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    _tokenizer_files(causal, path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {mode: mode == ST_MODES[pooling] for mode in ST_MODES.values()}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    return path


def make_tiny_classifier(path: Path, num_labels: int = 1, seed: int = 0) -> Path:
    """A Qwen3ForSequenceClassification checkpoint (a cross-encoder when num_labels is 1) with a random head."""
    from transformers import AutoModelForSequenceClassification

    causal = make_tiny_model(path.with_name(path.name + "-causal"), "qwen3", seed=seed)
    model = AutoModelForSequenceClassification.from_pretrained(causal, dtype=torch.float32, num_labels=num_labels,
                                                               pad_token_id=0)
    with torch.no_grad():
        model.score.weight.copy_(0.3 * torch.randn(model.score.weight.shape,
                                                   generator=torch.Generator().manual_seed(seed + 1)))
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer_files(causal, path)
    return path
