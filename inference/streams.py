"""What a request's gRPC handler reads, made on a thread of its own.

The engine's loop hands over each step's sampled tokens in one batch and goes
on launching; this module's thread turns them into text (incremental
detokenizing, stop strings) and puts the messages on each request's
``events`` queue, which its handler streams out:

    StreamPromptLogprobs(first_position, logprobs, top)     once the prompt is scored (when asked for)
    StreamTokens(token_ids, logprobs, text, top_logprobs)   as tokens are sampled
    StreamFinished(finish, completion_tokens)               after the daemon freed its blocks
    StreamError(message)                                    the daemon was lost mid-request

Every message of a request goes through this thread, in the order the loop
sent it, so a request's tokens always come before its end.

A stop string is found here, possibly a step or two after the loop sampled
its token. The thread then asks the engine to stop the request (``on_stop``)
and drops every token sampled after the stop: the client sees the same
tokens, text, count and finish reason as if the loop had checked the stop
string itself (end-of-sequence at the same token still wins, as there). A
stop string ending before the request's ``min_tokens``-th token does not stop
it; with ``include_stop_str_in_output`` the text keeps the stop string.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from inference.detokenizer import IncrementalDetokenizer
from inference.requests import Finish, Sequence
from inference.step_timings import StepTimings

log = logging.getLogger("inference.streams")

#: A token's most likely alternatives: (their ids, their logprobs).
TopLogprobs = tuple[list[int], list[float]]

# NOTE: the per-token values below are NamedTuples, not frozen dataclasses:
# the loop makes one per sampled token and this thread one per streamed
# token, and a NamedTuple costs a third of a frozen dataclass to make.


class SampledToken(NamedTuple):
    """One sampled token, as the loop hands it over."""

    seq: Sequence
    token: int
    logprob: float
    top: TopLogprobs | None  # None: the request asked for no top logprobs
    final: bool  # the loop ended the sequence with it (EOS, a stop token, its length)


class StreamTokens(NamedTuple):
    """Tokens for the client; ``logprobs`` and ``top_logprobs`` are empty unless asked for."""

    token_ids: list[int]
    logprobs: list[float]
    text: str  # the text they add (a stop string's candidate text is held back)
    top_logprobs: list[TopLogprobs]


class StreamPromptLogprobs(NamedTuple):
    """The prompt's scored tokens (asked for with ``prompt_logprobs``), before any token."""

    first_position: int
    logprobs: list[float]
    top_logprobs: list[TopLogprobs]  # empty unless asked for


class StreamFinished(NamedTuple):
    """The request's end, once the daemon freed its blocks."""

    finish: Finish
    completion_tokens: int  # tokens streamed (a stop string drops those sampled after it)


class StreamError(NamedTuple):
    """The request failed (the daemon was lost, a drain handed it back)."""

    message: str


#: What a request's ``events`` queue holds.
StreamEvent = StreamPromptLogprobs | StreamTokens | StreamFinished | StreamError


# The loop's jobs for this thread, in the order it hands them over.


@dataclass(frozen=True, slots=True)
class _WriteTokens:
    batch: list[SampledToken]


@dataclass(frozen=True, slots=True)
class _WritePromptLogprobs:
    seq: Sequence


@dataclass(frozen=True, slots=True)
class _WriteFinished:
    seq: Sequence


@dataclass(frozen=True, slots=True)
class _WriteError:
    seq: Sequence
    message: str


@dataclass(frozen=True, slots=True)
class _Flush:
    done: threading.Event  # set once every earlier job is written


@dataclass(frozen=True, slots=True)
class _Close:
    """Ends the thread."""


_Job = _WriteTokens | _WritePromptLogprobs | _WriteFinished | _WriteError | _Flush | _Close


def _detokenizer(tokenizer, seq: Sequence) -> IncrementalDetokenizer:
    p = seq.params
    return IncrementalDetokenizer(
        tokenizer, seq.prompt_ids, p.stop, min_tokens=p.min_tokens, include_stop=p.include_stop_str_in_output
    )


@dataclass(slots=True)
class _Stream:
    """The thread's state of one request."""

    detokenizer: IncrementalDetokenizer
    emitted: int = 0  # tokens sent to the handler
    stopped: Finish | None = None  # set once a stop string ended it here


class StreamWriter:
    """The thread that writes every request's ``events``.

    Args:
        tokenizer: the model's tokenizer (for text deltas and stop strings).
        on_stop: called with a request id when a stop string ends it (the
            engine's loop then releases it like a cancelled request).
        timings: where this thread adds the seconds its token batches take (``stream_s``).
    """

    def __init__(self, tokenizer, on_stop: Callable[[str], None], timings: StepTimings | None = None) -> None:
        self.tokenizer = tokenizer
        self._on_stop = on_stop
        self._timings = timings
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # this thread's only
        self._thread = threading.Thread(target=self._run, name="engine-streams", daemon=True)
        self._thread.start()

    # ------------------------------------------------ the loop's side

    def tokens(self, batch: list[SampledToken]) -> None:
        """A step's sampled tokens, in the order they were sampled."""
        if batch:
            self._jobs.put(_WriteTokens(batch))

    def prompt_logprobs(self, seq: Sequence) -> None:
        """``seq``'s prompt is scored (``seq.prompt_logprobs``, complete; never changed after)."""
        self._jobs.put(_WritePromptLogprobs(seq))

    def finished(self, seq: Sequence) -> None:
        """The daemon freed ``seq``'s blocks (or never had any): its last message."""
        self._jobs.put(_WriteFinished(seq))

    def error(self, seq: Sequence, message: str) -> None:
        self._jobs.put(_WriteError(seq, message))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Waits until every message handed over so far is written (tests, stop)."""
        done = threading.Event()
        self._jobs.put(_Flush(done))
        return done.wait(timeout_s)

    def close(self) -> None:
        self._jobs.put(_Close())
        self._thread.join(timeout=10)

    # ------------------------------------------------ the thread's side

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                match job:
                    case _WriteTokens(batch):
                        started = time.perf_counter()
                        self._write_tokens(batch)
                        if self._timings is not None:
                            self._timings.stream_s += time.perf_counter() - started
                    case _WritePromptLogprobs(seq):
                        first = seq.params.prompt_logprobs_from
                        seq.events.put(StreamPromptLogprobs(first, seq.prompt_logprobs, seq.prompt_top))
                    case _WriteFinished(seq):
                        self._write_finished(seq)
                    case _WriteError(seq, message):
                        self._write_error(seq, message)
                    case _Flush(done):
                        done.set()
                    case _Close():
                        return
            except Exception:  # a bad tokenizer call must not silence every other stream
                log.exception("writing a stream message failed", extra={"kind": type(job).__name__})

    def _write_tokens(self, batch: list[SampledToken]) -> None:
        for seq, token, logprob, top, final in batch:
            stream = self._streams.get(seq.request_id)
            if stream is None:
                detokenizer = _detokenizer(self.tokenizer, seq)
                stream = self._streams[seq.request_id] = _Stream(detokenizer)
            if stream.stopped is not None:
                continue  # sampled before the loop heard of the stop string
            detokenizer = stream.detokenizer
            text = detokenizer.push([token])
            if detokenizer.stopped:
                # The loop's verdict for this same token wins only when it was EOS.
                stream.stopped = Finish.EOS if final and seq.finish is Finish.EOS else Finish.STOP
                if not final:
                    self._on_stop(seq.request_id)
            elif final:
                text += detokenizer.finish()
            stream.emitted += 1
            logprobs = [logprob] if seq.params.logprobs else []
            seq.events.put(StreamTokens([token], logprobs, text, [top] if top else []))

    def _write_finished(self, seq: Sequence) -> None:
        if seq.finish is Finish.ERROR:  # ended early on purpose (a drain hands it back)
            self._write_error(seq, seq.error or "the request was ended by the engine")
            return
        stream = self._streams.pop(seq.request_id, None)
        if stream is None:
            seq.events.put(StreamFinished(seq.finish, 0))
            return
        seq.events.put(StreamFinished(stream.stopped or seq.finish, stream.emitted))

    def _write_error(self, seq: Sequence, message: str) -> None:
        self._streams.pop(seq.request_id, None)
        seq.events.put(StreamError(message))
