"""Engines driving the Step contract for real, with a fake model.

A real daemon runs in-process on a unix socket; real engines (their pipelined
loop, request table, sampler and daemon session) attach to it. The model is
replaced by a runner that writes each token id into its K/V slot and derives
the next token from the whole sequence as it READS IT BACK through the block
table: a wrong block table, a block freed while in use, or a cache hit on
other content changes the output, which must equal a reference computed from
the token lists alone. A small pool makes the daemon preempt while forwards
are in flight.
"""

from __future__ import annotations

import random
import time
from concurrent import futures

import pytest
import torch

from inference.config import EngineConfig
from inference.engine import Engine
from inference.model_runner import NO_MARK, ForwardMark
from inference.requests import Sequence
from inference.sampling import SamplingParams
from inference.step_inputs import Chunk
from inference.streams import StreamError, StreamFinished, StreamTokens
from kvd.common.client import DaemonClient
from kvd.common.layout import CacheLayout
from kvd.config import DaemonConfig
from kvd.daemon import Daemon
from kvd.service import build_server
from tests.conftest import wait_for

VOCAB = 97
BS = 4
LAYOUT = CacheLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=BS, dtype="float32")


def next_token(tokens: list[int]) -> int:
    """The fake model: every token of the sequence matters, and its position."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) + 7 * len(tokens)) % VOCAB


def reference(prompt: list[int], max_new_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakeRunner:
    """Writes token ids as K/V; reads the sequence back from the cache."""

    def __init__(self, cache: torch.Tensor, block_size: int) -> None:
        self.cache = cache
        self.block_size = block_size
        self.forwards = 0

    def _slot(self, chunk: Chunk, position: int) -> tuple[int, int]:
        return chunk.block_table[position // self.block_size], position % self.block_size

    def _slot_of(self, chunk: Chunk):
        return lambda position: self._slot(chunk, position)

    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Writes the chunks' tokens; samples each from what the cache holds."""
        self.forwards += 1
        rows = []
        for chunk in chunks:
            end = chunk.first + len(chunk.token_ids)
            for position in range(max(chunk.first, chunk.write_from), end):
                block, slot = self._slot(chunk, position)
                self.cache[block, 0, 0, slot, 0, 0] = float(chunk.token_ids[position - chunk.first])
            if chunk.wants_logits:
                slots = map(self._slot_of(chunk), range(end))
                seen = [int(self.cache[block, 0, 0, slot, 0, 0]) for block, slot in slots]
                logits = torch.full((VOCAB,), -1e9)
                logits[next_token(seen)] = 0.0
                rows.append(logits)
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)

    def mark_forward(self) -> ForwardMark:
        return NO_MARK

    def wait_for_writes(self) -> None:
        pass

    def wait_for_copies(self, handles) -> None:
        pass


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


class InProcessDaemon:
    def __init__(self, folder: str, num_blocks: int, lease_s: float = 5.0) -> None:
        config = DaemonConfig(
            block_size=BS, num_blocks=num_blocks, shm_dir=folder, model_layout=LAYOUT, lease_s=lease_s
        )
        self.daemon = Daemon(config)
        self.server = build_server(self.daemon, None)
        self.address = f"unix:{folder}/kvd.sock"
        self.server.add_port(self.address)
        self.server.start()

    def client(self) -> DaemonClient:
        return DaemonClient.connect(self.address)

    def stop(self) -> None:
        self.server.stop(grace_s=0)
        self.daemon.close()


@pytest.fixture
def daemon(workdir):
    started = InProcessDaemon(workdir, num_blocks=40)
    yield started
    started.stop()


def start_engine(
    daemon: InProcessDaemon,
    name: str,
    max_num_seqs: int = 4,
    token_budget: int = 12,
    pipelined: bool = True,
    make_runner=FakeRunner,
) -> Engine:
    client = daemon.client()
    engine = Engine(
        model=None,
        tokenizer=FakeTokenizer(),
        attach=lambda: client.attach(name, LAYOUT),
        config=EngineConfig(max_num_seqs=max_num_seqs, token_budget=token_budget, pipelined=pipelined),
        eos_token_ids=set(),
        make_runner=make_runner,
    )
    engine.start()
    assert wait_for(lambda: engine.healthy, 10)
    return engine


def submit(engine: Engine, prompt: list[int], max_new_tokens: int) -> Sequence:
    seq = Sequence(f"r{random.getrandbits(48):x}", list(prompt), SamplingParams(max_new_tokens=max_new_tokens))
    engine.submit(seq)
    return seq


def collect(seq: Sequence, timeout_s: float = 60.0) -> tuple[list[int], str]:
    """The sequence's tokens and how it ended ("finished:<reason>" or "error")."""
    tokens: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        match seq.events.get(timeout=max(0.1, deadline - time.monotonic())):
            case StreamTokens(token_ids=token_ids):
                tokens.extend(token_ids)
            case StreamFinished(finish=finish):
                return tokens, f"finished:{finish.value}"
            case StreamError():
                return tokens, "error"


def prompts(rng: random.Random, n: int, shared: list[int]) -> list[list[int]]:
    return [
        shared[: rng.choice([0, 8, 12])] + [rng.randrange(VOCAB) for _ in range(rng.randint(3, 14))] for _ in range(n)
    ]


@pytest.mark.parametrize("second_pipelined", [True, False], ids=["both-pipelined", "one-pipelined"])
def test_two_engines_are_exact_under_preemption_and_share_prefixes(daemon, second_pipelined):
    rng = random.Random(12)
    shared = [rng.randrange(VOCAB) for _ in range(12)]
    first = start_engine(daemon, "e1", max_num_seqs=6)
    second = start_engine(daemon, "e2", max_num_seqs=6, pipelined=second_pipelined)
    try:
        # The first engine computes the shared prefix; the second then hits it.
        warm = submit(first, shared + [1, 2], 3)
        assert collect(warm) == (reference(shared + [1, 2], 3), "finished:length")
        hit = submit(second, shared + [5], 4)
        assert collect(hit)[0] == reference(shared + [5], 4)
        assert hit.num_cached_prompt == 12
        # Then both flood a 40-block pool: the daemon preempts while forwards are in flight.
        work = [(engine, p, rng.randint(12, 30)) for engine in (first, second) for p in prompts(rng, 10, shared)]
        seqs = [(submit(engine, p, n), p, n) for engine, p, n in work]
        for seq, prompt, n in seqs:
            assert collect(seq) == (reference(prompt, n), "finished:length"), seq.request_id
        assert first.num_preempted + second.num_preempted > 0, "the pool never ran short: preemption untested"
        with daemon.client() as client:
            assert wait_for(lambda: client.stats().num_used_blocks == 0, 10)
            assert client.stats().num_requests == 0
    finally:
        first.stop()
        second.stop()


def test_a_cancellation_racing_commits_frees_everything_and_spares_the_others(daemon):
    engine = start_engine(daemon, "e1")
    rng = random.Random(3)
    try:
        for round_ in range(6):
            keep = [(p, 10) for p in prompts(rng, 3, [])]
            kept = [(submit(engine, p, n), p, n) for p, n in keep]
            doomed = [submit(engine, p, 30) for p in prompts(rng, 3, [])]
            time.sleep(0.002 * round_)  # cancel at a different point of the loop each round
            for seq in doomed:
                engine.cancel(seq.request_id)
            for seq in doomed:
                tokens, end = collect(seq)
                assert end == "finished:cancelled" and len(tokens) < 30
                assert tokens == reference(seq.prompt_ids, 30)[: len(tokens)]
            for seq, prompt, n in kept:
                assert collect(seq) == (reference(prompt, n), "finished:length")
        with daemon.client() as client:
            assert wait_for(lambda: client.stats().num_used_blocks == 0, 10)
    finally:
        engine.stop()


def test_one_engines_death_never_touches_the_others_requests(workdir):
    daemon = InProcessDaemon(workdir, num_blocks=64, lease_s=1.0)
    survivor, doomed = start_engine(daemon, "survivor"), start_engine(daemon, "doomed")
    rng = random.Random(5)
    try:
        long_ones = [(submit(survivor, p, 40), p) for p in prompts(rng, 3, [])]
        lost = [submit(doomed, p, 40) for p in prompts(rng, 3, [])]
        assert wait_for(lambda: all(s.output_ids for s in lost), 10)
        # The doomed engine hangs: no more Steps, no heartbeats (as if SIGKILLed).
        doomed.session._stop.set()
        doomed._stop.set()
        doomed._thread.join(10)
        reaped = []  # the doomed session, once its 1 s lease lapses
        assert wait_for(lambda: reaped.extend(daemon.daemon.reap_expired()) or reaped, 10)
        assert len(reaped) == 1
        for seq, prompt in long_ones:
            assert collect(seq) == (reference(prompt, 40), "finished:length")
        with daemon.client() as client:
            # Its process (this one) lives: its blocks stay quarantined until it detaches.
            assert client.stats().num_quarantined_sessions == 1
            doomed.session.detach()
            assert wait_for(lambda: client.stats().num_used_blocks == 0, 10)
    finally:
        survivor.stop()
        daemon.stop()


def test_one_session_cannot_starve_another(workdir):
    daemon = InProcessDaemon(workdir, num_blocks=24)
    hog, meek = start_engine(daemon, "hog", max_num_seqs=16), start_engine(daemon, "meek")
    rng = random.Random(9)
    try:
        flood = [submit(hog, p, 30) for p in prompts(rng, 40, [])]
        assert wait_for(lambda: sum(1 for s in flood if s.output_ids) >= 3, 120)
        prompt = [rng.randrange(VOCAB) for _ in range(8)]
        start = time.monotonic()
        small = submit(meek, prompt, 8)
        assert collect(small, timeout_s=300) == (reference(prompt, 8), "finished:length")
        waited = time.monotonic() - start
        unfinished = sum(1 for s in flood if not s.is_finished)
        assert unfinished > 10, f"the flood ended first ({unfinished} left after {waited:.1f}s): nothing was tested"
        for seq in flood:
            hog.cancel(seq.request_id)
    finally:
        hog.stop()
        meek.stop()
        daemon.stop()


def test_engines_step_concurrently_without_errors(daemon):
    """Many submitting threads, two engines: every request ends exactly."""
    engines = [start_engine(daemon, "a"), start_engine(daemon, "b")]
    rng = random.Random(21)
    jobs = [(engines[i % 2], p, rng.randint(1, 12)) for i, p in enumerate(prompts(rng, 24, [3] * 12))]
    try:
        with futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda job: collect(submit(*job)), jobs))
        for (_, prompt, n), got in zip(jobs, results, strict=True):
            assert got == (reference(prompt, n), "finished:length")
    finally:
        for engine in engines:
            engine.stop()


def test_an_engine_never_writes_once_its_lease_may_have_lapsed(daemon):
    engine = start_engine(daemon, "slow")
    try:
        seq = submit(engine, [1, 2, 3, 4, 5], 200)
        assert wait_for(lambda: len(seq.output_ids) >= 2, 10)
        session, runner = engine.session, engine.runner
        real_step = session.step

        def late_step(msg, timeout_s=None):
            reply = real_step(msg, timeout_s)
            session.renewed_at -= session.lease_s  # as if the answer had taken a whole lease
            return reply

        session.step = late_step
        forwards = runner.forwards
        tokens, end = collect(seq)
        assert end == "error" and runner.forwards <= forwards + 1  # at most the forward already under way
        assert tokens == reference([1, 2, 3, 4, 5], 200)[: len(tokens)]
        assert wait_for(lambda: engine.session is not None and engine.session is not session, 10)  # attached again
    finally:
        engine.stop()


def test_an_engine_detaches_only_after_its_forward_in_flight_wrote(daemon):
    """The daemon gives a detached session's blocks (its fenced ones too) to
    others at once: the engine must wait for its last forward first."""
    log: list[str] = []

    class RecordingRunner(FakeRunner):
        def wait_for_writes(self) -> None:
            log.append("wait")

    engine = start_engine(daemon, "stopping", make_runner=RecordingRunner)
    seq = submit(engine, [1, 2, 3, 4, 5], 10_000)
    assert wait_for(lambda: len(seq.output_ids) >= 3, 10)
    session = engine.session
    real_detach = session.detach
    session.detach = lambda: log.append("detach") or real_detach()
    engine.stop()  # pipelined and decoding: a forward is in flight between Steps
    assert log[-2:] == ["wait", "detach"]


def test_each_step_waits_for_every_forward_but_the_one_in_flight_and_names_the_latest(daemon):
    """Prefills that sample nothing are not waited for where they are read
    (that would idle a GPU while the next forward is launched) but before the
    next Step, which may hand their blocks to others and copy them between
    tiers; every Step names the latest forward's event for the daemon's copies."""
    log: list[tuple] = []

    class Mark(ForwardMark):
        def wait(self) -> None:
            log.append(("wait", self.handle))

    class MarkingRunner(FakeRunner):
        def mark_forward(self) -> ForwardMark:
            log.append(("launch", f"f{self.forwards}".encode()))
            return Mark(None, f"f{self.forwards}".encode())

    engine = start_engine(daemon, "marks", token_budget=4, make_runner=MarkingRunner)
    session = engine.session
    real_step = session.step

    def logged_step(msg, timeout_s=None):
        log.append(("step", msg.forward_event))
        return real_step(msg, timeout_s)

    session.step = logged_step
    try:
        # Warm-ups (prefill only: nothing sampled) in chunks of 4 tokens.
        warmups = [
            Sequence(f"w{i}", list(range(10 * i, 10 * i + 13)), SamplingParams(max_new_tokens=0)) for i in range(3)
        ]
        for seq in warmups:
            engine.submit(seq)
        for seq in warmups:
            assert collect(seq)[1] == "finished:length"
    finally:
        engine.stop()
    launched: list[bytes] = []
    waited: set[bytes] = set()
    steps = 0
    for kind, handle in log:
        if kind == "launch":
            launched.append(handle)
        elif kind == "wait":
            waited.add(handle)
        elif launched:
            steps += 1
            assert handle == launched[-1], log
            assert set(launched[:-1]) <= waited, (
                f"a Step went out before forwards {set(launched[:-1]) - waited} were done"
            )
    assert steps >= 6 and len(launched) >= 6, log


@pytest.mark.parametrize("failing", ["attach", "runner"])
def test_an_engine_that_cannot_use_the_daemons_memory_gives_up_at_once(daemon, failing):
    """What a GPU without CUDA IPC does (an error mapping the cache, or making
    the interprocess events): the engine says why and stops (kvd-engine then
    exits), leaving no session behind, instead of waiting unhealthy forever."""
    client = daemon.client()

    def attach():
        if failing == "attach":
            raise RuntimeError("CUDA error: invalid device context")
        return client.attach("doomed", LAYOUT)

    def make_runner(cache, block_size):
        raise RuntimeError("CUDA error: operation not supported")

    engine = Engine(None, FakeTokenizer(), attach, EngineConfig(), set(), make_runner=make_runner)
    engine.start()
    assert wait_for(lambda: engine.fatal is not None, 10), "the engine kept trying"
    step = "attaching to the KV-cache daemon" if failing == "attach" else "preparing the model on the daemon's memory"
    assert engine.fatal.startswith(f"{step} failed: RuntimeError: CUDA error"), engine.fatal
    assert not engine.healthy
    assert wait_for(lambda: client.stats().num_sessions == 0, 10), "its session was left attached"
    engine.stop()
