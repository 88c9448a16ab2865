"""Engine-side scheduling: queues and block tables; the daemon decides.

Each step, computed tokens catch up to known tokens within a token budget:

  1. commits: every sequence the last forward touched reports how many of its
     tokens are now computed, and the tokens sampled since;
  2. frees: sequences that finished or were cancelled;
  3. appends: running sequences ask for all their uncomputed tokens, decodes
     first (one token each) so long prefills never stall them, then prefill
     chunks;
  4. admissions: waiting sequences, preempted ones first, while there is room
     for more running sequences.

All of it travels in one Step call. The daemon answers what runs this step
(prefix-aware: cached tokens cost nothing), which admissions wait, and whom it
preempted to make room; preempted sequences go back to the head of the queue
and later recompute (their committed blocks are usually still cached).
"""

from __future__ import annotations

from collections import deque

from inference.model_runner import Chunk
from inference.sequence import Finish, Sequence, Status
from kvd.step import AdmissionWork, StepInput, StepOutput

#: Admissions offered per step. Each carries its whole token list, and the
#: daemon admits only what the budget holds, so offering the whole queue
#: would only make every step's message larger.
MAX_ADMISSIONS_PER_STEP = 8


class Scheduler:
    """Owns the queues; not thread-safe (the engine loop is its only user).

    Args:
        max_num_seqs: the most sequences running at once.
        token_budget: the most tokens computed in one step.
    """

    def __init__(self, max_num_seqs: int, token_budget: int) -> None:
        if max_num_seqs < 1 or token_budget < 1:
            raise ValueError("max_num_seqs and token_budget must be >= 1")
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self._commits: dict[str, tuple[str, int, list[int]]] = {}
        self._frees: list[str] = []
        self._known_by_daemon: dict[str, int] = {}  # tokens the daemon has of each running sequence

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._frees)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: the uncached rest of each prefilling
        sequence, and of each waiting one what its daemon did not hold when it came."""
        prefilling = sum(s.num_tokens - s.num_computed for s in self.running.values() if not s.output_ids)
        return prefilling + sum(s.num_tokens - max(s.num_computed, s.expected_cached) for s in self.waiting)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def cancel(self, request_id: str) -> Sequence | None:
        """Stops a sequence wherever it is; its blocks are freed next step."""
        seq = self.running.get(request_id)
        if seq is not None:
            self._retire(seq)
        else:
            seq = next((s for s in self.waiting if s.request_id == request_id), None)
            if seq is None:
                return None
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish = seq.finish or Finish.CANCELLED
        return seq

    # ------------------------------------------------------------- step

    def build_step(self) -> StepInput:
        """This step's block work for the daemon."""
        decodes, prefills = [], []
        for seq in self.running.values():
            remaining = seq.num_tokens - seq.num_computed
            (decodes if remaining == 1 and seq.output_ids else prefills).append((seq.request_id, remaining))
        room = min(self.max_num_seqs - len(self.running), MAX_ADMISSIONS_PER_STEP)
        admissions = [
            AdmissionWork(seq.request_id, seq.all_ids, seq.cache_salt) for seq in list(self.waiting)[: max(room, 0)]
        ]
        step = StepInput(
            commits=list(self._commits.values()),
            frees=self._frees,
            appends=decodes + prefills,
            admissions=admissions,
            token_budget=self.token_budget,
        )
        self._commits, self._frees = {}, []
        return step

    def apply(self, out: StepOutput) -> tuple[list[Chunk], list[Sequence]]:
        """Takes the daemon's answer: block tables grow, preempted sequences wait.

        Returns:
            The chunks to compute and their sequences, in the same order.
        """
        for request_id in out.preempted:
            self._preempted(request_id)
        admitted = {s.request_id for s in out.scheduled if s.admitted}
        if admitted:
            kept = deque()
            for seq in self.waiting:
                if seq.request_id in admitted:
                    self.running[seq.request_id] = seq
                    self._known_by_daemon[seq.request_id] = seq.num_tokens
                    seq.status = Status.RUNNING
                else:
                    kept.append(seq)
            self.waiting = kept
        chunks, seqs = [], []
        for s in out.scheduled:
            seq = self.running[s.request_id]
            seq.block_table.extend(s.new_block_ids)
            if s.admitted:
                seq.num_computed = s.first_position
                if seq.num_cached_prompt < 0:
                    seq.num_cached_prompt = min(s.num_cached_tokens, len(seq.prompt_ids))
                    seq.num_host_cached_prompt = min(s.num_host_cached_tokens, seq.num_cached_prompt)
            end = s.first_position + s.num_scheduled_tokens
            chunks.append(
                Chunk(
                    token_ids=seq.all_ids[s.first_position : end],
                    first=s.first_position,
                    block_table=seq.block_table,
                    request_id=seq.request_id,
                    write_from=max(s.first_position, s.num_cached_tokens if s.admitted else 0),
                    wants_logits=end == seq.num_tokens and not seq.prefill_only,
                )
            )
            seqs.append(seq)
        return chunks, seqs

    def computed(self, seq: Sequence, chunk: Chunk) -> None:
        """Records a forward's work on ``seq`` for the next step's commit."""
        seq.num_computed = chunk.first + len(chunk.token_ids)
        if seq.prefill_only and seq.num_computed == seq.num_tokens:
            seq.finish = Finish.LENGTH
            seq.status = Status.FINISHED
        self._queue_commit(seq)
        if seq.is_finished:
            self._retire(seq)

    def sampled(self, seq: Sequence) -> None:
        """A token was appended to ``seq`` (it may have finished with it)."""
        self._queue_commit(seq)
        if seq.is_finished:
            self._retire(seq)

    def drop_all(self) -> list[Sequence]:
        """Forgets every sequence (the daemon is gone); returns them."""
        seqs = list(self.running.values()) + list(self.waiting)
        self.running.clear()
        self.waiting.clear()
        self._commits, self._frees = {}, []
        self._known_by_daemon.clear()
        return seqs

    # ---------------------------------------------------------- helpers

    def _queue_commit(self, seq: Sequence) -> None:
        known = self._known_by_daemon.get(seq.request_id)
        if known is None:
            return
        new_ids = seq.all_ids[known : seq.num_tokens]
        self._known_by_daemon[seq.request_id] = seq.num_tokens
        previous = self._commits.get(seq.request_id)
        if previous is not None:
            new_ids = previous[2] + new_ids
        self._commits[seq.request_id] = (seq.request_id, seq.num_computed, new_ids)

    def _retire(self, seq: Sequence) -> None:
        """A running sequence leaves: the daemon frees its blocks next step."""
        if self.running.pop(seq.request_id, None) is not None:
            self._frees.append(seq.request_id)
            self._known_by_daemon.pop(seq.request_id, None)

    def _preempted(self, request_id: str) -> None:
        seq = self.running.pop(request_id)
        self._commits.pop(request_id, None)
        self._known_by_daemon.pop(request_id, None)
        seq.reset_blocks()
        self.waiting.appendleft(seq)
