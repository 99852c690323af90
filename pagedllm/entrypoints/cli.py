"""The `pagedllm` command: generate (and, as they land, serve, plan, bench)."""
from __future__ import annotations

import argparse
import sys

from pagedllm.engine.arg_utils import add_engine_args, engine_args_from
from pagedllm.entrypoints.command import run_command


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

    from pagedllm.entrypoints.plan import dry_run_plan

    if ns.model_pos is not None:
        ns.model = ns.model_pos
    if ns.plot is not None:
        from pagedllm.plotting import check_plot_path

        check_plot_path(ns.plot)
    plan = dry_run_plan(engine_args_from(ns, server=True), device=ns.device, device_memory=ns.device_memory,
                        device_memory_used=ns.device_memory_used, unified=ns.unified_memory,
                        host_memory=ns.host_memory, page_cache=ns.page_cache,
                        tensor_parallel_size=ns.tensor_parallel_size)
    if ns.audio_tokenizer_type is not None or ns.audio_tokenizer_path is not None:
        from pagedllm.audio.memory import with_planned_audio_tokenizer

        plan = with_planned_audio_tokenizer(plan, ns.audio_tokenizer_type, ns.audio_tokenizer_path)
    if ns.plot is not None:
        from pagedllm.memory.plot import plot_plan

        plot_plan(plan, ns.plot, f"pagedllm plan {ns.model or 'the demo model'}: "
                                 f"{'fits' if plan.fits else 'does not fit: ' + plan.cause}")
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
    add_engine_args(serve, server=True)
    add_server_args(serve)
    serve.set_defaults(func=_cmd_serve)

    plan = sub.add_parser("plan", help="dry-run memory plan: what fits, before loading any weight")
    plan.add_argument("model_pos", nargs="?", metavar="MODEL",
                      help="model folder, config.json, hub name in the local cache, or a preset: "
                           "llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen2.5-0.5b, qwen2.5-7b, qwen3-0.6b, "
                           "mistral-7b-v0.3")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--plot", default=None, metavar="FILE",
                      help="draw the plan as a picture: FILE.png or FILE.svg (one bar of the device's memory, the "
                           "budget line, what does not fit, each fix as its own bar; needs matplotlib)")
    plan.add_argument("--device-memory", default=None, help="total device memory, e.g. 128GiB, 119.7GB")
    plan.add_argument("--device-memory-used", default=None,
                      help="memory already held by other processes and the OS (default 0 with --device-memory)")
    plan.add_argument("--unified-memory", action="store_true", help="the device shares memory with the CPU")
    plan.add_argument("--page-cache", default=None,
                      help="with --device-memory on unified memory (or --device cpu): reclaimable page cache in it, "
                           "besides --device-memory-used, counted as free (e.g. 60GiB)")
    plan.add_argument("--host-memory", default=None,
                      help="with --device-memory: the host's memory beside it, where --swap-space goes "
                           "(default: unknown, not checked)")
    add_engine_args(plan, server=True)
    add_audio_tokenizer_args(plan)
    plan.set_defaults(func=_cmd_plan)

    bench = sub.add_parser("bench", help="benchmarks: throughput, serve, roofline, sweep, audio, host, soak, compare, "
                                         "spec", add_help=False)
    bench.add_argument("kind", choices=["throughput", "serve", "roofline", "sweep", "audio", "host", "soak",
                                        "compare", "spec"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_cmd_bench)
    return parser


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
