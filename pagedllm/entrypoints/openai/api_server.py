"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): its flags, and its life: start (the engine, the app of
routes.py), drain on SIGTERM, shutdown.

    python -m pagedllm.entrypoints.openai.api_server --model M [vLLM flags]
    pagedllm serve [M] [vLLM flags]
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.audio_args import (
    add_audio_server_args,
    audio_server_config,
)
from pagedllm.entrypoints.openai.connections import uvicorn_config
from pagedllm.entrypoints.openai.cors import add_cors_args, with_cors
from pagedllm.errors import WorkerError
from pagedllm.entrypoints.openai.generation_defaults import (
    GenerationDefaults,
    add_generation_config_args,
    json_object_arg,
)
from pagedllm.entrypoints.openai.limits import RequestLimits, add_limit_args
from pagedllm.entrypoints.openai.request_templates import RequestTemplateRenderer
from pagedllm.entrypoints.openai.shutdown import CLOSE_GRACE_S, DrainingServer
from pagedllm.entrypoints.openai.reasoning import HARMONY_PARSERS, REASONING_PARSERS, reasoning_parser_for
from pagedllm.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS, tool_call_parser_for_template
from pagedllm.entrypoints.openai.routes import build_app
from pagedllm.metrics import EngineMetrics

logger = logging.getLogger("pagedllm.server")


UNIMPLEMENTED_FLAGS = {
    "--pipeline-parallel-size": 1,
    "--enable-lora": False,
    "--enable-chunked-prefill": None,
}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="N engine replicas (each with its own --tensor-parallel-size ranks and KV cache) behind "
                        "this one server: each request goes to the replica with the most free KV blocks, or to "
                        "one that recently served the same prompt beginning (its prefix cache)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", nargs="+", default=None)
    g.add_argument("--api-key", default=None, help="also read from PAGEDLLM_API_KEY")
    g.add_argument("--chat-template", default=None, help="a jinja template or a file holding one")
    add_generation_config_args(g)
    g.add_argument("--disable-log-requests", action="store_true")
    g.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="larger request bodies get 413 before they are read (default: 64 bytes per token of "
                        "max_model_len, at least 8 MiB)")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="requests waiting to be scheduled beyond which new ones get 503 + Retry-After "
                        "(default: no limit, as vLLM)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide when to call tools (tool_choice auto); needs --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS),
                   help="how tool calls are read from the model's reply: hermes (<tool_call> JSON blocks: Qwen, "
                        "Hermes), llama3_json (a JSON object: Llama 3.1+), qwen3_coder (<tool_call> XML blocks: "
                        "Qwen3-Coder), mistral ([TOOL_CALLS]: Mistral, Devstral, Magistral) or openai (gpt-oss' "
                        "harmony function calls); unset, picked from the chat template where it shows one")
    g.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                   help="send a thinking model's reasoning as reasoning_content, apart from the answer's content (a "
                        "structured output then starts after it): deepseek_r1 or qwen3 read a think block (<think> "
                        "... </think>; whether the reply starts inside it is read from the rendered prompt); gpt_oss "
                        "(or openai_gptoss) reads gpt-oss' harmony channels, and is picked when the chat template "
                        "renders harmony")
    g.add_argument("--structured-outputs-config", default=None, type=_structured_outputs_config,
                   help="JSON, vLLM's: {\"enable_in_reasoning\": true} constrains a thinking model's whole reply, its "
                        "reasoning included; by default (false) a structured output starts after the reasoning")
    g.add_argument("--no-web-ui", action="store_true",
                   help="serve no web page at / (by default: chat, speech for an audio model, and live memory, in the "
                        "browser; it calls this server's API with the key it asks for)")
    add_cors_args(g)
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's head (request line and headers) may take to arrive; slower "
                        "connections are closed")
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may go without sending a byte; then 408")
    g.add_argument("--require-api-key-for-metrics", action="store_true",
                   help="/metrics needs the API key too (by default it is open, as vLLM's, for Prometheus scrapers: "
                        "it shows request counts, latencies and memory, no request content)")
    g.add_argument("--max-connections", type=int, default=None,
                   help="connections served at once, more get 503 (default: the open-files limit, raised to its "
                        "hard limit at start, less 256)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests may take to finish after SIGTERM/SIGINT before they are "
                        "ended with an error (a second signal ends them at once)")
    add_limit_args(parser.add_argument_group("request limits (each a 400 naming its flag)"))
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_audio_server_args(parser)
    u = parser.add_argument_group("vLLM flags not implemented yet (refused unless at their neutral value)")
    for flag, neutral in UNIMPLEMENTED_FLAGS.items():
        if isinstance(neutral, bool):
            u.add_argument(flag, action="store_true", default=neutral)
        elif isinstance(neutral, int) and not isinstance(neutral, bool):
            u.add_argument(flag, type=int, default=neutral)
        elif isinstance(neutral, float):
            u.add_argument(flag, type=float, default=neutral)
        else:
            u.add_argument(flag, default=neutral)
    u.add_argument("--trust-remote-code", action="store_true",
                   help="accepted: pagedllm runs only its own model code, never a checkpoint's")


def refuse_unimplemented(ns: argparse.Namespace) -> None:
    for flag, neutral in UNIMPLEMENTED_FLAGS.items():
        value = getattr(ns, flag.lstrip("-").replace("-", "_"))
        if value != neutral:
            raise ValueError(
                f"{flag} {'' if isinstance(value, bool) else value} is a vLLM flag that pagedllm does not "
                f"implement yet, and pagedllm never accepts a flag it would ignore. Remove {flag} to start."
                .replace("  ", " "))


STRUCTURED_OUTPUTS_CONFIG_KEYS = ("enable_in_reasoning", "backend")


def _structured_outputs_config(value: str) -> dict:
    """--structured-outputs-config: the keys pagedllm reads (backend: xgrammar, the only one, or auto)."""
    config = json_object_arg(value)
    unknown = set(config) - set(STRUCTURED_OUTPUTS_CONFIG_KEYS)
    if unknown:
        raise argparse.ArgumentTypeError(f"keys {sorted(unknown)} are not supported; these are: "
                                         f"{', '.join(STRUCTURED_OUTPUTS_CONFIG_KEYS)}")
    if config.get("backend", "xgrammar") not in ("xgrammar", "auto"):
        raise argparse.ArgumentTypeError(f"backend {config['backend']!r}: pagedllm's structured outputs are xgrammar's "
                                         f"(xgrammar or auto)")
    if not isinstance(config.get("enable_in_reasoning", False), bool):
        raise argparse.ArgumentTypeError("enable_in_reasoning must be true or false")
    return config


def _read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    if len(value) < 4096 and path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a jinja template")
    return value


def resolve_api_key(flag: str | None) -> str | None:
    """--api-key, else PAGEDLLM_API_KEY, else None (no key). An empty or blank key is refused: it would turn
    authentication off without a word (`--api-key "$KEY"` with KEY unset)."""
    source, key = ("--api-key", flag) if flag is not None else ("PAGEDLLM_API_KEY", os.environ.get("PAGEDLLM_API_KEY"))
    if key is not None and not key.strip():
        raise ValueError(f"{source} is empty: an empty key would leave the server open to anyone. Give a key, or "
                         f"leave {source} out to serve without one.")
    return key


def run_server(ns: argparse.Namespace) -> int:
    from pagedllm.engine.arg_utils import engine_args_from
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.demo import DEMO_SERVED_NAME
    from pagedllm.entrypoints.llm import load_tokenizer

    refuse_unimplemented(ns)
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)})")
    chat_template = _read_chat_template(ns.chat_template)
    api_key = resolve_api_key(ns.api_key)
    config = engine_args_from(ns, server=True).create_engine_config()  # bad settings are refused here, before any replica
    generation_defaults = GenerationDefaults.resolve(ns.generation_config, config.model.path,
                                                     ns.override_generation_config)
    if ns.data_parallel_size != 1:
        if ns.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {ns.data_parallel_size}.")
        from pagedllm.entrypoints.openai.data_parallel import serve_data_parallel

        return serve_data_parallel(ns, api_key)
    tokenizer = load_tokenizer(config.model.tokenizer) if config.model.tokenizer else None
    tool_call_parser = ns.tool_call_parser if ns.enable_auto_tool_choice else None
    template = chat_template or getattr(tokenizer, "chat_template", None)
    reasoning_parser = reasoning_parser_for(ns.reasoning_parser, template if isinstance(template, str) else None)
    if reasoning_parser != ns.reasoning_parser:
        logger.info("the chat template renders harmony (gpt-oss): replies are read by channel (--reasoning-parser "
                    "gpt_oss): analysis as reasoning_content, final as content, function calls as tool_calls")
    if ns.tool_call_parser == "openai" and reasoning_parser not in HARMONY_PARSERS:
        raise ValueError("--tool-call-parser openai reads gpt-oss' harmony function calls, and this model's chat "
                         "template does not render harmony: name the parser of its call format (hermes, "
                         "llama3_json, qwen3_coder, mistral).")
    if not ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        # Chat front-ends (Open WebUI) send their tools with no tool_choice, i.e. auto: read the calls in the
        # format the model's own template renders, rather than refuse every such chat.
        tool_call_parser = tool_call_parser_for_template(template)
        if tool_call_parser is not None:
            logger.info("tool_choice auto reads %s tool calls: the format the chat template renders tools in "
                        "(--enable-auto-tool-choice --tool-call-parser NAME to choose)", tool_call_parser)
    audio = audio_server_config(ns)
    if audio.enabled:
        from pagedllm.entrypoints.openai.audio_setup import create_audio_engine

        llm_engine = create_audio_engine(config, tokenizer, audio)
    else:
        llm_engine = LLMEngine(config, tokenizer)
    names = ns.served_model_name or [ns.model or DEMO_SERVED_NAME]
    metrics = EngineMetrics(names[0])
    stop_on_lost_worker = _StopOnLostWorker()
    engine = AsyncLLMEngine(llm_engine, step_listener=metrics.on_step, abort_listener=metrics.on_abort,
                            failure_listener=stop_on_lost_worker)
    request_templates = None
    if ns.trust_request_chat_template:
        special = getattr(tokenizer, "special_tokens_map", {}) if tokenizer is not None else {}
        request_templates = RequestTemplateRenderer({k: v for k, v in special.items() if isinstance(v, str)},
                                                    timeout_s=ns.request_chat_template_timeout)
    app = build_app(engine, names, api_key, chat_template, metrics, audio, ns.max_request_body_bytes,
                    ns.max_waiting_requests, tool_call_parser,
                    RequestLimits.from_args(ns), request_templates, ns.body_timeout, ns.require_api_key_for_metrics,
                    generation_defaults, reasoning_parser,
                    constrain_reasoning=(ns.structured_outputs_config or {}).get("enable_in_reasoning", False),
                    web_ui=not ns.no_web_ui)
    generation_defaults.log(ns.generation_config)
    logger.info("serving %s on http://%s:%d/v1 (max_model_len %d)%s", ", ".join(names), ns.host, ns.port,
                llm_engine.config.model.max_model_len,
                "" if ns.no_web_ui else f"; web page: http://{ns.host}:{ns.port}/")
    def end_requests() -> None:  # streams get their error event; compiles and request templates are killed
        engine.abort_all("the server is shutting down: this request was ended before it finished")
        llm_engine.structured_outputs.cancel_all()
        if request_templates is not None:
            request_templates.shutdown()

    config = uvicorn_config(with_cors(app.state.guard, ns), ns, CLOSE_GRACE_S, access_log=not ns.disable_log_requests)
    server = DrainingServer(config, app.state.guard, ns.shutdown_timeout, end_requests)
    stop_on_lost_worker.server = server
    try:
        server.run()
    finally:
        engine.shutdown()
        if request_templates is not None:
            request_templates.shutdown()
        if app.state.audio is not None:
            app.state.audio.shutdown()
    if isinstance(engine.errored, WorkerError):
        logger.error("exiting: %s", engine.errored)
        return 1
    return 1 if server.forced else 0


class _StopOnLostWorker:
    """A tensor-parallel worker lost (dead, failed, silent): its requests have their 503s; the server then
    stops (exit status 1) rather than serve on unhealthy. Other engine errors leave it up, /health 503."""

    GRACE_S = 1.0  # for the 503s already queued to be written

    def __init__(self) -> None:
        self.server: DrainingServer | None = None

    def __call__(self, error: BaseException) -> None:
        server = self.server
        if isinstance(error, WorkerError) and server is not None and server.loop is not None:
            server.loop.call_soon_threadsafe(server.loop.call_later, self.GRACE_S, server.stop)


def build_parser() -> argparse.ArgumentParser:
    from pagedllm.engine.arg_utils import add_engine_args

    parser = argparse.ArgumentParser(prog="python -m pagedllm.entrypoints.openai.api_server")
    parser.add_argument("--log-level", default="INFO")
    add_engine_args(parser, server=True)
    add_server_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagedllm.entrypoints.command import run_command

    parser = build_parser()
    ns = parser.parse_args(argv)
    return run_command(run_server, ns)


if __name__ == "__main__":
    sys.exit(main())
