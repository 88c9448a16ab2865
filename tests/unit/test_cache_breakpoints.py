"""Cache breakpoints as the daemon's cache marks (``gateway.cache_marks``),
placed on SmolLM2's real chat template, and the creation usage they earn; the
Anthropic surface's translation of ``cache_control`` and stop sequences."""

from __future__ import annotations

import pytest

from gateway.cache_marks import CacheTtls, PlacedMarks, chat_prefix, check_breakpoints, creation_usage, place
from gateway.http_api.anthropic_messages import StopSequences, generate_request, usage
from gateway.http_api.anthropic_schemas import MessagesRequest
from gateway.tokenizer import GatewayTokenizer
from inference import model_store
from inference.service import tokenizer_files
from kvd.common.cache_marks import check_marks
from kvd.common.field_error import FieldError
from kvd_api.daemon.v1 import daemon_pb2 as dpb
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb

BLOCK = 16
TTLS = CacheTtls(five_minutes_s=300, one_hour_s=3600)
SYSTEM = "You are the support assistant of ACME Corp. ACME sells anvils, rockets and giant magnets. " * 3


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> GatewayTokenizer:
    files = tokenizer_files(model_store.load_tokenizer(model_dir))
    return GatewayTokenizer(lambda: files)


def chat(*messages: tuple[str, str]) -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    request.chat.messages.extend(epb.ChatMessage(role=r, content=c) for r, c in messages)
    return request


def placed(tokenizer, request: pb.GenerateRequest, block: int = BLOCK) -> tuple[list[int], PlacedMarks]:
    check_breakpoints(request)
    ids = tokenizer.chat_ids(request.chat)

    def prefix_ids(message: int, chars: int) -> list[int]:
        return tokenizer.chat_ids(chat_prefix(request.chat, message, chars))

    return ids, place(request, ids, prefix_ids, block, TTLS, "acme", 0)


def test_a_mark_on_a_message_ends_with_its_turn(tokenizer):
    request = chat(("system", SYSTEM), ("user", "Do you ship abroad?"))
    request.cache_breakpoints.add(message=0, ttl=pb.CACHE_TTL_1H)
    ids, marks = placed(tokenizer, request)
    alone = tokenizer.chat_ids([("system", SYSTEM)], add_generation_prompt=False)
    (mark,) = marks.marks.marks
    assert mark.num_tokens == len(alone) and ids[: len(alone)] == alone  # the system turn, its end included
    assert mark.ttl_seconds == 3600 and marks.one_hour == (True,)
    assert marks.marks.owner == "acme"


def test_a_mark_inside_a_message_ends_before_the_rest(tokenizer):
    first, rest = SYSTEM.rstrip(), "Today is 2026-11-29."
    request = chat(("system", first + "\n" + rest), ("user", "Hi"))
    request.cache_breakpoints.add(message=0, content_chars=len(first))
    ids, marks = placed(tokenizer, request)
    (mark,) = marks.marks.marks
    kept = tokenizer.decode(ids[: mark.num_tokens])
    assert kept.endswith(first[-10:]) and "2026" not in kept


def test_marks_keep_order_merge_and_skip_short_ones(tokenizer):
    request = chat(("system", SYSTEM), ("user", "Hi"))
    request.cache_breakpoints.add(prompt=True)
    request.cache_breakpoints.add(message=0)
    request.cache_breakpoints.add(message=1, ttl=pb.CACHE_TTL_1H)  # before the assistant's header
    request.cache_breakpoints.add(message=1)  # the same place: the longer TTL is kept
    ids, marks = placed(tokenizer, request)
    counts = [m.num_tokens for m in marks.marks.marks]
    assert counts == sorted(set(counts)) and counts[-1] == len(ids) and len(counts) == 3
    assert marks.one_hour == (False, True, False)
    check_marks(marks.marks, len(ids))  # what the daemon takes
    short = chat(("user", "Hi"))  # 27 tokens, with SmolLM2's default system message
    short.cache_breakpoints.add(message=0)
    assert placed(tokenizer, short, block=32)[1].empty  # under one block: nothing to pin


def test_breakpoints_that_point_nowhere_are_refused():
    request = chat(("user", "Hi"))
    request.cache_breakpoints.add(message=1)
    with pytest.raises(FieldError, match=r"cache_breakpoints\[0\]\.message"):
        check_breakpoints(request)
    request = pb.GenerateRequest(text="Hi")
    request.cache_breakpoints.add(message=0)
    with pytest.raises(FieldError, match="only a chat prompt"):
        check_breakpoints(request)
    request = pb.GenerateRequest(text="Hi")
    for _ in range(5):
        request.cache_breakpoints.add(prompt=True)
    with pytest.raises(FieldError, match="at most 4"):
        check_breakpoints(request)
    request = pb.GenerateRequest(text="Hi")
    request.cache_breakpoints.add()
    with pytest.raises(FieldError, match="say where"):
        check_breakpoints(request)


def test_creation_counts_what_the_marks_pinned_past_the_cached_prefix():
    marks = dpb.CacheMarks(marks=[dpb.CacheMark(num_tokens=64, ttl_seconds=3600),
                                  dpb.CacheMark(num_tokens=100, ttl_seconds=300)])  # fmt: skip
    two = PlacedMarks(marks, (True, False))
    results = [
        dpb.MarkResult(num_tokens=100, num_pinned_tokens=96),
        dpb.MarkResult(num_tokens=64, num_pinned_tokens=64),
    ]
    u = pb.Usage(prompt_tokens=120, cached_prompt_tokens=32)
    creation_usage(u, results, two)
    assert (u.cache_creation_tokens, u.cache_creation_1h_tokens, u.cache_creation_5m_tokens) == (64, 32, 32)
    assert u.unpinned_breakpoints == 0
    hit = pb.Usage(prompt_tokens=120, cached_prompt_tokens=96)
    creation_usage(hit, results, two)
    assert hit.cache_creation_tokens == 0  # all read
    refused = pb.Usage(prompt_tokens=120)
    creation_usage(refused, [results[1], dpb.MarkResult(num_tokens=100, refused="quota")], two)
    assert (refused.cache_creation_tokens, refused.unpinned_breakpoints) == (64, 1)


def test_the_shared_check_refuses_marks_the_daemon_cannot_honour():
    with pytest.raises(FieldError, match=r"marks\[1\]\.num_tokens"):
        check_marks(dpb.CacheMarks(marks=[dpb.CacheMark(num_tokens=32, ttl_seconds=1),
                                          dpb.CacheMark(num_tokens=32, ttl_seconds=1)]), 64)  # fmt: skip
    with pytest.raises(FieldError, match=r"marks\[0\]\.num_tokens"):
        check_marks(dpb.CacheMarks(marks=[dpb.CacheMark(num_tokens=65, ttl_seconds=1)]), 64)
    with pytest.raises(FieldError, match=r"marks\[0\]\.ttl_seconds"):
        check_marks(dpb.CacheMarks(marks=[dpb.CacheMark(num_tokens=16, ttl_seconds=0)]), 64)


# ------------------------------------------------------------ Anthropic


def test_cache_control_becomes_breakpoints_on_blocks_and_the_last_message():
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 8,
        "system": [{"type": "text", "text": "abc"},
                   {"type": "text", "text": "defg", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                   {"type": "text", "text": "now"}],
        "messages": [{"role": "user",
                      "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                     {"role": "assistant", "content": "ok"},
                     {"role": "user", "content": "more"}],
        "cache_control": {"type": "ephemeral"},
    })  # fmt: skip
    request = generate_request(body)
    assert [m.role for m in request.chat.messages] == ["system", "user", "assistant", "user"]
    assert request.chat.messages[0].content == "abc\ndefg\nnow"
    marks = [(b.message, b.content_chars, b.ttl) for b in request.cache_breakpoints]
    assert marks == [(0, len("abc\ndefg"), pb.CACHE_TTL_1H), (1, 0, pb.CACHE_TTL_5M), (3, 0, pb.CACHE_TTL_5M)]
    check_breakpoints(request)


def test_unsupported_blocks_and_fields_are_refused_by_name():
    base = {"model": "m", "max_tokens": 8}
    with pytest.raises(ValueError, match="only text blocks"):
        MessagesRequest.model_validate({**base, "messages": [{"role": "user", "content": [{"type": "image"}]}]})
    with pytest.raises(ValueError, match="tools"):
        MessagesRequest.model_validate({**base, "messages": [{"role": "user", "content": "x"}], "tools": [{}]})
    with pytest.raises(ValueError, match="thinking"):
        MessagesRequest.model_validate(
            {**base, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}}
        )


def test_a_stop_sequence_is_held_back_then_named():
    stops = StopSequences(["END", "STOP"])
    sent = stops.text("hello E") + stops.text("N") + stops.text("D")
    assert sent == "hello "
    assert stops.end(epb.FINISH_REASON_STOP) == ("", "END")
    stops = StopSequences(["END"])
    assert stops.text("an E") == "an " and stops.end(epb.FINISH_REASON_LENGTH) == ("E", None)
    long = StopSequences(["ab" * 50_000])  # a 100k-character stop: what could begin it is held, no more
    assert long.text("xxa") == "xx" and long.text("bab") == "" and long.text("c") == "ababc"


def test_usage_splits_reads_creation_and_the_rest():
    u = pb.Usage(prompt_tokens=100, cached_prompt_tokens=32, cache_creation_tokens=48, cache_creation_1h_tokens=48,
                 completion_tokens=5)  # fmt: skip
    out = usage(u)
    assert (out["input_tokens"], out["cache_read_input_tokens"], out["cache_creation_input_tokens"]) == (20, 32, 48)
    assert out["cache_creation"] == {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 48}
