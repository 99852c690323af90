"""The `pagedllm` command: generate (and, as they land, serve, plan, bench)."""
from __future__ import annotations

import argparse
import logging
import sys

from pagedllm.config import KV_CACHE_DTYPES, PREEMPTION_MODES, QUANTIZATION_METHODS, SCHEDULING_POLICIES
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.structured_output_limits import StructuredOutputLimits


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags with vLLM's names and meanings."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF model folder, config.json (with --load-format dummy) "
                   "or hub name in the local HF cache; default: the built-in demo model")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--revision", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half", "float"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=_max_model_len, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of device memory the engine may take (on CPU: of host memory)")
    g.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 4GiB (overrides the utilization)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="storage dtype of the KV cache: auto = the model dtype, fp8 = fp8_e4m3 (half a 16-bit "
                        "cache; per-tensor k/v scales from the checkpoint, else 1.0)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of prompts' shared prefixes (full blocks); on by default")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every step's kernels are launched one by one (saves the graph pool's "
                        "memory and the capture time at start; decode is slower)")
    g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes captured in CUDA graphs at start (a decode step of n sequences replays "
                        "the smallest >= n); default 1 2 4 8 16 24 ... up to --max-num-seqs")
    g.add_argument("--async-output-proc", action=argparse.BooleanOptionalAction, default=None,
                   help="make each step's outputs (detokenization, stop strings) while the next step runs on the "
                        "device; default: on with CUDA, off on a CPU")
    g.add_argument("--disable-async-output-proc", action="store_true", help="vLLM's spelling of --no-async-output-proc")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu", "triton"],
                   help="how attention is computed: torch (PyTorch ops, any device), cpu (native CPU kernels), "
                        "triton (CUDA kernels reading the paged cache in place); auto: triton on CUDA, cpu on "
                        "a CPU, else torch")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="a request's logits do not depend on the other requests in its batch, so a seeded request "
                        "samples the same tokens (or audio) alone or beside any others; every Linear multiplies "
                        "in fixed 16-row tiles and attention runs per query (slower). Default: "
                        "VLLM_BATCH_INVARIANT=1 in the environment turns it on")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model across N ranks (devices; processes on a CPU): attention heads, MLP and "
                        "vocabulary sharded Megatron-style, one all-reduce per attention and per MLP "
                        "(torch.distributed: NCCL on CUDA, gloo on a CPU). Refused, with the sizes that work, "
                        "when it does not divide the model's heads")
    g.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                   help="what starts the other ranks: mp (default) local processes; ray actors placed on a "
                        "running Ray cluster (several machines: docs/distributed.md)")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_METHODS),
                   help="int8: weight-only int8 decoder Linears (per-output-channel scales), quantized at load; "
                        "embeddings and LM head stay in --dtype")
    g.add_argument("--cpu-offload-gb", type=float, default=0.0,
                   help="GiB of weights (whole decoder layers, the last first) kept in host memory and copied "
                        "to the GPU layer by layer; CUDA only")
    g.add_argument("--swap-space", type=float, default=0.0,
                   help="GiB of host memory for the KV blocks of preempted requests, swapped out and back in "
                        "instead of recomputed. vLLM's default is 4 (and its V1 engine ignores the flag); "
                        "pagedllm's is 0: no swap space, preempted requests recompute")
    g.add_argument("--preemption-mode", default=None, choices=list(PREEMPTION_MODES),
                   help="force swap (needs --swap-space) or recompute preemption; default: swap when there is "
                        "swap space and the request has computed at least one block, else recompute")
    s = parser.add_argument_group("structured outputs: what one constraint may be and cost (a 400 names the limit)")
    s.add_argument("--structured-outputs-max-bytes", type=int, default=StructuredOutputLimits.max_spec_bytes,
                   help="bytes of a JSON schema's text, a regex, a grammar or a choice list")
    s.add_argument("--structured-outputs-max-properties", type=int, default=StructuredOutputLimits.max_properties,
                   help="object properties in a whole JSON schema")
    s.add_argument("--structured-outputs-max-alternatives", type=int,
                   default=StructuredOutputLimits.max_alternatives,
                   help="members of one anyOf / oneOf / enum, strings of one choice")
    s.add_argument("--structured-outputs-max-depth", type=int, default=StructuredOutputLimits.max_depth,
                   help="nesting of a JSON schema's objects, arrays and combinators")
    s.add_argument("--structured-outputs-compile-timeout", type=float, default=10.0,
                   help="seconds one constraint may take to compile, in a worker process that is then killed (400); "
                        "0: compile in the engine's process with no deadline")
    s.add_argument("--structured-outputs-compile-memory", default="2GiB",
                   help="memory the compile worker may take beyond its start (e.g. 2GiB)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=list(SCHEDULING_POLICIES),
                   help="fcfs: first come first served, a request's priority other than 0 is refused (400); "
                        "priority: requests' priority field (lower first) orders scheduling and preemption")
    g.add_argument("--repetition-aware-sampling", action=argparse.BooleanOptionalAction, default=True,
                   help="audio models: repetition-aware sampling as the checkpoint's generation_config.json sets it "
                        "(ras_win_len); --no-repetition-aware-sampling turns it off")


def _max_model_len(value: str) -> int | str:
    return "auto" if value == "auto" else int(value)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    args = EngineArgs(**{k: v for k, v in vars(ns).items() if k in EngineArgs.field_names()})
    if not args.structured_outputs_compile_timeout:  # 0: no worker, no deadline
        args.structured_outputs_compile_timeout = None
    args.request_template_worker = bool(getattr(ns, "trust_request_chat_template", False))
    return args


def _cmd_generate(ns: argparse.Namespace) -> int:
    from pagedllm import SamplingParams
    from pagedllm.entrypoints.llm import LLM

    params = SamplingParams(
        n=ns.n, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
        max_tokens=ns.max_tokens, seed=ns.sampling_seed, stop=ns.stop or None, ignore_eos=ns.ignore_eos,
    )
    args = engine_args_from(ns)
    llm = LLM(**vars(args))
    if ns.chat:
        outputs = llm.chat([{"role": "user", "content": ns.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(ns.prompt, params, use_tqdm=False)
    for completion in outputs[0].outputs:
        text = completion.text if llm.get_tokenizer() is not None else str(completion.token_ids)
        print(text if ns.n == 1 else f"[{completion.index}] {text}")
    return 0


def _cmd_plan(ns: argparse.Namespace) -> int:
    import json

    from pagedllm.memory.dry_run import dry_run_plan

    if ns.model_pos is not None:
        ns.model = ns.model_pos
    plan = dry_run_plan(engine_args_from(ns), device=ns.device, device_memory=ns.device_memory,
                        device_memory_used=ns.device_memory_used, unified=ns.unified_memory,
                        host_memory=ns.host_memory, page_cache=ns.page_cache,
                        tensor_parallel_size=ns.tensor_parallel_size)
    if ns.audio_tokenizer_type is not None or ns.audio_tokenizer_path is not None:
        from pagedllm.audio.memory import with_planned_audio_tokenizer

        plan = with_planned_audio_tokenizer(plan, ns.audio_tokenizer_type, ns.audio_tokenizer_path)
    if ns.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        verdict = "fits" if plan.fits else "does NOT fit"
        print(f"memory plan for {ns.model or 'the demo model'}: {verdict}")
        print(plan.table())
    return 0 if plan.fits else 1


def _cmd_bench(ns: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(f"pagedllm.bench.{ns.kind}").main(ns.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference over a paged KV cache")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--stop", action="append")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    from pagedllm.entrypoints.openai.api_server import add_server_args
    from pagedllm.entrypoints.openai.audio_args import add_audio_tokenizer_args

    serve = sub.add_parser("serve", help="the OpenAI-compatible API server")
    serve.add_argument("model_pos", nargs="?", metavar="MODEL", help="model (default: the built-in demo model)")
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(func=_cmd_serve)

    plan = sub.add_parser("plan", help="dry-run memory plan: what fits, before loading any weight")
    plan.add_argument("model_pos", nargs="?", metavar="MODEL",
                      help="model folder, config.json, hub name in the local cache, or a preset: "
                           "llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen2.5-0.5b, qwen2.5-7b, qwen3-0.6b, "
                           "mistral-7b-v0.3")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--device-memory", default=None, help="total device memory, e.g. 128GiB, 119.7GB")
    plan.add_argument("--device-memory-used", default=None,
                      help="memory already held by other processes and the OS (default 0 with --device-memory)")
    plan.add_argument("--unified-memory", action="store_true", help="the device shares memory with the CPU")
    plan.add_argument("--trust-request-chat-template", action="store_true",
                      help="plan the worker process serve's --trust-request-chat-template renders requests' "
                           "templates in")
    plan.add_argument("--page-cache", default=None,
                      help="with --device-memory on unified memory (or --device cpu): reclaimable page cache in it, "
                           "besides --device-memory-used, counted as free (e.g. 60GiB)")
    plan.add_argument("--host-memory", default=None,
                      help="with --device-memory: the host's memory beside it, where --swap-space goes "
                           "(default: unknown, not checked)")
    add_engine_args(plan)
    add_audio_tokenizer_args(plan)
    plan.set_defaults(func=_cmd_plan)

    bench = sub.add_parser("bench", help="benchmarks: throughput, serve, roofline, sweep, audio, host, soak",
                           add_help=False)
    bench.add_argument("kind", choices=["throughput", "serve", "roofline", "sweep", "audio", "host", "soak"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_cmd_bench)
    return parser


def run_command(func, ns: argparse.Namespace) -> int:
    """Run a subcommand; bad input (ValueError, missing files) is one line on stderr and exit code 2."""
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return func(ns)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _cmd_serve(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server

    if ns.model_pos is not None:
        ns.model = ns.model_pos
    return run_server(ns)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    return run_command(ns.func, ns)


if __name__ == "__main__":
    sys.exit(main())
