"""Text deltas: whole characters only, exact concatenation, stop strings."""

from __future__ import annotations

import pytest

from inference import model_store
from inference.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return model_store.load_tokenizer(model_dir)


def stream(tokenizer, text: str, stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop)
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
