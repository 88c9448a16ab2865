"""One engine step through run_step: scheduling order, waiting, preemption, and atomic validation."""

from __future__ import annotations

import dataclasses

import pytest

from kvd.block_pool import BlockPool
from kvd.cache_manager import KVCacheManager
from kvd.errors import NotFoundError
from kvd.session import Session, SessionRegistry
from kvd.step import AdmissionWork, AppendWork, CommitWork, StepInput, run_step

BS = 4


def make(num_blocks: int = 16) -> tuple[BlockPool, KVCacheManager, Session]:
    pool = BlockPool(num_blocks, record_events=True)
    return pool, KVCacheManager(pool, BS), SessionRegistry(60).open("engine")


def step(manager, session, **kwargs):
    kwargs.setdefault("token_budget", 1000)
    return run_step(manager, session, StepInput(**kwargs))


def admit(manager, session, request_id, tokens, **kwargs):
    return step(manager, session, admissions=[AdmissionWork(request_id, tokens, **kwargs)])


def by_id(out):
    return {s.request_id: s for s in out.scheduled}


def snapshot(pool: BlockPool, manager: KVCacheManager, session: Session):
    return (
        pool.num_free,
        [b.block_id for b in pool.free_queue],
        {h: b.block_id for h, b in pool.cached.items()},
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        pool.num_evictions,
        list(session.requests),
        {
            rid: (
                list(r.token_ids),
                list(r.block_hashes),
                [b.block_id for b in r.blocks],
                r.num_computed_tokens,
                r.num_scheduled_tokens,
                r.num_indexed_blocks,
            )
            for rid, r in session.requests.items()
        },
        list(session.recently_freed),
        (manager.query_tokens, manager.hit_tokens),
    )


# ----------------------------------------------------------- the happy path


def test_chunked_prefill_then_append_continues_the_prompt():
    pool, manager, session = make(16)
    out = step(manager, session, admissions=[AdmissionWork("a", list(range(10)))], token_budget=6)
    (s,) = out.scheduled
    assert (s.admitted, s.first_position, s.num_scheduled_tokens, s.num_cached_tokens) == (True, 0, 6, 0)
    assert s.new_block_ids == [0, 1]
    assert out.num_free_blocks == pool.num_free == 14
    out = step(manager, session, commits=[CommitWork("a", 6)], appends=[AppendWork("a", 4)], token_budget=100)
    (s,) = out.scheduled
    assert (s.admitted, s.first_position, s.num_scheduled_tokens) == (False, 6, 4)
    assert s.new_block_ids == [2]
    out = step(manager, session, commits=[CommitWork("a", 10, [10])], frees=["a"])
    assert out.scheduled == []
    assert out.num_free_blocks == 16
    assert len(pool.cached) == 2


def test_block_aligned_full_prefix_hit_through_a_step():
    pool, manager, session = make(16)
    admit(manager, session, "a", list(range(8)))
    step(manager, session, commits=[CommitWork("a", 8)], frees=["a"])
    out = admit(manager, session, "b", list(range(8)))
    (s,) = out.scheduled
    assert (s.first_position, s.num_scheduled_tokens, s.num_cached_tokens) == (7, 1, 8)
    assert s.new_block_ids == [0, 1]  # the whole table, all of it hits
    assert pool.num_evictions == 0


def test_admissions_share_one_budget_in_priority_order():
    _, manager, session = make(16)
    out = step(
        manager,
        session,
        admissions=[AdmissionWork("a", list(range(6))), AdmissionWork("b", list(range(10, 20)))],
        token_budget=10,
    )
    assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 6), ("b", 4)]
    assert out.waiting == []


def test_appends_are_served_before_admissions_and_take_the_budget_first():
    _, manager, session = make(16)
    admit(manager, session, "run", list(range(8)))
    out = step(
        manager,
        session,
        commits=[CommitWork("run", 8, [1])],
        appends=[AppendWork("run", 3)],
        admissions=[AdmissionWork("new", list(range(20, 30)))],
        token_budget=5,
    )
    assert [(s.request_id, s.admitted, s.num_scheduled_tokens) for s in out.scheduled] == [
        ("run", False, 3),
        ("new", True, 2),
    ]


def test_an_append_is_cut_to_the_budget_left():
    _, manager, session = make(16)
    admit(manager, session, "a", list(range(4)))
    admit(manager, session, "b", list(range(4, 8)))
    out = step(manager, session, appends=[AppendWork("a", 3), AppendWork("b", 3)], token_budget=4)
    assert [(s.request_id, s.first_position, s.num_scheduled_tokens) for s in out.scheduled] == [
        ("a", 4, 3),
        ("b", 4, 1),
    ]


def test_a_spent_budget_makes_later_admissions_wait():
    pool, manager, session = make(16)
    out = step(
        manager,
        session,
        admissions=[AdmissionWork("a", list(range(8))), AdmissionWork("b", [1, 2])],
        token_budget=8,
    )
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert out.waiting == ["b"]
    assert list(session.requests) == ["a"]


def test_free_and_readmit_the_same_id_in_one_step():
    pool, manager, session = make(8)
    admit(manager, session, "a", list(range(8)))
    out = step(manager, session, commits=[CommitWork("a", 8)], frees=["a"], admissions=[AdmissionWork("a", [0, 1])])
    assert by_id(out)["a"].admitted
    assert list(session.requests) == ["a"]
    assert session.requests["a"].token_ids == [0, 1]


# ------------------------------------------------------------------ waiting


def test_a_request_that_does_not_fit_waits_and_changes_nothing():
    pool, manager, session = make(4)
    admit(manager, session, "a", list(range(12)))  # 3 of 4 blocks
    before = snapshot(pool, manager, session)
    out = admit(manager, session, "big", list(range(100, 108)))  # needs 2
    assert out.scheduled == []
    assert out.waiting == ["big"]
    assert out.preempted == []
    assert snapshot(pool, manager, session) == before


def test_later_admissions_do_not_jump_the_queue():
    pool, manager, session = make(4)
    admit(manager, session, "a", list(range(12)))
    before = snapshot(pool, manager, session)
    out = step(
        manager,
        session,
        admissions=[AdmissionWork("big", list(range(100, 108))), AdmissionWork("small", [7])],
    )
    assert out.scheduled == []
    assert out.waiting == ["big", "small"]
    assert snapshot(pool, manager, session) == before


def test_an_admission_fits_when_its_hits_cover_it():
    # 5 blocks, 3 held by "a": "b" shares those 3 and needs 2 more, so it fits.
    pool, manager, session = make(5)
    admit(manager, session, "a", list(range(12)))
    step(manager, session, commits=[CommitWork("a", 12)])
    out = admit(manager, session, "b", list(range(12)) + [50] * 8)
    (s,) = out.scheduled
    assert (s.num_cached_tokens, s.first_position, s.num_scheduled_tokens) == (12, 12, 8)
    assert pool.num_free == 0


# --------------------------------------------------------------- preemption


def fill_pool_with_two_requests():
    """4 blocks: "old" holds 2 (8 tokens), "new" holds 2 (6 tokens); all committed."""
    pool, manager, session = make(4)
    admit(manager, session, "old", list(range(8)))
    admit(manager, session, "new", list(range(100, 106)))
    step(manager, session, commits=[CommitWork("old", 8, [8]), CommitWork("new", 6, [106])])
    assert pool.num_free == 0
    return pool, manager, session


def test_when_an_append_cannot_be_served_the_newest_request_is_preempted():
    pool, manager, session = fill_pool_with_two_requests()
    out = step(manager, session, appends=[AppendWork("old", 1)])
    assert out.preempted == ["new"]
    (s,) = out.scheduled
    assert (s.request_id, s.first_position, s.num_scheduled_tokens) == ("old", 8, 1)
    assert len(s.new_block_ids) == 1
    assert list(session.requests) == ["old"]
    with pytest.raises(ValueError, match="already freed"):
        session.get("new")


def test_a_request_that_is_itself_the_newest_preempts_itself():
    pool, manager, session = fill_pool_with_two_requests()
    admit_state = snapshot(pool, manager, session)[6]["old"]
    out = step(manager, session, appends=[AppendWork("new", 3)])  # positions 6..8: needs a third block
    assert out.preempted == ["new"]
    assert out.scheduled == []
    assert list(session.requests) == ["old"]
    assert snapshot(pool, manager, session)[6]["old"] == admit_state
    assert pool.num_free == 2


def test_a_preempted_request_scheduled_earlier_in_the_step_is_unscheduled():
    pool, manager, session = fill_pool_with_two_requests()
    # "new" gets slot 6 in its own block first; then "old" needs a block and preempts it.
    out = step(manager, session, appends=[AppendWork("new", 1), AppendWork("old", 1)])
    assert out.preempted == ["new"]
    assert [s.request_id for s in out.scheduled] == ["old"]


def test_preemption_continues_newest_first_until_the_append_fits():
    pool, manager, session = make(4)
    admit(manager, session, "a", list(range(4)))
    admit(manager, session, "b", list(range(10, 14)))
    admit(manager, session, "c", list(range(20, 24)))
    out = step(manager, session, appends=[AppendWork("a", 12)])  # needs 3 more blocks, 1 free
    assert out.preempted == ["c", "b"]
    assert [(s.request_id, s.num_scheduled_tokens, len(s.new_block_ids)) for s in out.scheduled] == [("a", 12, 3)]
    assert pool.num_free == 0


def test_a_step_that_preempted_admits_nobody():
    pool, manager, session = fill_pool_with_two_requests()
    out = step(
        manager,
        session,
        appends=[AppendWork("old", 1)],
        admissions=[AdmissionWork("tiny", list(range(8)))],  # would fully hit "old"'s blocks
    )
    assert out.preempted == ["new"]
    assert out.waiting == ["tiny"]
    assert "tiny" not in session.requests


def test_preempt_then_resume_hits_its_own_committed_blocks():
    pool, manager, session = fill_pool_with_two_requests()
    new_blocks = [b.block_id for b in session.requests["new"].blocks]
    step(manager, session, appends=[AppendWork("old", 1)])
    step(manager, session, commits=[CommitWork("old", 9, [9])], frees=["old"])
    # The engine re-admits "new" with its prompt plus its one output token.
    out = admit(manager, session, "new", list(range(100, 106)) + [106])
    (s,) = out.scheduled
    assert s.admitted
    assert s.num_cached_tokens == 4
    assert (s.first_position, s.num_scheduled_tokens) == (4, 3)
    assert s.new_block_ids[0] == new_blocks[0]
    assert "new" not in session.recently_freed


# ---------------------------------------------------------------- bad input


def test_double_free_in_one_step_is_refused():
    pool, manager, session = make(8)
    admit(manager, session, "a", [1, 2, 3])
    before = snapshot(pool, manager, session)
    with pytest.raises(ValueError, match="twice"):
        step(manager, session, frees=["a", "a"])
    assert snapshot(pool, manager, session) == before


def test_freeing_an_already_freed_request_is_refused():
    _, manager, session = make(8)
    admit(manager, session, "a", [1, 2, 3])
    step(manager, session, frees=["a"])
    with pytest.raises(ValueError, match="already freed"):
        step(manager, session, frees=["a"])


@pytest.mark.parametrize(
    "work",
    [
        {"frees": ["ghost"]},
        {"commits": [CommitWork("ghost", 1)]},
        {"appends": [AppendWork("ghost", 1)]},
    ],
    ids=["free", "commit", "append"],
)
def test_an_unknown_request_id_is_not_found(work):
    _, manager, session = make(8)
    with pytest.raises(NotFoundError):
        step(manager, session, **work)


@pytest.mark.parametrize("budget", [0, -5])
def test_a_budget_below_one_with_work_is_refused(budget):
    _, manager, session = make(8)
    admit(manager, session, "a", [1, 2, 3])
    with pytest.raises(ValueError, match="token_budget"):
        step(manager, session, appends=[AppendWork("a", 1)], token_budget=budget)
    with pytest.raises(ValueError, match="token_budget"):
        step(manager, session, admissions=[AdmissionWork("b", [1])], token_budget=budget)


def test_a_step_with_only_commits_and_frees_needs_no_budget():
    pool, manager, session = make(8)
    admit(manager, session, "a", [1, 2, 3, 4])
    out = step(manager, session, commits=[CommitWork("a", 4)], frees=["a"], token_budget=0)
    assert out.num_free_blocks == 8


def baseline():
    """A session with running A, B, C and a freed F, plus a valid step doing each kind of work.

    After the set-up: A knows 11 tokens, 10 computed, 11 slots; B knows 9, 8 computed;
    C knows 6, 5 computed, 5 slots; F was freed. The good step commits A, frees B,
    appends to C and admits D, whose first 8 tokens hit A's blocks.
    """
    pool, manager, session = make(32)
    step(
        manager,
        session,
        admissions=[
            AdmissionWork("A", list(range(10))),
            AdmissionWork("B", list(range(20, 28))),
            AdmissionWork("C", list(range(30, 35))),
            AdmissionWork("F", [9, 9, 9, 9, 9]),
        ],
    )
    step(
        manager,
        session,
        commits=[CommitWork("A", 10, [100]), CommitWork("B", 8, [101]), CommitWork("C", 5, [102])],
        frees=["F"],
        appends=[AppendWork("A", 1)],
    )
    good = StepInput(
        commits=[CommitWork("A", 11, [103])],
        frees=["B"],
        appends=[AppendWork("C", 1)],
        admissions=[AdmissionWork("D", list(range(8)) + [7, 7])],
        token_budget=64,
    )
    return pool, manager, session, good


def test_the_baseline_step_is_valid():
    pool, manager, session, good = baseline()
    before = snapshot(pool, manager, session)
    out = run_step(manager, session, good)
    assert [s.request_id for s in out.scheduled] == ["C", "D"]
    assert by_id(out)["D"].num_cached_tokens == 8
    assert snapshot(pool, manager, session) != before


# name -> (field to extend, bad item, expected error); the bad item joins the good ones.
BAD_ITEMS = {
    "commit goes backwards": ("commits", CommitWork("C", 4), ValueError),
    "commit beyond scheduled slots": ("commits", CommitWork("C", 6, [1]), ValueError),
    "commit with a negative new token": ("commits", CommitWork("C", 5, [-1]), ValueError),
    "commit with a too-large new token": ("commits", CommitWork("C", 5, [2**32]), ValueError),
    "commit of an unknown request": ("commits", CommitWork("ghost", 1), NotFoundError),
    "commit of a freed request": ("commits", CommitWork("F", 1), ValueError),
    "the same request committed twice": ("commits", CommitWork("A", 11), ValueError),
    "double free in one step": ("frees", "B", ValueError),
    "free of an unknown request": ("frees", "ghost", NotFoundError),
    "free of an already freed request": ("frees", "F", ValueError),
    "append of an unknown request": ("appends", AppendWork("ghost", 1), NotFoundError),
    "append of zero tokens": ("appends", AppendWork("A", 0), ValueError),
    "append of negative tokens": ("appends", AppendWork("A", -2), ValueError),
    "append of a request freed in this step": ("appends", AppendWork("B", 1), ValueError),
    "the same request appended twice": ("appends", AppendWork("C", 2), ValueError),
    "admission with no tokens": ("admissions", AdmissionWork("E", []), ValueError),
    "admission with a negative token in the partial tail": (
        "admissions",
        AdmissionWork("E", [1, 2, 3, 4, -1]),
        ValueError,
    ),
    "admission with a too-large token in a full block": (
        "admissions",
        AdmissionWork("E", [1, 2**32, 3, 4]),
        ValueError,
    ),
    "admission with a float token": ("admissions", AdmissionWork("E", [1, 2.5]), ValueError),
    "admission with a str token": ("admissions", AdmissionWork("E", ["1"]), ValueError),
    "admission of a running request": ("admissions", AdmissionWork("A", [1]), ValueError),
    "admission with an empty id": ("admissions", AdmissionWork("", [1]), ValueError),
    "the same id admitted twice": ("admissions", AdmissionWork("D", [1]), ValueError),
}


def assert_step_refused_and_nothing_changed(pool, manager, session, bad: StepInput, error) -> None:
    before = snapshot(pool, manager, session)
    assert pool.take_events(), "the baseline stored blocks, so the event check below can fail"
    with pytest.raises(error):
        run_step(manager, session, bad)
    assert snapshot(pool, manager, session) == before
    assert pool.take_events() == []


@pytest.mark.parametrize("front", [False, True], ids=["bad-last", "bad-first"])
@pytest.mark.parametrize("name", list(BAD_ITEMS))
def test_bad_input_changes_nothing(name, front):
    field, item, error = BAD_ITEMS[name]
    pool, manager, session, good = baseline()
    items = list(getattr(good, field))
    bad = dataclasses.replace(good, **{field: [item, *items] if front else [*items, item]})
    assert_step_refused_and_nothing_changed(pool, manager, session, bad, error)


def test_a_zero_budget_with_good_work_changes_nothing():
    pool, manager, session, good = baseline()
    bad = dataclasses.replace(good, token_budget=0)
    assert_step_refused_and_nothing_changed(pool, manager, session, bad, ValueError)


def test_commit_beyond_known_tokens_in_a_step_changes_nothing():
    pool, manager, session, good = baseline()
    step(manager, session, commits=[CommitWork("A", 11, [103])], appends=[AppendWork("A", 3)])
    # A knows 12 tokens and has 14 slots: committing 14 with one new token is 1 too many.
    before = snapshot(pool, manager, session)
    with pytest.raises(ValueError, match="known"):
        step(manager, session, commits=[CommitWork("C", 5), CommitWork("A", 14, [1])], frees=["B"])
    assert snapshot(pool, manager, session) == before


# ---------------------------------------------------------------- isolation


def test_another_cache_salt_gets_no_cached_tokens_through_a_step():
    _, manager, session = make(16)
    admit(manager, session, "a", list(range(8)), cache_salt=b"tenant-a")
    step(manager, session, commits=[CommitWork("a", 8)], frees=["a"])
    out = step(
        manager,
        session,
        admissions=[
            AdmissionWork("b", list(range(8)), cache_salt=b"tenant-b"),
            AdmissionWork("c", list(range(8))),
            AdmissionWork("d", list(range(8)), cache_salt=b"tenant-a"),
        ],
    )
    cached = {s.request_id: s.num_cached_tokens for s in out.scheduled}
    assert cached == {"b": 0, "c": 0, "d": 8}
