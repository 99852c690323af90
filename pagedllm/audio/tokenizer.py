"""The audio tokenizer (codec): waveforms <-> codes, through transformers' HiggsAudioV2TokenizerModel.

`--audio-tokenizer-type NAME|PATH` names it: a folder in HF format (config.json, model_type
`higgs_audio_v2_tokenizer`, safetensors), a hub name already in the local HF cache, or a config
preset (pagedllm/model_configs/higgs-audio-v2-tokenizer.json: the real tokenizer's shape, for
`pagedllm plan` and `--load-format dummy`). `--audio-tokenizer-path` gives the folder explicitly.

It runs in float32 on the engine's device: it is small beside the LLM (200M parameters, 0.8 GB),
the reference runs it in float32 (its checkpoint is float32), and its encoder picks each code as
the nearest codebook entry, where bfloat16 rounding flips near ties and so changes the prompt's codes.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedllm.audio.io import resample
from pagedllm.audio.torchaudio_compat import ensure_torchaudio
from pagedllm.model_executor.model_files import (
    hub_cache_dir,
    preset_config,
    weight_files,
)

logger = logging.getLogger(__name__)

AUDIO_TOKENIZER_DTYPE = torch.float32
MODEL_TYPE = "higgs_audio_v2_tokenizer"


@dataclass(frozen=True)
class AudioTokenizerSource:
    """Where an audio tokenizer comes from: a folder with weights, or a bare config (no weights)."""

    name: str  # as the user named it
    path: Path  # the folder, or a config .json file

    @property
    def has_weights(self) -> bool:
        return self.path.is_dir() and bool(weight_files(self.path))


def resolve_audio_tokenizer(name: str, path: str | None = None, revision: str | None = None
                            ) -> AudioTokenizerSource:
    """--audio-tokenizer-type / --audio-tokenizer-path -> the files. Order: an explicit path, a local
    folder or config file, the local HF cache, then a preset of the same name (shapes only)."""
    if path is not None:
        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"--audio-tokenizer-path {path}: no config.json there")
        return AudioTokenizerSource(name or path, folder)
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"audio tokenizer folder {local} has no config.json")
        return AudioTokenizerSource(name, local)
    if local.is_file() and local.suffix == ".json":
        return AudioTokenizerSource(name, local)
    cached = _from_hub_cache(name, revision)
    if cached is not None:
        return AudioTokenizerSource(name, cached)
    preset = preset_config(name)
    if preset is not None and _model_type(preset) == MODEL_TYPE:
        return AudioTokenizerSource(name, preset)
    raise FileNotFoundError(
        f"audio tokenizer {name!r} is neither a folder, nor in the local Hugging Face cache ({hub_cache_dir()}), "
        f"nor a preset (higgs-audio-v2-tokenizer). Pass a folder with config.json and *.safetensors.")


def _from_hub_cache(name: str, revision: str | None) -> Path | None:
    if name.count("/") != 1:
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, revision=revision, local_files_only=True, cache_dir=hub_cache_dir()))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def _model_type(config_file: Path) -> str | None:
    try:
        return json.loads(config_file.read_text()).get("model_type")
    except (OSError, json.JSONDecodeError):
        return None


def load_audio_tokenizer_config(source: AudioTokenizerSource):
    """The HiggsAudioV2TokenizerConfig of a folder or config file (refusing other model types by name)."""
    from transformers.models.higgs_audio_v2_tokenizer import HiggsAudioV2TokenizerConfig

    config_file = source.path / "config.json" if source.path.is_dir() else source.path
    raw = json.loads(config_file.read_text())
    if raw.get("model_type") != MODEL_TYPE:
        raise ValueError(f"audio tokenizer {source.name!r}: config.json has model_type {raw.get('model_type')!r}; "
                         f"pagedllm loads {MODEL_TYPE!r} (transformers' HiggsAudioV2TokenizerModel) only")
    raw.pop("model_type")
    return HiggsAudioV2TokenizerConfig.from_dict(raw)


def audio_tokenizer_class():
    """transformers' HiggsAudioV2TokenizerModel, imported from its module: the package's lazy
    top-level name decides once whether torchaudio exists, before our stand-in may be registered."""
    ensure_torchaudio()
    from transformers.models.higgs_audio_v2_tokenizer.modeling_higgs_audio_v2_tokenizer import (
        HiggsAudioV2TokenizerModel,
    )
    return HiggsAudioV2TokenizerModel


class AudioTokenizer:
    """One loaded codec. `encode` and `decode` are blocking torch calls: the server runs them on one
    worker thread, one at a time, so its memory peak is the one planned."""

    def __init__(self, model, name: str) -> None:
        self.model = model
        self.name = name

    @classmethod
    def load(cls, source: AudioTokenizerSource, device: str | torch.device, dummy: bool = False) -> AudioTokenizer:
        """Weights from the folder; random ones (seeded) only when `dummy` (a bare config, --load-format dummy)."""
        model_cls = audio_tokenizer_class()
        if source.has_weights and not dummy:
            model = model_cls.from_pretrained(str(source.path), dtype=AUDIO_TOKENIZER_DTYPE)
        elif dummy:
            torch.manual_seed(0)
            model = model_cls(load_audio_tokenizer_config(source)).to(AUDIO_TOKENIZER_DTYPE)
            randomize_codebooks(model, seed=0)
        else:
            raise FileNotFoundError(f"audio tokenizer {source.name!r} ({source.path}) has no weights: pass a folder "
                                    f"with *.safetensors, or --load-format dummy for random weights")
        return cls(model.to(device).eval(), source.name)

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def sampling_rate(self) -> int:
        return int(self.config.sample_rate)

    @property
    def num_codebooks(self) -> int:
        return int(self.config.num_quantizers)

    @property
    def codebook_size(self) -> int:
        return int(self.config.codebook_size)

    @property
    def frame_rate(self) -> int:
        return int(self.config.frame_rate)

    @property
    def hop_length(self) -> int:
        return int(self.config.hop_length)

    @property
    def weight_bytes(self) -> int:
        return module_bytes(self.model)

    @torch.inference_mode()
    def encode(self, samples: np.ndarray, sampling_rate: int) -> torch.Tensor:
        """Mono float32 samples at `sampling_rate` -> codes (frames, num_codebooks), int64 on the CPU."""
        samples = resample(np.asarray(samples, dtype=np.float32), sampling_rate, self.sampling_rate)
        x = torch.from_numpy(np.ascontiguousarray(samples)).to(self.device, AUDIO_TOKENIZER_DTYPE)
        codes = self.model.encode(x[None, None], return_dict=False)  # (1, K, frames)
        return codes[0].T.contiguous().cpu()

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> np.ndarray:
        """Codes (frames, num_codebooks) -> mono float32 samples at `sampling_rate`."""
        codes = torch.as_tensor(codes, dtype=torch.long)
        if codes.ndim != 2 or codes.shape[1] != self.num_codebooks:
            raise ValueError(f"codes must have shape (frames, {self.num_codebooks}), got {tuple(codes.shape)}")
        if codes.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        audio = self.model.decode(codes.T[None].to(self.device), return_dict=False)  # (1, 1, samples)
        return audio[0, 0].float().cpu().numpy()


def module_bytes(model: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (shared tensors once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.device, t.data_ptr()) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def randomize_codebooks(model: torch.nn.Module, seed: int) -> None:
    """transformers initialises codebooks to zeros (they come from the checkpoint), which makes every
    code 0. Random codebooks give a random-weight codec that spreads its codes, for dummy weights and tests."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in model.quantizer.quantizers:
            q.codebook.embed.copy_(torch.randn(q.codebook.embed.shape, generator=g))
