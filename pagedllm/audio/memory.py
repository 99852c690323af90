"""The audio tokenizer's memory: its weights and the peak of its largest call, for the memory plan.

Before loading (`pagedllm plan`): the codec is built on the meta device from its config, so its
parameter and buffer bytes are exact, and its two calls are traced there (shapes only, no compute)
while a dispatch mode adds up the bytes of the tensors alive at each op: the peak of the largest
encode (the longest reference audio that fits max_model_len) and of the largest decode
(max_model_len frames). Convolution kernels unfold their input into column buffers the trace
cannot see, so each convolution also counts its column buffer at its moment. Checked on this
project's CPU with the real shape (random weights, 100 frames): decode traced 125 MiB vs 99 MiB
measured (resident-set peak), encode 258 MiB vs 292 MiB; live tensors alone would be 55 and 118 MiB.
In the server the loaded codec is measured on its device by running both calls. Calls run one at a
time (one codec thread), so the plan counts one peak.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import replace

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from pagedllm.audio.tokenizer import (
    AUDIO_TOKENIZER_DTYPE,
    AudioTokenizer,
    AudioTokenizerSource,
    audio_tokenizer_class,
    load_audio_tokenizer_config,
    module_bytes,
    resolve_audio_tokenizer,
)
from pagedllm.memory.plan import ComponentMemory, MemoryPlan
from pagedllm.memory.profiler import measure_peak_bytes
from pagedllm.model_executor.meta import on_meta_device

NAME = "audio tokenizer"


class _LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensors created under this mode that are still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        if func is torch.ops.aten.convolution.default:
            self.peak = max(self.peak, self.current + _conv_workspace_bytes(args, out))
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata  # one entry per storage: views and in-place results add nothing
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(t, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


def _conv_workspace_bytes(args, out: torch.Tensor) -> int:
    """The column buffer a CPU or GPU convolution kernel may unfold its input into (im2col; col2im for a
    transposed one): input channels per group x kernel taps x output length (input length, transposed).
    Kernels allocate it inside the op, so the dispatch mode never sees it as a tensor."""
    x, weight, transposed = args[0], args[1], args[6]
    taps = 1
    for k in weight.shape[2:]:
        taps *= k
    if transposed:  # weight (in, out / groups, k...): the columns of the input before folding
        channels, length = weight.shape[1], x.shape[2:].numel()
    else:  # weight (out, in / groups, k...)
        channels, length = weight.shape[1], out.shape[2:].numel()
    groups = args[8]
    return x.shape[0] * groups * channels * taps * length * x.element_size()


def traced_peak_bytes(fn: Callable[[], object], inputs_bytes: int = 0) -> int:
    """Peak bytes of the tensors `fn` creates (plus its inputs), traced on the meta device."""
    with torch.no_grad(), _LiveTensorBytes() as live:
        fn()
    return live.peak + inputs_bytes


def with_planned_audio_tokenizer(plan: MemoryPlan, name: str | None, path: str | None) -> MemoryPlan:
    """`pagedllm plan --audio-tokenizer-type ...`: the plan with the codec's line, from its config."""
    source = resolve_audio_tokenizer(name or "", path)
    max_len = plan.settings.max_model_len or plan.model.model_max_len
    return replace(plan, components=plan.components + (planned_audio_tokenizer_memory(source, max_len),))


def max_audio_frames(max_model_len: int) -> int:
    """The most frames one call handles: a prompt's reference audio, or a generation, fills at most
    the context (each frame takes one position)."""
    return max_model_len


def planned_audio_tokenizer_memory(source: AudioTokenizerSource, max_model_len: int) -> ComponentMemory:
    """Weights and peak from the config alone (meta device): no weight is read."""
    config = load_audio_tokenizer_config(source)
    with on_meta_device():
        model = audio_tokenizer_class()(config).to(AUDIO_TOKENIZER_DTYPE).eval()
    frames = max_audio_frames(max_model_len)
    return ComponentMemory(NAME, module_bytes(model), _traced_peak(model, frames),
                           f"config shapes; {_peak_of(frames, config.frame_rate, 'traced')}", "float32")


def _traced_peak(model: torch.nn.Module, frames: int) -> int:
    """The larger peak of encoding `frames` frames of audio and decoding `frames` frames of codes."""
    config = model.config
    codes = torch.zeros(1, config.num_quantizers, frames, dtype=torch.long, device="meta")
    wave = torch.zeros(1, 1, frames * config.hop_length, dtype=AUDIO_TOKENIZER_DTYPE, device="meta")
    decode = traced_peak_bytes(lambda: model.decode(codes, return_dict=False), codes.nbytes)
    encode = traced_peak_bytes(lambda: model.encode(wave, return_dict=False), wave.nbytes)
    return max(decode, encode)


def measured_audio_tokenizer_memory(tokenizer: AudioTokenizer, max_model_len: int) -> ComponentMemory:
    """Weights of the loaded codec and the measured peak of its largest encode and decode (traced on
    the meta device where the device's peak cannot be read)."""
    frames = max_audio_frames(max_model_len)
    device = tokenizer.device
    codes = torch.zeros(frames, tokenizer.num_codebooks, dtype=torch.long)
    wave = torch.zeros(frames * tokenizer.hop_length, dtype=AUDIO_TOKENIZER_DTYPE).numpy()
    decode = measure_peak_bytes(lambda: tokenizer.decode(codes), device)
    encode = measure_peak_bytes(lambda: tokenizer.encode(wave, tokenizer.sampling_rate), device)
    if decode is None or encode is None:
        with on_meta_device():
            meta = audio_tokenizer_class()(tokenizer.config).to(AUDIO_TOKENIZER_DTYPE).eval()
        return ComponentMemory(NAME, tokenizer.weight_bytes, _traced_peak(meta, frames),
                               f"measured weights; {_peak_of(frames, tokenizer.frame_rate, 'traced')}", "float32")
    return ComponentMemory(NAME, tokenizer.weight_bytes, max(decode, encode),
                           f"measured; {_peak_of(frames, tokenizer.frame_rate, 'measured')}", "float32")


def _peak_of(frames: int, frame_rate: int, how: str) -> str:
    return f"peak {how}: encoding {frames / frame_rate:.0f} s of audio or decoding {frames} frames"
