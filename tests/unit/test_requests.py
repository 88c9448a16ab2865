"""The engine's request table: what a Step reports, and how replies apply."""

from __future__ import annotations

from inference.engine import Engine
from inference.requests import MAX_PROMPT_TOKENS_PER_STEP, Backlog, Finish, RequestTable, Sequence
from inference.sampling import SamplingParams
from inference.step_inputs import BlockTableRows
from kvd_api.daemon.v1 import daemon_pb2 as pb


def seq(request_id: str, num_tokens: int) -> Sequence:
    return Sequence(request_id, list(range(num_tokens)), SamplingParams(max_new_tokens=4))


def test_a_burst_of_long_prompts_is_spread_over_steps_under_the_message_limit():
    table = RequestTable(max_num_seqs=8, token_budget=512)
    for i in range(40):
        table.add(seq(f"r{i}", 8000))
    sent = []
    while table.num_unsent:
        msg = table.build_step()
        assert msg.ByteSize() < 4 * 1024 * 1024 and msg.new_requests
        assert sum(len(n.prompt_token_ids) for n in msg.new_requests) <= MAX_PROMPT_TOKENS_PER_STEP
        sent += [n.request_id for n in msg.new_requests]
    assert sent == [f"r{i}" for i in range(40)]  # each once, in arrival order
    huge = seq("huge", MAX_PROMPT_TOKENS_PER_STEP + 1)
    table.add(huge)
    assert [n.request_id for n in table.build_step().new_requests] == ["huge"]  # alone, never stuck


def test_settings_go_once_and_finishes_wait_for_the_forward_in_flight():
    table = RequestTable(max_num_seqs=2, token_budget=64)
    a, b = seq("a", 5), seq("b", 5)
    table.add(a)
    table.add(b)
    first = table.build_step()
    assert first.HasField("settings") and not table.build_step().HasField("settings")
    assert table.cancel("a") is None  # the daemon knows it: reported, not dropped
    msg = table.build_step(in_flight={"a"})
    assert list(msg.finished) == [] and msg.forward_in_flight
    assert list(table.build_step().finished) == ["a"] and a.finish is Finish.CANCELLED
    table.add(c := seq("c", 3))
    assert table.cancel("c") is c  # never sent: dropped at once


def scheduled(*entries: tuple[str, int, int, int, list[int]]) -> pb.StepResponse:
    """A reply scheduling (request id, first position, tokens, cached tokens, new blocks) each."""
    reply = pb.StepResponse()
    s = reply.scheduled
    for request_id, first, num_tokens, cached, blocks in entries:
        s.request_ids.append(request_id)
        s.first_positions.append(first)
        s.num_tokens.append(num_tokens)
        s.num_cached_tokens.append(cached)
        s.num_new_blocks.append(len(blocks))
        s.new_block_ids.extend(blocks)
    return reply


def test_a_running_sequences_row_persists_and_a_readmitted_ones_is_rewritten():
    table = RequestTable(max_num_seqs=2, token_budget=64)
    table.add(a := seq("a", 8))
    table.build_step()
    rows = BlockTableRows(rows=2, width=4)
    assign = lambda reply: rows.assign([Engine._chunk(w) for w in table.apply_step_reply(reply).work])  # noqa: E731

    first = assign(scheduled(("a", 0, 8, 0, [7, 3])))
    a.output_ids.append(1)  # its sampled token
    rows.table[first[0], 0] = -1  # marks a block the next step must not write again
    second = assign(scheduled(("a", 8, 1, 0, [5])))
    assert second == first and rows.table[first[0], :3].tolist() == [-1, 3, 5]  # only the gained block
    # Preempted, then admitted again in one reply with other blocks: the row is rewritten.
    reply = scheduled(("a", 0, 9, 0, [2, 6, 4]))
    reply.preempted.append("a")
    again = assign(reply)
    assert rows.table[again[0], :3].tolist() == [2, 6, 4] and a.block_table == [2, 6, 4]


def test_a_reply_extends_tables_and_drops_preempted_ones():
    table = RequestTable(max_num_seqs=2, token_budget=64)
    a = seq("a", 6)
    table.add(a)
    table.build_step()
    reply = pb.StepResponse()
    reply.scheduled.request_ids.append("a")
    reply.scheduled.first_positions.append(4)
    reply.scheduled.num_tokens.append(2)
    reply.scheduled.num_cached_tokens.append(4)
    reply.scheduled.num_new_blocks.append(2)
    reply.scheduled.new_block_ids.extend([7, 3])
    step = table.apply_step_reply(reply)
    assert [(w.seq, w.first, w.end) for w in step.work] == [(a, 4, 6)] and step.released == []
    assert a.block_table == [7, 3] and a.num_cached_prompt == 4
    step = table.apply_step_reply(pb.StepResponse(preempted=["a"]))
    assert step.work == [] and a.block_table == []


def test_what_the_daemon_held_of_a_waiting_prompt_leaves_the_queued_work():
    table = RequestTable(max_num_seqs=2, token_budget=64)
    table.add(a := seq("a", 40))
    table.add(b := seq("b", 24))
    assert table.backlog() == Backlog(queued_tokens=64, waiting=2)  # not told yet: whole prompts
    table.build_step()
    table.apply_step_reply(pb.StepResponse(arrival_cached_tokens=[32, 0]))  # in new_requests' order
    assert (a.expected_cached, b.expected_cached) == (32, 0)
    assert table.backlog() == Backlog(queued_tokens=40 - 32 + 24, waiting=2)
    table.add(seq("c", 16))
    table.build_step()
    table.apply_step_reply(pb.StepResponse())  # a daemon that sends no column changes nothing
    assert table.backlog() == Backlog(queued_tokens=40 - 32 + 24 + 16, waiting=3)
