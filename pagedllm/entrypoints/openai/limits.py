"""Limits a request is checked against before any work is done for it: each one a server flag with a default
that no ordinary client meets, and a 400 that names the flag. What they stop: 500,000 stop strings made every
engine step take 2.4 s; a 6 KB body asked for 102,400 sequences; n=128 x 1,000 tokens x 20 logprobs built a
response that held the event loop for 3.8 s."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    max_stop_strings: int = 256
    max_stop_bytes: int = 32 << 10  # all stop strings together
    max_sequences: int = 1024  # prompts x n in one request
    max_logprobs_entries: int = 500_000  # logprob entries one response may carry (sequences x tokens x (top + 1))

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> RequestLimits:
        return cls(ns.max_stop_strings, ns.max_stop_bytes, ns.max_sequences_per_request, ns.max_logprobs_entries)

    def check(self, params: SamplingParams, num_prompts: int, max_tokens: int,
              logprobs_param: str = "logprobs") -> None:
        """A request of `num_prompts` prompts (n samples each) with these parameters."""
        stops = params.stop
        if len(stops) > self.max_stop_strings:
            _refuse("stop", f"{len(stops)} stop strings", self.max_stop_strings, "--max-stop-strings")
        stop_bytes = sum(len(s.encode("utf-8", "surrogatepass")) for s in stops)
        if stop_bytes > self.max_stop_bytes:
            _refuse("stop", f"stop strings of {stop_bytes} bytes in all", self.max_stop_bytes, "--max-stop-bytes")
        sequences = num_prompts * params.n
        if sequences > self.max_sequences:
            _refuse("n", f"{sequences} sequences ({num_prompts} prompts x n={params.n})", self.max_sequences,
                    "--max-sequences-per-request")
        if params.logprobs is not None:
            entries = sequences * max_tokens * (params.logprobs + 1)
            if entries > self.max_logprobs_entries:
                _refuse(logprobs_param, f"up to {entries} logprob entries ({sequences} sequences x {max_tokens} "
                                        f"tokens x {params.logprobs + 1})", self.max_logprobs_entries,
                        "--max-logprobs-entries")


def _refuse(param: str, what: str, limit: int, flag: str) -> None:
    raise APIError(400, f"The request asks for {what}, over this server's limit of {limit} ({flag}).", param)


def add_limit_args(group: argparse._ArgumentGroup) -> None:
    defaults = RequestLimits()
    group.add_argument("--max-stop-strings", type=int, default=defaults.max_stop_strings,
                       help="stop strings one request may give")
    group.add_argument("--max-stop-bytes", type=int, default=defaults.max_stop_bytes,
                       help="bytes of one request's stop strings together")
    group.add_argument("--max-sequences-per-request", type=int, default=defaults.max_sequences,
                       help="sequences one request may ask for (prompts x n)")
    group.add_argument("--max-logprobs-entries", type=int, default=defaults.max_logprobs_entries,
                       help="logprob entries one response may carry (sequences x max_tokens x (logprobs + 1))")
    group.add_argument("--request-chat-template-timeout", type=float, default=2.0,
                       help="seconds a request's own chat template may take to render")
