"""Proposers: after a step, each generating request's drafts for its next step."""
from __future__ import annotations

from pagedllm.speculative_config import SpeculativeConfig
from pagedllm.spec_decode.ngram import propose_ngram


def speculates(request) -> bool:
    """Requests that get drafts: those generating text (a structured output's too: the engine masks each draft
    position's row by its grammar)."""
    return request.pooling_params is None and request.audio_state is None


class NgramProposer:
    """Prompt lookup over the request's own tokens (prompt and output)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, requests: list) -> dict[str, list[int]]:
        c = self.config
        out = {}
        for req in requests:
            if speculates(req):
                drafts = propose_ngram(req.all_token_ids, c.prompt_lookup_min, c.prompt_lookup_max,
                                       c.num_speculative_tokens)
                if drafts:
                    out[req.request_id] = drafts
        return out


def make_proposer(config: SpeculativeConfig | None) -> NgramProposer | None:
    if config is None:
        return None
    return NgramProposer(config)
