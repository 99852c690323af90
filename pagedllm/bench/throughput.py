"""`pagedllm bench throughput`: offline throughput of pagedllm beside transformers on the same requests.

Output tokens / wall time of the whole batch, as vLLM's benchmark_throughput reports it.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass

import torch


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int, prefix_len: int = 0) -> list[BenchRequest]:
    """Random token ids (ids 10.. to stay clear of the usual special tokens), lengths within +-range_ratio.

    With prefix_len, every prompt starts with the same prefix_len random tokens (a shared system
    prompt), followed by its own input_len random tokens, as vLLM's --random-prefix-len.
    """
    rng = random.Random(seed)

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    hi = min(vocab_size, 32000) - 1
    prefix = [rng.randint(10, hi) for _ in range(prefix_len)]
    return [BenchRequest(prefix + [rng.randint(10, hi) for _ in range(length(input_len))], length(output_len))
            for _ in range(num_prompts)]


def file_requests(path: str, num_prompts: int, output_len: int | None, tokenizer) -> list[BenchRequest]:
    """JSONL lines with "prompt" (and optional "output_len"), or ShareGPT JSON (first human turn)."""
    with open(path) as f:
        text = f.read()
    items = []
    if path.endswith(".jsonl"):
        for line in text.splitlines():
            if line.strip():
                row = json.loads(line)
                items.append((row["prompt"], row.get("output_len")))
    else:
        for conv in json.loads(text):
            turns = conv.get("conversations") or conv.get("conversation") or []
            if len(turns) >= 2:
                reply_len = len(tokenizer.encode(turns[1]["value"]))
                items.append((turns[0]["value"], reply_len))
    if tokenizer is None:
        raise ValueError("a dataset file needs a model with a tokenizer")
    return [BenchRequest(tokenizer.encode(p), output_len or n or 128) for p, n in items[:num_prompts]]


def make_llm(args):
    """An LLM built from the shared engine flags in `args`."""
    from pagedllm import LLM
    from pagedllm.engine.arg_utils import engine_args_from

    engine_args = vars(engine_args_from(args))
    return LLM(engine_args.pop("model"), **engine_args)


def preemption_counts(llm) -> dict[str, int]:
    """The engine's preemption, swap and prefix-cache totals so far."""
    engine = llm.llm_engine
    pre, swap, cache = engine.preemption_stats, engine.swap_stats, engine.prefix_cache_stats
    return {"swap_preemptions": pre.swap, "recompute_preemptions": pre.recompute,
            "recomputed_tokens": pre.recomputed_tokens, "swapped_out_blocks": swap.swapped_out_blocks,
            "swapped_in_blocks": swap.swapped_in_blocks, "prefix_cache_queried_tokens": cache.queries,
            "prefix_cache_hit_tokens": cache.hits}


# `--backend pagedllm-json`'s default constraint: an array of integers, which never has to end (so with
# --ignore-eos every step of every request is constrained, as long as the unconstrained run's).
DEFAULT_JSON_SCHEMA = '{"type": "array", "items": {"type": "integer"}}'


def run_pagedllm(args, requests: list[BenchRequest], llm=None, report: dict | None = None,
                 json_schema: str | None = None) -> float:
    """Seconds for the whole batch (each request constrained by `json_schema`, if given); `report` receives
    that run's preemption counts."""
    from pagedllm import SamplingParams
    from pagedllm.structured_output import GuidedDecodingParams

    llm = llm or make_llm(args)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    guided = None if json_schema is None else GuidedDecodingParams(json=json_schema)
    params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=r.output_len, ignore_eos=args.ignore_eos,
                             guided_decoding=guided) for r in requests]
    # Warm-up on reversed prompts, so that it leaves nothing in the prefix cache the timed run could hit.
    warm_up = [{"prompt_token_ids": r.prompt_token_ids[::-1]} for r in requests[:2]]
    llm.generate(warm_up, [p.clone(max_tokens=4) for p in params[:2]], use_tqdm=False)
    from pagedllm.distributed.parallel_state import collective_time

    before = preemption_counts(llm)
    collectives_before = collective_time.seconds
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    if report is not None:
        report.update({k: v - before[k] for k, v in preemption_counts(llm).items()})
        report["collective_s"] = collective_time.seconds - collectives_before  # rank 0's; 0 on one device
    return elapsed


def bench_device(args) -> torch.device:
    """The device of this benchmark's engine (--device; auto: cuda when there is one): the transformers
    baselines run there too, so that every backend is measured on the same hardware."""
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def _hf_model(args):
    from transformers import AutoModelForCausalLM

    from pagedllm.config import resolve_dtype
    from pagedllm.model_executor.model_files import load_hf_config, resolve_model_path

    device = bench_device(args)
    path = resolve_model_path(args.model)
    config = load_hf_config(path)
    dtype = resolve_dtype(args.dtype, getattr(config, "dtype", None), device.type)
    if args.load_format == "dummy":
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return model.eval()


def _synchronize(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def run_transformers(args, requests: list[BenchRequest], batch_size: int, model=None) -> float:
    """Static batches through `generate`, left-padded, sampling at temperature 1."""
    model = model or _hf_model(args)
    pad = 0
    start = time.perf_counter()
    from tqdm.auto import tqdm

    for i in tqdm(range(0, len(requests), batch_size), desc=f"transformers batch {batch_size}"):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch],
                           device=model.device)
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch],
                            device=model.device)
        out_len = max(r.output_len for r in batch)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                           top_k=0, max_new_tokens=out_len, min_new_tokens=out_len if args.ignore_eos else 0,
                           pad_token_id=pad)
    _synchronize(model)
    return time.perf_counter() - start


def run_transformers_cb(args, requests: list[BenchRequest], model=None) -> float:
    """transformers' own continuous batching (`generate_batch`) on the same requests."""
    from transformers import GenerationConfig

    model = model or _hf_model(args)
    out_len = max(r.output_len for r in requests)
    gen = GenerationConfig(max_new_tokens=out_len, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                           eos_token_id=None if args.ignore_eos else model.generation_config.eos_token_id,
                           pad_token_id=0)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate_batch(inputs=[r.prompt_token_ids for r in requests], generation_config=gen,
                             progress_bar=True)
    _synchronize(model)
    return time.perf_counter() - start


def build_parser() -> argparse.ArgumentParser:
    from pagedllm.engine.arg_utils import add_engine_args

    p = argparse.ArgumentParser(prog="pagedllm bench throughput")
    add_engine_args(p)  # the engine flags, shared with serve / generate / plan (--seed seeds the data too)
    p.add_argument("--backend", choices=["pagedllm", "pagedllm-json", "transformers", "transformers-cb"],
                   action="append", help="repeat to run several in one go (default: pagedllm); pagedllm-json: the "
                                         "same engine with every request under --json-schema (structured outputs)")
    p.add_argument("--json-schema", default=DEFAULT_JSON_SCHEMA, help="pagedllm-json's schema (JSON text)")
    p.add_argument("--dataset", default="random", help="'random', or a .jsonl / ShareGPT .json file")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", "--random-prefix-len", type=int, default=0,
                   help="a shared prefix of this many random tokens before each prompt (prefix caching workloads)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--hf-batch-size", type=int, nargs="+", default=[16])
    p.add_argument("--output-json", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    backends = args.backend or ["pagedllm"]

    from pagedllm.model_executor.model_files import (
        has_tokenizer,
        load_hf_config,
        resolve_model_path,
    )

    if args.model is None:
        from pagedllm.demo import demo_model_path

        args.model = str(demo_model_path())
    path = resolve_model_path(args.model)
    if args.dataset == "random":
        vocab = load_hf_config(path).vocab_size
        requests = random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab,
                                   args.seed, args.prefix_len)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path) if has_tokenizer(path) else None
        requests = file_requests(args.dataset, args.num_prompts, None, tok)

    in_tokens = sum(len(r.prompt_token_ids) for r in requests)
    out_tokens = sum(r.output_len for r in requests)
    results = []
    engines = {}  # pagedllm and pagedllm-json share one engine

    def engine():
        if "llm" not in engines:
            engines["llm"] = make_llm(args)
        return engines["llm"]

    for backend in backends:
        preemptions: dict[str, int] = {}
        runs = []
        if backend == "pagedllm":
            runs = [("pagedllm", None, lambda p=preemptions: run_pagedllm(args, requests, engine(), report=p))]
        elif backend == "pagedllm-json":
            runs = [("pagedllm-json", None, lambda p=preemptions: run_pagedllm(args, requests, engine(), report=p,
                                                                               json_schema=args.json_schema))]
        if backend == "transformers":
            model = _hf_model(args)
            runs = [("transformers", bs, lambda bs=bs, model=model: run_transformers(args, requests, bs, model))
                    for bs in args.hf_batch_size]
        elif backend == "transformers-cb":
            runs = [("transformers-cb", None, lambda: run_transformers_cb(args, requests))]
        for name, bs, fn in runs:
            elapsed = fn()
            results.append({
                "backend": name, "hf_batch_size": bs, "elapsed_s": elapsed,
                "requests_per_second": len(requests) / elapsed,
                "total_tokens_per_second": (in_tokens + out_tokens) / elapsed,
                "output_tokens_per_second": out_tokens / elapsed,
            })
            r = results[-1]
            label = name + (f" (batch {bs})" if bs else "")
            print(f"{label}: {r['requests_per_second']:.2f} requests/s, {r['total_tokens_per_second']:.1f} total "
                  f"tokens/s, {r['output_tokens_per_second']:.1f} output tokens/s ({elapsed:.1f} s)", flush=True)
            if name.startswith("pagedllm"):
                r.update(preemptions)
                print(f"pagedllm preemptions: {preemptions['swap_preemptions']} swap "
                      f"({preemptions['swapped_out_blocks']} blocks out, {preemptions['swapped_in_blocks']} in), "
                      f"{preemptions['recompute_preemptions']} recompute "
                      f"({preemptions['recomputed_tokens']} computed tokens dropped); prefix cache hits "
                      f"{preemptions['prefix_cache_hit_tokens']} of {preemptions['prefix_cache_queried_tokens']} "
                      f"prompt tokens", flush=True)
                if preemptions["collective_s"]:
                    print(f"tensor parallel: rank 0 spent {preemptions['collective_s']:.2f} s in all-reduce and "
                          f"gather ({100 * preemptions['collective_s'] / elapsed:.1f}% of the run)", flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "backend"} | {"backends": backends,
                "num_requests": len(requests), "input_tokens": in_tokens, "output_tokens": out_tokens}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"settings": settings, "results": results}, f, indent=2)
    base = next((r for r in results if r["backend"] == "pagedllm"), None)
    if base:
        for r in results:
            if r is not base:
                ratio = base["output_tokens_per_second"] / r["output_tokens_per_second"]
                label = r["backend"] + (f" (batch {r['hf_batch_size']})" if r["hf_batch_size"] else "")
                print(f"pagedllm / {label}: {ratio:.2f}x output tokens/s")
    return 0
