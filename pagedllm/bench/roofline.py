"""`pagedllm bench roofline`: this machine's memory bandwidth and matmul rate, the floor of a decode
step they imply for a model at each batch size, and pagedllm's measured step beside it."""
from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import time

import torch

from pagedllm.config import QUANTIZATION_METHODS
from pagedllm.model_executor.cpu_ops import cpu_has_bf16_arithmetic
from pagedllm.model_executor.moe import FusedMoE


CPU = torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU runs asynchronously; a CPU op is done when it returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, repeats: int, device: torch.device = CPU) -> float:
    fn()  # warm-up (page faults, kernel selection)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5, device: torch.device = CPU) -> dict:
    """Read bandwidth from a read-only reduction, and copy bandwidth (read + write bytes counted)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    read = num_bytes / _best_time(lambda: x.sum(), repeats, device)
    copy = 2 * num_bytes / _best_time(lambda: y.copy_(x), repeats, device)
    return {"read_bytes_per_s": read, "copy_bytes_per_s": copy}


def arithmetic_dtype(dtype: torch.dtype, device: torch.device = CPU) -> torch.dtype:
    """The dtype the engine's Linears multiply in: bf16 runs as fp32 FMAs on a CPU without bf16
    arithmetic (packed_linear's AVX2 path, upcast_linear), where PyTorch's bf16 matmul is a slow
    fallback (a 2048^3 product: ~1 min on a 2-core Zen 3). A GPU multiplies bf16 as bf16."""
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_bf16_arithmetic():
        return torch.float32
    return dtype


def measure_matmul(dtype: torch.dtype, size: int = 2048, repeats: int = 5, device: torch.device = CPU) -> float:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2 * size**3 / _best_time(lambda: a @ b, repeats, device)


def decode_floor(num_params: int, weight_bytes: int, kv_bytes_per_token: int, batch: int, context: int,
                 bandwidth: float, flops_rate: float, active: tuple[float, float] = (1.0, 1.0)) -> dict:
    """One decode step reads every weight once and each sequence's KV cache; computes 2 flops per
    parameter per token (plus attention, small at these lengths). `active`: the shares of the weights read
    and of the parameters each token uses (a mixture of experts': model_size.decode_active_share)."""
    bytes_read = int(weight_bytes * active[0]) + batch * context * kv_bytes_per_token
    flops = 2 * num_params * active[1] * batch
    t_mem, t_compute = bytes_read / bandwidth, flops / flops_rate
    return {"bytes": bytes_read, "flops": flops, "floor_s": max(t_mem, t_compute),
            "bound": "memory" if t_mem >= t_compute else "compute"}


def measure_decode_steps(llm, batch: int, prompt_len: int, steps: int, seed: int, before_each=None,
                         profiler=None) -> list[float]:
    """Wall time of each of `steps` decode steps with `batch` running sequences (after their prefill);
    `before_each()`, if given, runs (untimed) before each timed step; a torch `profiler`, if given, records
    the timed steps only.

    The prompts' prefill may take several steps (chunked), and sequences prefilled early decode during
    the later chunks: every request may generate up to max_model_len, and each timed step is checked to
    have run all `batch` sequences (a step with fewer would time less work than it claims)."""
    from pagedllm import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(seed)
    vocab = engine.config.model.vocab_size
    max_tokens = engine.config.model.max_model_len - prompt_len
    ids = [engine.add_request(None, {"prompt_token_ids": [rng.randrange(10, min(vocab, 32000)) for _ in range(prompt_len)]},
                              SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
           for _ in range(batch)]
    def prefilled() -> bool:
        stats = engine.stats(with_requests=True)
        return stats.num_waiting == 0 and all(r.computed_tokens >= prompt_len for r in stats.requests)

    while not prefilled():
        engine.step()
    engine.step()  # a first decode step, not timed
    times = []
    if profiler is not None:
        profiler.start()
    for _ in range(steps):
        if before_each is not None:
            before_each()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        if engine.last_step_num_requests != batch:
            raise RuntimeError(f"a timed decode step ran {engine.last_step_num_requests} sequences, not {batch}: "
                               "raise max_model_len (or lower --steps)")
    if profiler is not None:
        profiler.stop()
    for request_id in ids:
        engine.abort_request(request_id)
    return times


@torch.inference_mode()
def measure_gemm_time(model, batch: int, repeats: int = 5, device: torch.device = CPU) -> float:
    """Seconds the model's own matrix multiplies take for `batch` rows: every Linear of every decoder
    layer and the LM head, run back to back on random rows (best of `repeats`). What a decode step
    would cost if everything else were free: the ceiling this machine's GEMM kernels set at that batch."""
    from torch import nn

    dtype = next(model.parameters()).dtype
    linears = [m for layer in model.decoder_layers() for m in layer.modules() if isinstance(m, nn.Linear)]
    experts = [m for layer in model.decoder_layers() for m in layer.modules() if isinstance(m, FusedMoE)]
    inputs = {m.in_features: torch.randn(batch, m.in_features, device=device).to(dtype) for m in linears}
    hidden = torch.randn(batch, model.config.hidden_size, device=device).to(dtype)
    kwargs = {"vocab_major": True} if "vocab_major" in inspect.signature(model.compute_logits).parameters else {}
    if experts:  # each row to top_k experts drawn at random, as a router spreads them
        k, e = model.config.num_experts_per_tok, experts[0].num_experts
        ids = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(batch)])
        weights = torch.full((batch, k), 1.0 / k, device=device).to(dtype)

    def run() -> None:
        for m in linears:
            m(inputs[m.in_features])
        for m in experts:
            m(hidden, weights, ids)
        model.compute_logits(hidden, **kwargs)

    return _best_time(run, repeats, device)


def sustained_rate(fn, work_per_call: float, window_s: float, clock=time.perf_counter, sync=lambda: None) -> float:
    """Work per second of fn() called back to back until window_s has passed (at least once); `sync`
    waits for the work queued so far (on a GPU)."""
    calls, start = 0, clock()
    while True:
        fn()
        calls += 1
        sync()
        elapsed = clock() - start
        if elapsed >= window_s:
            return calls * work_per_call / elapsed


class MachineSampler:
    """Read bandwidth and matmul rate sampled again and again, the best kept. On a shared machine the
    speed drifts (other tenants take cores and memory bandwidth for seconds at a time, and leave gaps of
    a few milliseconds); sampling the machine between the very steps being timed, and comparing best with
    best, keeps the two sides of the ratio under the same conditions. The matmuls of a sample run back to
    back for matmul_window_s, about one decode step: the rate compared with a step is one the machine held
    for a step's length, not a gap a single ~10 ms matmul fell into."""

    def __init__(self, dtype: torch.dtype, bandwidth_bytes: int, matmul_size: int = 2048,
                 matmul_window_s: float = 0.1, device: torch.device = CPU) -> None:
        self.device = device
        self.array = torch.ones(bandwidth_bytes // 4, dtype=torch.float32, device=device)
        self.matmul_dtype = dtype = arithmetic_dtype(dtype, device)
        self.a = torch.randn(matmul_size, matmul_size, device=device).to(dtype)
        self.b = torch.randn(matmul_size, matmul_size, device=device).to(dtype)
        self.matmul_window_s = matmul_window_s
        self.bandwidth = self.matmul_rate = 0.0

    def sample(self) -> None:
        read = self.array.numel() * 4 / _best_time(lambda: self.array.sum(), 1, self.device)
        self.a @ self.b  # warm-up: the step before left other data in the caches
        rate = sustained_rate(lambda: self.a @ self.b, 2 * self.a.shape[0] ** 3, self.matmul_window_s,
                              sync=lambda: synchronize(self.device))
        self.bandwidth, self.matmul_rate = max(self.bandwidth, read), max(self.matmul_rate, rate)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedllm bench roofline")
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_METHODS), help="as the engine flag")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the engine and the machine's samples run (auto: cuda when there is one)")
    p.add_argument("--attention-backend", default="auto", help="as the engine flag")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--bandwidth-bytes", default="1GiB")
    p.add_argument("--matmul-window", type=float, default=0.1,
                   help="seconds of back-to-back matmuls per sample of the matmul rate (about one decode step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if any(b < 1 for b in args.batch_sizes) or args.steps < 1 or args.prompt_len < 1:
        raise ValueError("--batch-sizes, --steps and --prompt-len must be >= 1")
    if not args.matmul_window > 0:
        raise ValueError(f"--matmul-window must be > 0 seconds, got {args.matmul_window}")

    from pagedllm import LLM
    from pagedllm.utils import parse_size
    from pagedllm.memory.model_size import decode_active_share, kv_bytes_per_token, num_params_from_config

    # Room for the timed steps, plus the decode steps of sequences prefilled in an early chunk while the
    # rest of the batch's prompts are prefilled (2048 tokens a step, the engine's default).
    prefill_steps = -(-max(args.batch_sizes) * args.prompt_len // 2048)
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, quantization=args.quantization,
              max_model_len=args.prompt_len + args.steps + 2 * prefill_steps + 16, max_num_seqs=max(args.batch_sizes),
              device=args.device, attention_backend=args.attention_backend)
    device = torch.device(llm.llm_engine.runner_facts.device)
    cfg = llm.llm_engine.config.model
    num_params = num_params_from_config(cfg.hf_config)
    weights = llm.llm_engine.runner_facts.weight_bytes
    kv_tok = kv_bytes_per_token(cfg.hf_config, cfg.dtype)
    model = llm.llm_engine.local_model()
    print("per row: read bandwidth and matmul rate are the best of samples taken before each timed step "
          f"(the matmul rate over {args.matmul_window:g} s of back-to-back matmuls); the step time is the best "
          "of --steps (median beside)")
    print(f"{'batch':>5} {'GB/s':>5} {'GFLOP/s':>7} {'floor ms':>9} {'bound':>8} {'pagedllm ms':>12} {'median':>7} "
          f"{'ratio':>6} {'tok/s':>7} {'% matmul rate':>13} {'GEMMs alone ms':>15}")
    rows, bandwidth_bytes = [], parse_size(args.bandwidth_bytes)
    for b in args.batch_sizes:
        machine = MachineSampler(cfg.dtype, bandwidth_bytes, matmul_window_s=args.matmul_window, device=device)
        if machine.matmul_dtype != cfg.dtype and b == args.batch_sizes[0]:
            print(f"this CPU has no {cfg.dtype} arithmetic: the matmul rate is {machine.matmul_dtype}'s, which the "
                  "engine's many-row products run in")
        times = measure_decode_steps(llm, b, args.prompt_len, args.steps, args.seed, before_each=machine.sample)
        machine.sample()
        bandwidth, rate = machine.bandwidth, machine.matmul_rate
        floor = decode_floor(num_params, weights, kv_tok, b, args.prompt_len, bandwidth, rate,
                             decode_active_share(cfg.hf_config, b))
        best, median = min(times), statistics.median(times)
        gemm = measure_gemm_time(model, b, device=device)
        achieved = floor["flops"] / best / rate
        rows.append({"batch": b, **floor, "read_bytes_per_s": bandwidth, "matmul_flops_per_s": rate,
                     "matmul_dtype": str(machine.matmul_dtype).removeprefix("torch."),
                     "measured_s": best, "median_s": median, "ratio": best / floor["floor_s"],
                     "tokens_per_s": b / best, "fraction_of_matmul_rate": achieved, "gemm_only_s": gemm,
                     "gemm_only_fraction_of_matmul_rate": floor["flops"] / gemm / rate})
        print(f"{b:>5} {bandwidth / 1e9:>5.1f} {rate / 1e9:>7.0f} {floor['floor_s'] * 1000:>9.1f} {floor['bound']:>8} "
              f"{best * 1000:>12.1f} {median * 1000:>7.1f} {best / floor['floor_s']:>6.2f} {b / best:>7.1f} "
              f"{100 * achieved:>12.0f}% {gemm * 1000:>15.1f}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=2)
    return 0
