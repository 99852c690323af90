"""SamplingParams: vLLM defaults, normalisation, and ValueErrors that name the field and the value."""
from __future__ import annotations

import re

import pytest

from pagedllm.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "name", "value"),
    [
        ({"temperature": -0.5}, "temperature", "-0.5"),
        ({"temperature": -1e-9}, "temperature", "-1e-09"),
        ({"temperature": float("nan")}, "temperature", "nan"),
        ({"top_p": 0.0}, "top_p", "0.0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_p": -0.1}, "top_p", "-0.1"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"top_k": 2.5}, "top_k", "2.5"),
        ({"min_p": 1.5}, "min_p", "1.5"),
        ({"min_p": -0.1}, "min_p", "-0.1"),
        ({"n": 0}, "n", "0"),
        ({"n": -3}, "n", "-3"),
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"max_tokens": -5}, "max_tokens", "-5"),
        ({"min_tokens": -1}, "min_tokens", "-1"),
        ({"logprobs": -1}, "logprobs", "-1"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "-1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "0.0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "-1.0"),
        ({"presence_penalty": 3.0}, "presence_penalty", "3.0"),
        ({"presence_penalty": -2.5}, "presence_penalty", "-2.5"),
        ({"frequency_penalty": 2.1}, "frequency_penalty", "2.1"),
        ({"seed": "abc"}, "seed", "abc"),
    ],
)
def test_invalid_value_names_parameter_and_value(kwargs: dict, name: str, value: str) -> None:
    with pytest.raises(ValueError) as exc_info:
        SamplingParams(**kwargs)
    msg = str(exc_info.value)
    assert re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", msg), msg
    # The bad value appears as itself (its repr), not as part of a longer number.
    shown = repr(kwargs[name])
    assert shown.strip("'") == value
    assert re.search(rf"(?<![\w.\-]){re.escape(shown)}(?![\d])", msg), msg


def test_min_tokens_greater_than_max_tokens() -> None:
    with pytest.raises(ValueError) as exc_info:
        SamplingParams(min_tokens=10, max_tokens=5)
    msg = str(exc_info.value)
    assert "min_tokens" in msg and "max_tokens" in msg
    assert "10" in msg and "5" in msg
    # Equal is fine, and so is any min_tokens without a max_tokens.
    assert SamplingParams(min_tokens=5, max_tokens=5).min_tokens == 5
    assert SamplingParams(min_tokens=500, max_tokens=None).min_tokens == 500


@pytest.mark.parametrize("stop", ["", ["ok", ""]])
def test_empty_stop_string(stop) -> None:
    with pytest.raises(ValueError) as exc_info:
        SamplingParams(stop=stop)
    msg = str(exc_info.value)
    assert "stop" in msg
    assert "''" in msg  # the offending empty string is shown


def test_non_string_stop() -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["ok", 3])


def test_negative_stop_token_id() -> None:
    with pytest.raises(ValueError) as exc_info:
        SamplingParams(stop_token_ids=[5, -1])
    msg = str(exc_info.value)
    assert "stop_token_ids" in msg and "-1" in msg


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.presence_penalty == 0.0
    assert p.frequency_penalty == 0.0
    assert p.repetition_penalty == 1.0
    assert p.seed is None
    assert p.stop == []
    assert p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.logprobs is None
    assert p.prompt_logprobs is None
    assert p.skip_special_tokens is True
    assert p.spaces_between_special_tokens is True
    assert p.include_stop_str_in_output is False
    assert p.greedy is False


def test_valid_edge_values_accepted() -> None:
    p = SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
                       repetition_penalty=1e-3, logprobs=0, prompt_logprobs=0, max_tokens=1, seed=0, n=4)
    assert p.logprobs == 0 and p.prompt_logprobs == 0 and p.max_tokens == 1 and p.n == 4
    q = SamplingParams(top_p=1e-6, top_k=1, min_p=0.0, max_tokens=None)
    assert q.top_p == 1e-6 and q.top_k == 1 and q.max_tokens is None


def test_stop_str_becomes_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []


def test_stop_list_is_copied() -> None:
    stops = ["a"]
    ids = [3]
    p = SamplingParams(stop=stops, stop_token_ids=ids)
    stops.append("b")
    ids.append(4)
    assert p.stop == ["a"]
    assert p.stop_token_ids == [3]


def test_stop_token_ids_none_becomes_empty_list() -> None:
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(2, 3)).stop_token_ids == [2, 3]


def test_top_k_minus_one_means_disabled() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


@pytest.mark.parametrize(("temperature", "greedy"), [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False),
                                                     (2.0, False)])
def test_greedy_flag(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_greedy_resets_distribution_knobs() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.greedy
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    q = SamplingParams(temperature=0.8, top_p=0.5, top_k=3, min_p=0.2)
    assert (q.top_p, q.top_k, q.min_p) == (0.5, 3, 0.2)


def test_greedy_still_validates_knobs() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=0.0, top_p=0.0)


def test_clone_applies_changes_and_revalidates() -> None:
    p = SamplingParams(temperature=0.5, stop="x", seed=3)
    q = p.clone(seed=4)
    assert q.seed == 4 and q.temperature == 0.5 and q.stop == ["x"]
    assert p.seed == 3
    with pytest.raises(ValueError, match="temperature"):
        p.clone(temperature=-1.0)


@pytest.mark.parametrize("name", ["temperature", "top_p", "presence_penalty", "repetition_penalty"])
def test_non_finite_values_refused(name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: float("inf")})
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: float("nan")})
