"""Request defaults from the model's generation_config.json, as vLLM's `--generation-config` and
`--override-generation-config` give them.

Model makers publish their recommended sampling in generation_config.json (Qwen3: temperature 0.6, top_p 0.95,
top_k 20). `--generation-config auto` (the default, as vLLM's) uses those values for the requests that leave the
field out; `vllm` ignores the file; a folder reads that folder's generation_config.json instead.
`--override-generation-config '{"temperature": 0.5}'` sets or replaces values on top. `max_new_tokens` caps every
request's max_tokens (vLLM's rule: the smallest of the request's, the context left and this one), so an operator
can bound the tokens one request may cost. Values equal to transformers' own defaults are not applied (a file
that restates them recommends nothing), as vLLM does.
"""
from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.model_executor.model_files import generation_config

logger = logging.getLogger("pagedllm.server")

# generation_config.json key -> request field
REQUEST_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# transformers' GenerationConfig defaults: a file that only restates them sets nothing.
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def add_generation_config_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--generation-config", default="auto",
                       help="request defaults (temperature, top_p, top_k, min_p, repetition_penalty, "
                            "max_new_tokens): 'auto' from the model's generation_config.json, 'vllm' none, or a "
                            "folder holding a generation_config.json")
    group.add_argument("--override-generation-config", default=None, type=json_object_arg,
                       help="JSON object of generation-config values set on top, e.g. "
                            "'{\"temperature\": 0.5, \"max_new_tokens\": 512}'; max_new_tokens caps every request")


def json_object_arg(text: str) -> dict:
    """An argparse type: a JSON object given as text."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"needs a JSON object, got {text!r}")
    return value


@dataclass(frozen=True)
class GenerationDefaults:
    """Request field -> the value a request that leaves it out gets (max_tokens: a cap on every request)."""

    values: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def resolve(cls, source: str, model_path: Path, override: dict | None) -> GenerationDefaults:
        """`source` as --generation-config takes it; `override` as --override-generation-config. Unknown keys in
        the override and values out of range are refused (ValueError naming the flag)."""
        if source == "vllm":
            found: dict = {}
        elif source == "auto":
            found = generation_config(model_path)
        else:
            folder = Path(source)
            if not (folder / "generation_config.json").is_file():
                raise ValueError(f"--generation-config {source}: no generation_config.json in that folder (give "
                                 f"'auto' for the model's own, 'vllm' for none, or a folder holding one)")
            found = generation_config(folder)
        values = {REQUEST_FIELDS[k]: v for k, v in found.items()
                  if k in REQUEST_FIELDS and v is not None and _HF_DEFAULTS.get(k) != v}
        unknown = sorted(set(override or {}) - set(REQUEST_FIELDS))
        if unknown:
            raise ValueError(f"--override-generation-config: {', '.join(unknown)} not used by pagedllm; the keys "
                             f"it takes: {', '.join(REQUEST_FIELDS)}")
        values |= {REQUEST_FIELDS[k]: v for k, v in (override or {}).items()}
        defaults = cls(values)
        defaults._check()
        return defaults

    def _check(self) -> None:
        from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest

        sampling = {k: v for k, v in self.values.items() if k != "max_tokens"}
        try:
            ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **sampling})
        except Exception as e:  # pydantic's ValidationError: the request fields' own ranges
            raise ValueError(f"generation config values out of range {sampling}: {e}") from None
        cap = self.values.get("max_tokens")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"generation config max_new_tokens must be an integer >= 1, got {cap!r}")

    def log(self, source: str) -> None:
        if self.values:
            logger.info("request defaults from the generation config (--generation-config %s, "
                        "--override-generation-config): %s; '--generation-config vllm' ignores the model's",
                        source, json.dumps(self.values))

    def fill(self, req: Any) -> None:
        """Set the request's sampling fields it left out (None) to these defaults."""
        for name, value in self.values.items():
            if name != "max_tokens" and getattr(req, name, 0) is None:
                setattr(req, name, value)

    def cap_max_tokens(self, max_tokens: int | None) -> int | None:
        cap = self.values.get("max_tokens")
        if cap is None:
            return max_tokens
        return cap if max_tokens is None else min(max_tokens, cap)
