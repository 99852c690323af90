"""`pagedllm bench host`: where the host's time goes in a decode step, from torch.profiler.

The engine labels the parts of a step (pagedllm.utils.phase): schedule (the scheduler and the runner's plain
input), launch (the runner: inputs, then `forward` and `sample`, the LM head and the sampler, queued on the
device), outputs (detokenization, stop strings, output objects; made during the next step's device work with
async output processing), wait (the host blocked on the device for the sampled ids) and update (the scheduler
takes the tokens). On a CPU the device is the host: launch holds the model's compute and wait is ~0. On a GPU,
wait is the host's idle time; host work that is not hidden is everything else."""
from __future__ import annotations

import argparse
import json
import statistics

from pagedllm.bench.roofline import measure_decode_steps

TOP_PHASES = ("schedule", "launch", "outputs", "wait", "update")
INNER_PHASES = ("forward", "sample")  # parts of launch


def phase_times(profiler, steps: int) -> dict[str, float]:
    """Seconds per step in each labelled phase (CPU time of the span, i.e. its wall time on the host)."""
    totals = {}
    for event in profiler.key_averages():
        if event.key.startswith("pagedllm."):
            totals[event.key.removeprefix("pagedllm.")] = event.cpu_time_total / 1e6 / steps
    return {name: totals.get(name, 0.0) for name in TOP_PHASES + INNER_PHASES}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedllm bench host")
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--attention-backend", default="auto", help="as the engine flag")
    p.add_argument("--enforce-eager", action="store_true", help="as the engine flag")
    p.add_argument("--async-output-proc", action=argparse.BooleanOptionalAction, default=None,
                   help="as the engine flag (default: on with CUDA)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if any(b < 1 for b in args.batch_sizes) or args.steps < 1 or args.prompt_len < 1:
        raise ValueError("--batch-sizes, --steps and --prompt-len must be >= 1")

    import torch

    from pagedllm import LLM

    prefill_steps = -(-max(args.batch_sizes) * args.prompt_len // 2048)
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
              attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
              async_output_proc=args.async_output_proc, max_num_seqs=max(args.batch_sizes),
              max_model_len=args.prompt_len + 2 * args.steps + 2 * prefill_steps + 16)
    engine = llm.llm_engine
    print(f"{args.model} on {engine.runner_facts.device}, graphs {'on' if engine.runner_facts.graph_sizes else 'off'}, "
          f"async output processing {'on' if engine.config.async_output_proc else 'off'}; ms per decode step "
          f"(mean of {args.steps}; the phases from torch.profiler, the step time from a run without it)")
    print("(recording every op slows op-heavy phases: compare the phases with the profiled step)")
    header = ["batch", "step", "profiled", *TOP_PHASES, "other", *INNER_PHASES]
    print(" ".join(f"{h:>9}" for h in header))
    rows = []
    for b in args.batch_sizes:
        wall = statistics.mean(measure_decode_steps(llm, b, args.prompt_len, args.steps, args.seed))
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiled = statistics.mean(measure_decode_steps(llm, b, args.prompt_len, args.steps, args.seed,
                                                        profiler=profiler))
        phases = phase_times(profiler, args.steps)
        other = max(profiled - sum(phases[name] for name in TOP_PHASES), 0.0)
        rows.append({"batch": b, "step_s": wall, "profiled_step_s": profiled, **{f"{k}_s": v for k, v in phases.items()},
                     "other_s": other})
        values = [wall, profiled, *(phases[n] for n in TOP_PHASES), other, *(phases[n] for n in INNER_PHASES)]
        print(f"{b:>9} " + " ".join(f"{v * 1000:>9.2f}" for v in values), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=2)
    return 0
