"""The engine's step loop: one daemon Step, one forward, one sampling pass.

The loop can be pipelined (``EngineConfig.pipelined``, on by default on a
GPU): the Step for step N+1 is sent while forward N runs, before its sampled
tokens are known (the daemon gives each sampling sequence
a slot for that token; forward N's commits go in the Step for N+2):

    Step N+1 ─► sample forward N ─► forward N+1 (its chunks' tokens filled
                                    in from those samples) ─► Step N+2 ...

On a GPU the Step's round trip overlaps the forward. Unpipelined, forward N's
results are read right after it and committed in the Step for N+1. A sequence that hits EOS in
forward N wastes at most its slot in step N+1.

Every Step is sent only once the forwards before the one in flight have
written everything (the daemon then hands their blocks to others and copies
them between tiers). Reading sampled tokens waits for a forward anyway; a
forward that samples nothing (prefill chunks) is waited for just before the
next Step, after the following forward was launched, so the device never
idles for it. Each Step also carries an event recorded after the latest
forward (``forward_event``): the daemon's tier copies wait for it on the
device (kvd/session.py: unsettled sessions).

A single thread owns the request table, the model and the daemon session.
gRPC handlers talk to it through a thread-safe inbox and read each
sequence's ``events`` queue, which another thread writes
(``inference.streams``: text, stop strings), so per-token Python work never
delays a launch.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from inference.config import EngineConfig
from inference.cuda_graphs import CudaGraphCapture, EagerStandIn, GraphPlan, capture_graphs
from inference.load import LoadBoard, LoadReport, PrefillRate
from inference.model_runner import NO_MARK, ForwardMark, ModelRunner
from inference.requests import Finish, RequestTable, Sequence, Work
from inference.sampling import Sampler, make_generator, score_tokens
from inference.step_inputs import Chunk
from inference.step_timings import StepTimings
from inference.streams import SampledToken, StreamWriter, TopLogprobs
from kvd.common.client import DaemonSession, LeaseLapsed

log = logging.getLogger("inference.engine")


@dataclass(slots=True)
class Forward:
    """A forward whose results are not read yet."""

    work: list[Work]
    chunks: list[Chunk]
    logits: torch.Tensor  # rows for the chunks that want them, in order
    started_s: float  # when its step began (its Step call counts: a prefill waits for it too)
    mark: ForwardMark = NO_MARK  # its end on the device

    @property
    def request_ids(self) -> set[str]:
        return {w.seq.request_id for w in self.work}


class EngineUnavailable(Exception):
    """The engine has no daemon session right now."""


# What other threads ask of the loop, through its inbox.


@dataclass(frozen=True, slots=True)
class _Add:
    seq: Sequence


@dataclass(frozen=True, slots=True)
class _HandBack:
    """End the requests that streamed nothing yet (all of them: ``everything``) with ``message``."""

    message: str
    everything: bool


@dataclass(frozen=True, slots=True)
class _Cancel:
    request_id: str
    finish: Finish


_InboxMessage = _Add | _HandBack | _Cancel


class Engine:
    """Continuous batching over the daemon's blocks.

    Args:
        model: the causal LM, its attention set to a paged backend.
        tokenizer: its tokenizer (for text deltas and stop strings).
        attach: opens a daemon session with the model's layout (called again
            after the daemon was lost).
        eos_token_ids: tokens that end a sequence unless it ignores EOS.
        on_health: told True/False as the daemon session comes and goes.
        make_runner: builds the runner on the mapped cache and block size
            (default: a ``ModelRunner`` of ``model``; tests pass a fake).
    """

    def __init__(
        self,
        model,
        tokenizer,
        attach: Callable[[], DaemonSession],
        config: EngineConfig,
        eos_token_ids: set[int],
        on_health: Callable[[bool], None] = lambda healthy: None,
        make_runner: Callable[[torch.Tensor, int], ModelRunner] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_ids = eos_token_ids
        self._attach = attach
        self._on_health = on_health
        self.session: DaemonSession | None = None
        self.runner: ModelRunner | None = None
        self.requests = RequestTable(config.max_num_seqs, config.token_budget)
        self.sampler = Sampler(eos_token_ids)
        self.timings = StepTimings()  # read by the metrics port (inference/metrics.py)
        self.streams = StreamWriter(
            tokenizer, on_stop=lambda request_id: self.cancel(request_id, Finish.STOP), timings=self.timings
        )
        self._inbox: queue.SimpleQueue[_InboxMessage] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._forward: Forward | None = None  # in flight: its results are read after the next Step
        self._unwaited: Forward | None = None  # read without waiting for it: waited for before the next Step
        self._last_mark = NO_MARK  # the latest forward's (its handle goes in every Step)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._make_runner = make_runner or self._new_runner
        self.steps = 0
        self.load = LoadBoard()  # what routers see (the Load stream)
        self.prefill_rate = PrefillRate()
        self._free_blocks = 0
        self.num_preempted = 0  # requests the daemon preempted, summed over steps
        self.num_handed_back = 0  # requests ended before their first token by a drain
        self.draining: str | None = None  # set by start_draining(): why new requests are refused
        self.fatal: str | None = None  # set when the engine can never serve; the process should exit

    # ------------------------------------------------------------ public

    @property
    def healthy(self) -> bool:
        return self.session is not None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        if self.session is not None:
            self._close_session()
        self.streams.close()

    def submit(self, seq: Sequence) -> None:
        """Queues a sequence. Raises ``EngineUnavailable`` without a daemon or while draining."""
        if self.draining:
            raise EngineUnavailable(self.draining)
        if not self.healthy:
            raise EngineUnavailable("the engine is not attached to the KV-cache daemon")
        self._inbox.put(_Add(seq))
        self._wake.set()

    def start_draining(self, message: str) -> None:
        """Stops taking requests (``submit`` raises ``EngineUnavailable(message)``)
        and hands back every request that has streamed nothing yet: it ends
        with ``message`` as an error before its first token, which a router
        retries on another replica. The others run to their end."""
        self.draining = message
        self._inbox.put(_HandBack(message, everything=False))
        self._wake.set()

    def end_all(self, message: str) -> None:
        """Ends every request now with ``message`` as an error (a drain out of time)."""
        self._inbox.put(_HandBack(message, everything=True))
        self._wake.set()

    @property
    def busy(self) -> bool:
        """Requests are queued, running, or waiting for their release here."""
        return self.requests.has_work or self._forward is not None or not self._inbox.empty()

    def cancel(self, request_id: str, finish: Finish = Finish.CANCELLED) -> None:
        """Stops a sequence; safe from any thread, for finished ones too.
        ``finish``: the reason it reports (a stop string: STOP)."""
        self._inbox.put(_Cancel(request_id, finish))
        self._wake.set()

    # -------------------------------------------------------------- loop

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.session is None and not self._try_attach():
                self._stop.wait(self.config.reattach_interval_s)
                continue
            if self.session.lost is not None:  # seen by a heartbeat while we were idle
                self._lost_daemon(f"the KV-cache daemon is unavailable ({self.session.lost})")
                continue
            self._take_inbox()
            self._publish_load()
            if not self.requests.has_work and self._forward is None:
                self._idle(0.5)
                continue
            try:
                ran = self._step()
                self._publish_load()
                if not ran:
                    self._idle(self.config.idle_poll_s)
            except grpc.RpcError as err:
                self._lost_daemon(f"the KV-cache daemon is unavailable ({err.code().name}: {err.details()})")
            except LeaseLapsed as err:
                self._lost_daemon(f"the KV-cache daemon session lapsed ({err})")
            except Exception:  # a bug must not leave clients hanging
                log.exception("engine step failed")
                self._lost_daemon("internal engine error; see the engine's log")

    def _idle(self, timeout_s: float) -> None:
        started = time.perf_counter()
        self._wake.wait(timeout_s)
        self._wake.clear()
        self.timings.idle_s += time.perf_counter() - started

    def _step(self) -> bool:
        """One Step, the last forward's sampling, the next forward. Returns
        False when nothing ran (every request waits in the daemon)."""
        assert self.session is not None and self.runner is not None
        timings = self.timings
        timings.begin()
        previous = self._forward
        started = time.monotonic()
        msg = self.requests.build_step(previous.request_ids if previous else ())
        self._wait_unwaited()
        msg.forward_event = self._last_mark.handle
        timings.lap("schedule")
        reply = self.session.step(msg)
        timings.lap("step_rpc")
        self.steps += 1
        self._free_blocks = reply.num_free_blocks
        if reply.preempted:
            self.num_preempted += len(reply.preempted)
            log.info("preempted to make room; they will recompute", extra={"requests": list(reply.preempted)})
        step = self.requests.apply_step_reply(reply)
        timings.lap("apply")
        self._forward = None
        if previous is not None:
            self._read_results(previous)
        for seq in step.released:  # their commits and frees are in the daemon now
            self.streams.finished(seq)
        work = [w for w in step.work if not w.seq.is_finished]  # finished by the results just read
        if not work:
            timings.lap("results")
            timings.end("none")
            return previous is not None
        if reply.copy_events:  # host-tier blocks still being copied into the cache (CUDA)
            self.runner.wait_for_copies(reply.copy_events)
        chunks = [self._chunk(w) for w in work]
        self.session.check_lease()  # never write into blocks that may be someone else's by now
        # NOTE: a graphed forward's logits are a view of a static buffer that
        # the next replay overwrites. Safe: the previous forward's logits were
        # sampled above (their reads queued, their tokens read back) before
        # this forward is launched on the same stream.
        logits = self.runner.forward(chunks)
        self._last_mark = self.runner.mark_forward()
        timings.lap("forward")
        self._forward = Forward(work, chunks, logits, started, self._last_mark)
        if not self.config.pipelined:
            self._forward, forward = None, self._forward
            self._read_results(forward)
        tokens = sum(len(c.token_ids) for c in chunks)
        timings.end("decode" if tokens == len(chunks) else "mixed", tokens)
        return True

    @staticmethod
    def _chunk(w: Work) -> Chunk:
        seq = w.seq
        num_tokens = seq.num_tokens
        if w.end > num_tokens:
            raise RuntimeError(f"the daemon scheduled {seq.request_id} to {w.end}, past its {num_tokens} tokens")
        in_prompt = w.end <= len(seq.prompt_ids)  # no need to join prompt and output
        return Chunk(
            token_ids=(seq.prompt_ids if in_prompt else seq.all_ids)[w.first : w.end],
            first=w.first,
            block_table=seq.block_table,
            request_id=seq.request_id,  # its block-table row persists while it runs
            write_from=max(w.first, w.num_cached_tokens),
            wants_logits=w.end == num_tokens and seq.samples,
            prompt_logits=seq.prompt_logit_positions(w.first, w.end),
        )

    def _read_results(self, forward: Forward) -> None:
        """Commits a finished forward's chunks and samples its sequences."""
        sampling = []
        for w, chunk in zip(forward.work, forward.chunks, strict=True):
            seq = w.seq
            self.requests.computed(seq, w.end)
            if chunk.wants_logits:
                sampling.append(seq)
            elif not seq.samples and w.end == seq.num_tokens and not seq.is_finished:
                seq.finish = Finish.LENGTH  # a warm-up (or a prompt scored) whose prompt is now in the cache
                self._finished(seq)
        logits = forward.logits
        if any(chunk.num_prompt_logits for chunk in forward.chunks):
            logits = self._score_prompts(forward)
        if not sampling:
            # Reading sampled tokens waits for the forward; without any, it is
            # waited for before the next Step (which commits these blocks), once
            # the next forward is launched.
            self._unwaited = forward
            self.timings.lap("results")
            return
        self.timings.lap("results")
        # NOTE: the sequences themselves are the histories: the processors read
        # a row's prompt and output ids only when its params use them.
        sampled = self.sampler.sample(logits, [s.params for s in sampling], [s.generator for s in sampling], sampling)
        self.timings.lap("sample")
        self._observe_rate(forward)  # reading the sampled tokens waited for the forward
        batch: list[SampledToken] = []
        for i, seq in enumerate(sampling):
            if seq.is_finished:  # cancelled while its forward ran: its token is dropped
                continue
            batch.append(self._append_token(seq, sampled.tokens[i], sampled.logprobs[i], sampled.top[i]))
        self.streams.tokens(batch)
        self.timings.lap("results")

    def _score_prompts(self, forward: Forward) -> torch.Tensor:
        """Scores the prompt tokens of the forward's prompt-logit rows, hands
        each prompt scored in full to its stream, and returns the sampling
        rows' logits (each chunk's rows: its prompt's, then its last one's)."""
        sampling_rows: list[int] = []
        row = 0
        for w, chunk in zip(forward.work, forward.chunks, strict=True):
            seq, (start, stop) = w.seq, chunk.prompt_logits
            if stop > start:
                scored = score_tokens(
                    forward.logits[row : row + stop - start], seq.prompt_ids[start + 1 : stop + 1],
                    seq.params.prompt_top_logprobs,
                )  # fmt: skip
                seq.prompt_logprobs.extend(scored.logprobs)
                seq.prompt_top.extend(scored.top or ())
                row += stop - start
                if seq.prompt_scored and seq.finish in (None, Finish.LENGTH):  # not cancelled meanwhile
                    self.streams.prompt_logprobs(seq)
            if chunk.wants_logits:
                sampling_rows.append(row)
                row += 1
        return forward.logits[sampling_rows]

    def _wait_unwaited(self) -> None:
        """Waits for a forward read without waiting (see the module's docstring)."""
        if self._unwaited is not None:
            forward, self._unwaited = self._unwaited, None
            forward.mark.wait()
            self._observe_rate(forward)

    def _observe_rate(self, forward: Forward) -> None:
        tokens = sum(len(c.token_ids) for c in forward.chunks)
        self.prefill_rate.observe(tokens, time.monotonic() - forward.started_s)

    def _publish_load(self) -> None:
        rate = self.prefill_rate
        backlog = self.requests.backlog()
        self.load.publish(
            LoadReport(
                queued_tokens=backlog.queued_tokens,
                waiting=backlog.waiting,
                running=len(self.requests.seqs) - backlog.waiting,
                free_blocks=self._free_blocks,
                forward_s=rate.forward_s if rate.known else 0.0,
                token_s=rate.token_s if rate.known else 0.0,
                token_budget=self.requests.settings.token_budget,
            )
        )

    def _append_token(self, seq: Sequence, token: int, logprob: float, top: TopLogprobs | None) -> SampledToken:
        """Takes a sampled token; ends the sequence on EOS, a stop token or its
        length (stop strings: ``inference.streams``). Returns its stream entry."""
        if seq.first_token_s is None:
            seq.first_token_s = time.monotonic()
        seq.output_ids.append(token)
        seq.output_logprobs.append(logprob)
        seq.finish = self._finish_after(seq, token)
        self.requests.sampled(seq, token)
        if seq.finish is not None:
            self._finished(seq)
        return SampledToken(seq, token, logprob, top, final=seq.finish is not None)

    def _finish_after(self, seq: Sequence, token: int) -> Finish | None:
        """How ``token`` (just appended) ends ``seq``, if it does."""
        params = seq.params
        if seq.grammar is not None and (ended := _grammar_finish(seq, token)) is not None:
            return ended
        # The sampler masks EOS and the stop ids while the output is shorter
        # than min_tokens; this only keeps a forced one from ending it early.
        may_stop = len(seq.output_ids) >= params.min_tokens
        if may_stop and token in self.eos_token_ids and not params.ignore_eos:
            return Finish.EOS
        if may_stop and token in params.stop_token_ids:
            return Finish.STOP
        if len(seq.output_ids) >= params.max_new_tokens:
            return Finish.LENGTH
        return None

    def _finished(self, seq: Sequence) -> None:
        self.requests.finished(seq)

    def _take_inbox(self) -> None:
        """Acts on every message other threads sent so far."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            match message:
                case _Add(seq):
                    seq.generator = make_generator(seq.params.seed)
                    self.requests.add(seq)
                    if seq.params.prompt_logprobs and seq.prompt_scored:  # nothing to score: its scores are empty
                        self.streams.prompt_logprobs(seq)
                case _HandBack(reason, everything):
                    self._hand_back(reason, everything)
                case _Cancel(request_id, finish):
                    dropped = self.requests.cancel(request_id, finish)
                    if dropped is not None:  # the daemon never heard of it
                        self.streams.finished(dropped)

    def _hand_back(self, message: str, everything: bool) -> None:
        """Ends the requests that streamed nothing yet (all of them: ``everything``) with an error."""
        for seq in list(self.requests.seqs.values()):
            if seq.is_finished or (seq.output_ids and not everything):
                continue
            seq.error = message
            self.num_handed_back += not seq.output_ids
            dropped = self.requests.cancel(seq.request_id, Finish.ERROR)
            if dropped is not None:  # the daemon never heard of it
                self.streams.finished(dropped)

    # ------------------------------------------------------------ daemon

    def _new_runner(self, cache: torch.Tensor, block_size: int) -> ModelRunner:
        """A runner on the newly mapped cache, its graphs captured on it
        (the cache's address is baked into each graph)."""
        runner = ModelRunner(self.model, cache, block_size, timings=self.timings)
        if self.config.cuda_graphs:
            c = self.config
            plan = GraphPlan.for_engine(c.max_num_seqs, c.token_budget, c.max_context)
            capture = CudaGraphCapture(runner.device) if runner.device.type == "cuda" else EagerStandIn()
            runner.graphs = capture_graphs(runner, plan, capture)
        return runner

    def _try_attach(self) -> bool:
        try:
            session = self._attach()
        except (grpc.RpcError, ConnectionError) as err:
            log.debug("daemon not reachable", extra={"error": str(err)})
            return False
        except ValueError as err:  # e.g. a layout or block size this engine cannot use
            log.error("cannot serve with this daemon", extra={"error": str(err)})
            return self._give_up(str(err))
        except Exception as err:  # mapping its memory failed (CUDA IPC, shared memory): a retry fails alike
            log.exception("attaching to the KV-cache daemon failed")
            return self._give_up(f"attaching to the KV-cache daemon failed: {type(err).__name__}: {err}")
        assert session.cache is not None
        try:
            runner = self._make_runner(session.cache, session.layout.block_size)
        except Exception as err:  # e.g. no interprocess CUDA events here
            log.exception("preparing the model on the daemon's memory failed")
            with contextlib.suppress(grpc.RpcError):
                session.detach()
            return self._give_up(f"preparing the model on the daemon's memory failed: {type(err).__name__}: {err}")
        self.session, self.runner = session, runner
        self.runner.before_write = session.check_lease  # checked per layer, see inference/attention.py
        log.info("attached to the KV-cache daemon", extra={"session": session.session_id})
        self._on_health(True)
        return True

    def _give_up(self, reason: str) -> bool:
        """The engine can never serve: its process exits (``fatal``, read by
        kvd-engine's main) instead of staying up unhealthy with no one told."""
        self.fatal = reason
        self._stop.set()
        return False

    def _lost_daemon(self, message: str) -> None:
        """Ends every request with an error, never with wrong tokens."""
        log.error("lost the KV-cache daemon; failing in-flight requests", extra={"error": message})
        self._take_inbox()
        self._forward = self._unwaited = None
        for seq in self.requests.drop_all():
            if seq.finish not in (None, Finish.ERROR):
                # It has all its tokens; only its free was pending, and the
                # daemon releases a lost session's blocks by itself.
                self.streams.finished(seq)
                continue
            seq.error = message
            seq.finish = Finish.ERROR
            self.streams.error(seq, message)
        self._close_session()
        self._on_health(False)

    def _close_session(self) -> None:
        session, runner = self.session, self.runner
        self.session, self.runner = None, None
        self._last_mark = NO_MARK  # the next runner records into events of its own
        if session is None:
            return
        # NOTE: detaching tells the daemon we no longer write: a lapsed
        # session's blocks, quarantined until now, are handed out again. On a
        # GPU a forward's writes may still be queued on the stream.
        try:
            if runner is not None:
                runner.wait_for_writes()
        except Exception:  # unsure our writes landed: leave the blocks to the daemon's quarantine
            log.exception("could not wait for the last forward's writes; not detaching")
            session.stop_heartbeats()
            return
        with contextlib.suppress(grpc.RpcError):  # the daemon is gone; its lease lapses
            session.detach()


def _grammar_finish(seq: Sequence, token: int) -> Finish | None:
    """Moves a constrained sequence's grammar past ``token``: EOS when the
    grammar took it as its end (even with ignore_eos: nothing may follow),
    STOP when it forbade it, which only a row with every token masked can
    draw (min_tokens masking the one EOS a finished grammar allows)."""
    assert seq.grammar is not None
    if not seq.grammar.accept(token):
        log.warning("a sampled token broke its grammar: the output ends", extra={"request": seq.request_id})
        return Finish.STOP
    return Finish.EOS if seq.grammar.finished else None
