"""The stream writer: stop strings found off the loop thread end a request
exactly where the loop would have ended it."""

from __future__ import annotations

import pytest

from inference import model_store
from inference.requests import Finish, Sequence
from inference.sampling import SamplingParams
from inference.streams import SampledToken, StreamError, StreamEvent, StreamFinished, StreamTokens, StreamWriter


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return model_store.load_tokenizer(model_dir)


def events_of(seq: Sequence) -> list[StreamEvent]:
    """Every event written for ``seq`` so far."""
    events = []
    while not seq.events.empty():
        events.append(seq.events.get_nowait())
    return events


def run(tokenizer, text: str, stop=(), finish_last: Finish | None = None, **sampling):
    """Streams ``text``'s tokens as one step each, the loop ending the
    sequence at the last one with ``finish_last``; returns (events, stop calls)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    stopped: list[str] = []
    writer = StreamWriter(tokenizer, on_stop=stopped.append)
    seq = Sequence("r1", [1, 2], SamplingParams(max_new_tokens=len(ids), stop=tuple(stop), **sampling))
    try:
        for i, token in enumerate(ids):
            final = i == len(ids) - 1 and finish_last is not None
            if final:
                seq.finish = finish_last
            seq.output_ids.append(token)
            writer.tokens([SampledToken(seq, token, -0.5, None, final)])
        if seq.finish is None:  # the loop heard of the stop and cancelled it
            seq.finish = Finish.STOP if stopped else Finish.LENGTH
        writer.finished(seq)
        assert writer.flush()
    finally:
        writer.close()
    return ids, events_of(seq), stopped


def test_tokens_after_a_stop_string_are_dropped_and_the_count_ends_at_it(tokenizer):
    ids, events, stopped = run(tokenizer, "The answer is forty-two. END OF STORY and more words", stop=["END OF"])
    tokens = [e.token_ids[0] for e in events if isinstance(e, StreamTokens)]
    text = "".join(e.text for e in events if isinstance(e, StreamTokens))
    assert stopped == ["r1"]
    assert text == "The answer is forty-two. "
    assert "END OF" in tokenizer.decode(tokens) and "END OF" not in tokenizer.decode(tokens[:-1])
    assert tokens == ids[: len(tokens)] and len(tokens) < len(ids)
    assert events[-1] == StreamFinished(Finish.STOP, len(tokens))


def test_without_a_stop_every_token_streams_and_held_text_is_released_at_the_end(tokenizer):
    ids, events, stopped = run(tokenizer, "It ended with END", stop=["END OF"], finish_last=Finish.LENGTH)
    assert stopped == []
    assert "".join(e.text for e in events if isinstance(e, StreamTokens)) == "It ended with END"
    assert events[-1] == StreamFinished(Finish.LENGTH, len(ids))


def test_eos_at_the_stop_strings_own_token_wins_as_in_the_loop(tokenizer):
    ids, events, stopped = run(tokenizer, "one two END OF", stop=["END OF"], finish_last=Finish.EOS)
    assert stopped == []  # the loop already ended it
    assert events[-1] == StreamFinished(Finish.EOS, len(ids))


def streamed(events: list[StreamEvent]) -> tuple[list[int], str]:
    tokens = [e.token_ids[0] for e in events if isinstance(e, StreamTokens)]
    return tokens, "".join(e.text for e in events if isinstance(e, StreamTokens))


def test_include_stop_str_in_output_streams_the_stop_string(tokenizer):
    text = "The answer is forty-two. END OF STORY and more words"
    ids, events, stopped = run(tokenizer, text, stop=["END OF"], include_stop_str_in_output=True)
    tokens, streamed_text = streamed(events)
    assert stopped == ["r1"]
    assert streamed_text == "The answer is forty-two. END OF"
    assert events[-1] == StreamFinished(Finish.STOP, len(tokens)) and len(tokens) < len(ids)


def test_a_stop_string_before_min_tokens_does_not_end_the_request(tokenizer):
    text = "END OF one two END OF three four"
    ids = tokenizer.encode(text, add_special_tokens=False)
    first = next(n for n in range(1, len(ids)) if "END OF" in tokenizer.decode(ids[:n]))
    _, events, stopped = run(tokenizer, text, stop=["END OF"], min_tokens=first + 1)
    tokens, streamed_text = streamed(events)
    assert stopped == ["r1"]  # by the second one
    assert streamed_text == "END OF one two "
    assert len(tokens) > first + 1 and events[-1] == StreamFinished(Finish.STOP, len(tokens))


def test_an_error_follows_the_tokens_sent_before_it(tokenizer):
    writer = StreamWriter(tokenizer, on_stop=lambda request_id: None)
    seq = Sequence("r2", [1], SamplingParams())
    try:
        writer.tokens([SampledToken(seq, 42, 0.0, None, False)])
        writer.error(seq, "the KV-cache daemon is unavailable")
        assert writer.flush()
    finally:
        writer.close()
    assert [type(e) for e in events_of(seq)] == [StreamTokens, StreamError]
