"""Proposers: after a step, each generating request's drafts for its next step."""
from __future__ import annotations

from pagedllm.speculative_config import SpeculativeConfig
from pagedllm.spec_decode.ngram import propose_ngram
from pagedllm.spec_decode.verify import speculates


class NgramProposer:
    """Prompt lookup over the request's own tokens (prompt and output)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, requests: list, block_tables: dict[str, list[int]] | None = None,
                num_drafts: int | None = None) -> dict[str, list[int]]:
        c = self.config
        out = {}
        for req in requests:
            if speculates(req):
                drafts = propose_ngram(req.all_token_ids, c.prompt_lookup_min, c.prompt_lookup_max,
                                       c.num_speculative_tokens)
                if drafts:
                    out[req.request_id] = drafts
        return out


def make_proposer(config, runner):
    """The engine config's proposer (None: no speculative decoding), made in the model runner."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "draft_model":
        from pagedllm.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, runner)
    return NgramProposer(spec)
