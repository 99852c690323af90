"""Speculative decoding with a draft model (method draft_model), tiny fp32 checkpoints: greedy tokens and logprobs
equal to no speculation for four architectures (the target itself as its draft: every draft kept) and with a
different draft (some rejected), under chunked prefill and recompute preemption; sampled tokens distributed as the
target's with a noisy draft's q (chi-square against transformers), and a rule that replaces rejected drafts from p
instead of the residual failing the same test; configurations it cannot run refused at start; the draft's weights
and K/V in the memory plan."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.helpers import ARCHS
from tests.spec_decode.test_ngram_engine import ENGINE, GREEDY, PROMPTS, _marginal_of_second_token, _run
from tests.test_sampler import chi2_sf


def _draft(path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k, "adaptive": False}


@pytest.mark.parametrize("arch", ARCHS)
def test_the_target_as_its_own_draft_keeps_every_draft_and_changes_no_token(tiny_models, arch):
    path = tiny_models[arch]
    ref, ref_lps, _, _, _ = _run(path, spec=None)
    tokens, lps, stats, _, _ = _run(path, spec=_draft(path))
    assert tokens == ref
    for a, b in zip(lps, ref_lps):
        assert a == pytest.approx(b, abs=1e-4)
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens == stats.num_draft_tokens


def _perturbed_copy(path, dest, scale: float):
    """The checkpoint with noise added to every weight (a draft that agrees with it some of the time)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, dest)
    for file in dest.glob("*.safetensors"):
        tensors = load_file(str(file))
        g = torch.Generator().manual_seed(5)
        save_file({k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.dim() > 1 else v
                   for k, v in tensors.items()}, str(file))
    return dest


def test_a_different_draft_is_partly_rejected_and_changes_no_token_under_preemption(tiny_models, tmp_path):
    target = tiny_models["llama"]
    draft = _perturbed_copy(target, tmp_path / "draft", 0.5)
    ref, ref_lps, _, _, _ = _run(target, spec=None)
    tokens, lps, stats, preemptions, _ = _run(target, spec=_draft(draft, 4), num_gpu_blocks_override=48)
    assert tokens == ref
    for a, b in zip(lps, ref_lps):
        assert a == pytest.approx(b, abs=1e-4)
    assert preemptions.recompute > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_configurations_it_cannot_run_are_refused_at_start(tiny_models, tmp_path):
    target = tiny_models["llama"]
    other_vocab = tiny_models["qwen2"]
    for spec, engine, says in ((_draft(other_vocab), {}, "share the target's tokenizer"),
                               (_draft(target), {"tensor_parallel_size": 2}, "tensor-parallel-size"),
                               (_draft(target), {"swap_space": 0.01}, "--swap-space"),
                               ({"method": "draft_model"}, {}, "needs \"model\""),
                               ({"method": "ngram", "model": str(target)}, {}, "only it takes one")):
        if spec.get("model") == str(other_vocab) and json.loads((other_vocab / "config.json").read_text())[
                "vocab_size"] == json.loads((target / "config.json").read_text())["vocab_size"]:
            continue  # (the tiny checkpoints' vocabularies match: nothing to refuse)
        with pytest.raises(ValueError, match=says):
            LLM(str(target), speculative_config=spec, **{**ENGINE, **engine})


def test_the_plan_holds_the_drafts_weights_and_kv(tiny_models):
    target = tiny_models["llama"]
    with LLM(str(target), kv_cache_memory="1MiB", **ENGINE) as plain:
        base = plain.llm_engine.memory_plan
    with LLM(str(target), speculative_config=_draft(target), kv_cache_memory="1MiB", **ENGINE) as llm:
        plan = llm.llm_engine.memory_plan
        runner = llm.llm_engine.executor.driver
        assert plan.settings.draft_weight_bytes == runner.draft.weight_bytes == runner.weight_bytes
        assert plan.kv_bytes_per_token == 2 * base.kv_bytes_per_token  # the same model twice
        assert runner.draft.kv_cache.shape[3] == runner.kv_cache.shape[3]  # the same blocks
        assert plan.num_blocks == base.num_blocks // 2  # the same bytes hold half the blocks
        assert "draft model weights" in plan.table() and "draft KV cache per token" in plan.table()


def test_sampled_tokens_follow_the_target_distribution_with_a_random_draft(tmp_path, monkeypatch):
    """The demo model as the target, a noisy copy of it as the draft (its q near p, not equal): the second token's
    counts over 3000 samples match transformers' probabilities; replacing a rejected draft by a draw from p instead
    of the residual max(0, p - q) fails. (Checking a draft as if it were certain, q ignored, is no bug: that rule
    keeps p for any draft, as n-gram drafts use it, only less often keeps the draft.)"""
    from transformers import AutoTokenizer

    from pagedllm.demo import CORPUS, demo_model_path

    target = demo_model_path()
    draft = _perturbed_copy(target, tmp_path / "draft", 0.3)
    prompt = AutoTokenizer.from_pretrained(str(target))(CORPUS[:300])["input_ids"]
    temperature = 0.8
    expected = _marginal_of_second_token(target, prompt, temperature)

    def p_value():
        params = SamplingParams(temperature=temperature, max_tokens=3, n=3000, seed=99, ignore_eos=True)
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 1,
                "adaptive": False}
        with LLM(str(target), speculative_config=spec, dtype="float32", max_num_seqs=256) as llm:
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            stats = llm.llm_engine.spec_decode_stats
        counts = torch.bincount(torch.tensor([o.token_ids[1] for o in out.outputs]),
                                minlength=len(expected)).double()
        exp = expected * 3000
        big = exp >= 5
        obs, exp = torch.cat([counts[big], counts[~big].sum()[None]]), torch.cat([exp[big], exp[~big].sum()[None]])
        return chi2_sf(float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1), stats

    p, stats = p_value()
    assert stats.num_draft_tokens >= 2900 and 0.2 * stats.num_draft_tokens < stats.num_accepted_tokens \
        < stats.num_draft_tokens
    assert p > 1e-4

    from pagedllm.model_executor import model_runner
    from pagedllm.model_executor.sampler import sample_from_probs

    def residual_forgotten(probs, drafts, accept_u, draw_u, draft_probs=None):
        """The classic bug: a rejected draft replaced by a draw from p, not from max(0, p - q)."""
        x = drafts[0]
        if accept_u[0] * float(draft_probs[0, x]) < float(probs[0, x]):
            return [x]
        return [int(sample_from_probs(probs[:1].double(), torch.tensor([draw_u[0]], dtype=torch.float64))[0])]

    monkeypatch.setattr(model_runner, "sampled_chain", residual_forgotten)
    p, _ = p_value()
    assert p < 1e-6
