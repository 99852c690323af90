"""IncrementalDetokenizer with the project's real byte-level BPE tokenizer (built offline)."""
from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm.demo import EOS_TOKEN, EOT_TOKEN, build_tokenizer
from pagedllm.engine.detokenizer import IncrementalDetokenizer

MULTIBYTE = "héllo wörld 日本語 🙂 done"
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    path: Path = tmp_path_factory.mktemp("detok_tokenizer")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None, int | None]:
    """Feed ids one at a time until a stop string matches. Returns deltas, the stop, and its token index."""
    deltas = []
    for k, t in enumerate(ids):
        delta, stop = detok.add_token(t)
        deltas.append(delta)
        if stop is not None:
            return deltas, stop, k
    return deltas, None, None


@pytest.mark.parametrize("prompt", ["", "Once upon a time", "日本"])
def test_multibyte_text_streams_exactly(tokenizer, prompt: str) -> None:
    ids = encode(tokenizer, MULTIBYTE)
    # The text really has characters split over several byte tokens.
    assert any(REPLACEMENT in tokenizer.decode([t]) for t in ids)
    prompt_ids = tokenizer.encode(prompt) if prompt else []
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas, stop, _ = stream(detok, ids)
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(ids) == MULTIBYTE
    assert detok.output_text == MULTIBYTE
    for d in deltas:
        assert REPLACEMENT not in d
    # Some tokens were held back (incomplete characters) and released later.
    assert "" in deltas
    # Text so far is always a prefix of the final text.
    acc = ""
    for d in deltas:
        acc += d
        assert MULTIBYTE.startswith(acc)


@pytest.mark.parametrize("text", [
    "The bird flew up into the blue sky. Anna was sad",
    " leading space and  double  spaces\nnew line\ttab",
    "Ünïcödé — “quotes” ½ ∑ 🙂🙂 👩‍👩‍👧 end",
    "a" * 40 + "🙂" + "b",
])
def test_concatenated_deltas_equal_decode(tokenizer, text: str) -> None:
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Anna and Tom"))
    deltas, stop, _ = stream(detok, ids)
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.output_text == text
    assert all(REPLACEMENT not in d for d in deltas)


def test_first_output_token_keeps_leading_space(tokenizer) -> None:
    prompt = tokenizer.encode("Once upon a")
    ids = encode(tokenizer, " time there")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas, _, _ = stream(detok, ids)
    assert deltas[0] == " time"
    assert detok.output_text == " time there"


def test_stop_string_split_across_tokens(tokenizer) -> None:
    text = "Tom saw the red roof and the white sand."
    ids = encode(tokenizer, text)
    stop_str = "roof"
    # Precondition: no single token holds the stop string.
    assert all(stop_str not in tokenizer.decode([t]) for t in ids)
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop_str])
    deltas, stop, k = stream(detok, ids)
    assert stop == stop_str
    # It is found at the very token that completes it.
    first_k = next(i for i in range(len(ids)) if stop_str in tokenizer.decode(ids[:i + 1]))
    assert k == first_k
    assert detok.output_text == "Tom saw the red "
    assert stop_str not in detok.output_text


def test_stop_string_kept_with_include_stop_str_in_output(tokenizer) -> None:
    text = "Tom saw the red roof and the white sand."
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["d ro"], include_stop_str_in_output=True)
    _, stop, _ = stream(detok, ids)
    assert stop == "d ro"
    assert detok.output_text == "Tom saw the red ro"


def test_stop_string_inside_multibyte_characters(tokenizer) -> None:
    ids = encode(tokenizer, MULTIBYTE)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["本語"])
    deltas, stop, _ = stream(detok, ids)
    assert stop == "本語"
    assert detok.output_text == "héllo wörld 日"
    assert all(REPLACEMENT not in d for d in deltas)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["🙂"], include_stop_str_in_output=True)
    _, stop, _ = stream(detok, ids)
    assert stop == "🙂"
    assert detok.output_text == "héllo wörld 日本語 🙂"


def test_earliest_stop_string_wins(tokenizer) -> None:
    text = "Tom saw the red roof and the white sand."
    ids = encode(tokenizer, text)
    # Both stops are completed by the same token ("f"); the one that starts earlier wins,
    # whatever the order of the list.
    for stops in (["oof", "ed roof"], ["ed roof", "oof"]):
        detok = IncrementalDetokenizer(tokenizer, [], stop=stops)
        _, stop, _ = stream(detok, ids)
        assert stop == "ed roof"
        assert detok.output_text == "Tom saw the r"


def test_stop_that_completes_first_wins_over_earlier_starting_longer_one(tokenizer) -> None:
    text = "Tom saw the red roof and the white sand."
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["the red roof and", "red"])
    _, stop, _ = stream(detok, ids)
    assert stop == "red"
    assert detok.output_text == "Tom saw the "


@pytest.mark.parametrize("stops", [
    ["the", "sky"], ["Anna was", " bl", "lue s"], ["y. A", "sky. Anna"], ["zzz"], ["up into", "p i"],
])
def test_stops_match_reference(tokenizer, stops: list[str]) -> None:
    text = "The bird flew up into the blue sky. Anna was sad"
    ids = encode(tokenizer, text)
    # Reference: the first token after which some stop appears; the earliest-starting one wins.
    expected_stop, expected_text = None, text
    for k in range(len(ids)):
        so_far = tokenizer.decode(ids[:k + 1])
        found = sorted((so_far.find(s), s) for s in stops if s in so_far)
        if found:
            i, expected_stop = found[0]
            expected_text = so_far[:i]
            break
    detok = IncrementalDetokenizer(tokenizer, [], stop=stops)
    _, stop, _ = stream(detok, ids)
    assert stop == expected_stop
    assert detok.output_text == expected_text


def test_skip_special_tokens(tokenizer) -> None:
    eot = tokenizer.convert_tokens_to_ids(EOT_TOKEN)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    ids = encode(tokenizer, "hello") + [eot] + encode(tokenizer, " wörld") + [eos]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Anna"), skip_special_tokens=True)
    deltas, _, _ = stream(detok, ids)
    assert detok.output_text == "hello wörld"
    assert "".join(deltas) == "hello wörld"
    assert "<|" not in detok.output_text

    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Anna"), skip_special_tokens=False)
    deltas, _, _ = stream(detok, ids)
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=False)
    assert detok.output_text == f"hello{EOT_TOKEN} wörld{EOS_TOKEN}"
    assert "".join(deltas) == detok.output_text


def test_special_token_in_prompt_context_not_leaked(tokenizer) -> None:
    prompt = tokenizer.encode("Anna") + [tokenizer.convert_tokens_to_ids(EOT_TOKEN)]
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False)
    deltas, _, _ = stream(detok, encode(tokenizer, "Tom"))
    assert detok.output_text == "Tom"  # the prompt's text is context only, never output


def test_flush_releases_incomplete_trailing_bytes(tokenizer) -> None:
    ids = encode(tokenizer, "ab 日本")
    partial = encode(tokenizer, "🙂")[:1]  # only the first byte(s) of a 4-byte character
    assert tokenizer.decode(partial).endswith(REPLACEMENT)
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas, _, _ = stream(detok, ids + partial)
    assert "".join(deltas) == "ab 日本"  # the dangling bytes are held back...
    delta, stop = detok.flush()  # ...until the sequence ends
    assert stop is None
    assert delta.endswith(REPLACEMENT) and delta
    assert detok.output_text == tokenizer.decode(ids + partial)
    assert detok.flush() == ("", None)  # nothing left


def test_flush_with_nothing_held_back(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Anna"))
    stream(detok, encode(tokenizer, " was sad"))
    assert detok.flush() == ("", None)
    assert detok.output_text == " was sad"
