"""The compiled-grammar cache: bounded in bytes by VLLM_XGRAMMAR_CACHE_MB (as vLLM), least recently used out,
its size what /v1/memory reports; a bad value of the variable is refused by name."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedllm.structured_output import GrammarCompiler, GuidedDecodingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models["llama"])


def schema(i: int) -> GuidedDecodingParams:
    return GuidedDecodingParams(json={"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                      "required": [f"k{i}"]})


def test_the_cache_keeps_within_its_bytes_and_drops_the_least_recently_used(tokenizer, monkeypatch):
    one = GrammarCompiler(tokenizer, len(tokenizer)).compile(schema(0)).memory_size_bytes
    assert one > 0
    monkeypatch.setenv("VLLM_XGRAMMAR_CACHE_MB", str(3.5 * one / 2**20))  # room for three
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    first = compiler.compile(schema(0))
    for i in range(1, 3):
        compiler.compile(schema(i))
    assert compiler.compile(schema(0)) is first  # a hit, and now the most recently used
    for i in range(3, 10):
        compiler.compile(schema(i))
        assert 0 < compiler.cache_bytes <= compiler.cache_limit_bytes
    assert compiler.cache_bytes >= 2 * one  # (sizes differ by a few bytes between schemas)
    assert compiler.compile(schema(0)) is not first  # dropped long ago: compiled again
    assert compiler.compile(schema(9)) is compiler.compile(schema(9))


@pytest.mark.parametrize("value", ["lots", "-1"])
def test_a_bad_cache_size_is_refused_by_name(tokenizer, monkeypatch, value):
    monkeypatch.setenv("VLLM_XGRAMMAR_CACHE_MB", value)
    with pytest.raises(ValueError, match="VLLM_XGRAMMAR_CACHE_MB"):
        GrammarCompiler(tokenizer, len(tokenizer))
