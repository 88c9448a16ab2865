"""Pointer-level tests of the intrusive free-block queue, on Blocks built directly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.block import Block
from kvd.block_pool import FreeBlockQueue


def make_queue(n: int) -> tuple[list[Block], FreeBlockQueue]:
    blocks = [Block(block_id=i) for i in range(n)]
    return blocks, FreeBlockQueue(blocks)


def ids(queue: FreeBlockQueue) -> list[int]:
    return [block.block_id for block in queue]


def assert_well_linked(queue: FreeBlockQueue) -> None:
    """Walks the list both ways from the sentinels and checks every back link."""
    forward = []
    node = queue._head
    while node.next_free is not None:
        nxt = node.next_free
        assert nxt.prev_free is node, f"{nxt}.prev_free is not {node}"
        forward.append(nxt)
        node = nxt
    assert node is queue._tail
    assert forward[-1] is queue._tail
    members = forward[:-1]
    assert len(members) == queue.num_free == len(queue)
    assert len({id(b) for b in members}) == len(members), "a block is linked twice"
    backward = []
    node = queue._tail
    while node.prev_free is not None:
        backward.append(node.prev_free)
        node = node.prev_free
    assert node is queue._head
    assert backward[::-1][1:] == members


def assert_unlinked(block: Block) -> None:
    assert block.prev_free is None
    assert block.next_free is None


# ---------------------------------------------------------------- building


def test_new_queue_holds_blocks_in_given_order_with_sentinels_at_both_ends():
    blocks, queue = make_queue(4)
    assert ids(queue) == [0, 1, 2, 3]
    assert queue.num_free == len(queue) == 4
    assert blocks[0].prev_free is queue._head
    assert blocks[-1].next_free is queue._tail
    for left, right in zip(blocks, blocks[1:], strict=False):
        assert left.next_free is right
        assert right.prev_free is left
    assert_well_linked(queue)


def test_empty_queue_has_sentinels_linked_to_each_other():
    queue = FreeBlockQueue()
    assert queue.num_free == 0
    assert list(queue) == []
    assert queue._head.next_free is queue._tail
    assert queue._tail.prev_free is queue._head


# ------------------------------------------------------------------ popping


def test_popleft_takes_the_head_and_unlinks_it():
    blocks, queue = make_queue(3)
    popped = queue.popleft()
    assert popped is blocks[0]
    assert_unlinked(popped)
    assert ids(queue) == [1, 2]
    assert blocks[1].prev_free is queue._head
    assert queue.num_free == 2
    assert_well_linked(queue)


def test_popleft_on_an_empty_queue_raises_index_error():
    queue = FreeBlockQueue()
    with pytest.raises(IndexError):
        queue.popleft()
    assert queue.num_free == 0


def test_popleft_after_draining_raises_index_error():
    _, queue = make_queue(2)
    queue.popleft()
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    assert queue.num_free == 0
    assert_well_linked(queue)


def test_popleft_n_takes_blocks_head_first_and_unlinks_each():
    blocks, queue = make_queue(5)
    taken = queue.popleft_n(3)
    assert taken == blocks[:3]
    for block in taken:
        assert_unlinked(block)
    assert ids(queue) == [3, 4]
    assert blocks[3].prev_free is queue._head
    assert queue.num_free == 2
    assert_well_linked(queue)


def test_popleft_n_of_everything_leaves_an_empty_well_formed_queue():
    blocks, queue = make_queue(4)
    assert queue.popleft_n(4) == blocks
    assert queue.num_free == 0
    assert queue._head.next_free is queue._tail
    assert queue._tail.prev_free is queue._head
    with pytest.raises(IndexError):
        queue.popleft()


def test_popleft_n_zero_takes_nothing():
    _, queue = make_queue(3)
    assert queue.popleft_n(0) == []
    assert ids(queue) == [0, 1, 2]
    assert_well_linked(queue)


def test_popleft_n_more_than_free_raises_and_changes_nothing():
    _, queue = make_queue(3)
    with pytest.raises(IndexError):
        queue.popleft_n(4)
    assert ids(queue) == [0, 1, 2]
    assert queue.num_free == 3
    assert_well_linked(queue)


def test_popleft_n_negative_is_refused_and_changes_nothing():
    _, queue = make_queue(3)
    with pytest.raises((IndexError, ValueError)):
        queue.popleft_n(-1)
    assert queue.num_free == 3


# ----------------------------------------------------------------- removing


def test_remove_from_the_middle_relinks_the_neighbours():
    blocks, queue = make_queue(5)
    queue.remove(blocks[2])
    assert_unlinked(blocks[2])
    assert blocks[1].next_free is blocks[3]
    assert blocks[3].prev_free is blocks[1]
    assert ids(queue) == [0, 1, 3, 4]
    assert queue.num_free == 4
    assert_well_linked(queue)


def test_remove_head_and_tail_blocks():
    blocks, queue = make_queue(3)
    queue.remove(blocks[0])
    queue.remove(blocks[2])
    assert ids(queue) == [1]
    assert blocks[1].prev_free is queue._head
    assert blocks[1].next_free is queue._tail
    assert_well_linked(queue)


def test_remove_of_a_block_not_in_the_queue_is_refused():
    blocks, queue = make_queue(3)
    outsider = Block(block_id=99)
    with pytest.raises(AssertionError):
        queue.remove(outsider)
    queue.remove(blocks[1])
    with pytest.raises(AssertionError):
        queue.remove(blocks[1])
    assert ids(queue) == [0, 2]
    assert queue.num_free == 2


# ---------------------------------------------------------------- appending


def test_append_links_at_the_tail():
    blocks, queue = make_queue(3)
    head = queue.popleft()
    queue.append(head)
    assert ids(queue) == [1, 2, 0]
    assert head.next_free is queue._tail
    assert head.prev_free is blocks[2]
    assert queue.num_free == 3
    assert_well_linked(queue)


def test_appendleft_links_at_the_head():
    blocks, queue = make_queue(3)
    queue.remove(blocks[2])
    queue.appendleft(blocks[2])
    assert ids(queue) == [2, 0, 1]
    assert blocks[2].prev_free is queue._head
    assert blocks[2].next_free is blocks[0]
    assert_well_linked(queue)


def test_append_and_appendleft_into_an_empty_queue():
    queue = FreeBlockQueue()
    a, b, c = Block(0), Block(1), Block(2)
    queue.appendleft(a)
    assert ids(queue) == [0]
    queue.append(b)
    queue.appendleft(c)
    assert ids(queue) == [2, 0, 1]
    assert queue.num_free == 3
    assert_well_linked(queue)


def test_append_n_links_all_in_order_at_the_tail():
    blocks, queue = make_queue(2)
    extra = [Block(7), Block(8)]
    queue.append_n(extra)
    assert ids(queue) == [0, 1, 7, 8]
    assert queue.num_free == 4
    assert_well_linked(queue)


# ------------------------------------------------------- double-free guards


@pytest.mark.parametrize("op", ["append", "appendleft"])
def test_appending_a_block_that_is_already_free_is_refused(op):
    blocks, queue = make_queue(3)
    with pytest.raises(AssertionError, match="already free"):
        getattr(queue, op)(blocks[1])
    assert ids(queue) == [0, 1, 2]
    assert queue.num_free == 3
    assert_well_linked(queue)


@pytest.mark.parametrize("op", ["append", "appendleft"])
def test_appending_a_referenced_block_is_refused(op):
    _, queue = make_queue(2)
    held = Block(block_id=5, ref_cnt=1)
    with pytest.raises(AssertionError, match="still referenced"):
        getattr(queue, op)(held)
    assert_unlinked(held)
    assert ids(queue) == [0, 1]
    assert queue.num_free == 2


def test_append_n_with_a_duplicate_block_is_refused_at_the_duplicate():
    queue = FreeBlockQueue()
    block = Block(0)
    with pytest.raises(AssertionError):
        queue.append_n([block, block])
    assert ids(queue) == [0]
    assert queue.num_free == 1
    assert_well_linked(queue)


# ------------------------------------------------------------- model check

_ops = st.lists(
    st.tuples(st.sampled_from(["popleft", "popleft_n", "remove", "append", "appendleft"]), st.integers(0, 7)),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_queue_matches_a_list_model_under_any_operation_sequence(ops):
    blocks, queue = make_queue(8)
    model = list(range(8))
    out = []  # ids not in the queue
    for op, arg in ops:
        if op == "popleft":
            if not model:
                with pytest.raises(IndexError):
                    queue.popleft()
                continue
            popped = queue.popleft()
            assert popped.block_id == model.pop(0)
            out.append(popped.block_id)
        elif op == "popleft_n":
            n = arg % (len(model) + 1)
            taken = [b.block_id for b in queue.popleft_n(n)]
            assert taken == model[:n]
            del model[:n]
            out.extend(taken)
        elif op == "remove" and model:
            victim = model[arg % len(model)]
            queue.remove(blocks[victim])
            model.remove(victim)
            out.append(victim)
        elif op in ("append", "appendleft") and out:
            back = out.pop(arg % len(out))
            getattr(queue, op)(blocks[back])
            if op == "append":
                model.append(back)
            else:
                model.insert(0, back)
        assert ids(queue) == model
        assert_well_linked(queue)
        for block_id in out:
            assert_unlinked(blocks[block_id])
