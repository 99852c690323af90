"""`pagedllm bench roofline`: this machine's memory bandwidth and matmul rate, the floor of a decode
step they imply for a model at each batch size, and pagedllm's measured step beside it."""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from pagedllm.config import QUANTIZATION_METHODS


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up (page faults, kernel selection)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Read bandwidth from a read-only reduction, and copy bandwidth (read + write bytes counted)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    read = num_bytes / _best_time(lambda: x.sum(), repeats)
    copy = 2 * num_bytes / _best_time(lambda: y.copy_(x), repeats)
    return {"read_bytes_per_s": read, "copy_bytes_per_s": copy}


def measure_matmul(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size**3 / _best_time(lambda: a @ b, repeats)


def decode_floor(num_params: int, weight_bytes: int, kv_bytes_per_token: int, batch: int, context: int,
                 bandwidth: float, flops_rate: float) -> dict:
    """One decode step reads every weight once and each sequence's KV cache; computes 2 flops per
    parameter per token (plus attention, small at these lengths)."""
    bytes_read = weight_bytes + batch * context * kv_bytes_per_token
    flops = 2 * num_params * batch
    t_mem, t_compute = bytes_read / bandwidth, flops / flops_rate
    return {"bytes": bytes_read, "flops": flops, "floor_s": max(t_mem, t_compute),
            "bound": "memory" if t_mem >= t_compute else "compute"}


def measure_decode_step(llm, batch: int, prompt_len: int, steps: int, seed: int) -> float:
    """Mean wall time of a decode step with `batch` running sequences (after their prefill)."""
    from pagedllm import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(seed)
    vocab = engine.config.model.vocab_size
    for _ in range(batch):
        engine.add_request(None, {"prompt_token_ids": [rng.randrange(10, min(vocab, 32000)) for _ in range(prompt_len)]},
                           SamplingParams(temperature=0.0, max_tokens=steps + 3, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()  # a first decode step, not timed
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedllm bench roofline")
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_METHODS), help="as the engine flag")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--bandwidth-bytes", default="1GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if any(b < 1 for b in args.batch_sizes) or args.steps < 1 or args.prompt_len < 1:
        raise ValueError("--batch-sizes, --steps and --prompt-len must be >= 1")

    from pagedllm import LLM
    from pagedllm.engine.arg_utils import parse_size
    from pagedllm.memory.model_size import kv_bytes_per_token, num_params_from_config

    bw = measure_bandwidth(parse_size(args.bandwidth_bytes))
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, quantization=args.quantization,
              max_model_len=args.prompt_len + args.steps + 16, max_num_seqs=max(args.batch_sizes))
    cfg = llm.llm_engine.config.model
    rate = measure_matmul(cfg.dtype)
    num_params = num_params_from_config(cfg.hf_config)
    weights = llm.llm_engine.runner.weight_bytes
    kv_tok = kv_bytes_per_token(cfg.hf_config, cfg.dtype)
    print(f"read bandwidth {bw['read_bytes_per_s'] / 1e9:.1f} GB/s, copy {bw['copy_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"matmul {rate / 1e9:.0f} GFLOP/s ({str(cfg.dtype).removeprefix('torch.')})")
    print(f"{'batch':>5} {'floor ms':>9} {'bound':>8} {'pagedllm ms':>12} {'ratio':>6} {'tok/s':>8} {'% matmul rate':>13}")
    rows = []
    for b in args.batch_sizes:
        floor = decode_floor(num_params, weights, kv_tok, b, args.prompt_len, bw["read_bytes_per_s"], rate)
        measured = measure_decode_step(llm, b, args.prompt_len, args.steps, args.seed)
        achieved = floor["flops"] / measured / rate
        rows.append({"batch": b, **floor, "measured_s": measured, "ratio": measured / floor["floor_s"],
                     "tokens_per_s": b / measured, "fraction_of_matmul_rate": achieved})
        print(f"{b:>5} {floor['floor_s'] * 1000:>9.1f} {floor['bound']:>8} {measured * 1000:>12.1f} "
              f"{measured / floor['floor_s']:>6.2f} {b / measured:>8.1f} {100 * achieved:>12.0f}%", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"settings": vars(args), "bandwidth": bw, "matmul_flops_per_s": rate, "rows": rows}, f, indent=2)
    return 0
