"""Hostile input to the gateway's HTTP API: every documented parameter of the
completions (output constraints and tools among them) and the template routes drawn from valid and invalid values
(wrong types, huge and negative numbers, NaN, unknown fields, malformed
JSON). Each answer must be one of the documented statuses, in OpenAI's error
shape when it is an error, never a 500; the gateway must not die; afterwards
no request holds a block.

Examples per route: ``KVD_FUZZ_EXAMPLES`` (default 15), as for the gRPC fuzzing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections import Counter
from urllib.parse import quote

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import blocks_held, free_port, start_daemon, start_engine, start_gateway, wait_for

EXAMPLES = int(os.environ.get("KVD_FUZZ_EXAMPLES", "15"))
DOCUMENTED = frozenset({200, 400, 401, 403, 404, 409, 429, 503, 504})
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("KVD_FUZZ_RANDOM") != "1",
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
KEY = "fuzz-key"

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=5,
)
INTS = st.sampled_from([0, 1, -1, 2, 5, 20, 21, 2**31 - 1, 2**31, -(2**63), 2**63, 2**64, 10**30])
TEXT = st.one_of(st.text(max_size=30), st.sampled_from(["", "support-bot", "chat-bot", "../x", "\x00", "é" * 40]))
FLOATS = st.one_of(st.floats(-3, 3, allow_nan=False), st.sampled_from([math.nan, math.inf, -math.inf, 1e30, 0.0]))
SMALL = st.integers(1, 3)  # new tokens that keep a case short
NAMES = st.one_of(st.sampled_from(["support-bot", "chat-bot", "missing", "fuzz-a"]), TEXT)


HOSTILE = st.one_of(JUNK, INTS, FLOATS, TEXT)
VALID_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
     "content": st.one_of(TEXT, st.none(), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                                                    min_size=1, max_size=2))},
    optional={"name": TEXT, "tool_calls": st.none(), "function_call": st.none(), "refusal": st.none(),
              "audio": st.none(), "annotations": st.just([]), "cache_control": JUNK},
)  # fmt: skip
TOKEN = st.integers(0, 49151)
SCHEMA = st.one_of(
    st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    st.just({"type": "string", "enum": ["x", "y"]}),
    st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "pattern"]), JUNK, max_size=2),
)
TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["get_weather", "add"])}, optional={"description": TEXT, "parameters": SCHEMA})},
)  # fmt: skip
CALL = st.fixed_dictionaries(
    {"id": TEXT, "type": st.just("function"),
     "function": st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "add", "x"]), "arguments": TEXT})},
)  # fmt: skip
TOOL_MESSAGES = st.one_of(
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.none(), "tool_calls": st.lists(CALL, max_size=2)}
    ),
    st.fixed_dictionaries({"role": st.just("tool"), "content": TEXT, "tool_call_id": TEXT}),
)
#: output constraints: the engine compiles them (a regex or grammar drawn from TEXT is mostly a 400)
CONSTRAINTS = {
    "response_format": st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        st.fixed_dictionaries(
            {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"name": TEXT, "schema": SCHEMA})}
        ),
    ),  # fmt: skip
    "guided_regex": st.one_of(st.sampled_from(["[a-z]+", "(yes|no)", "[0-9]{2}"]), TEXT),
    "guided_choice": st.lists(TEXT, max_size=3),
    "guided_json": SCHEMA,
    "guided_grammar": st.one_of(st.just('root ::= "a" | "b"'), TEXT),
    "structured_outputs": st.dictionaries(
        st.sampled_from(["regex", "choice", "json", "json_object"]), JUNK, max_size=2
    ),
}
#: param -> its valid values (the hostile ones are drawn from HOSTILE).
SAMPLING = {
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "max_tokens": SMALL,
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 50),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)),
    "user": TEXT,
    "n": st.integers(1, 3),
    "template": NAMES,
    "prompt_cache_key": TEXT,
    "ignore_eos": st.booleans(),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "min_p": st.floats(0, 1),
    "logit_bias": st.dictionaries(TOKEN.map(str), st.floats(-100, 100), max_size=3),
    "min_tokens": st.integers(0, 3),
    "stop_token_ids": st.lists(TOKEN, max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.just(True),
    "spaces_between_special_tokens": st.just(True),
    "best_of": st.just(1),
    "safety_identifier": TEXT,
    "prompt_cache_retention": st.sampled_from(["in_memory", "24h"]),
    "echo": st.just(False),
    **CONSTRAINTS,
}
CHAT = {
    **SAMPLING,
    "messages": st.lists(st.one_of(VALID_MESSAGE, TOOL_MESSAGES), min_size=1, max_size=3),
    "max_completion_tokens": SMALL,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "tools": st.lists(TOOL, max_size=2),
    "tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required"]),
        st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["add", "rm"])})}
        ),
    ),  # fmt: skip
    "parallel_tool_calls": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), st.booleans(), max_size=2),
}
COMPLETION = {
    **SAMPLING,
    "prompt": st.one_of(
        TEXT,
        st.lists(TOKEN, min_size=1, max_size=6),
        st.lists(TEXT, max_size=3),
        st.lists(st.lists(TOKEN, min_size=1, max_size=4), min_size=1, max_size=3),
    ),
    "logprobs": st.integers(0, 5),
    "add_special_tokens": st.booleans(),
    "echo": st.booleans(),  # with logprobs: the prompt's, scored
    "max_tokens": st.integers(0, 3),  # 0: with echo only
}
TOKENIZE = {
    "model": st.just("MODEL"),
    "prompt": TEXT,
    "messages": st.lists(VALID_MESSAGE, min_size=1, max_size=3),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "add_special_tokens": st.booleans(),
    "return_token_strs": st.booleans(),
}
DETOKENIZE = {"model": st.just("MODEL"), "tokens": st.lists(TOKEN, max_size=8)}
TEMPLATE = {
    "name": NAMES,
    "content": TEXT,
    "messages": st.lists(VALID_MESSAGE, max_size=2),
    "ttl_seconds": st.integers(0, 10**9),
    "description": TEXT,
}


def bodies(params: dict, required: tuple[str, ...]) -> st.SearchStrategy:
    """Valid bodies, and valid bodies with one field hostile (or one unknown field added)."""
    valid = st.fixed_dictionaries(
        {k: params[k] for k in required}, optional={k: v for k, v in params.items() if k not in required}
    )
    names = st.sampled_from([*params, "unknown_field"])
    hostile = valid.flatmap(lambda body: st.tuples(names, HOSTILE).map(lambda kv: {**body, kv[0]: kv[1]}))
    return st.one_of(valid, hostile)


HEADERS = st.sampled_from([{"Authorization": f"Bearer {KEY}"}] * 6 + [{}, {"Authorization": "Bearer wrong"}])


class Tally:
    def __init__(self) -> None:
        self.statuses: Counter = Counter()

    def check(self, what: str, response: httpx.Response) -> None:
        self.statuses[response.status_code] += 1
        assert response.status_code in DOCUMENTED, (what, response.status_code, response.text[:500])
        if response.status_code != 200:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and error["message"], (what, response.text)
        elif response.headers["content-type"].startswith("text/event-stream"):
            events = response.content.split(b"\n\n")  # as the strictest SSE readers split them
            assert events[-1] == b"" and events[-2] == b"data: [DONE]", (what, response.text[-500:])
            assert all(e.startswith(b"data: ") and b"\n" not in e for e in events[:-1]), (what, response.text[:500])

    def report(self, name: str) -> None:
        print(f"{name}: {sum(self.statuses.values())} cases, statuses {dict(sorted(self.statuses.items()))}")


@pytest.fixture(scope="module")
def stack(model_dir):
    """(daemon, gateway, an HTTP client on its API) with the templates the draws name."""
    folder = tempfile.mkdtemp(prefix="kvd-fuzzh-", dir="/tmp")
    with open(f"{folder}/keys.json", "w") as f:
        json.dump({"keys": [{"key": KEY, "tenant": "fuzz", "scopes": ["generate", "templates:write"]}]}, f)
    http = f"127.0.0.1:{free_port()}"
    daemon = start_daemon(["--block-size", "16", "--num-blocks", "512", "--lease-s", "2"], folder)
    engine = start_engine(daemon, ["--model", str(model_dir)], folder)
    gateway = start_gateway(engine.address, ["--data-dir", f"{folder}/gw", "--api-keys", f"{folder}/keys.json",
                                             "--max-templates", "8", "--http-listen", http], folder)  # fmt: skip
    client = httpx.Client(base_url=f"http://{http}/v1", headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    try:
        assert wait_for(lambda: httpx.get(f"http://{http}/ready").status_code == 200, 30), gateway.log()
        assert client.post("/templates", json={"name": "support-bot", "content": "You help. " * 5}).status_code == 200
        chat = {"name": "chat-bot", "messages": [{"role": "system", "content": "Be brief."}]}
        assert client.post("/templates", json=chat).status_code == 200
        yield daemon, gateway, client
    finally:
        client.close()
        for process in (gateway, engine, daemon):
            process.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _model(client: httpx.Client) -> str:
    return client.get("/models").json()["data"][0]["id"]


def _named(body: dict, model: str) -> dict:
    if body.get("model") == "MODEL":
        body = {**body, "model": model}
    for field in ("max_tokens", "max_completion_tokens"):  # a valid huge one would run long
        if type(body.get(field)) is int and 3 < body[field] < 2**31:
            body = {**body, field: 3}
    # NOTE: null is unset too: a chat would run to the end of the context (and a constrained one may never end early)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body = {**body, "max_tokens": 2}
    return body


def _post(client: httpx.Client, path: str, body, headers: dict) -> httpx.Response:
    content = json.dumps(body, allow_nan=True).encode()  # NaN and Infinity: JSON no parser should take
    return client.post(path, content=content, headers={"Content-Type": "application/json", **headers})


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_completions(stack, path):
    daemon, gateway, client = stack
    served = _model(client)
    tally = Tally()

    chat = path == "/chat/completions"
    model_names = st.sampled_from(["MODEL", "MODEL", "MODEL", "gpt-4o"])
    draws = bodies(CHAT, ("messages",)) if chat else bodies(COMPLETION, ("prompt",))

    @settings(FUZZ, max_examples=EXAMPLES * 3)
    @given(body=draws, model=model_names, headers=HEADERS)
    def one(body, model, headers):
        tally.check(path, _post(client, path, _named({"model": model, **body}, served), headers))

    one()
    for malformed in (b"{", b"[]", b'"x"', b"\xff\xfe", b'{"model": NaN}'):
        tally.check(path, client.post(path, content=malformed, headers={"Content-Type": "application/json"}))
    tally.report(path)
    assert gateway.process.poll() is None
    assert wait_for(lambda: blocks_held(daemon) == 0, 30)


def test_tokenize_and_detokenize(stack):
    daemon, gateway, client = stack
    served = _model(client)
    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    tally = Tally()

    @FUZZ
    @given(tokenize=bodies(TOKENIZE, ()), detokenize=bodies(DETOKENIZE, ("tokens",)), headers=HEADERS)
    def one(tokenize, detokenize, headers):
        for path, body in (("/tokenize", tokenize), ("/detokenize", detokenize)):
            if body.get("model") == "MODEL":
                body = {**body, "model": served}
            tally.check(path, _post(client, f"{base}{path}", body, headers))

    one()
    for path in ("/version", "/metrics"):
        tally.check(path, client.get(f"{base}{path}"))
    tally.report("tokenize")
    assert gateway.process.poll() is None


def test_templates(stack):
    daemon, gateway, client = stack
    tally = Tally()

    updates = st.fixed_dictionaries({}, optional={"ttl_seconds": st.integers(0, 10**9), "description": TEXT})
    pages = st.fixed_dictionaries({}, optional={"page_size": INTS | TEXT, "page_token": TEXT})

    @FUZZ
    @given(body=bodies(TEMPLATE, ("name",)), name=NAMES, update=JUNK | updates, page=pages, headers=HEADERS)
    def one(body, name, update, page, headers):
        name = quote(name, safe="")
        tally.check("create", _post(client, "/templates", body, headers))
        tally.check("get", client.get(f"/templates/{name}", headers=headers))
        tally.check("list", client.get("/templates", params=page, headers=headers))
        content = json.dumps(update).encode()
        tally.check("update", client.patch(f"/templates/{name}", content=content, headers=headers))
        if name not in ("support-bot", "chat-bot"):  # the completions' draws name them
            tally.check("delete", client.delete(f"/templates/{name}", headers=headers))

    one()
    tally.report("templates")
    assert gateway.process.poll() is None
