"""Hostile input to Anthropic's Messages API and to explicit caching: bodies of
``POST /v1/messages`` (whole and streamed) and ``/v1/messages/count_tokens``
drawn from valid and invalid values of every field (``cache_control`` on the
top level, on system and message blocks, valid, malformed and more than 4;
blocks other than text; roles, sampling values out of range, stop
sequences empty, many and long; ``tools``, ``thinking``, ``diagnostics``,
unknown fields), and the gRPC ``Generate``/``Complete`` with random
``cache_breakpoints`` (message indices and content lengths in and out of
range, the whole prompt, neither, unknown TTLs) and ``diagnose_cache``.

Each HTTP answer must be a documented status in Anthropic's error shape when
it is an error, never a 500; a whole reply is Anthropic's message, its usage
adding up to the prompt's tokens (as count_tokens counts them); a stream is
Anthropic's events in order, ending with ``message_stop`` or an ``error``
event. Each gRPC answer is OK or INVALID_ARGUMENT with a message (that one
whenever a breakpoint points nowhere). Afterwards no request holds a block,
and the marks' pins (TTLs of 2 and 3 seconds here) have all expired.

Beside the fuzzing, the bugs it and its reading found, pinned down: more
than 4 breakpoints refused, max_tokens 0 refused (the schema's ``ge=1`` was
lost under ``Int32``'s own bounds), a mark on an empty first block keeping
no more than the message's opening (it kept the whole message), and a long
stop sequence not stalling the gateway's event loop (its matching was
quadratic in the stop's length).

Examples: ``KVD_FUZZ_EXAMPLES`` (default 15) times 5 for ``/v1/messages``,
times 3 for count_tokens, times 4 for the gRPC requests.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections import Counter

import grpc
import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.common.client import DaemonClient
from kvd_api.gateway.v1 import gateway_pb2 as gpb
from kvd_api.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tests.conftest import blocks_held, free_port, start_daemon, start_engine, start_gateway, wait_for

EXAMPLES = int(os.environ.get("KVD_FUZZ_EXAMPLES", "15"))
#: What /v1/messages may answer (a conflict, 409, is the templates' alone; 500 never).
DOCUMENTED = frozenset({200, 400, 401, 403, 404, 413, 429, 503, 504})
#: Anthropic's error type for each status.
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
              503: "overloaded_error", 504: "timeout_error"}  # fmt: skip
STOP_REASONS = frozenset({"end_turn", "max_tokens", "stop_sequence"})
MISS_REASONS = frozenset({"previous_message_not_found", "model_changed", "system_changed", "messages_changed"})
MAX_BREAKPOINTS = 4
TTL_5M_S, TTL_1H_S = 2, 3
QUOTA_BLOCKS = 8  # each tenant's marks' pins: some marks go unpinned
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("KVD_FUZZ_RANDOM") != "1",
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
KEY, TEMPLATES_ONLY = "fuzz-key", "fuzz-templates-only"
AUTH, BEARER = {"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=5,
)
#: Long enough that a mark through it pins blocks of 16 tokens.
LONG = "The quick brown fox jumps over the lazy dog. " * 8
#: Text no drawn body has (the targeted tests' own prefixes).
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa. "
TEXT = st.one_of(st.text(max_size=30), st.sampled_from(["", " ", "\x00", "é" * 40, "Hi", LONG]))

CACHE_CONTROL = st.sampled_from([{"type": "ephemeral"}, {"type": "ephemeral", "ttl": "5m"},
                                 {"type": "ephemeral", "ttl": "1h"}])  # fmt: skip
BAD_CACHE_CONTROL = st.one_of(
    st.sampled_from([{}, {"type": "persistent"}, {"type": "ephemeral", "ttl": "2h"}, {"type": "ephemeral", "ttl": 5},
                     {"ttl": "5m"}, "ephemeral", [], {"type": "ephemeral", "ttl": "5m", "extra": 1}]),
    JUNK,
)  # fmt: skip
BLOCK = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}, optional={"cache_control": CACHE_CONTROL})
MARKED_BLOCK = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT, "cache_control": CACHE_CONTROL})
BAD_BLOCK = st.one_of(
    st.sampled_from([
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}},
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
        {"type": "thinking", "thinking": "hm", "signature": "x"},
        {"text": "no type"}, {"type": "text"}, {"type": "text", "text": 5}, {"type": "TEXT", "text": "x"},
    ]),
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT, "cache_control": BAD_CACHE_CONTROL}),
    JUNK,
)  # fmt: skip
CONTENT = st.one_of(TEXT, st.lists(BLOCK, min_size=1, max_size=3))
ROLES = st.sampled_from(["user", "user", "assistant"])
MESSAGE = st.fixed_dictionaries({"role": ROLES, "content": CONTENT})
BAD_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "tool", "developer", "", "User", None]) | TEXT,
                           "content": CONTENT}),
    st.fixed_dictionaries({"role": ROLES, "content": st.lists(st.one_of(BLOCK, BAD_BLOCK), min_size=1, max_size=3)}),
    st.fixed_dictionaries({"role": ROLES, "content": st.just([]) | JUNK}),
    st.fixed_dictionaries({"role": ROLES}),
    JUNK,
)  # fmt: skip
STOPS = st.one_of(
    st.lists(st.text(min_size=1, max_size=6), max_size=4),
    st.lists(st.text(min_size=1, max_size=3), min_size=20, max_size=60),  # many
    st.just(["x" * 3000]),  # long
    st.sampled_from([["."], [" "], ["\n"], ["the"]]),  # ones that end a reply early
)

#: field -> (its valid values, its hostile ones; the generic HOSTILE too).
FIELDS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "model": (st.just("MODEL"), st.sampled_from(["claude-sonnet-4-5", "", "MODEL "])),
    "max_tokens": (st.integers(1, 4), st.sampled_from([0, -1, 2**31, -(2**63), 10**30, "2", 2.5, None, []])),
    "messages": (
        st.lists(MESSAGE, min_size=1, max_size=3),
        st.one_of(st.just([]), st.lists(st.one_of(MESSAGE, BAD_MESSAGE), min_size=1, max_size=3), TEXT),
    ),
    "system": (
        st.one_of(TEXT, st.lists(BLOCK, max_size=3)),
        st.one_of(st.lists(st.one_of(BLOCK, BAD_BLOCK), min_size=1, max_size=3), st.just({"type": "text"})),
    ),
    "temperature": (st.floats(0, 1), st.sampled_from([-0.01, 1.01, 2.0, math.nan, math.inf, -math.inf, "0.5"])),
    "top_p": (st.floats(0.01, 1), st.sampled_from([0.0, -1.0, 1.5, math.nan, math.inf])),
    "top_k": (st.integers(0, 50), st.sampled_from([-1, 2**31, 10**30, 1.5, "5"])),
    "stop_sequences": (STOPS, st.one_of(st.sampled_from([[""], ["a", ""], "stop", [1], [None]]), JUNK)),
    "stream": (st.booleans(), st.sampled_from(["yes", 2, None, []])),
    "cache_control": (CACHE_CONTROL, BAD_CACHE_CONTROL),
    "metadata": (st.fixed_dictionaries({}, optional={"user_id": TEXT}), st.sampled_from(["x", [], 5])),
    "service_tier": (st.sampled_from(["auto", "standard_only"]), st.sampled_from([5, [], {}])),
    "thinking": (
        st.sampled_from([{"type": "disabled"}, {}]),
        st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}, "on"]),
    ),
    "tools": (
        st.just([]),
        st.sampled_from(
            [
                [{"name": "get_weather", "description": "x", "input_schema": {"type": "object"}}],
                [{"type": "web_search_20250305", "name": "web_search"}],
                {"name": "x"},
            ]
        ),
    ),  # fmt: skip
    "tool_choice": (st.none(), st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "x"}])),
    "diagnostics": (
        st.fixed_dictionaries({}, optional={"previous_message_id": st.sampled_from([None, "PREVIOUS", "msg_nope"])}),
        st.sampled_from([{"previous_message_id": 5}, {"previous_message_id": []}, "yes", []]),
    ),
    "kvd_diagnose_cache": (st.booleans(), st.sampled_from(["x", 5])),
}
HOSTILE = st.one_of(JUNK, TEXT, st.sampled_from([0, -1, 2**31, 10**30, math.nan, math.inf]))
REQUIRED = ("model", "max_tokens", "messages")


def bodies(required=REQUIRED) -> st.SearchStrategy:
    """Valid bodies; ones with many marked blocks; ones with one field hostile (or an unknown field added)."""
    valid = st.fixed_dictionaries(
        {k: FIELDS[k][0] for k in required}, optional={k: v[0] for k, v in FIELDS.items() if k not in required}
    )
    marked = st.fixed_dictionaries({
        "model": st.just("MODEL"), "max_tokens": st.integers(1, 3),
        "system": st.lists(MARKED_BLOCK, max_size=3),
        "messages": st.lists(st.fixed_dictionaries({"role": ROLES, "content": st.lists(MARKED_BLOCK, min_size=1,
                                                                                      max_size=3)}),
                             min_size=1, max_size=2),
    }, optional={"cache_control": CACHE_CONTROL, "stream": st.booleans()})  # fmt: skip
    names = st.sampled_from([*FIELDS, "unknown_field"])

    def hostile(body: dict) -> st.SearchStrategy:
        def replaced(name: str) -> st.SearchStrategy:
            pool = st.one_of(FIELDS[name][1], HOSTILE) if name in FIELDS else HOSTILE
            return pool.map(lambda value: {**body, name: value})

        return names.flatmap(replaced)

    return st.one_of(valid, marked, valid.flatmap(hostile))


HEADERS = st.sampled_from([AUTH] * 6 + [BEARER, {}, {"x-api-key": "wrong"}, {"x-api-key": TEMPLATES_ONLY}])


def breakpoints(body: dict) -> int:
    """How many cache breakpoints a valid body asks for."""
    blocks = [body.get("system")] + [m["content"] for m in body["messages"]]
    marked = sum(1 for part in blocks if isinstance(part, list) for b in part if b.get("cache_control") is not None)
    return marked + (body.get("cache_control") is not None)


def error_shape(what, status: int, error: dict) -> None:
    assert error.get("type") == "error", (what, error)
    assert error["error"]["type"] == ERROR_TYPE[status], (what, status, error)
    assert isinstance(error["error"]["message"], str) and error["error"]["message"].strip(), (what, error)


def check_usage(what, usage: dict, body: dict) -> int:
    """Anthropic's usage; the prompt's tokens it adds up to."""
    counts = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    assert all(type(usage[k]) is int and usage[k] >= 0 for k in counts), (what, usage)
    assert int(body["max_tokens"]) >= 1, (what, "a reply for max_tokens < 1", body)
    assert 0 < usage["output_tokens"] <= int(body["max_tokens"]), (what, usage)
    by_ttl = usage["cache_creation"]
    assert by_ttl["ephemeral_5m_input_tokens"] + by_ttl["ephemeral_1h_input_tokens"] == usage[
        "cache_creation_input_tokens"], (what, usage)  # fmt: skip
    marks = breakpoints(body)
    assert 0 <= usage["kvd"]["unpinned_breakpoints"] <= marks, (what, usage, marks)
    if not marks:
        assert usage["cache_creation_input_tokens"] == 0, (what, usage)
    return usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]


def check_stop(what, reason, stop, body: dict) -> None:
    assert reason in STOP_REASONS, (what, reason)
    assert (reason == "stop_sequence") == (stop is not None), (what, reason, stop)
    assert stop is None or stop in (body.get("stop_sequences") or ()), (what, stop)


def check_diagnostics(what, diagnostics: dict | None, body: dict) -> None:
    if not isinstance(body.get("diagnostics"), dict):
        assert diagnostics is None, (what, diagnostics)
        return
    reason = diagnostics["cache_miss_reason"]
    if body["diagnostics"].get("previous_message_id") is None:
        assert reason is None, (what, diagnostics)
    elif reason is not None:
        assert reason["type"] in MISS_REASONS, (what, reason)
        assert reason["type"] == "previous_message_not_found" or reason["cache_missed_input_tokens"] >= 0, reason


def sse_events(what, raw: str) -> list[tuple[str, dict]]:
    """(name, data) of each event of an SSE body, as a strict reader splits them."""
    assert raw.endswith("\n\n"), (what, raw[-300:])
    events = []
    for chunk in raw.split("\n\n")[:-1]:
        fields = dict(line.split(": ", 1) for line in chunk.split("\n") if not line.startswith(":"))
        assert set(fields) == {"event", "data"}, (what, chunk)
        data = json.loads(fields["data"])
        assert data["type"] == fields["event"], (what, chunk)
        events.append((fields["event"], data))
    return events


class Tally:
    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.statuses: Counter = Counter()
        self.replies: Counter = Counter()  # what the 200s did: streamed, created, read, unpinned...
        self.last_id = "msg_nope"  # the last reply's: a later body's diagnostics may name it

    def check(self, what, response: httpx.Response, body=None) -> None:
        status = response.status_code
        self.statuses[status] += 1
        assert status in DOCUMENTED, (what, status, response.text[:500])
        if status != 200:
            error_shape(what, status, response.json())
        elif what == "count_tokens":
            count = response.json()["input_tokens"]
            assert type(count) is int and count > 0, (what, response.text)
        elif response.headers["content-type"].startswith("text/event-stream"):
            self._stream(what, response.text, body)
        else:
            self._whole(what, response, body)

    def _whole(self, what, response: httpx.Response, body: dict) -> None:
        reply = response.json()
        assert reply["id"].startswith("msg_") and reply["type"] == "message", (what, reply)
        assert reply["role"] == "assistant" and reply["model"] == body["model"], (what, reply)
        assert [b["type"] for b in reply["content"]] == ["text"] and isinstance(reply["content"][0]["text"], str)
        check_stop(what, reply["stop_reason"], reply["stop_sequence"], body)
        prompt = self._usage(what, reply["usage"], body)
        unpinned = reply["usage"]["kvd"]["unpinned_breakpoints"]
        assert response.headers.get("x-kvd-cache-unpinned-breakpoints") == (str(unpinned) if unpinned else None)
        assert breakpoints(body) <= MAX_BREAKPOINTS, (what, body)
        check_diagnostics(what, reply.get("diagnostics"), body)
        self._same_prompt(what, body, prompt)
        self.last_id = reply["id"]

    def _stream(self, what, raw: str, body: dict) -> None:
        events = sse_events(what, raw)
        names = [name for name, _ in events]
        assert names[:2] == ["message_start", "content_block_start"], (what, names)
        start = events[0][1]["message"]
        assert start["id"].startswith("msg_") and start["role"] == "assistant" and start["content"] == [], start
        if names[-1] == "error":  # after the first event: the status was sent
            error = events[-1][1]["error"]
            assert error["type"] in ERROR_TYPE.values(), (what, error)  # api_error: a 500
            assert isinstance(error["message"], str) and error["message"].strip(), (what, error)
            assert set(names[2:-1]) <= {"content_block_delta", "content_block_stop", "message_delta"}, (what, names)
            return
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"], (what, names)
        assert set(names[2:-3]) <= {"content_block_delta"}, (what, names)
        assert all(data["delta"]["type"] == "text_delta" and data["delta"]["text"] for _, data in events[2:-3])
        end = events[-2][1]
        check_stop(what, end["delta"]["stop_reason"], end["delta"]["stop_sequence"], body)
        self.replies["streamed"] += 1
        prompt = self._usage(what, end["usage"], body)
        assert breakpoints(body) <= MAX_BREAKPOINTS, (what, body)
        check_diagnostics(what, start.get("diagnostics"), body)
        self._same_prompt(what, body, prompt)
        self.last_id = start["id"]

    def _usage(self, what, usage: dict, body: dict) -> int:
        prompt = check_usage(what, usage, body)
        for name, count in (("created", usage["cache_creation_input_tokens"]),
                            ("read", usage["cache_read_input_tokens"]),
                            ("unpinned", usage["kvd"]["unpinned_breakpoints"])):  # fmt: skip
            self.replies[name] += count > 0
        return prompt

    def _same_prompt(self, what, body: dict, prompt_tokens: int) -> None:
        """The usage adds up to the prompt's tokens, as count_tokens counts them."""
        counted = _post(self.client, "/messages/count_tokens", body, AUTH)
        assert counted.status_code == 200, (what, body, counted.text)
        assert counted.json()["input_tokens"] == prompt_tokens, (what, body, counted.json(), prompt_tokens)

    def report(self, name: str) -> None:
        statuses = dict(sorted(self.statuses.items()))
        print(f"\n{name}: {sum(self.statuses.values())} cases, statuses {statuses}, replies {dict(self.replies)}")


@pytest.fixture(scope="module")
def stack(model_dir):
    """(daemon, gateway, an HTTP client on its API, the served model's name, the templates' pins):
    marks' TTLs of seconds, a pin quota per tenant, a text and a chat template."""
    folder = tempfile.mkdtemp(prefix="kvd-fuzzm-", dir="/tmp")
    with open(f"{folder}/keys.json", "w") as f:
        keys = [{"key": KEY, "tenant": "fuzz", "scopes": ["generate", "templates:write"]},
                {"key": TEMPLATES_ONLY, "tenant": "fuzz", "scopes": ["templates:write"]}]  # fmt: skip
        json.dump({"keys": keys}, f)
    http = f"127.0.0.1:{free_port()}"
    daemon = start_daemon(["--block-size", "16", "--num-blocks", "512", "--lease-s", "2"], folder)
    engine = start_engine(daemon, ["--model", str(model_dir)], folder)
    gateway = start_gateway(engine.address, [
        "--data-dir", f"{folder}/gw", "--api-keys", f"{folder}/keys.json", "--http-listen", http,
        "--cache-ttl-5m-s", str(TTL_5M_S), "--cache-ttl-1h-s", str(TTL_1H_S), "--max-pinned-blocks", str(QUOTA_BLOCKS),
    ], folder)  # fmt: skip
    client = httpx.Client(base_url=f"http://{http}/v1", timeout=120)  # each call sends its own key (or none)
    try:
        assert wait_for(lambda: httpx.get(f"http://{http}/ready").status_code == 200, 30), gateway.log()
        text = {"name": "support-bot", "content": "You help. " * 5}
        assert client.post("/templates", json=text, headers=BEARER).status_code == 200
        chat = {"name": "chat-bot", "messages": [{"role": "system", "content": "Be brief."}]}
        assert client.post("/templates", json=chat, headers=BEARER).status_code == 200
        model = client.get("/models", headers=BEARER).json()["data"][0]["id"]
        with DaemonClient.connect(daemon.address) as stats:
            template_pins = stats.stats().num_pins  # warmed: pinned before their creation returned
        yield daemon, gateway, client, model, template_pins
    finally:
        client.close()
        for process in (gateway, engine, daemon):
            process.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _named(body, model: str, last_id: str):
    """The served model's name for "MODEL", a short max_tokens for a valid long one, the last reply's id."""
    if not isinstance(body, dict):
        return body
    if body.get("model") == "MODEL":
        body = {**body, "model": model}
    if type(body.get("max_tokens")) is int and 4 < body["max_tokens"] < 2**31:  # valid, but would run long
        body = {**body, "max_tokens": 4}
    if isinstance(body.get("diagnostics"), dict) and body["diagnostics"].get("previous_message_id") == "PREVIOUS":
        body = {**body, "diagnostics": {"previous_message_id": last_id}}
    return body


def _post(client: httpx.Client, path: str, body, headers: dict) -> httpx.Response:
    content = json.dumps(body, allow_nan=True).encode()  # NaN and Infinity: JSON no parser should take
    return client.post(path, content=content, headers={"Content-Type": "application/json", **headers})


def _settled(daemon) -> bool:
    with DaemonClient.connect(daemon.address) as client:
        stats = client.stats()
    return stats.num_requests == 0 and blocks_held(daemon) == 0


def test_messages(stack):
    daemon, gateway, client, model, template_pins = stack
    tally = Tally(client)

    @settings(FUZZ, max_examples=EXAMPLES * 5)
    @given(body=bodies(), headers=HEADERS, stream=st.sampled_from([True, False, None]))
    def one(body, headers, stream):
        body = _named(body, model, tally.last_id)
        if stream is not None and isinstance(body, dict) and "stream" not in body:  # more streams
            body = {**body, "stream": stream}
        tally.check("messages", _post(client, "/messages", body, headers), body)

    one()
    for malformed in (b"{", b"[]", b'"x"', b"\xff\xfe", b'{"model": NaN}', b"null"):
        tally.check(
            "messages", client.post("/messages", content=malformed, headers={"Content-Type": "application/json"})
        )
    tally.report("/v1/messages")
    assert gateway.process.poll() is None
    assert wait_for(lambda: _settled(daemon), 30), DaemonClient.connect(daemon.address).stats()


def test_at_most_four_breakpoints(stack):
    """Four marked blocks are served (the first pin, the rest as the quota lets them); a fifth is a 400,
    whole or streamed."""
    daemon, gateway, client, model, template_pins = stack

    def marked(n: int) -> dict:  # a prefix no fuzzed body has: its marks create what they pin
        return {"type": "text", "text": f"Mark {n}: {WORDS}", "cache_control": {"type": "ephemeral", "ttl": "1h"}}

    with DaemonClient.connect(daemon.address) as stats:
        # The fuzzed marks gone: the tenant is under its pin quota again.
        assert wait_for(lambda: stats.stats().num_pins == template_pins, 10 * TTL_1H_S), stats.stats()
        for stream in (False, True):
            four = {"model": model, "max_tokens": 1, "stream": stream, "system": [marked(1), marked(2)],
                    "messages": [{"role": "user", "content": [marked(3), marked(4)]}]}  # fmt: skip
            reply = _post(client, "/messages", four, AUTH)
            assert reply.status_code == 200, reply.text
            if not stream:  # the marks pinned: their expiry (last test) is no vacuous check
                usage = reply.json()["usage"]
                assert usage["cache_creation_input_tokens"] > 0 and usage["kvd"]["unpinned_breakpoints"] < 4, usage
                assert stats.stats().num_pins > template_pins, stats.stats()
            five = {**four, "cache_control": {"type": "ephemeral"}}
            reply = _post(client, "/messages", five, AUTH)
            assert reply.status_code == 400, reply.text
            error_shape("five breakpoints", 400, reply.json())


def test_max_tokens_below_one_is_refused(stack):
    """Anthropic's max_tokens is at least 1: 0 is a 400 (not an empty reply), as -1 is."""
    daemon, gateway, client, model, template_pins = stack
    for stream in (False, True):
        for max_tokens in (0, -1):
            body = {
                "model": model,
                "max_tokens": max_tokens,
                "stream": stream,
                "messages": [{"role": "user", "content": "Hi"}],
            }
            reply = _post(client, "/messages", body, AUTH)
            assert reply.status_code == 400, (body, reply.text[:500])
            error_shape(body, 400, reply.json())
            assert "max_tokens" in reply.json()["error"]["message"], reply.text


def test_a_mark_on_an_empty_first_block_keeps_no_more_than_before_it(stack):
    """A marked block keeps the prompt through that block: an empty first one, through the message's opening
    (no further than the message with no content at all), not the whole message."""
    daemon, gateway, client, model, template_pins = stack
    blocks = [
        {"type": "text", "text": "", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Empty mark probe. " + WORDS * 2},  # no prompt before had it: nothing reads it
    ]
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": blocks}]}
    with DaemonClient.connect(daemon.address) as stats:  # the earlier marks gone: under the pin quota
        assert wait_for(lambda: stats.stats().num_pins == template_pins, 10 * TTL_1H_S), stats.stats()
    reply = _post(client, "/messages", body, AUTH)
    assert reply.status_code in (200, 400), reply.text  # (Anthropic refuses empty text blocks)
    if reply.status_code == 200:
        opening = {"model": model, "messages": [{"role": "user", "content": ""}]}
        before = _post(client, "/messages/count_tokens", opening, AUTH).json()["input_tokens"]
        usage = reply.json()["usage"]
        assert usage["kvd"]["unpinned_breakpoints"] == 0, usage  # whatever it marks, the quota let it pin
        assert usage["cache_creation_input_tokens"] <= before, (usage, before)


def test_count_tokens(stack):
    daemon, gateway, client, model, template_pins = stack
    tally = Tally(client)

    @settings(FUZZ, max_examples=EXAMPLES * 3)
    @given(body=bodies(("model", "messages")), headers=HEADERS)
    def one(body, headers):
        tally.check("count_tokens", _post(client, "/messages/count_tokens", _named(body, model, "msg_nope"), headers))

    one()
    for malformed in (b"{", b"[]", b'{"model": NaN}'):
        headers = {"Content-Type": "application/json"}
        tally.check("count_tokens", client.post("/messages/count_tokens", content=malformed, headers=headers))
    tally.report("/v1/messages/count_tokens")
    assert gateway.process.poll() is None


# ------------------------------------------------------------------ gRPC

INT32 = st.one_of(st.integers(-2, 8), st.sampled_from([2**31 - 1, -(2**31), 60, 500]))
TTLS = st.one_of(st.sampled_from([0, 1]), st.integers(-5, 1000))  # unknown enum values too


@st.composite
def any_breakpoint(draw) -> gpb.CacheBreakpoint:
    """A breakpoint anywhere: at a message (in range or not), the prompt, prompt=false, or neither."""
    mark = gpb.CacheBreakpoint(content_chars=draw(st.one_of(st.just(0), INT32)), ttl=draw(TTLS))
    at = draw(st.sampled_from(["message", "message", "prompt", "prompt false", "neither"]))
    if at == "message":
        mark.message = draw(INT32)
    elif at.startswith("prompt"):
        mark.prompt = at == "prompt"  # false still says where (the oneof is set)
    return mark


@st.composite
def fitting_breakpoint(draw, messages) -> gpb.CacheBreakpoint:
    """A breakpoint the request's prompt has: the whole prompt, or a message through some of its content."""
    mark = gpb.CacheBreakpoint(ttl=draw(st.sampled_from([0, 1])))
    if not messages or draw(st.integers(0, 3)) == 0:
        mark.prompt = True
    else:
        mark.message = draw(st.integers(0, len(messages) - 1))
        mark.content_chars = draw(st.integers(0, len(messages[mark.message].content)))
    return mark


@st.composite
def generate_requests(draw) -> gpb.GenerateRequest:
    request = gpb.GenerateRequest(diagnose_cache=draw(st.booleans()))
    kind = draw(st.sampled_from(["chat", "chat", "chat", "chat", "text", "token_ids", "none"]))
    if kind == "chat":
        roles = st.sampled_from(["system", "user", "assistant", "user", "user", "tool", ""])
        for role, content in draw(st.lists(st.tuples(roles, TEXT), min_size=draw(st.sampled_from([0, 1, 1])),
                                           max_size=3)):  # fmt: skip
            request.chat.messages.add(role=role, content=content)
        request.chat.continue_final_message = draw(st.booleans()) and bool(request.chat.messages)
    elif kind == "text":
        request.text = draw(TEXT)
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(st.lists(st.integers(0, 49151), max_size=60)))
    request.template = draw(st.sampled_from(["", "", "", "", "chat-bot", "support-bot"]))
    request.sampling.max_new_tokens = draw(st.integers(1, 3))
    messages = request.chat.messages if kind == "chat" else []
    fitting = fitting_breakpoint(messages)
    marks = draw(st.one_of(st.lists(fitting, max_size=4), st.lists(st.one_of(fitting, any_breakpoint()), max_size=6)))
    request.cache_breakpoints.extend(marks)
    return request


def breakpoints_point_somewhere(request: gpb.GenerateRequest) -> bool:
    """Whether every breakpoint is one the API documents (at most 4, each at a message in range or the prompt)."""
    messages = request.chat.messages if request.WhichOneof("prompt") == "chat" else []
    if len(request.cache_breakpoints) > MAX_BREAKPOINTS:
        return False
    for mark in request.cache_breakpoints:
        at = mark.WhichOneof("at")
        if at is None or mark.ttl not in gpb.CacheTtl.values():
            return False
        if at == "prompt" and mark.content_chars:
            return False
        if at == "message" and not (0 <= mark.message < len(messages)
                                    and 0 <= mark.content_chars <= len(messages[mark.message].content)):  # fmt: skip
            return False
    return True


def test_generate_with_breakpoints(stack):
    daemon, gateway, client, model, template_pins = stack
    codes: Counter = Counter()
    metadata = (("authorization", f"Bearer {KEY}"),)
    with grpc.insecure_channel(gateway.address) as channel:
        stub = gpb_grpc.GatewayStub(channel)

        @settings(FUZZ, max_examples=EXAMPLES * 4)
        @given(request=generate_requests(), streamed=st.booleans())
        def one(request, streamed):
            try:
                if streamed:
                    replies = list(stub.Generate(request, metadata=metadata, timeout=60))
                else:
                    replies = [stub.Complete(request, metadata=metadata, timeout=60)]
            except grpc.RpcError as err:
                codes[err.code().name] += 1
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details(), (request, err)
                return
            codes["OK"] += 1
            assert breakpoints_point_somewhere(request), request
            last = replies[-1]
            usage = last.usage
            codes["OK, created"] += usage.cache_creation_tokens > 0
            codes["OK, unpinned"] += usage.unpinned_breakpoints > 0
            assert usage.cached_prompt_tokens + usage.cache_creation_tokens <= usage.prompt_tokens, (request, usage)
            assert usage.cache_creation_5m_tokens + usage.cache_creation_1h_tokens == usage.cache_creation_tokens
            assert 0 <= usage.unpinned_breakpoints <= len(request.cache_breakpoints), (request, usage)
            assert last.HasField("cache_diagnosis") == request.diagnose_cache, (request, last)

        one()
    print(f"\nGenerate with breakpoints: {sum(codes.values())} cases: {dict(codes)}")
    assert gateway.process.poll() is None
    assert wait_for(lambda: _settled(daemon), 30), DaemonClient.connect(daemon.address).stats()


def test_nothing_left_held_and_marks_expire(stack):
    """Last: no request holds a block, and once the templates are gone every pin (the marks') expires."""
    daemon, gateway, client, model, template_pins = stack
    assert wait_for(lambda: _settled(daemon), 30), DaemonClient.connect(daemon.address).stats()
    for name in ("support-bot", "chat-bot"):
        assert client.delete(f"/templates/{name}", headers=BEARER).status_code == 200
    with DaemonClient.connect(daemon.address) as stats:
        assert wait_for(lambda: stats.stats().num_pins == 0, 10 * TTL_1H_S), stats.stats()
        assert stats.stats().num_pinned_blocks == 0, stats.stats()
    assert gateway.process.poll() is None
