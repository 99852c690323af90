"""Incremental detokenization: text that grows token by token, right across multi-byte characters
and stop strings split over several tokens."""
from __future__ import annotations

# Tokens of prompt context decoded with the output, so a first output token's leading space is kept.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Decodes a small window of tokens each step instead of the whole sequence.

    Text is released only once the window decodes to complete characters (no trailing U+FFFD),
    so a character spread over several byte tokens appears whole, exactly once.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def add_token(self, token_id: int) -> tuple[str, str | None]:
        """Append one token. Returns (new text, the stop string it completed or None).

        After a stop string matched, `output_text` is cut at it (kept when include_stop_str_in_output).
        """
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return "", None  # an incomplete character: wait for its remaining bytes
        delta = full_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        old_len = len(self.output_text)
        self.output_text += delta
        stop = self._find_stop(old_len)
        return self.output_text[old_len:], stop

    def flush(self) -> tuple[str, str | None]:
        """At the end of a sequence, release text held back for bytes that never completed."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text):
            return "", None
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        old_len = len(self.output_text)
        self.output_text += full_text[len(prefix_text):]
        stop = self._find_stop(old_len)
        return self.output_text[old_len:], stop

    def _find_stop(self, old_len: int) -> str | None:
        if not self.stop:
            return None
        search_from = max(0, old_len - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.output_text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.output_text = self.output_text[: i + len(s) if self.include_stop_str_in_output else i]
        return s
