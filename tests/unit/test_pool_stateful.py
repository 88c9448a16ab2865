"""A hypothesis state machine over the whole block path: steps, pins, lookups, sessions.

A small pool (16 blocks of 4 tokens) and a four-token vocabulary make prefixes collide,
hit, get evicted and get preempted often. After every rule the pool's accounting is
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
from kvd.errors import CapacityError, NotFoundError
from kvd.hashing import chain_block_hashes, encode_extra_keys
from kvd.host_tier import HostTier, SlotState
from kvd.pins import PinRegistry
from kvd.session import SessionRegistry
from kvd.step import AdmissionWork, AppendWork, CommitWork, StepInput, run_step

BS = 4
NUM_BLOCKS = 16
PIN_CAP = 2
MAX_TOKENS = 40  # a request stops sampling new tokens past this length
SALTS = [b"", b"x", b"y"]
PIN_IDS = ["p0", "p1", "p2"]
TOKEN = st.integers(0, 3)
HOST_SLOTS = 12  # larger than the device pool, as in real use


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BS)


def chain(tokens: list[int], salt: bytes) -> list[bytes]:
    return chain_block_hashes(tokens, BS, encode_extra_keys(salt))


@dataclass
class ModelRequest:
    tokens: list[int]
    salt: bytes
    computed: int
    scheduled: int


class PoolMachine(RuleBasedStateMachine):
    with_host_tier = False

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, record_events=True)
        self.host = HostTier(HOST_SLOTS, record=self.pool.record) if self.with_host_tier else None
        self.manager = KVCacheManager(self.pool, BS, self.host)
        self.copies_out: list = []  # offloads submitted and not finished: (block, slot)
        self.registry = SessionRegistry(lease_s=3600)
        self.sessions = [self.registry.open("e0"), self.registry.open("e1")]
        self.pins = PinRegistry(self.pool, PIN_CAP)
        # The model.
        self.live: list[dict[str, ModelRequest]] = [{}, {}]  # per session, in admission order
        self.parked: list[dict[str, ModelRequest]] = [{}, {}]  # freed or preempted: may resume
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

    @rule(data=st.data(), sid=st.integers(0, 1), budget=st.integers(1, 24))
    def step(self, data, sid, budget):
        """Random but valid work: commit anything scheduled, with or without sampled tokens."""
        live = self.live[sid]
        commits, frees, appends = [], [], []
        new_tokens: dict[str, list[int]] = {}
        for rid, req in live.items():
            if data.draw(st.booleans(), label=f"commit {rid}"):
                k = 0 if len(req.tokens) >= MAX_TOKENS else data.draw(st.integers(0, 2), label="sampled")
                sampled = data.draw(st.lists(TOKEN, min_size=k, max_size=k), label="sampled ids")
                upto = min(req.scheduled, len(req.tokens) + k)
                target = data.draw(st.integers(req.computed, upto), label="num_computed")
                commits.append(CommitWork(rid, target, sampled))
                new_tokens[rid] = sampled
            action = data.draw(st.sampled_from(["none", "append", "append", "free"]), label=f"act {rid}")
            if action == "free":
                frees.append(rid)
            elif action == "append":
                appends.append(AppendWork(rid, data.draw(st.integers(1, 6), label="num_tokens")))
        admissions = self.draw_admissions(data, sid)
        self.finish_copies(data)
        self.run_and_check(sid, StepInput(commits, frees, appends, admissions, budget), new_tokens)

    @rule(data=st.data(), sid=st.integers(0, 1), budget=st.integers(4, 32))
    def engine_step(self, data, sid, budget):
        """What a real engine sends: commit what ran, finish or continue each request, admit more."""
        commits, frees, appends = [], [], []
        new_tokens: dict[str, list[int]] = {}
        for rid, req in self.live[sid].items():
            prefill_done = req.scheduled >= len(req.tokens)
            sampled = [data.draw(TOKEN, label="sampled")] if prefill_done and len(req.tokens) < MAX_TOKENS else []
            commits.append(CommitWork(rid, min(req.scheduled, len(req.tokens) + len(sampled)), sampled))
            new_tokens[rid] = sampled
            remaining = len(req.tokens) + len(sampled) - req.scheduled
            if remaining <= 0 or data.draw(st.integers(0, 9), label="finish") == 0:
                frees.append(rid)
            else:
                appends.append(AppendWork(rid, remaining))
        admissions = self.draw_admissions(data, sid)
        self.finish_copies(data)
        self.run_and_check(sid, StepInput(commits, frees, appends, admissions, budget), new_tokens)

    def draw_admissions(self, data, sid: int) -> list[AdmissionWork]:
        admissions: list[AdmissionWork] = []
        for _ in range(data.draw(st.integers(0, 2), label="num admissions")):
            parked = [rid for rid in self.parked[sid] if rid not in {a.request_id for a in admissions}]
            if parked and data.draw(st.booleans(), label="resume"):
                rid = data.draw(st.sampled_from(parked), label="resumed id")
                old = self.parked[sid][rid]
                admissions.append(AdmissionWork(rid, list(old.tokens), old.salt))
            else:
                tokens, salt = self.draw_tokens(data, max_size=24)
                admissions.append(AdmissionWork(self.new_id(), tokens, salt))
        return admissions

    def run_and_check(self, sid: int, work: StepInput, new_tokens: dict[str, list[int]]) -> None:
        """Runs one step and checks its output against the model, then updates the model."""
        session, live = self.sessions[sid], self.live[sid]
        commits, frees, appends, admissions = work.commits, work.frees, work.appends, work.admissions
        budget = work.token_budget

        out = run_step(self.manager, session, work)
        offloads, swap_ins = self.manager.take_copies()
        self.copies_out += offloads
        for slot, block in swap_ins:  # without a GPU a swap-in is done within its step
            assert block.block_hash == slot.block_hash and block.ref_cnt >= 1
            self.host.end_read([slot])

        for commit in commits:
            req = live[commit.request_id]
            req.tokens.extend(new_tokens[commit.request_id])
            req.computed = commit.num_computed_tokens
            self.record_commit(req)
            self.remember(req.tokens, req.salt)
        for rid in frees:
            self.parked[sid][rid] = live.pop(rid)

        # Preemption takes the session's newest requests, newest first.
        newest_first = list(reversed(live))
        assert out.preempted == newest_first[: len(out.preempted)]
        for rid in out.preempted:
            self.parked[sid][rid] = live.pop(rid)

        appended = [s for s in out.scheduled if not s.admitted]
        admitted = [s for s in out.scheduled if s.admitted]
        assert [s.request_id for s in appended] == [
            a.request_id for a in appends if a.request_id in {s.request_id for s in appended}
        ]
        left = budget
        for append in appends:
            if out.preempted:
                break
            match = [s for s in appended if s.request_id == append.request_id]
            if left <= 0:
                assert match == []
                continue
            (s,) = match
            assert s.num_scheduled_tokens == min(append.num_tokens, left)
            left -= s.num_scheduled_tokens
        for s in appended:
            req = live[s.request_id]
            assert s.first_position == req.scheduled
            assert s.num_cached_tokens == 0
            requested = next(a.num_tokens for a in appends if a.request_id == s.request_id)
            assert 1 <= s.num_scheduled_tokens <= requested
            assert len(s.new_block_ids) == blocks_for(req.scheduled + s.num_scheduled_tokens) - blocks_for(
                req.scheduled
            )
            req.scheduled += s.num_scheduled_tokens

        # Admissions, in priority order: scheduled, or deferred (its next block
        # is another request's to compute), until the first that does not fit.
        order = [a.request_id for a in admissions]
        waiting = set(out.waiting)
        assert sorted([s.request_id for s in admitted] + out.waiting, key=order.index) == order
        assert [r for r in order if r not in waiting] == [s.request_id for s in admitted]
        if out.preempted:
            assert admitted == []
        blocked = [a for a in admissions if a.request_id in waiting and not self.deferred(a)]
        for adm in blocked[1:]:  # everything behind the first one that did not fit waits too
            assert order.index(adm.request_id) > order.index(blocked[0].request_id)
        scheduled_admissions = [a for a in admissions if a.request_id not in waiting]
        for adm, s in zip(scheduled_admissions, admitted, strict=True):
            tokens = list(adm.token_ids)
            self.assert_cached_prefix_was_committed(tokens, adm.cache_salt, s.num_cached_tokens)
            assert s.first_position == min(s.num_cached_tokens, len(tokens) - 1)
            assert s.num_scheduled_tokens == min(len(tokens) - s.first_position, left)
            assert len(s.new_block_ids) == blocks_for(s.first_position + s.num_scheduled_tokens)
            left -= s.num_scheduled_tokens
            self.parked[sid].pop(adm.request_id, None)
            live[adm.request_id] = ModelRequest(
                tokens, adm.cache_salt, s.first_position, s.first_position + s.num_scheduled_tokens
            )
            self.remember(tokens, adm.cache_salt)
        if blocked and not out.preempted and left > 0:
            self.assert_admission_really_did_not_fit(blocked[0], left)
        assert out.num_free_blocks == self.pool.num_free

    def deferred(self, adm: AdmissionWork) -> bool:
        """Whether the admission's first uncached block is in flight (another
        request admitted to compute it, not committed yet)."""
        hashes = chain(list(adm.token_ids), adm.cache_salt)
        hits = self.cached_prefix(hashes)
        return len(hits) < len(hashes) and hashes[len(hits)] in self.manager.inflight

    def assert_admission_really_did_not_fit(self, adm: AdmissionWork, budget: int) -> None:
        # Nothing changes after a refused admission, so the pool is as admit() saw it.
        hashes = chain(list(adm.token_ids), adm.cache_salt)
        cached = self.cached_prefix(hashes)
        hits = [c for c in cached if c is not None]
        first = min(len(cached) * BS, len(adm.token_ids) - 1)
        num_new = min(len(adm.token_ids) - first, budget)
        needed = max(0, blocks_for(first + num_new) - len(hits))
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        assert needed + free_hits > self.pool.num_free, f"{adm.request_id} waited but fit"

    @rule(data=st.data(), sid=st.integers(0, 1))
    def bad_step(self, data, sid):
        live = self.live[sid]
        kinds = ["free unknown", "bad token", "zero budget", "empty tokens", "empty id"]
        if live:
            kinds += ["double free", "append zero", "admit running", "commit beyond slots", "commit twice"]
        if any(r.computed > 0 for r in live.values()):
            kinds += ["commit backwards"]
        if self.parked[sid]:
            kinds += ["free freed"]
        kind = data.draw(st.sampled_from(kinds), label="bad kind")
        rid = data.draw(st.sampled_from(list(live)), label="target") if live else None
        tokens, salt = self.draw_tokens(data)
        good_admission = AdmissionWork(self.new_id(), tokens, salt)
        commits, frees, appends, admissions, budget = [], [], [], [good_admission], 16
        if live:  # a valid append to some request other than the target
            others = [r for r in live if r != rid]
            if others:
                appends.append(AppendWork(data.draw(st.sampled_from(others), label="good append"), 1))
        error: type[Exception] = ValueError
        if kind == "free unknown":
            frees, error = ["nobody"], NotFoundError
        elif kind == "free freed":
            frees = [data.draw(st.sampled_from(list(self.parked[sid])), label="freed id")]
        elif kind == "bad token":
            bad = data.draw(st.sampled_from([-1, 2**32, 1.5, "2"]), label="bad token")
            admissions.append(AdmissionWork(self.new_id(), [*tokens, bad], salt))
        elif kind == "zero budget":
            budget = 0
        elif kind == "empty tokens":
            admissions.append(AdmissionWork(self.new_id(), []))
        elif kind == "empty id":
            admissions.append(AdmissionWork("", [1]))
        elif kind == "double free":
            frees = [rid, rid]
        elif kind == "append zero":
            appends.append(AppendWork(rid, 0))
        elif kind == "admit running":
            admissions.append(AdmissionWork(rid, [1, 2, 3]))
        elif kind == "commit beyond slots":
            commits = [CommitWork(rid, live[rid].scheduled + 1, [1] * (live[rid].scheduled + 1))]
        elif kind == "commit twice":
            commits = [CommitWork(rid, live[rid].computed)] * 2
        elif kind == "commit backwards":
            rid = next(r for r, req in live.items() if req.computed > 0)
            commits = [CommitWork(rid, live[rid].computed - 1)]
        admissions = data.draw(st.permutations(admissions), label="admission order")
        before = self.snapshot()
        with pytest.raises(error):
            run_step(self.manager, self.sessions[sid], StepInput(commits, frees, appends, admissions, budget))
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
    def lookup(self, data):
        tokens, salt = self.draw_tokens(data, max_size=20)
        before = self.snapshot()
        num_cached = self.manager.lookup(chain(tokens, salt))
        assert self.snapshot() == before
        self.assert_cached_prefix_was_committed(tokens, salt, num_cached)

    @rule(data=st.data(), pin_id=st.sampled_from(PIN_IDS))
    def pin(self, data, pin_id):
        tokens, salt = self.draw_tokens(data, max_size=20)
        hashes = chain(tokens, salt)
        num_cached = self.manager.lookup(hashes)
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
            assert self.registry.close(self.sessions[sid].session_id, self.manager) == len(self.live[sid])
            self.sessions[sid] = self.registry.open(f"e{sid}")
            self.live[sid] = {}
            self.parked[sid] = {}
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
            for rid, model in live.items():
                request = session.requests[rid]
                assert request.token_ids == model.tokens
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
        running = {id(r) for session in self.sessions for r in session.requests.values()}
        for block_hash, request in self.manager.inflight.items():
            assert id(request) in running, "a finished request still claims an in-flight block"
            assert block_hash in request.block_hashes[request.num_indexed_blocks :]

    def teardown(self):
        while self.copies_out:
            block, slot = self.copies_out.pop()
            self.pool.copy_finished(block)
            self.host.written(slot)
        for session, live in zip(self.sessions, self.live, strict=True):
            run_step(self.manager, session, StepInput(frees=list(live)))
            assert session.requests == {}
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
