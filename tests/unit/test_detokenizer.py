"""Text deltas: whole characters only, exact concatenation, stop strings."""

from __future__ import annotations

import pytest

from inference import model_store
from inference.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return model_store.load_tokenizer(model_dir)


def stream(tokenizer, text: str, stop=(), **options) -> tuple[list[str], IncrementalDetokenizer]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop, **options)
    deltas = [detok.push([token]) for token in ids]
    deltas.append(detok.finish())
    return deltas, detok


@pytest.mark.parametrize("text", ["Hello, world! How are you today?", "naïve café — 日本語 🙂 über straße"])
def test_deltas_concatenate_to_the_decoded_text_and_never_split_a_character(tokenizer, text):
    deltas, _ = stream(tokenizer, text)
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_a_stop_string_across_tokens_is_cut_exactly(tokenizer):
    deltas, detok = stream(tokenizer, "The answer is forty-two. END OF STORY and more", stop=["END OF"])
    assert "".join(deltas) == "The answer is forty-two. "
    assert detok.stopped


def test_a_partial_stop_string_is_held_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], ["ENDGAME"])
    out = ""
    for token in tokenizer.encode("The END is near", add_special_tokens=False):
        out += detok.push([token])
        assert "ENDGAME" not in out
    out += detok.finish()
    assert out == "The END is near" and not detok.stopped


def test_special_tokens_add_no_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], ())
    text = detok.push(tokenizer.encode("Hi", add_special_tokens=False))
    assert text + detok.push([tokenizer.eos_token_id]) + detok.finish() == "Hi"


def test_include_stop_keeps_the_stop_string_and_cuts_after_it(tokenizer):
    deltas, detok = stream(tokenizer, "The answer is forty-two. END OF STORY and more", ["END OF"], include_stop=True)
    assert "".join(deltas) == "The answer is forty-two. END OF"
    assert detok.stopped


def tokens_through_first_stop(tokenizer, text: str, stop: str) -> int:
    """How many of ``text``'s tokens it takes for ``stop`` to appear."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))


def test_a_stop_string_before_min_tokens_does_not_stop_and_one_ending_at_it_does(tokenizer):
    text = "END OF one two END OF three"
    first = tokens_through_first_stop(tokenizer, text, "END OF")
    deltas, detok = stream(tokenizer, text, ["END OF"], min_tokens=first + 1)
    assert "".join(deltas) == "END OF one two " and detok.stopped  # the second one stops it
    deltas, detok = stream(tokenizer, text, ["END OF"], min_tokens=first)  # ends in the min_tokens-th token: counts
    assert "".join(deltas) == "" and detok.stopped
    deltas, detok = stream(tokenizer, text, ["END OF"], min_tokens=100)
    assert "".join(deltas) == text and not detok.stopped
