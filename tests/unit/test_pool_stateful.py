"""A hypothesis state machine over the whole block path: steps, pins, lookups, sessions.

A small pool (16 blocks of 4 tokens) and a four-token vocabulary make prefixes collide,
hit, get evicted and get preempted often. Each session is driven as an engine drives
it, pipelined or not at each step: with a forward in flight, that forward's commits
(and sampled tokens) arrive one Step late, and no block that forward may be writing
goes to another session until the session's next Step (the fence). After every rule the pool's accounting is
checked against an independent model of who holds what and what was ever committed.
The same machine runs once more with a host tier (24 slots) behind the pool, whose
outgoing copies finish whenever the machine decides (the worker thread's part).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvd.block import BlockState
from kvd.block_pool import DEVICE, HOST, AllCleared, BlockPool, BlockRemoved, BlockStored
from kvd.cache_manager import KVCacheManager
from kvd.common.hashing import encode_extra_keys, hash_token_ids
from kvd.errors import CapacityError, NotFoundError
from kvd.host_tier import HostTier, SlotState
from kvd.pins import PinRegistry
from kvd.scheduler import run_step
from kvd.session import SessionRegistry
from kvd_api.daemon.v1 import daemon_pb2 as pb

BS = 4
NUM_BLOCKS = 16
PIN_CAP = 2
MAX_NEW_TOKENS = 6
SALTS = [b"", b"x", b"y"]
PIN_IDS = ["p0", "p1", "p2"]
TOKEN = st.integers(0, 3)
HOST_SLOTS = 12  # larger than the device pool, as in real use


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BS)


def chain(tokens: list[int], salt: bytes) -> list[bytes]:
    return hash_token_ids(tokens, BS, encode_extra_keys(salt))


@dataclass
class ModelRequest:
    """A request as the daemon should see it, and as its engine knows it."""

    tokens: list[int]  # the daemon's: prompt and committed samples
    salt: bytes
    max_end: int  # no position at or past this is ever scheduled
    computed: int = 0
    scheduled: int = 0
    running: bool = False
    engine_tokens: list[int] | None = None  # the engine's: every sample so far
    max_tokens: int = 0  # prompt + max_new_tokens: the engine finishes it there


@dataclass
class Row:
    request_id: str
    first: int
    num_tokens: int
    num_cached: int
    num_new_blocks: int

    @property
    def end(self) -> int:
        return self.first + self.num_tokens


def rows_of(reply: pb.StepResponse) -> list[Row]:
    s = reply.scheduled
    return [
        Row(*r)
        for r in zip(s.request_ids, s.first_positions, s.num_tokens, s.num_cached_tokens, s.num_new_blocks, strict=True)
    ]


def admitted_flags(rows: list[Row], running_before: dict[str, bool]) -> list[bool]:
    """Per row: whether its request was running before the step (False: admitted by it)."""
    return [running_before[r.request_id] for r in rows]


def commits_pb(pending: dict[str, tuple[int, list[int]]]) -> pb.Commits:
    ids = list(pending)
    return pb.Commits(
        request_ids=ids,
        num_computed_tokens=[pending[r][0] for r in ids],
        num_new_tokens=[len(pending[r][1]) for r in ids],
        new_token_ids=[t for r in ids for t in pending[r][1]],
    )


class PoolMachine(RuleBasedStateMachine):
    with_host_tier = False

    def __init__(self) -> None:
        super().__init__()
        self.next_forward: list[Row] = []
        self.pool = BlockPool(NUM_BLOCKS, record_events=True)
        self.host = HostTier(HOST_SLOTS, record=self.pool.record) if self.with_host_tier else None
        self.manager = KVCacheManager(self.pool, BS, self.host)
        self.copies_out: list = []  # offloads submitted and not finished: (block, slot)
        self.registry = SessionRegistry(lease_s=3600)
        self.sessions = [self.registry.open("e0"), self.registry.open("e1")]
        self.pins = PinRegistry(self.pool, PIN_CAP)
        # The model.
        self.live: list[dict[str, ModelRequest]] = [{}, {}]  # per session, in arrival order
        self.released: list[list[str]] = [[], []]  # per session: ids whose release was confirmed
        self.forward: list[list[Row] | None] = [None, None]  # per session: a forward not sampled yet
        # Per session: (request, block) pairs a forward of its engine may still
        # be writing, as far as the daemon can know: the latest forward's, and
        # while pipelined the one in flight at its last Step (the engine reads
        # it after that Step's reply, while other sessions step).
        self.writing: list[set[tuple[str, int]]] = [set(), set()]
        self.pending: list[dict[str, tuple[int, list[int]]]] = [{}, {}]  # sampled, not committed yet
        self.finishing: list[set[str]] = [set(), set()]  # done in the engine, not reported yet
        self.committed: set[tuple[bytes, tuple[int, ...]]] = set()  # (salt, full-block prefix) ever computed
        self.committed_hashes: set[bytes] = set()
        self.pinned: dict[str, list[int]] = {}
        # Each tier's index as a consumer of take_events() sees it.
        self.event_view: dict[str, set[bytes]] = {DEVICE: set(), HOST: set()}
        self.seen: list[tuple[list[int], bytes]] = []  # recent admissions and their token lists
        self.committed_seqs: list[tuple[list[int], bytes]] = []  # recent committed prefixes
        self.next_id = 0

    # ------------------------------------------------------------ helpers

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def remember(self, tokens: list[int], salt: bytes) -> None:
        self.seen.append((list(tokens), salt))
        del self.seen[:-16]

    def draw_tokens(self, data, max_size: int = 16) -> tuple[list[int], bytes]:
        """Mostly a prefix of something seen or committed before plus a short tail, so lookups hit."""
        source = data.draw(st.sampled_from(["seen", "committed", "committed", "fresh"]), label="source")
        pool = self.seen if source == "seen" else self.committed_seqs
        if source == "committed" and self.host is not None:
            # Prefer prefixes evicted from the device but kept by the host tier.
            pool = [(t, salt) for t, salt in pool if self.host_continues(t, salt)] or pool
        if source != "fresh" and pool:
            base, salt = data.draw(st.sampled_from(pool), label="base")
            cut = data.draw(st.one_of(st.just(len(base)), st.integers(1, len(base))), label="cut")
            tokens = base[:cut] + data.draw(st.lists(TOKEN, max_size=6), label="tail")
            salt = data.draw(st.sampled_from([salt, salt, salt, *SALTS]), label="salt")
        else:
            tokens = data.draw(st.lists(TOKEN, min_size=1, max_size=max_size), label="tokens")
            salt = data.draw(st.sampled_from(SALTS), label="salt")
        return tokens, salt

    def record_commit(self, request: ModelRequest) -> None:
        if request.computed >= BS:
            self.committed_seqs.append((request.tokens[: request.computed], request.salt))
            del self.committed_seqs[:-16]
        hashes = chain(request.tokens[: request.computed], request.salt)
        for i in range(request.computed // BS):
            self.committed.add((request.salt, tuple(request.tokens[: (i + 1) * BS])))
            self.committed_hashes.add(hashes[i])

    def assert_cached_prefix_was_committed(self, tokens: list[int], salt: bytes, num_cached: int) -> None:
        assert num_cached % BS == 0
        for j in range(1, num_cached // BS + 1):
            assert (salt, tuple(tokens[: j * BS])) in self.committed, (
                f"{num_cached} cached tokens reported for a prefix of which only {j - 1} blocks were ever committed"
            )

    def snapshot(self):
        return (
            [b.block_id for b in self.pool.free_queue],
            [(b.ref_cnt, b.block_hash) for b in self.pool.blocks],
            {h: b.block_id for h, b in self.pool.cached.items()},
            self.pool.num_evictions,
            [
                {
                    rid: (
                        list(r.token_ids),
                        [b.block_id for b in r.blocks],
                        r.num_computed_tokens,
                        r.num_scheduled_tokens,
                    )
                    for rid, r in s.requests.items()
                }
                for s in self.sessions
            ],
            [list(s.recently_freed) for s in self.sessions],
            [
                (list(s.running), [r.request_id for r in s.waiting], s.token_budget, s.max_num_seqs)
                for s in self.sessions
            ],
            {pid: [b.block_id for b in blocks] for pid, blocks in self.pins.pins.items()},
            self.host_snapshot(),
        )

    def host_snapshot(self):
        if self.host is None:
            return None
        return list(self.host.cached), sorted(self.host.writing), [(s.block_hash, s.readers) for s in self.host.slots]

    def cached_prefix(self, hashes: list[bytes]) -> list:
        """The model of admission's cache lookup: per leading block, the device
        block holding it, or None where only the host tier does."""
        prefix = []
        for block_hash in hashes:
            block = self.pool.cached.get(block_hash)
            if block is None and (self.host is None or block_hash not in self.host.cached):
                break
            prefix.append(block)
        return prefix

    def host_continues(self, tokens: list[int], salt: bytes) -> bool:
        return None in self.cached_prefix(chain(tokens, salt))

    # -------------------------------------------------------------- rules

    def draw_new_requests(self, data) -> list[pb.NewRequest]:
        new = []
        for _ in range(data.draw(st.integers(0, 2), label="num new requests")):
            tokens, salt = self.draw_tokens(data, max_size=24)
            max_new = data.draw(st.integers(0, MAX_NEW_TOKENS), label="max_new_tokens")
            priority = data.draw(st.integers(0, 2), label="priority")
            new.append(
                pb.NewRequest(
                    request_id=self.new_id(),
                    prompt_token_ids=tokens,
                    cache_salt=salt,
                    max_new_tokens=max_new,
                    priority=priority,
                )
            )
        return new

    def sample_forward(self, data, sid: int) -> None:
        """The engine reads the forward's results: computed tokens, and a
        sampled token for each chunk that ended at its last known token."""
        forward, self.forward[sid] = self.forward[sid], None
        for row in forward or []:
            req = self.live[sid].get(row.request_id)
            if req is None or row.request_id in self.finishing[sid]:
                continue
            computed, sampled = self.pending[sid].get(row.request_id, (0, []))
            engine = req.engine_tokens
            if row.end == len(engine) and len(engine) < req.max_tokens:
                token = data.draw(TOKEN, label="sampled")
                engine.append(token)
                sampled = [*sampled, token]
            self.pending[sid][row.request_id] = (row.end, sampled)
            if len(engine) >= req.max_tokens or data.draw(st.integers(0, 11), label="stop") == 0:
                self.finishing[sid].add(row.request_id)

    @rule(data=st.data(), sid=st.integers(0, 1), pipelined=st.booleans(), budget=st.integers(1, 24))
    def engine_step(self, data, sid, pipelined, budget):
        """What an engine sends: new requests, the commits of every forward but
        the one in flight, finished requests that no forward still writes."""
        if not pipelined:
            self.sample_forward(data, sid)
        in_flight = {r.request_id for r in self.forward[sid] or []}
        live = self.live[sid]
        cancels = [r for r in live if r not in in_flight and data.draw(st.integers(0, 15), label="cancel") == 0]
        self.finishing[sid].update(cancels)
        finished = sorted(r for r in self.finishing[sid] if r not in in_flight)
        msg = pb.StepRequest(
            new_requests=self.draw_new_requests(data),
            commits=commits_pb(self.pending[sid]),
            finished=finished,
            forward_in_flight=bool(in_flight),
        )
        if data.draw(st.booleans(), label="settings"):
            msg.settings.CopyFrom(pb.SessionSettings(max_num_seqs=data.draw(st.integers(1, 6)), token_budget=budget))
        self.finish_copies(data)
        in_flight_writes = self.writes_of(sid, self.forward[sid]) if pipelined else set()
        self.run_and_check(sid, msg)
        self.assert_not_handed_out(sid, in_flight_writes)
        if pipelined:
            self.sample_forward(data, sid)
        self.forward[sid] = [r for r in self.next_forward if r.request_id not in self.finishing[sid]]
        self.writing[sid] = in_flight_writes | self.writes_of(sid, self.forward[sid])

    def writes_of(self, sid: int, rows: list[Row] | None) -> set[tuple[str, int]]:
        """The (request, block) pairs a forward of these rows writes: its
        positions past the cached prefix (the engine never rewrites those)."""
        requests = self.sessions[sid].requests
        writes = set()
        for row in rows or []:
            blocks = requests[row.request_id].blocks
            for position in range(max(row.first, row.num_cached), row.end):
                writes.add((row.request_id, blocks[position // BS].block_id))
        return writes

    def assert_not_handed_out(self, sid: int, writes: set[tuple[str, int]]) -> None:
        """Each block a forward of session ``sid`` may be writing is held by
        that session (a request of its own, whose forward runs after this one,
        or its fence): not free, not another session's (the daemon cannot
        know that forward is done), not pinned, not indexed."""
        if not writes:
            return
        holders: dict[int, set[int]] = {}
        for other, session in enumerate(self.sessions):
            for request in session.requests.values():
                for block in request.blocks:
                    holders.setdefault(block.block_id, set()).add(other)
        fenced = {b.block_id for b in self.sessions[sid].fenced}
        pinned = {b for ids in self.pinned.values() for b in ids}
        for request_id, block_id in writes:
            block = self.pool.blocks[block_id]
            held_by = holders.get(block_id, set())
            assert block.prev_free is None, f"{block} is free while {request_id} of session {sid} writes it"
            assert held_by <= {sid}, f"{block} handed to session {held_by} while {request_id} of {sid} writes it"
            assert held_by or block_id in fenced, f"{block} left {request_id} but is not fenced"
            assert block_id not in pinned and block.block_hash is None, block

    def run_and_check(self, sid: int, msg: pb.StepRequest) -> None:
        """Runs one step and checks its reply against the model, then updates the model."""
        session, live = self.sessions[sid], self.live[sid]
        reply = run_step(self.manager, session, msg)
        offloads, swap_ins = self.manager.take_copies()
        self.copies_out += offloads
        for slot, block in swap_ins:  # without a GPU a swap-in is done within its step
            assert block.block_hash == slot.block_hash and block.ref_cnt >= 1
            self.host.end_read([slot])

        for new in msg.new_requests:
            tokens = list(new.prompt_token_ids)
            live[new.request_id] = ModelRequest(
                tokens,
                new.cache_salt,
                max_end=len(tokens) + max(new.max_new_tokens - 1, 0),
                engine_tokens=list(tokens),
                max_tokens=len(tokens) + new.max_new_tokens,
            )
        c = msg.commits
        offset = 0
        for rid, computed, count in zip(c.request_ids, c.num_computed_tokens, c.num_new_tokens, strict=True):
            req = live[rid]
            req.tokens.extend(c.new_token_ids[offset : offset + count])
            offset += count
            if req.running:
                req.computed = computed
                self.record_commit(req)
            self.remember(req.tokens, req.salt)
        self.pending[sid] = {}
        assert list(reply.released) == list(msg.finished)
        for rid in msg.finished:
            live.pop(rid)
            self.finishing[sid].discard(rid)
            self.released[sid].append(rid)

        # Preemption takes running requests, lowest priority and newest first.
        for rid in reply.preempted:
            req = live[rid]
            assert req.running
            req.running, req.computed, req.scheduled = False, 0, 0

        rows = rows_of(reply)
        live_before = {rid: r.running for rid, r in live.items()}
        assert len({r.request_id for r in rows}) == len(rows)
        assert sum(r.num_tokens for r in rows) <= session.token_budget
        if reply.preempted:
            assert all(live[r.request_id].running for r in rows), "a step that preempted admits nobody"
        for row in rows:
            req = live[row.request_id]
            assert row.num_tokens >= 1
            if req.running:
                assert row.first == req.scheduled and row.num_cached == 0
                assert row.num_new_blocks == blocks_for(row.end) - blocks_for(req.scheduled)
            else:  # admitted now
                self.assert_cached_prefix_was_committed(req.tokens, req.salt, row.num_cached)
                assert row.first == min(row.num_cached, len(req.tokens) - 1)
                assert row.num_new_blocks == blocks_for(row.end)
                req.running, req.computed = True, row.first
                self.remember(req.tokens, req.salt)
            # Never past the prompt and samples' last computed position, nor more
            # than one token past what the daemon knows (the speculative slot).
            assert row.end <= max(req.max_end, len(req.tokens))
            assert row.end <= len(req.tokens) + (1 if msg.forward_in_flight else 0)
            req.scheduled = row.end
        if any(not was_running for was_running in admitted_flags(rows, live_before)):
            assert sum(1 for r in live.values() if r.running) <= session.max_num_seqs
        self.next_forward = rows
        assert reply.num_waiting == sum(1 for r in live.values() if not r.running)
        assert reply.num_free_blocks == self.pool.num_free

    @rule(data=st.data(), sid=st.integers(0, 1))
    def bad_step(self, data, sid):
        live = self.live[sid]
        running = [r for r, req in live.items() if req.running]
        kinds = ["finish unknown", "bad token", "zero budget", "empty tokens", "empty id", "negative max_new_tokens"]
        if live:
            kinds += ["double finish", "new request known", "commit twice"]
        if running:
            kinds += ["commit beyond slots"]
        if any(live[r].computed > 0 for r in running):
            kinds += ["commit backwards"]
        if self.released[sid]:
            kinds += ["finish released"]
        kind = data.draw(st.sampled_from(kinds), label="bad kind")
        rid = data.draw(st.sampled_from(list(live)), label="target") if live else None
        tokens, salt = self.draw_tokens(data)
        new = [pb.NewRequest(request_id=self.new_id(), prompt_token_ids=tokens, cache_salt=salt, max_new_tokens=2)]
        msg = pb.StepRequest()
        commits: dict[str, tuple[int, list[int]]] = {}
        error: type[Exception] = ValueError
        if kind == "finish unknown":
            msg.finished.append("nobody")
            error = NotFoundError
        elif kind == "finish released":
            msg.finished.append(data.draw(st.sampled_from(self.released[sid]), label="released id"))
        elif kind == "bad token":
            bad = data.draw(st.sampled_from([-1, 2**32]), label="bad token")
            new.append(pb.NewRequest(request_id=self.new_id(), prompt_token_ids=[*tokens, bad]))
        elif kind == "zero budget":
            msg.settings.CopyFrom(pb.SessionSettings(max_num_seqs=4, token_budget=0))
        elif kind == "empty tokens":
            new.append(pb.NewRequest(request_id=self.new_id()))
        elif kind == "empty id":
            new.append(pb.NewRequest(prompt_token_ids=[1]))
        elif kind == "negative max_new_tokens":
            new.append(pb.NewRequest(request_id=self.new_id(), prompt_token_ids=[1], max_new_tokens=-1))
        elif kind == "double finish":
            msg.finished.extend([rid, rid])
        elif kind == "new request known":
            new.append(pb.NewRequest(request_id=rid, prompt_token_ids=[1, 2, 3]))
        elif kind == "commit beyond slots":
            rid = data.draw(st.sampled_from(running), label="running target")
            commits = {rid: (live[rid].scheduled + 1, [1] * (live[rid].scheduled + 1))}
        elif kind == "commit twice":
            msg.commits.request_ids.extend([rid, rid])
            msg.commits.num_computed_tokens.extend([live[rid].computed] * 2)
            msg.commits.num_new_tokens.extend([0, 0])
        elif kind == "commit backwards":
            rid = next(r for r in running if live[r].computed > 0)
            commits = {rid: (live[rid].computed - 1, [])}
        if commits:
            msg.commits.CopyFrom(commits_pb(commits))
        msg.new_requests.extend(data.draw(st.permutations(new), label="new request order"))
        before = self.snapshot()
        with pytest.raises(error):
            run_step(self.manager, self.sessions[sid], msg)
        assert self.snapshot() == before

    @rule(data=st.data())
    def finish_copies(self, data):
        """The copier's worker finishes some outgoing copies, in any order
        (steps also do, before they run: the worker keeps up most of the time)."""
        if not self.copies_out:
            return
        done = data.draw(st.lists(st.sampled_from(range(len(self.copies_out))), unique=True), label="finished")
        for i in sorted(done, reverse=True):
            block, slot = self.copies_out.pop(i)
            assert block.block_hash == slot.block_hash, "a copying block's content changed"
            self.pool.copy_finished(block)
            self.host.written(slot)

    @rule(data=st.data())
    def count_device_cached_tokens(self, data):
        tokens, salt = self.draw_tokens(data, max_size=20)
        before = self.snapshot()
        num_cached = self.manager.device_cached_tokens(chain(tokens, salt))
        assert self.snapshot() == before
        self.assert_cached_prefix_was_committed(tokens, salt, num_cached)

    @rule(data=st.data(), pin_id=st.sampled_from(PIN_IDS))
    def pin(self, data, pin_id):
        tokens, salt = self.draw_tokens(data, max_size=20)
        hashes = chain(tokens, salt)
        num_cached = self.manager.device_cached_tokens(hashes)
        others = {b for pid, ids in self.pinned.items() if pid != pin_id for b in ids}
        candidate = {b.block_id for b in self.pool.match_prefix(hashes)}
        before = self.snapshot()
        if len(others | candidate) > PIN_CAP:
            with pytest.raises(CapacityError):
                self.pins.pin(pin_id, hashes)
            assert self.snapshot() == before
            return
        blocks = self.pins.pin(pin_id, hashes)
        assert len(blocks) * BS == num_cached
        self.pinned[pin_id] = [b.block_id for b in blocks]
        assert self.pins.num_pinned_blocks == len(others | candidate)

    @rule(pin_id=st.sampled_from(PIN_IDS))
    def unpin(self, pin_id):
        if pin_id in self.pinned:
            assert self.pins.unpin(pin_id) == len(self.pinned.pop(pin_id))
        else:
            with pytest.raises(NotFoundError):
                self.pins.unpin(pin_id)

    @rule(sid=st.integers(0, 1), what=st.sampled_from(["close session", "reset"]))
    def lifecycle(self, sid, what):
        """An engine goes away (its session's blocks are all released), or an operator resets the cache."""
        if what == "close session":
            closed = self.sessions[sid]
            assert self.registry.close(closed.session_id, self.manager) == len(self.live[sid])
            assert closed.fenced == [], "an ended session's fenced blocks come back"
            self.sessions[sid] = self.registry.open(f"e{sid}")
            self.live[sid], self.released[sid], self.forward[sid] = {}, [], None
            self.writing[sid] = set()  # the engine detaches after its last forward
            self.pending[sid], self.finishing[sid] = {}, set()
            return
        before = self.snapshot()
        if self.pool.num_free < NUM_BLOCKS:
            with pytest.raises(ValueError):
                self.pool.reset()
            assert self.snapshot() == before
        else:
            assert not self.copies_out, "a block with a copy in flight counts as used"
            assert self.pool.reset() == len(before[2])
            assert self.pool.cached == {}
            if self.host is not None:
                self.host.clear()

    # --------------------------------------------------------- invariants

    @invariant()
    def free_plus_used_is_total(self):
        used = sum(1 for b in self.pool.blocks if b.ref_cnt > 0)
        assert self.pool.num_free + used == NUM_BLOCKS
        assert all(b.ref_cnt >= 0 for b in self.pool.blocks)

    @invariant()
    def the_free_queue_is_exactly_the_unreferenced_blocks(self):
        queued = list(self.pool.free_queue)
        assert len(queued) == self.pool.num_free == len(self.pool.free_queue)
        assert len({b.block_id for b in queued}) == len(queued)
        assert {b.block_id for b in queued} == {b.block_id for b in self.pool.blocks if b.ref_cnt == 0}
        for block in self.pool.blocks:
            assert (block.prev_free is not None) == (block.ref_cnt == 0), block

    @invariant()
    def ref_counts_equal_the_holders(self):
        holders: Counter[int] = Counter()
        for session in self.sessions:
            for request in session.requests.values():
                ids = [b.block_id for b in request.blocks]
                assert len(set(ids)) == len(ids), f"{request.request_id} holds a block twice"
                holders.update(ids)
        for pid, blocks in self.pins.pins.items():
            assert [b.block_id for b in blocks] == self.pinned[pid]
            holders.update(b.block_id for b in blocks)
        holders.update(b.block_id for b, _ in self.copies_out)  # each outgoing copy holds its block
        for session in self.sessions:  # and a session's fence, each block it fenced
            holders.update(b.block_id for b in session.fenced)
        assert set(self.pins.pins) == set(self.pinned)
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], block

    @invariant()
    def a_block_being_copied_out_is_never_free(self):
        copying = Counter(b.block_id for b, _ in self.copies_out)
        assert self.pool.num_copying == len(copying)
        for block in self.pool.blocks:
            assert block.pending_copies == copying[block.block_id], block
            if block.pending_copies:
                assert block.state is BlockState.COPYING and block.prev_free is None, block

    @invariant()
    def host_slots_are_consistent(self):
        host = self.host
        if host is None:
            return
        states = Counter(s.state for s in host.slots)
        assert states[SlotState.FREE] == host.num_free
        assert states[SlotState.READY] == len(host.cached)
        assert states[SlotState.WRITING] == len(host.writing) == len(self.copies_out)
        for block_hash, slot in host.cached.items():
            assert slot.block_hash == block_hash and slot.state is SlotState.READY
        for block_hash, slot in host.writing.items():
            assert slot.block_hash == block_hash
        assert {s.slot_id for _, s in self.copies_out} == {s.slot_id for s in host.writing.values()}
        assert all(s.readers == 0 for s in host.slots) and host.num_read == 0, "a swap-in outlived its step"
        assert set(host.cached) <= self.committed_hashes, "the host holds a hash nobody committed"

    @invariant()
    def no_block_is_handed_to_another_while_a_forward_may_write_it(self):
        for sid in range(len(self.sessions)):
            self.assert_not_handed_out(sid, self.writing[sid])

    @invariant()
    def fenced_blocks_are_held_only_by_the_fence(self):
        for session in self.sessions:
            for block in session.fenced:
                assert block.block_hash is None and block.ref_cnt == 1, block
            ids = [b.block_id for b in session.fenced]
            assert len(set(ids)) == len(ids), "a block fenced twice"

    @invariant()
    def pinned_blocks_are_never_free(self):
        pinned = {b for ids in self.pinned.values() for b in ids}
        assert len(pinned) == self.pins.num_pinned_blocks <= PIN_CAP
        assert not pinned & {b.block_id for b in self.pool.free_queue}

    @invariant()
    def the_hash_map_and_the_blocks_agree(self):
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash
        for block in self.pool.blocks:
            if block.block_hash is not None:
                assert self.pool.cached.get(block.block_hash) is block
        assert set(self.pool.cached) <= self.committed_hashes, "a hash was indexed that nobody committed"

    @invariant()
    def sessions_match_the_model(self):
        for session, live in zip(self.sessions, self.live, strict=True):
            assert list(session.requests) == list(live)
            assert set(session.running) == {rid for rid, r in live.items() if r.running}
            for rid, model in live.items():
                request = session.requests[rid]
                assert list(request.token_ids) == model.tokens
                assert request.num_computed_tokens == model.computed
                assert request.num_scheduled_tokens == model.scheduled
                assert len(request.blocks) == blocks_for(model.scheduled)
                own = chain(model.tokens, model.salt)
                for i, block in enumerate(request.blocks):
                    if block.block_hash is not None:
                        assert i < len(own) and block.block_hash == own[i], f"{rid} block {i} holds other content"

    @invariant()
    def events_replay_to_each_tier_index(self):
        for event in self.pool.take_events():
            if isinstance(event, BlockStored):
                view = self.event_view[event.tier]
                assert not view & set(event.block_hashes)
                view.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                view = self.event_view[event.tier]
                assert set(event.block_hashes) <= view
                view.difference_update(event.block_hashes)
            else:
                assert isinstance(event, AllCleared)
                for view in self.event_view.values():
                    view.clear()
        assert self.event_view[DEVICE] == set(self.pool.cached)
        assert self.event_view[HOST] == (set(self.host.cached) if self.host is not None else set())

    @invariant()
    def inflight_blocks_belong_to_running_requests(self):
        running = {id(r) for session in self.sessions for r in session.running.values()}
        for block_hash, request in self.manager.inflight.items():
            assert id(request) in running, "a finished request still claims an in-flight block"
            assert block_hash == request.block_hashes[request.num_indexed_blocks], "not its next block"

    def teardown(self):
        while self.copies_out:
            block, slot = self.copies_out.pop()
            self.pool.copy_finished(block)
            self.host.written(slot)
        for session, live in zip(self.sessions, self.live, strict=True):
            run_step(self.manager, session, pb.StepRequest(finished=list(live)))
            assert session.requests == {} and session.waiting == []
        for pin_id in list(self.pinned):
            self.pins.unpin(pin_id)
        assert self.pool.num_free == NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)
        assert len(list(self.pool.free_queue)) == NUM_BLOCKS
        assert self.pins.num_pinned_blocks == 0
        assert self.manager.inflight == {}


class TieredPoolMachine(PoolMachine):
    with_host_tier = True


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolStateMachine = PoolMachine.TestCase
TieredPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestTieredPoolStateMachine = TieredPoolMachine.TestCase
