"""`pagedllm bench audio`: audio decode speed (frames/s) of an audio model (Higgs Audio v2) in pagedllm
beside transformers' `generate` on the same prompt.

Every backend decodes exactly `--frames` frames greedily after the same prompt (random text tokens,
then the audio-bos token): pagedllm with ignore_eos (no stream eos unless the delay pattern forces
it), transformers with eos_token_id=None (it never stops early). Reported per backend: prefill
seconds (up to the first frame) and decode frames/s over the other frames. pagedllm runs
`--num-prompts` copies in one batch (frames/s counts all of them); transformers runs batch 1.

    pagedllm bench audio --model higgs-audio-v2-3b --load-format dummy --dtype bfloat16 --frames 32 \\
        --backend pagedllm --backend transformers
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

BACKENDS = ["pagedllm", "transformers"]


@dataclass
class AudioBenchResult:
    backend: str
    batch_size: int
    prompt_len: int
    frames: int  # per request
    prefill_s: float  # start to the first frame of every request
    decode_s: float  # first frame to the last
    load_s: float

    @property
    def decode_frames_per_s(self) -> float:
        return self.batch_size * (self.frames - 1) / self.decode_s

    def line(self) -> str:
        return (f"{self.backend} (batch {self.batch_size}): {self.decode_frames_per_s:.2f} frames/s decode "
                f"({self.frames} frames per request, prefill of {self.prompt_len} tokens {self.prefill_s:.2f} s, "
                f"load {self.load_s:.0f} s)")


def bench_prompt(config, prompt_len: int, seed: int) -> list[int]:
    """bos, random text ids (clear of the special ids), audio bos: the model speaks the text."""
    rng = random.Random(seed)
    specials = {config.audio_token_id, config.audio_delay_token_id, config.audio_bos_token_id}
    hi = min(config.vocab_size, 100_000) - 1
    text = [t for t in (rng.randint(10, hi) for _ in range(4 * prompt_len)) if t not in specials][:prompt_len - 2]
    return [config.bos_token_id, *text, config.audio_bos_token_id]


def run_pagedllm(args, prompt: list[int]) -> AudioBenchResult:
    from pagedllm import SamplingParams
    from pagedllm.bench.throughput import make_llm

    start = time.perf_counter()
    llm = make_llm(args)
    load_s = time.perf_counter() - start
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.frames, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, params.clone(max_tokens=3), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    for i in range(args.num_prompts):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": prompt}, params, stream=True)
    first, frames = None, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            frames[out.request_id] = len(out.outputs[0].token_ids)
        if first is None and len(frames) == args.num_prompts:
            first = time.perf_counter()
    end = time.perf_counter()
    if set(frames.values()) != {args.frames}:
        raise RuntimeError(f"pagedllm generated {sorted(set(frames.values()))} frames, not {args.frames}")
    del llm, engine
    gc.collect()
    return AudioBenchResult("pagedllm", args.num_prompts, len(prompt), args.frames, first - start, end - first, load_s)


class _Timestamps:
    """A transformers streamer that notes when each generated step arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _hf_audio_model(args) -> torch.nn.Module:
    """transformers' model: random weights (from_config) for --load-format dummy, else the checkpoint."""
    from transformers import HiggsAudioV2ForConditionalGeneration

    from pagedllm.config import resolve_dtype
    from pagedllm.model_executor.model_files import load_hf_config, resolve_model_path

    path = resolve_model_path(args.model)
    config = load_hf_config(path)
    device = "cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    dtype = resolve_dtype(args.dtype, getattr(config, "dtype", None), device)
    if args.load_format == "dummy":
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = HiggsAudioV2ForConditionalGeneration._from_config(config, dtype=dtype)
    else:
        model = HiggsAudioV2ForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device)
    return model.eval()


def _hf_generate(model, prompt: list[int], frames: int, streamer=None):
    """Greedy; eos_token_id=None so it never stops before `frames` frames."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=frames, eos_token_id=None, streamer=streamer,
                              return_dict_in_generate=True)


def run_transformers(args, prompt: list[int]) -> AudioBenchResult:
    start = time.perf_counter()
    model = _hf_audio_model(args)
    load_s = time.perf_counter() - start
    _hf_generate(model, prompt, 3)  # warm-up
    stamps = _Timestamps()
    start = time.perf_counter()
    got = _hf_generate(model, prompt, args.frames, stamps).sequences.shape[1] - len(prompt)
    if got != args.frames:
        raise RuntimeError(f"transformers generated {got} frames, not {args.frames}")
    del model
    gc.collect()
    first, end = stamps.times[1], stamps.times[-1]  # times[0]: the prompt
    return AudioBenchResult("transformers", 1, len(prompt), args.frames, first - start, end - first, load_s)


def run_in_child(argv: list[str], backend: str) -> AudioBenchResult:
    """One backend in a process of its own: a 3B model twice would not fit in a small host's memory."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "pagedllm", "bench", "audio", *argv, "--only-backend", backend,
               "--output-json", str(out)]
        subprocess.run(cmd, check=True)
        row = json.loads(out.read_text())["results"][0]
    row.pop("decode_frames_per_s")
    return AudioBenchResult(**row)


def build_parser() -> argparse.ArgumentParser:
    from pagedllm.engine.arg_utils import add_engine_args

    p = argparse.ArgumentParser(prog="pagedllm bench audio")
    add_engine_args(p)
    p.add_argument("--backend", choices=BACKENDS, action="append",
                   help="repeat to run both, each in its own process (default: pagedllm)")
    p.add_argument("--only-backend", choices=BACKENDS, default=None, help=argparse.SUPPRESS)  # the child's
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--frames", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=1, help="pagedllm: requests decoded together")
    p.add_argument("--output-json", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(argv)
    backends = [args.only_backend] if args.only_backend else (args.backend or ["pagedllm"])
    if len(backends) > 1:
        results = [run_in_child(argv, b) for b in backends]
    else:
        results = [run_backend(args, backends[0])]
    for result in results if not args.only_backend else []:  # a child's parent reports
        print(result.line(), flush=True)
    if len(results) == 2:
        print(f"pagedllm / transformers: {results[0].decode_frames_per_s / results[1].decode_frames_per_s:.2f}x "
              f"decode frames/s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"settings": vars(args), "results": [asdict(r) | {"decode_frames_per_s": r.decode_frames_per_s}
                                                           for r in results]}, f, indent=2)
    return 0


def run_backend(args, backend: str) -> AudioBenchResult:
    from pagedllm.model_executor.model_files import load_hf_config, resolve_model_path
    from pagedllm.utils import cdiv

    if args.model is None:
        args.model = "higgs-audio-v2-3b"
    config = load_hf_config(resolve_model_path(args.model))
    if args.kv_cache_memory is None and args.num_gpu_blocks_override is None:
        # A KV cache for the bench only, which skips the profile run (a full-budget forward: minutes on a CPU).
        tokens = max(args.max_model_len or config.max_position_embeddings,
                     args.num_prompts * (args.prompt_len + args.frames))
        args.num_gpu_blocks_override = cdiv(tokens, args.block_size)
    prompt = bench_prompt(config, args.prompt_len, args.seed)
    return run_pagedllm(args, prompt) if backend == "pagedllm" else run_transformers(args, prompt)
