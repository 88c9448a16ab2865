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
    appears the output ends right before it (or right after it, with
    ``include_stop``).

    A stop string counts only if it ends in the text of the ``min_tokens``-th
    token or later (vLLM's rule: stop strings are not checked before then);
    one that ended earlier stays in the text.

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompt_token_ids: unused for the text (only output is returned); kept
            so windows never start inside the prompt's last word.
        stop: stop strings.
        min_tokens: output tokens before a stop string may end the text.
        include_stop: keep the stop string that ended the text in it.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.output_ids: list[int] = []
        self._read_offset = 0  # tokens whose text has been taken into `text`
        self.text = ""  # decoded output so far (whole characters)
        self._emitted = 0  # characters of `text` already returned
        self._stops_from = 0  # a stop string must end past this many characters of `text`
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds tokens; returns the newly available text."""
        if self.stopped:
            return ""
        self.output_ids.extend(token_ids)
        self._decode_new()
        if len(self.output_ids) < self.min_tokens:
            self._stops_from = len(self.text)  # too early for a stop string to end here
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
        if len(self.output_ids) >= self.min_tokens:
            end = self._stop_end(end)
        if not self.stopped and not final and not self.include_stop:
            # (Included, a candidate stop string is output either way: nothing to hold.)
            end -= self._held_back()
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _stop_end(self, end: int) -> int:
        """Where the text ends: before (or after) the first stop string, else ``end``."""
        first, first_stop = end, ""
        for stop in self.stop:
            start = max(0, self._emitted - len(stop) + 1, self._stops_from - len(stop) + 1)
            found = self.text.find(stop, start)
            if found != -1 and found < first:
                first, first_stop = found, stop
                self.stopped = True
        if self.stopped and self.include_stop:
            return first + len(first_stop)
        return first

    def _held_back(self) -> int:
        """Characters at the end that could still begin a stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text) - self._emitted), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
