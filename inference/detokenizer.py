"""Text deltas from token ids, whole characters only, with stop strings."""

from __future__ import annotations

from collections.abc import Sequence

#: Tokens decoded before the new ones: enough context for tokenizers whose
#: decoding of a token depends on its neighbours (leading spaces, byte pieces).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text deltas.

    The text is decoded from a short window (a few already-emitted tokens
    plus the new ones) and only the part after the already-emitted text is
    returned. A trailing U+FFFD (an incomplete UTF-8 character) is held back
    until a later token completes it. With stop strings, text that could
    still become a stop string is held back until decided; once a stop string
    appears the output ends right before it.

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompt_token_ids: unused for the text (only output is returned); kept
            so windows never start inside the prompt's last word.
        stop: stop strings.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.output_ids: list[int] = []
        self._read_offset = 0  # tokens whose text has been taken into `text`
        self.text = ""  # decoded output so far (whole characters)
        self._emitted = 0  # characters of `text` already returned
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds tokens; returns the newly available text."""
        if self.stopped:
            return ""
        self.output_ids.extend(token_ids)
        self._decode_new()
        return self._release(final=False)

    def finish(self) -> str:
        """The text still held back (a partial stop string), at the end."""
        if self.stopped:
            return ""
        return self._release(final=True)

    def _decode_new(self) -> None:
        window_start = max(0, self._read_offset - _CONTEXT_TOKENS)
        before = self._decode(self.output_ids[window_start : self._read_offset])
        after = self._decode(self.output_ids[window_start:])
        if after.endswith("\ufffd"):
            return  # an incomplete character: wait for the next token
        if after.startswith(before):
            self.text += after[len(before) :]
        else:  # the window's start decoded differently in context: decode it all
            self.text = self._decode(self.output_ids)
        self._read_offset = len(self.output_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _release(self, final: bool) -> str:
        end = len(self.text)
        for stop in self.stop:
            found = self.text.find(stop, max(0, self._emitted - len(stop) + 1))
            if found != -1 and found < end:
                end = found
                self.stopped = True
        if not self.stopped and not final:
            end -= self._held_back()
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _held_back(self) -> int:
        """Characters at the end that could still begin a stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text) - self._emitted), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
