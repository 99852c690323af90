"""Finding a model's files: local folders, the local Hugging Face cache, config and weight files."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def resolve_model_path(model: str, revision: str | None = None, allow_download: bool | None = None) -> Path:
    """A folder, a config.json file (for dummy weights), or a hub name found in the local HF cache.

    Downloading from the hub happens only when allowed (not when HF_HUB_OFFLINE is set).
    """
    path = Path(model).expanduser()
    preset = preset_config(model)
    if preset is not None and not path.exists():
        return preset
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        return path
    if path.is_file() and path.suffix == ".json":
        return path
    if _looks_like_a_path(model):
        raise FileNotFoundError(f"no such file or folder: {model}. {_WHAT_A_MODEL_IS}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache_dir = hub_cache_dir()
    try:
        return Path(snapshot_download(model, revision=revision, local_files_only=True, cache_dir=cache_dir))
    except (LocalEntryNotFoundError, ValueError, OSError) as local_err:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        if allow_download is None:
            allow_download = not offline
        if not allow_download:
            raise FileNotFoundError(
                f"model {model!r} is neither a local folder nor in the local Hugging Face cache "
                f"({cache_dir}), and downloading is off (HF_HUB_OFFLINE is set). {_WHAT_A_MODEL_IS}"
            ) from local_err
        logger.info("downloading %s from the Hugging Face hub", model)
        return Path(snapshot_download(
            model, revision=revision, cache_dir=cache_dir,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"],
        ))


PRESETS_DIR = Path(__file__).resolve().parent.parent / "model_configs"


def _looks_like_a_path(model: str) -> bool:
    """A local path, not a hub id ("org/name"): it starts with . / ~, ends with .json, or has two slashes."""
    return model.startswith((".", "/", "~")) or model.endswith(".json") or model.count("/") > 1


class _WhatAModelIs:
    """The sentence every 'model not found' ends with (the presets listed when it is printed)."""

    def __str__(self) -> str:
        return ("A model is a folder with config.json and *.safetensors (and tokenizer files), a config.json to "
                "run with --load-format dummy, a hub name already in the local Hugging Face cache, or one of the "
                f"built-in shapes (random weights with --load-format dummy): {', '.join(preset_names())}.")


_WHAT_A_MODEL_IS = _WhatAModelIs()


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def preset_config(name: str) -> Path | None:
    """config.json shapes of common models shipped with pagedllm ("llama-3.2-3b", "Qwen/Qwen2.5-0.5B"), quantized
    checkpoints' included ("Qwen/Qwen3-8B-FP8", "nvidia/Llama-3.1-8B-Instruct-FP8", "Qwen/Qwen2.5-7B-Instruct-AWQ");
    "-Instruct" and a "Meta-" prefix are not part of the shape's name."""
    stem = name.rsplit("/", 1)[-1].lower().replace("-instruct", "").removeprefix("meta-")
    path = PRESETS_DIR / f"{stem}.json"
    return path if path.is_file() else None


def hub_cache_dir() -> str:
    """The HF hub cache, read from the environment now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    hf_home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface")
    return os.path.join(hf_home, "hub")


def load_hf_config(path: Path):
    """Parse config.json with transformers (which normalises rope settings across versions)."""
    from transformers import AutoConfig, CONFIG_MAPPING

    if path.is_dir():
        return AutoConfig.from_pretrained(path)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    model_type = raw.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{path}: unknown or missing model_type {model_type!r}")
    return CONFIG_MAPPING[model_type].from_dict(raw)


def has_tokenizer(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in TOKENIZER_FILES)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the ones its index names, or all of them."""
    if not path.is_dir():
        return []
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {missing}")
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


def generation_config(path: Path) -> dict:
    """The model folder's generation_config.json ({} without one, or for a bare config.json)."""
    gen = path / "generation_config.json" if path.is_dir() else None
    if gen is None or not gen.is_file():
        return {}
    return json.loads(gen.read_text())


def generation_eos_ids(path: Path) -> set[int]:
    """EOS ids from generation_config.json (a number or a list), if the model has one."""
    eos = generation_config(path).get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}
