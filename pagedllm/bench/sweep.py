"""`pagedllm bench sweep`: output tokens/s against batch size for each backend, with the roofline.

At batch size b every backend gets the same b random requests at once (input_len prompt tokens,
output_len generated tokens, ignore_eos), as llama.cpp's `llama-batched-bench` does with
`-npl b`: output tokens/s = b * output_len / wall time of the whole batch. The roofline is the
best any engine could do on the same work on this machine: the prefill's floor plus one decode
step's floor per generated token, from the bandwidth and matmul rate measured in the same run.
"""
from __future__ import annotations

import argparse
import json

ROOFLINE = "roofline (this machine's floor)"


def roofline_tokens_per_s(batch: int, input_len: int, output_len: int, num_params: int, weight_bytes: int,
                          kv_bytes_per_token: int, bandwidth: float, flops_rate: float, hf_config=None) -> float:
    """Output tokens/s of the whole batch if every step ran at its floor. With `hf_config`, a step reads and
    multiplies by the weights its tokens use (a mixture of experts' chosen experts: decode_active_share)."""
    from pagedllm.bench.roofline import decode_floor
    from pagedllm.memory.model_size import decode_active_share

    def active(tokens: int) -> tuple[float, float]:
        return (1.0, 1.0) if hf_config is None else decode_active_share(hf_config, tokens)

    read, used = active(batch * input_len)
    prefill = max(weight_bytes * read / bandwidth, 2 * num_params * used * batch * input_len / flops_rate)
    mid_context = input_len + output_len // 2  # decode steps read contexts from input_len to input_len+output_len
    step = decode_floor(num_params, weight_bytes, kv_bytes_per_token, batch, mid_context, bandwidth, flops_rate,
                        active(batch))
    return batch * output_len / (prefill + output_len * step["floor_s"])


def read_llamacpp_jsonl(path: str, input_len: int, output_len: int) -> list[dict]:
    """Rows of `llama-batched-bench --output-format jsonl` (keys pp, tg, pl, t) for this workload."""
    rows = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("pp") == input_len and row.get("tg") == output_len:
                rows.append({"backend": "llama.cpp", "batch": row["pl"], "elapsed_s": row["t"],
                             "output_tokens_per_second": row["pl"] * row["tg"] / row["t"]})
    if not rows:
        raise ValueError(f"{path} has no llama-batched-bench rows with pp={input_len} and tg={output_len}")
    return rows


def plot_sweep(rows: list[dict], path: str, title: str) -> None:
    """One line per backend: output tokens/s against batch size (log2 x axis); the roofline dashed."""
    from pagedllm.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for backend in dict.fromkeys(r["backend"] for r in rows):
        points = sorted((r["batch"], r["output_tokens_per_second"]) for r in rows if r["backend"] == backend)
        xs, ys = zip(*points)
        style = {"linestyle": "--", "color": "black"} if backend == ROOFLINE else {"marker": "o"}
        ax.plot(xs, ys, label=backend, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (requests at once)")
    ax.set_ylabel("output tokens/s (whole batch)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    from pagedllm.engine.arg_utils import add_engine_args

    p = argparse.ArgumentParser(prog="pagedllm bench sweep")
    add_engine_args(p)
    p.add_argument("--backend", choices=["pagedllm", "transformers", "transformers-cb"], action="append",
                   help="repeat to run several (default: pagedllm)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--bandwidth-bytes", default="1GiB", help="size of the bandwidth probe")
    p.add_argument("--llamacpp-jsonl", default=None, help="llama-batched-bench -oj output to draw beside")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="write a PNG here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    args.ignore_eos = True
    if any(b < 1 for b in args.batch_sizes) or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--batch-sizes, --input-len and --output-len must be >= 1")
    backends = args.backend or ["pagedllm"]
    if args.plot:
        from pagedllm.plotting import check_plot_path

        check_plot_path(args.plot)
    if args.model is None:
        from pagedllm.demo import demo_model_path

        args.model = str(demo_model_path())
    args.max_num_seqs = max(args.max_num_seqs, max(args.batch_sizes))
    rows = read_llamacpp_jsonl(args.llamacpp_jsonl, args.input_len, args.output_len) if args.llamacpp_jsonl else []

    from pagedllm.bench import throughput as tp
    from pagedllm.bench.roofline import arithmetic_dtype, measure_bandwidth, measure_matmul
    from pagedllm.utils import parse_size
    from pagedllm.memory.model_size import kv_bytes_per_token, num_params_from_config
    from pagedllm.model_executor.model_files import load_hf_config, resolve_model_path

    vocab = load_hf_config(resolve_model_path(args.model)).vocab_size
    llm = tp.make_llm(args)
    cfg = llm.llm_engine.config.model
    bandwidth = measure_bandwidth(parse_size(args.bandwidth_bytes))["read_bytes_per_s"]
    matmul_dtype = arithmetic_dtype(cfg.dtype)
    rate = measure_matmul(matmul_dtype)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, matmul {rate / 1e9:.0f} GFLOP/s "
          f"({str(matmul_dtype).removeprefix('torch.')})", flush=True)
    shape = (num_params_from_config(cfg.hf_config), llm.llm_engine.runner_facts.weight_bytes,
             kv_bytes_per_token(cfg.hf_config, cfg.dtype))
    hf_model = tp._hf_model(args) if {"transformers", "transformers-cb"} & set(backends) else None
    for b in args.batch_sizes:
        requests = tp.random_requests(b, args.input_len, args.output_len, 0.0, vocab, args.seed + b)
        rows.append({"backend": ROOFLINE, "batch": b, "output_tokens_per_second": roofline_tokens_per_s(
            b, args.input_len, args.output_len, *shape, bandwidth, rate, cfg.hf_config)})
        for backend in backends:
            if backend == "pagedllm":
                elapsed = tp.run_pagedllm(args, requests, llm)
            elif backend == "transformers":
                elapsed = tp.run_transformers(args, requests, b, hf_model)
            else:
                elapsed = tp.run_transformers_cb(args, requests, hf_model)
            rows.append({"backend": backend, "batch": b, "elapsed_s": elapsed,
                         "output_tokens_per_second": b * args.output_len / elapsed})
            print(f"batch {b:>4} {backend:<16} {rows[-1]['output_tokens_per_second']:8.1f} output tok/s",
                  flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "backend"} | {"backends": backends,
                "bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": rate,
                "matmul_dtype": str(matmul_dtype).removeprefix("torch.")}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"settings": settings, "rows": rows}, f, indent=2)
    if args.plot:
        title = (f"{args.model} ({str(cfg.dtype).removeprefix('torch.')}), {args.input_len} in / "
                 f"{args.output_len} out tokens per request")
        plot_sweep(rows, args.plot, title)
        print(f"plot written to {args.plot}")
    return 0
