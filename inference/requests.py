"""The engine's requests and its half of the Step contract.

The daemon owns every request's schedule (kvd/scheduler.py). The engine keeps
its sequences by id and their block tables as the replies gave them, and
reports, once per step, what happened since the last Step:

- new requests, each prompt sent once;
- commits: per sequence, the tokens now computed and the tokens sampled;
- finished requests (done or cancelled), once no forward in flight still
  writes their blocks (their blocks must not go to another engine while it
  does).

The reply says what to compute (a chunk and block-table delta per sequence),
whom the daemon preempted (their tables are dropped; they wait in the daemon
and are recomputed later) and whose blocks are released.
"""

from __future__ import annotations

import enum
import queue
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, NamedTuple

import torch

from inference.sampling import SamplingParams
from kvd_api.daemon.v1 import daemon_pb2 as pb

if TYPE_CHECKING:
    from inference.constraints import GrammarState
    from inference.streams import StreamEvent

#: Prompt tokens sent in one Step at most (at least one request goes): a burst
#: of long prompts is spread over Steps, each far below gRPC's 4 MB message
#: limit (a token id takes at most 5 bytes on the wire).
MAX_PROMPT_TOKENS_PER_STEP = 131_072


class Finish(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    CANCELLED = "cancelled"
    ERROR = "error"  # the engine lost the daemon or failed; see Sequence.error


@dataclass(eq=False)
class Sequence:
    """A request: its tokens, its block table, its output.

    The daemon owns its schedule (waiting, running, preempted); the engine
    keeps what it needs to run the chunks the daemon hands out.

    Attributes:
        request_id: unique within the engine; also the daemon's request id.
        prompt_ids: the prompt's tokens.
        output_ids: sampled tokens so far.
        block_table: the daemon's block ids for this sequence, in order, as
            its Step replies gave them (empty while it waits).
        priority: smaller runs first (the daemon orders by it, then arrival).
        num_cached_prompt: prompt tokens served from the cache at admission.
        prompt_logprobs: the prompt's scored tokens so far (``params.prompt_logprobs``),
            from position ``params.prompt_logprobs_from`` on.
        prompt_top: their most likely tokens, when asked for.
        grammar: with a constraint, where its output stands in the
            constraint's grammar (the sampler masks what it forbids).
        events: what the gRPC handler streams out (``inference.streams``):
            ``StreamTokens``, then one ``StreamFinished`` or ``StreamError``.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: bytes = b""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    priority: int = 0
    finish: Finish | None = None
    error: str = ""
    block_table: list[int] = field(default_factory=list)
    num_cached_prompt: int = -1  # -1 until first admitted
    num_host_cached_prompt: int = 0  # of num_cached_prompt, copied back from the host tier
    num_disk_cached_prompt: int = 0  # of num_host_cached_prompt, read back from the disk tier
    #: while waiting: the prompt tokens its daemon held when it came (load reports; 0: not known yet)
    expected_cached: int = 0
    num_computed: int = 0  # tokens whose K/V a finished forward wrote (load reports)
    generator: torch.Generator | None = None
    arrival_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    events: queue.SimpleQueue[StreamEvent] = field(default_factory=queue.SimpleQueue)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top: list[tuple[list[int], list[float]]] = field(default_factory=list)
    grammar: GrammarState | None = None
    cache_marks: pb.CacheMarks | None = None  # prefixes the daemon pins once computed
    marks: list[pb.MarkResult] = field(default_factory=list)  # what became of them, as the daemon reported

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish is not None

    @property
    def samples(self) -> bool:
        """It generates tokens (max_new_tokens 0: the prompt only, a warm-up or its logprobs)."""
        return self.params.max_new_tokens > 0

    def prompt_logit_positions(self, first: int, end: int) -> tuple[int, int]:
        """The positions of [first, end) whose logits score prompt tokens not
        scored yet (a preempted sequence recomputes some), as [start, stop)."""
        p = self.params
        if not p.prompt_logprobs:
            return (0, 0)
        start = max(first, p.prompt_logprobs_from - 1 + len(self.prompt_logprobs))
        stop = min(end, len(self.prompt_ids) - 1)  # the last position's logits pick the first new token
        return (start, stop) if start < stop else (0, 0)

    @property
    def prompt_scored(self) -> bool:
        """Every prompt token it asked logprobs for has them."""
        p = self.params
        return len(self.prompt_logprobs) >= len(self.prompt_ids) - p.prompt_logprobs_from


@dataclass(slots=True)
class Work:
    """A sequence's chunk of one step: compute positions [first, first + num_tokens)."""

    seq: Sequence
    first: int
    num_tokens: int
    num_cached_tokens: int  # at admission: the prefix the cache served

    @property
    def end(self) -> int:
        return self.first + self.num_tokens


class StepWork(NamedTuple):
    """What a Step's reply hands the engine."""

    work: list[Work]  # this step's chunks (finished sequences left out)
    released: list[Sequence]  # sequences whose blocks the daemon freed; the table forgot them


class Backlog(NamedTuple):
    """What a new request queues behind (load reports)."""

    queued_tokens: int  # prompt tokens still to compute
    waiting: int  # sequences the daemon has not admitted yet (or preempted)


class RequestTable:
    """The engine's sequences by id; not thread-safe (the engine loop owns it).

    Args:
        max_num_seqs: the most sequences the daemon may run at once for us.
        token_budget: the most tokens it may schedule in one step.
    """

    def __init__(self, max_num_seqs: int, token_budget: int) -> None:
        self.settings = pb.SessionSettings(max_num_seqs=max_num_seqs, token_budget=token_budget)
        self.seqs: dict[str, Sequence] = {}
        self._unsent: dict[str, Sequence] = {}  # new, not told to the daemon yet
        self._commits: dict[str, tuple[int, list[int]]] = {}  # id -> (computed tokens, sampled since)
        self._finished: dict[str, Sequence] = {}  # done, not reported yet
        self._arriving: list[Sequence] = []  # the last Step's new requests, in its order
        self._settings_due = True

    @property
    def has_work(self) -> bool:
        return bool(self.seqs)

    @property
    def num_unsent(self) -> int:
        return len(self._unsent)

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.request_id] = seq
        self._unsent[seq.request_id] = seq

    def cancel(self, request_id: str, finish: Finish = Finish.CANCELLED) -> Sequence | None:
        """Ends a sequence early (``finish``: the reason it reports). Returns it
        when it can be dropped at once (the daemon never heard of it);
        otherwise its free is reported in a coming Step and it comes back
        through ``apply_step_reply`` as released."""
        seq = self.seqs.get(request_id)
        if seq is None or request_id in self._finished:
            return None
        seq.finish = seq.finish or finish
        if self._unsent.pop(request_id, None) is not None:
            del self.seqs[request_id]
            return seq
        self._finished[request_id] = seq
        return None

    def finished(self, seq: Sequence) -> None:
        """``seq`` is done (its finish set): report it."""
        self._finished[seq.request_id] = seq

    def computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """A forward wrote the K/V of ``seq``'s tokens up to this position."""
        seq.num_computed = num_computed_tokens
        entry = self._commits.get(seq.request_id)
        self._commits[seq.request_id] = (num_computed_tokens, entry[1] if entry else [])

    def sampled(self, seq: Sequence, token: int) -> None:
        """A token was appended to ``seq`` (computed tokens are reported by ``computed``)."""
        entry = self._commits.get(seq.request_id)
        if entry is None:
            self._commits[seq.request_id] = entry = (0, [])
        entry[1].append(token)

    # ------------------------------------------------------------- Step

    def build_step(self, in_flight: Collection[str] = ()) -> pb.StepRequest:
        """The next Step's reports. ``in_flight``: the ids in a forward whose
        results are not known yet (their finishes wait for it)."""
        msg = pb.StepRequest(forward_in_flight=bool(in_flight))
        if self._settings_due:
            msg.settings.CopyFrom(self.settings)
            self._settings_due = False
        sent_tokens = 0
        self._arriving = []
        for seq in list(self._unsent.values()):
            if sent_tokens and sent_tokens + len(seq.prompt_ids) > MAX_PROMPT_TOKENS_PER_STEP:
                break  # the rest go in the next Step
            sent_tokens += len(seq.prompt_ids)
            del self._unsent[seq.request_id]
            self._arriving.append(seq)
            new = msg.new_requests.add(
                request_id=seq.request_id,
                prompt_token_ids=seq.prompt_ids,
                cache_salt=seq.cache_salt,
                priority=seq.priority,
                max_new_tokens=seq.params.max_new_tokens,
            )
            if seq.params.prompt_logprobs:  # the positions scored are computed, not served by the cache
                new.max_cached_tokens = seq.params.prompt_logprobs_from - 1
            if seq.cache_marks is not None:
                new.cache_marks.CopyFrom(seq.cache_marks)
        if self._commits:
            c = msg.commits
            ids = list(self._commits)
            c.request_ids.extend(ids)
            c.num_computed_tokens.extend([self._commits[r][0] for r in ids])
            c.num_new_tokens.extend([len(self._commits[r][1]) for r in ids])
            c.new_token_ids.extend([t for r in ids for t in self._commits[r][1]])
            self._commits = {}
        done = [rid for rid in self._finished if rid not in in_flight]
        for rid in done:
            del self._finished[rid]
        msg.finished.extend(done)
        return msg

    def apply_step_reply(self, reply: pb.StepResponse) -> StepWork:
        """Takes the daemon's answer.

        Returns:
            This step's work (finished sequences left out: a slot given for a
            token after their last is wasted, never computed), and the
            released sequences, which the engine forgets.
        """
        seqs = self.seqs
        # (A daemon of an older release sends no column: the reports then
        # count every waiting prompt whole.)
        for seq, cached in zip(self._arriving, reply.arrival_cached_tokens, strict=False):
            seq.expected_cached = cached
        self._arriving = []
        for mark in reply.marks:  # before `released`: a mark is reported by the Step that frees its request at last
            seqs[mark.request_id].marks.append(mark)
        for request_id in reply.preempted:
            seqs[request_id].block_table = []
            seqs[request_id].num_computed = 0
        released = [seqs.pop(request_id) for request_id in reply.released]
        s = reply.scheduled
        block_ids = s.new_block_ids[:]
        offsets = list(accumulate(s.num_new_blocks, initial=0))
        host_cached = s.num_host_cached_tokens[:]
        disk_cached = s.num_disk_cached_tokens[:]
        work = []
        for i, (request_id, first, num_tokens, cached) in enumerate(
            zip(s.request_ids, s.first_positions, s.num_tokens, s.num_cached_tokens, strict=True)
        ):
            seq = seqs[request_id]
            if not seq.block_table and seq.num_cached_prompt < 0:  # its first admission
                seq.num_cached_prompt = min(cached, len(seq.prompt_ids))
                seq.num_host_cached_prompt = min(host_cached[i] if host_cached else 0, seq.num_cached_prompt)
                seq.num_disk_cached_prompt = min(disk_cached[i] if disk_cached else 0, seq.num_host_cached_prompt)
            seq.block_table.extend(block_ids[offsets[i] : offsets[i + 1]])
            if not seq.is_finished:
                work.append(Work(seq, first, num_tokens, cached))
        return StepWork(work, released)

    def backlog(self) -> Backlog:
        """What a new request queues behind, in one pass: the prompt tokens
        still to compute (the rest of each prefilling sequence, and of each
        waiting one what its daemon did not hold when it came), and the
        sequences the daemon has not admitted yet (or preempted)."""
        queued = waiting = 0
        for s in self.seqs.values():
            waiting += not s.block_table
            if not s.output_ids and not s.is_finished:
                queued += len(s.prompt_ids) - max(s.num_computed, s.expected_cached)
        return Backlog(queued, waiting)

    def drop_all(self) -> list[Sequence]:
        """Forgets every sequence (the daemon is gone); returns them."""
        seqs = list(self.seqs.values())
        self.seqs.clear()
        self._unsent, self._commits, self._finished, self._arriving = {}, {}, {}, []
        self._settings_due = True
        return seqs
