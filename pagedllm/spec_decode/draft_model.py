"""Draft-model proposals: a small model of the target's vocabulary, loaded in the same model runner.

Its K/V lives in its own cache tensor, indexed by the target's block tables (a block holds both models' K/V of
the same tokens, so the block manager, prefix caching and recompute preemption need nothing of their own). Every
step the draft runs over the step's tokens too (`follow`), so its cache holds what the target's does; after the
step, `propose` runs k one-token steps from each request's last token. Greedy requests take the draft's first
choice at each position; sampled ones draw from the draft's distribution under the request's own parameters, and
keep those distributions (q) for the accept / reject rule."""
from __future__ import annotations

import torch

from pagedllm.config import EngineConfig
from pagedllm.model_executor.attention import AttentionShape, bind_kv_cache, forward_context, kv_cache_shape
from pagedllm.model_executor.attention.selector import unsupported_reason
from pagedllm.model_executor.loader import load_model
from pagedllm.model_executor.sampler import argmax_rows, sample_from_probs
from pagedllm.spec_decode.verify import DraftPosition, speculates

DRAFT_SEED_SALT = 0x2545F4914F6CDD1D  # a seeded request's draft draws: its seed xor this


class DraftModelProposer:
    def __init__(self, config: EngineConfig, runner) -> None:
        self.config = config
        self.runner = runner  # its attention backend builds the draft's step metadata, its sampler shapes q
        self.k = config.speculative.num_speculative_tokens
        m = config.draft_model
        shape = AttentionShape(runner.device, m.hf_config.num_attention_heads, m.num_kv_heads, m.head_dim, m.dtype,
                               config.kv_cache_dtype)
        reason = unsupported_reason(runner.attn_backend.name, shape)
        if reason is not None:
            raise ValueError(f"the draft model {m.model} cannot run on the {runner.attn_backend.name} attention "
                             f"backend the target uses: {reason}")
        self.loaded = load_model(m, runner.device)
        self.model = self.loaded.model
        # A draft may have fewer (padding) rows in its vocabulary than the target (Qwen2.5-0.5B: 151,936 for
        # 7B's 152,064): its logits are widened with -inf, and ids past its table read its last row.
        self.vocab_size = m.vocab_size
        self.pad = config.model.vocab_size - m.vocab_size
        self.kv_cache: torch.Tensor | None = None

    @property
    def weight_bytes(self) -> int:
        return self.loaded.weight_bytes

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.config.draft_model
        shape = kv_cache_shape(m.num_layers, m.num_kv_heads, num_blocks * self.runner.block_size, m.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.runner.kv_cache.dtype, device=self.runner.device)
        bind_kv_cache(self.model.attention_layers(), self.kv_cache)

    def release_kv_cache(self) -> None:
        self.kv_cache = None
        bind_kv_cache(self.model.attention_layers(), None)

    def _forward(self, starts: list[int], lengths: list[int], tables: list[list[int]], ids: torch.Tensor):
        backend = self.runner.attn_backend
        metas = [backend.build_metadata(starts, lengths, tables, self.runner.block_size, self.runner.device)]
        if self.pad:
            ids = ids.clamp(max=self.vocab_size - 1)
        with forward_context(metas):
            return self.model(ids, metas[0].positions)

    @torch.inference_mode()
    def follow(self, starts: list[int], lengths: list[int], tables: list[list[int]], input_ids: list[int]) -> None:
        """The step's tokens through the draft: its K/V of them, where the target's goes."""
        self._forward(starts, lengths, tables, torch.tensor(input_ids, dtype=torch.long, device=self.runner.device))

    @torch.inference_mode()
    def propose(self, requests: list, block_tables: dict[str, list[int]],
                num_drafts: int | None = None) -> dict[str, list[int]]:
        """k drafts (or `num_drafts`, fewer: the on/off rule's) for each request that generates text, from its last
        token (whose K/V is not computed yet). `block_tables`: each request's table as this step had it (it has room
        for the drafts' positions)."""
        k = self.k if num_drafts is None else min(self.k, num_drafts)
        reqs = [r for r in requests if speculates(r)]
        if not reqs or k < 1:
            return {}
        sampler, device = self.runner.sampler, self.runner.device
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        rooms = [min(k, self._room(r)) for r in reqs]  # drafts the scheduler could check
        last = [r.all_token_ids[-1] for r in reqs]
        for j in range(max(rooms, default=0)):
            active = [i for i, room in enumerate(rooms) if room > j]
            hidden = self._forward([reqs[i].num_tokens - 1 + j for i in active], [1] * len(active),
                                   [block_tables[reqs[i].request_id] for i in active],
                                   torch.tensor([last[i] for i in active], dtype=torch.long, device=device))
            logits = self.model.compute_logits(hidden)
            if self.pad:
                logits = torch.nn.functional.pad(logits.float(), (0, self.pad), value=float("-inf"))
            views = [DraftPosition(reqs[i], drafts[i]) for i in active]
            tokens = argmax_rows(sampler.adjusted_logits(logits, views)).tolist()
            sampled = [row for row, i in enumerate(active) if not reqs[i].sampling_params.greedy]
            if sampled:
                index = torch.tensor(sampled, device=device)
                q = sampler.probs(logits[index], [views[row] for row in sampled])
                uniform = sampler.uniforms([views[row] for row in sampled], DRAFT_SEED_SALT)
                draws = sample_from_probs(q.double(), torch.tensor(uniform, dtype=torch.float64, device=device))
                for n, (row, token) in enumerate(zip(sampled, draws.tolist())):
                    tokens[row] = token
                    probs[active[row]].append(q[n])
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                last[i] = tokens[row]
        sampled = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy and drafts[i]]
        for i in sampled:
            reqs[i].draft_probs = torch.stack(probs[i])
        return {r.request_id: d for r, d in zip(reqs, drafts) if d}

    def _room(self, request) -> int:
        """Drafts a request may still check: it ends at max_tokens or max_model_len, and a step that checks d
        drafts writes up to d + 1 tokens."""
        p = request.sampling_params
        limit = self.config.model.max_model_len - request.num_prompt_tokens
        if p.max_tokens is not None:
            limit = min(limit, p.max_tokens)
        return limit - request.num_output_tokens - 1
