"""The engine's step loop: one daemon Step, one forward, one sampling pass.

A single thread owns the scheduler, the model and the daemon session. gRPC
handlers talk to it through a thread-safe inbox and read each sequence's
``events`` queue:

    ("tokens", token_ids, logprobs, text, top_logprobs)   as tokens are sampled
    ("finished", Finish)                    after the daemon freed its blocks
    ("error", message)                      the daemon was lost mid-request
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

from inference.detokenizer import IncrementalDetokenizer
from inference.load import LoadBoard, LoadReport, PrefillRate
from inference.model_runner import ModelRunner
from inference.sampling import Sampler, make_generator
from inference.scheduler import Scheduler
from inference.sequence import Finish, Sequence, Status
from kvd.client import DaemonSession

log = logging.getLogger("inference.engine")


@dataclass(frozen=True)
class EngineConfig:
    """Attributes:
    max_num_seqs: the most sequences running at once.
    token_budget: the most tokens computed in one step (chunked prefill).
    reattach_interval_s: how often to try the daemon again after losing it.
    """

    max_num_seqs: int = 64
    token_budget: int = 512
    reattach_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")


class EngineUnavailable(Exception):
    """The engine has no daemon session right now."""


class Engine:
    """Continuous batching over the daemon's blocks.

    Args:
        model: the causal LM, its attention set to a paged backend.
        tokenizer: its tokenizer (for text deltas and stop strings).
        attach: opens a daemon session with the model's layout (called again
            after the daemon was lost).
        eos_token_ids: tokens that end a sequence unless it ignores EOS.
        on_health: told True/False as the daemon session comes and goes.
    """

    def __init__(
        self,
        model,
        tokenizer,
        attach: Callable[[], DaemonSession],
        config: EngineConfig,
        eos_token_ids: set[int],
        on_health: Callable[[bool], None] = lambda healthy: None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_ids = eos_token_ids
        self._attach = attach
        self._on_health = on_health
        self.session: DaemonSession | None = None
        self.runner: ModelRunner | None = None
        self.scheduler = Scheduler(config.max_num_seqs, config.token_budget)
        self.sampler = Sampler()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._finished_pending: list[Sequence] = []  # released after their free reached the daemon
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.steps = 0
        self.load = LoadBoard()  # what routers see (the Load stream)
        self.prefill_rate = PrefillRate()
        self._free_blocks = 0
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

    def submit(self, seq: Sequence) -> None:
        """Queues a sequence. Raises ``EngineUnavailable`` without a daemon."""
        if not self.healthy:
            raise EngineUnavailable("the engine is not attached to the KV-cache daemon")
        self._inbox.put(("add", seq))
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        """Stops a sequence; safe from any thread, for finished ones too."""
        self._inbox.put(("cancel", request_id))
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
            self._drain_inbox()
            self._publish_load()
            if not self.scheduler.has_work and not self._finished_pending:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self._step()
                self._publish_load()
            except grpc.RpcError as err:
                self._lost_daemon(f"the KV-cache daemon is unavailable ({err.code().name}: {err.details()})")
            except Exception:  # a bug must not leave clients hanging
                log.exception("engine step failed")
                self._lost_daemon("internal engine error; see the engine's log")

    def _step(self) -> None:
        assert self.session is not None and self.runner is not None
        step = self.scheduler.build_step()
        released, self._finished_pending = self._finished_pending, []
        started = time.monotonic()  # a step's whole time (its Step call too) is what a prefill waits for
        out = self.session.step(step)
        self.steps += 1
        self._free_blocks = out.num_free_blocks
        if out.preempted:
            log.info("preempted to make room; they will recompute", extra={"requests": out.preempted})
        for seq in released:  # their commits and frees are in the daemon now
            seq.events.put(("finished", seq.finish))
        chunks, seqs = self.scheduler.apply(out)
        if not chunks:
            return
        if out.copy_events:  # host-tier blocks still being copied into the cache (CUDA)
            self.runner.wait_for_copies(out.copy_events)
        logits = self.runner.forward(chunks)
        sampling = []
        for chunk, seq in zip(chunks, seqs, strict=True):
            self.scheduler.computed(seq, chunk)
            if chunk.wants_logits:
                sampling.append(seq)
            elif seq.is_finished:  # a warm-up whose prompt is now in the cache
                self._finished(seq)
        if not sampling:
            # Reading sampled tokens waits for the forward; without any, wait
            # here: the next Step commits these blocks, and the daemon may copy
            # them to its host tier at once, from another process and stream.
            self.runner.wait_for_writes()
            self.prefill_rate.observe(sum(len(c.token_ids) for c in chunks), time.monotonic() - started)
            return
        sampled = self.sampler.sample(logits, [s.params for s in sampling], [s.generator for s in sampling])
        # Reading the sampled tokens waited for the forward: its time is known now.
        self.prefill_rate.observe(sum(len(c.token_ids) for c in chunks), time.monotonic() - started)
        for i, seq in enumerate(sampling):
            self._append_token(seq, sampled.tokens[i], sampled.logprobs[i], sampled.top[i])
            self.scheduler.sampled(seq)

    def _publish_load(self) -> None:
        sched, rate = self.scheduler, self.prefill_rate
        self.load.publish(
            LoadReport(
                queued_tokens=sched.queued_prefill_tokens(),
                waiting=len(sched.waiting),
                running=len(sched.running),
                free_blocks=self._free_blocks,
                forward_s=rate.forward_s if rate.known else 0.0,
                token_s=rate.token_s if rate.known else 0.0,
                token_budget=sched.token_budget,
            )
        )

    def _append_token(
        self, seq: Sequence, token: int, logprob: float, top: tuple[list[int], list[float]] | None
    ) -> None:
        if seq.first_token_s is None:
            seq.first_token_s = time.monotonic()
        seq.output_ids.append(token)
        seq.output_logprobs.append(logprob)
        detok = self._detokenizers[seq.request_id]
        text = detok.push([token])
        params = seq.params
        if token in self.eos_token_ids and not params.ignore_eos:
            seq.finish = Finish.EOS
        elif token in params.stop_token_ids or detok.stopped:
            seq.finish = Finish.STOP
        elif len(seq.output_ids) >= params.max_new_tokens:
            seq.finish = Finish.LENGTH
        if seq.finish is not None:
            text += "" if detok.stopped else detok.finish()
        seq.events.put(("tokens", [token], [logprob] if params.logprobs else [], text, [top] if top else []))
        if seq.finish is not None:
            self._finished(seq)

    def _finished(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self._detokenizers.pop(seq.request_id, None)
        self._finished_pending.append(seq)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                item.generator = make_generator(item.params.seed)
                self._detokenizers[item.request_id] = IncrementalDetokenizer(
                    self.tokenizer, item.prompt_ids, item.params.stop
                )
                self.scheduler.add(item)
            else:
                seq = self.scheduler.cancel(item)
                if seq is not None:
                    self._detokenizers.pop(seq.request_id, None)
                    self._finished_pending.append(seq)

    # ------------------------------------------------------------ daemon

    def _try_attach(self) -> bool:
        try:
            session = self._attach()
        except (grpc.RpcError, ConnectionError) as err:
            log.debug("daemon not reachable", extra={"error": str(err)})
            return False
        except ValueError as err:  # e.g. a layout or block size this engine cannot use
            log.error("cannot serve with this daemon", extra={"error": str(err)})
            self.fatal = str(err)
            self._stop.set()
            return False
        assert session.cache is not None
        self.session = session
        self.runner = ModelRunner(self.model, session.cache, session.layout.block_size)
        log.info("attached to the KV-cache daemon", extra={"session": session.session_id})
        self._on_health(True)
        return True

    def _lost_daemon(self, message: str) -> None:
        """Ends every request with an error, never with wrong tokens."""
        log.error("lost the KV-cache daemon; failing in-flight requests", extra={"error": message})
        self._drain_inbox()
        for seq in self.scheduler.drop_all():
            seq.error = message
            seq.finish = Finish.ERROR
            seq.status = Status.FINISHED
            seq.events.put(("error", message))
        # These already have all their tokens; only their free was pending,
        # and the daemon releases a lost session's blocks by itself.
        for seq in self._finished_pending:
            seq.events.put(("finished", seq.finish))
        self._finished_pending = []
        self._detokenizers.clear()
        self._close_session()
        self._on_health(False)

    def _close_session(self) -> None:
        session, self.session, self.runner = self.session, None, None
        if session is not None:
            with contextlib.suppress(grpc.RpcError):  # the daemon is gone; its lease lapses
                session.detach()
